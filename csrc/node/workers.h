// A rank's own threads beside its communication thread, which share a large call's blocks with it
// (docs/design.md, "A rank's cores"). They sleep between calls: a call wakes as many as it has work
// for, and none while it is small, so an idle engine takes no CPU from the training around it.
#pragma once

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
};

}  // namespace ddpx
