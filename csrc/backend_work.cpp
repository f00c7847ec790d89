// The works the ddpx backend returns (backend_work.h).
#include "backend_work.h"

#include <algorithm>
#include <thread>

namespace ddpx {

bool EngineWork::wait(std::chrono::milliseconds /*timeout*/) {
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
