// torch.profiler records only on the threads that carry its state: the one that started it, and
// those that take the caller's state along (as at::launch's and autograd's do). Work handed to
// the engine's thread takes the caller's profiler with it, so that its ranges there land in the
// caller's trace, and nothing else of the caller's state: it runs as it would unprofiled.
#pragma once

#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memory>

namespace ddpx {

// The profiler of the thread that constructs it.
struct CallerProfiler {
  at::RecordFunctionTLS callbacks = at::get_record_function_tls_();
  std::shared_ptr<c10::ThreadLocalDebugInfo> info = c10::ThreadLocalDebugInfo::current();
};

// This thread records into the caller's profiler while the guard lives.
class ProfilerGuard {
 public:
  explicit ProfilerGuard(const CallerProfiler& caller) : info_(caller.info) {
    at::set_record_function_tls_(caller.callbacks);
  }
  ~ProfilerGuard() { at::set_record_function_tls_(own_); }
  ProfilerGuard(const ProfilerGuard&) = delete;
  ProfilerGuard& operator=(const ProfilerGuard&) = delete;

 private:
  const at::RecordFunctionTLS own_ = at::get_record_function_tls_();  // before info_ is set
  c10::DebugInfoGuard info_;
};

}  // namespace ddpx
