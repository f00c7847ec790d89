// The works the ddpx backend returns: what torch.distributed waits on, asks for a future, or
// checks for an error, for a call on the engine, a send or receive on the inner gloo, and the
// calls of a coalescing block.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

namespace ddpx {

// A future's completion, awaited with a bound from any thread (the future's own wait has none).
class FutureDone {
 public:
  explicit FutureDone(c10::ivalue::Future& future);
  // True once the future has completed; false if `timeout` passed first.
  bool wait_for(std::chrono::milliseconds timeout);

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();
};

// A collective's work: done when the engine's thread has run it; wait() raises its error.
class EngineWork final : public c10d::Work {
 public:
  EngineWork(c10::intrusive_ptr<c10::ivalue::Future> future, c10d::OpType type)
      : Work(-1, type), future_(std::move(future)) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return future_->value().toTensorVector(); }
  // A timeout other than kNoTimeout raises DistBackendError once it passes with the call not
  // done, as torch's Work does; the call goes on, bounded by the group's timeout.
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A send or receive on the inner gloo, whose works have no future: the first getFuture() starts a
// thread that waits for the work and then completes the future with its tensors.
class PointToPointWork final : public c10d::Work {
 public:
  PointToPointWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> tensors,
                   c10d::OpType type)
      : Work(-1, type), inner_(std::move(inner)), tensors_(std::move(tensors)) {}

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  std::vector<at::Tensor> result() override { return tensors_; }
  bool wait(std::chrono::milliseconds timeout) override { return inner_->wait(timeout); }
  int sourceRank() const override { return inner_->sourceRank(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> tensors_;
  std::once_flag started_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The calls made between startCoalescing and endCoalescing, as one work.
class CoalescedWork final : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : Work(-1, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace ddpx
