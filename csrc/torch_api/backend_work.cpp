// The works the ddpx backend returns (backend_work.h).
#include "backend_work.h"

#include <algorithm>
#include <string>
#include <thread>

namespace ddpx {

FutureDone::FutureDone(c10::ivalue::Future& future) {
  future.addCallback([state = state_](c10::ivalue::Future&) {
    const std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->cv.notify_all();
  });
}

bool FutureDone::wait_for(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_for(lock, timeout, [&] { return state_->done; });
}

bool EngineWork::wait(std::chrono::milliseconds timeout) {
  if (timeout != kNoTimeout && !future_->completed() && !FutureDone(*future_).wait_for(timeout)) {
    C10_THROW_ERROR(DistBackendError,
                    "ddpx: the collective was not done within wait()'s timeout of " +
                        std::to_string(timeout.count()) +
                        " ms; it goes on (the group's timeout bounds it): wait() again for it");
  }
  future_->waitAndThrow();
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> PointToPointWork::getFuture() {
  std::call_once(started_, [this] {
    future_ =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    std::thread([inner = inner_, future = future_, tensors = c10::List<at::Tensor>(tensors_)] {
      try {
        inner->wait();
        future->markCompleted(c10::IValue(tensors));
      } catch (...) {
        future->setError(std::current_exception());
      }
    }).detach();
  });
  return future_;
}

bool CoalescedWork::isCompleted() {
  return std::all_of(works_.begin(), works_.end(), [](const auto& w) { return w->isCompleted(); });
}

bool CoalescedWork::isSuccess() const {
  return std::all_of(works_.begin(), works_.end(), [](const auto& w) { return w->isSuccess(); });
}

std::exception_ptr CoalescedWork::exception() const {
  for (const auto& w : works_) {
    if (auto error = w->exception()) return error;
  }
  return nullptr;
}

bool CoalescedWork::wait(std::chrono::milliseconds timeout) {
  for (const auto& w : works_) w->wait(timeout);
  return true;
}

c10::intrusive_ptr<c10::ivalue::Future> CoalescedWork::getFuture() {
  c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
      c10::FutureType::create(c10::AnyType::get()));
  for (const auto& w : works_) futures.push_back(w->getFuture());
  return c10::collectAll(futures);
}

}  // namespace ddpx
