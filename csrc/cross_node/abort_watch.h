// Where a rank that gives up says so to every rank of its job: a key of the job's store, so that
// the others' waits across nodes end now instead of at their timeout.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "../node/waiter.h"

namespace ddpx {

// A thread of its own talks to the store, which may be out of reach (the link to its host cut):
// neither a wait nor a rank that gives up ever blocks on it. It reads the key only while some
// wait has lasted kPoll, so a job's store sees no traffic from waits that end in time.
class AbortWatch {
 public:
  AbortWatch(c10::intrusive_ptr<c10d::Store> store, std::string key);

  static void start(const std::shared_ptr<AbortWatch>& watch);
  // Ends the thread; one still inside a store call (its host out of reach) is left to finish.
  void stop();
  // Says why this rank gave up, once; does not block.
  void give_up(const std::string& why);
  // Waits for a transfer and throws its failure, or why another rank gave up.
  void await(c10d::Work& work);
  // As await, for a transfer that has no future to wait on (gloo's sends and receives): it
  // waits in work.wait(timeout), which the watch's thread aborts once another rank has given up.
  void await_blocking(c10d::Work& work, std::chrono::milliseconds timeout);

 private:
  using Clock = std::chrono::steady_clock;
  struct Blocked {
    c10d::Work* work;
    Clock::time_point start;
    std::string why;  // why the watch aborted it
  };
  static void loop(std::shared_ptr<AbortWatch> watch);
  // Aborts the blocked waits once another rank has given up, and says whether one has lasted
  // kPoll. Under mu_.
  bool abort_blocked_waits();

  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::string mine_;    // why this rank gave up, to be said
  std::string theirs_;  // why a rank gave up, as the store says
  int long_waits_ = 0;  // waits that have lasted kPoll
  std::list<Blocked*> blocked_;
  bool in_store_ = false;
};

}  // namespace ddpx
