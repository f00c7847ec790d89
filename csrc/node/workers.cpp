// The rank's helper threads (workers.h).
#include "workers.h"

#include <algorithm>

#include "../common/thread_name.h"

namespace ddpx {

void Workers::resize(int threads) {
  threads = std::max(1, threads);
  if (threads == this->threads()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  start_.notify_all();
  for (std::thread& helper : helpers_) helper.join();
  helpers_.clear();
  scratch_.resize(size_t(threads));
  stopping_ = false;
  for (int index = 1; index < threads; ++index)
    helpers_.emplace_back([this, index] { loop(index); });
}

void Workers::loop(int index) {
  name_this_thread("ddpx worker");
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t seen = round_;
  for (;;) {
    start_.wait(lock, [&] { return stopping_ || round_ != seen; });
    if (stopping_) return;
    seen = round_;
    if (index > engaged_) continue;
    const std::function<void(int)>& task = *task_;
    lock.unlock();
    std::exception_ptr error;
    try {
      task(index);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    if (error && !error_) error_ = error;
    if (--running_ == 0) finished_.notify_one();
  }
}

void Workers::run(int n, const std::function<void(int)>& task) {
  n = std::min(n, threads());
  if (n <= 1) {
    task(0);
    return;
  }
  threaded_runs_.fetch_add(1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = &task;
    engaged_ = running_ = n - 1;
    error_ = nullptr;
    ++round_;
  }
  start_.notify_all();
  std::exception_ptr error;
  try {
    task(0);
  } catch (...) {
    error = std::current_exception();
  }
  std::unique_lock<std::mutex> lock(mu_);
  finished_.wait(lock, [&] { return running_ == 0; });
  task_ = nullptr;
  if (!error) error = error_;
  lock.unlock();
  if (error) std::rethrow_exception(error);
}

}  // namespace ddpx
