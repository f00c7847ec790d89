// The abort watch: the thread that says in the job's store why this rank gave up, and reads
// why another did, for the waits across nodes.
#include "abort_watch.h"

#include <c10/util/Exception.h>

#include "../common/thread_name.h"
#include "../torch_api/backend_work.h"

#include <exception>
#include <vector>

namespace ddpx {

AbortWatch::AbortWatch(c10::intrusive_ptr<c10d::Store> store, std::string key)
    : store_(std::move(store)), key_(std::move(key)) {}

void AbortWatch::start(const std::shared_ptr<AbortWatch>& watch) {
  watch->thread_ = std::thread(loop, watch);
}

void AbortWatch::stop() {
  bool in_store;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    in_store = in_store_;
  }
  cv_.notify_all();
  if (in_store) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

void AbortWatch::give_up(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (mine_.empty()) mine_ = why;
  }
  cv_.notify_all();
}

void AbortWatch::await(c10d::Work& work) {
  FutureDone done(*work.getFuture());
  bool watching = false;
  while (true) {
    if (done.wait_for(kPoll)) break;
    std::lock_guard<std::mutex> lock(mu_);
    if (!theirs_.empty()) {
      if (watching) --long_waits_;
      C10_THROW_ERROR(DistBackendError, "another rank gave up: " + theirs_);
    }
    if (!watching) {
      watching = true;
      ++long_waits_;
    }
  }
  if (watching) {
    std::lock_guard<std::mutex> lock(mu_);
    --long_waits_;
  }
  work.wait();
}

void AbortWatch::await_blocking(c10d::Work& work, std::chrono::milliseconds timeout) {
  Blocked blocked{&work, Clock::now(), ""};
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!theirs_.empty()) C10_THROW_ERROR(DistBackendError, "another rank gave up: " + theirs_);
    blocked_.push_back(&blocked);
  }
  // The wait's own timeout, not this watch's thread, ends it at the deadline: that thread may be
  // stuck in the store, out of reach behind the same cut link.
  std::exception_ptr error;
  bool done = false;
  try {
    done = work.wait(timeout);
  } catch (...) {
    error = std::current_exception();
  }
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    blocked_.remove(&blocked);
    why = blocked.why;
  }
  if (!why.empty()) C10_THROW_ERROR(DistBackendError, why);
  if (error) std::rethrow_exception(error);
  TORCH_CHECK(done, "ddpx: a transfer across nodes ended without completing");
}

bool AbortWatch::abort_blocked_waits() {
  const auto now = Clock::now();
  bool long_wait = false;
  for (Blocked* b : blocked_) {
    if (b->why.empty() && !theirs_.empty()) {
      b->why = "another rank gave up: " + theirs_;
      b->work->abort();
    }
    long_wait = long_wait || now - b->start >= kPoll;
  }
  return long_wait;
}

void AbortWatch::loop(std::shared_ptr<AbortWatch> w) {
  name_this_thread("ddpx abort");
  std::unique_lock<std::mutex> lock(w->mu_);
  bool said = false;
  while (true) {
    w->cv_.wait_for(lock, kPoll, [&] { return w->stopping_ || (!said && !w->mine_.empty()); });
    if (w->stopping_) return;
    const bool long_blocked = w->abort_blocked_waits();
    const bool say = !said && !w->mine_.empty();
    const bool look = (w->long_waits_ > 0 || long_blocked) && w->theirs_.empty();
    if (!say && !look) continue;
    const std::string mine = w->mine_;
    w->in_store_ = true;
    lock.unlock();
    std::string theirs;
    bool reachable = true;
    try {
      if (say) {
        w->store_->compareSet(w->key_, std::vector<uint8_t>(),
                              std::vector<uint8_t>(mine.begin(), mine.end()));
      } else if (w->store_->check({w->key_})) {
        const std::vector<uint8_t> why = w->store_->get(w->key_);
        theirs.assign(why.begin(), why.end());
      }
    } catch (const std::exception&) {
      reachable = false;  // the transfers still fail by themselves, at their timeout
    }
    lock.lock();
    w->in_store_ = false;
    if (!reachable) return;
    said = said || say;
    if (!theirs.empty()) w->theirs_ = theirs;
    w->abort_blocked_waits();
  }
}

}  // namespace ddpx
