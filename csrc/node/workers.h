// A rank's own threads beside its communication thread, which share a large call's blocks with it
// (docs/design.md, "A rank's cores"). They sleep between calls: a call wakes as many as it has work
// for, and none while it is small, so an idle engine takes no CPU from the training around it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace ddpx {

class Workers {
 public:
  Workers() = default;
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;
  ~Workers() { resize(1); }

  // The calling thread and threads - 1 helpers. Only between runs.
  void resize(int threads);
  int threads() const { return int(helpers_.size()) + 1; }
  // Runs task(0) on the calling thread and task(1) .. task(n - 1) on as many helpers (n at most
  // threads()); returns once every one has returned, rethrowing the first exception any raised.
  void run(int n, const std::function<void(int)>& task);
  // The runs so far that several threads worked on.
  uint64_t threaded_runs() const { return threaded_runs_.load(std::memory_order_relaxed); }
  // Thread `thread`'s scratch, where a collective puts what it reads of a peer's tensor through
  // the kernel (process_vm_readv). Only during a run, by that thread.
  std::vector<char>& scratch(int thread) { return scratch_[size_t(thread)]; }

 private:
  void loop(int index);

  std::mutex mu_;
  std::condition_variable start_, finished_;
  const std::function<void(int)>* task_ = nullptr;
  uint64_t round_ = 0;  // runs so far: a helper takes part in each round once, if engaged
  int engaged_ = 0;     // helpers 1 .. engaged_ run this round's task
  int running_ = 0;     // of those, the ones not yet returned
  bool stopping_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> helpers_;
  std::vector<std::vector<char>> scratch_{1};
  std::atomic<uint64_t> threaded_runs_{0};
};

}  // namespace ddpx
