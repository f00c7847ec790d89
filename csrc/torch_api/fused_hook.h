// The DDP communication hook in C++: DDP hands it each gradient bucket on the autograd thread,
// it queues the bucket on the engine and returns the engine's future at once, so backward keeps
// computing while the bucket is reduced. No Python and no GIL on this path. A sparse gradient
// (DDP gives each its own bucket) goes where the engine sends every sparse tensor
// (Engine::run_async), uncompressed.
#pragma once

#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../engine/engine.h"
#include "../node/arena.h"
#include "error_feedback.h"

namespace ddpx {

// register_fused_hook(optimizer=...): the optimizer steps a bucket's parameters (given its
// reduced gradients, views of the bucket) once the bucket is reduced and the backward's last
// bucket is in: before that the steps would take cores from the backward's own computation, which
// every later bucket waits for. Then the engine's thread runs them as idle work
// (ShmEngine::when_idle): in its waits for the link, while the last bucket crosses, and once it
// has no collective left, so that they never take cores from the node's own work. One at a time:
// they share the optimizer.
class BucketSteps : public std::enable_shared_from_this<BucketSteps> {
 public:
  using Step = std::function<void(const std::vector<at::Tensor>& gradients,
                                  const std::vector<at::Tensor>& parameters)>;
  BucketSteps(Step step, std::shared_ptr<ShmEngine> engine)
      : step_(std::move(step)), engine_(std::move(engine)) {}

  // A future that completes with `reduced`'s value once the optimizer has stepped the bucket's
  // parameters, or with the reduction's error, or the step's.
  c10::intrusive_ptr<c10::ivalue::Future> after(
      const c10::intrusive_ptr<c10::ivalue::Future>& reduced, const c10d::GradBucket& bucket) {
    auto stepped = c10::make_intrusive<c10::ivalue::Future>(reduced->elementType());
    // DDP hands a backward's buckets over in index order, so bucket 0 begins a backward. One that
    // failed before its last bucket left steps that must never run.
    uint64_t backward = 0;
    {
      std::vector<Held> left;
      {
        std::lock_guard<std::mutex> lock(lock_);
        if (bucket.getIndex() == 0) {
          left.swap(held_);
          last_in_ = false;
          ++backward_;
        }
        backward = backward_;
      }
      drop(left, "the backward ended before its last bucket");
    }
    reduced->addCallback([self = shared_from_this(), stepped, backward,
                          gradients = bucket.getGradients(),
                          parameters = bucket.getParameters()](c10::ivalue::Future& done) {
      if (done.hasError()) {
        {
          std::lock_guard<std::mutex> lock(self->lock_);
          self->failed_ = backward;
        }
        stepped->setError(done.exception_ptr());
        return;
      }
      Held task{stepped, gradients, parameters, done.value(), backward};
      {
        std::lock_guard<std::mutex> lock(self->lock_);
        if (!self->last_in_) {
          self->held_.push_back(std::move(task));
          return;
        }
      }
      self->launch(std::move(task));
    });
    if (bucket.isLast()) {
      std::vector<Held> now;
      {
        std::lock_guard<std::mutex> lock(lock_);
        last_in_ = true;
        now.swap(held_);
      }
      for (Held& task : now) launch(std::move(task));
    }
    return stepped;
  }

 private:
  struct Held {
    c10::intrusive_ptr<c10::ivalue::Future> stepped;
    std::vector<at::Tensor> gradients, parameters;
    c10::IValue value;
    uint64_t backward;  // which backward's (BucketSteps::backward_)
  };

  void launch(Held task) {
    engine_->when_idle([self = shared_from_this(), task = std::move(task)] {
      try {
        std::lock_guard<std::mutex> lock(self->one_at_a_time_);
        if (!self->may_step(task.backward)) {
          drop({task}, "its backward failed");
          return;
        }
        self->step_(task.gradients, task.parameters);
      } catch (...) {
        task.stepped->setError(std::current_exception());
        return;
      }
      task.stepped->markCompleted(task.value);
    });
  }

  // Whether a step of `backward` may run: none once a bucket of it failed, or once the next
  // backward began (which only a failed one lets happen before its steps are taken).
  bool may_step(uint64_t backward) {
    std::lock_guard<std::mutex> lock(lock_);
    return backward == backward_ && backward != failed_;
  }

  static void drop(const std::vector<Held>& held, const std::string& why) {
    for (const Held& task : held)
      task.stepped->setError(std::make_exception_ptr(
          std::runtime_error("ddpx: a bucket's optimizer step was dropped: " + why)));
  }

  Step step_;
  std::shared_ptr<ShmEngine> engine_;
  std::mutex one_at_a_time_;
  std::mutex lock_;
  bool last_in_ = false;    // the backward's last bucket is in: steps run as buckets come back
  uint64_t backward_ = 0;   // backwards begun
  uint64_t failed_ = 0;     // the last backward a bucket of which failed (0: none)
  std::vector<Held> held_;  // buckets reduced before it, not yet stepped
};

struct FusedHookConfig {
  std::shared_ptr<Engine> engine;
  double scale;                        // 1 / world size: DDP averages gradients
  std::optional<at::ScalarType> wire;  // compression dtype of the dense buckets, or none
  // Moves each bucket's storage into the arena the first time the hook meets it (arena.h).
  bool into_arena;
  // compression="int8": each bucket's residual, carried from step to step; else null.
  std::shared_ptr<ErrorFeedback> feedback;
  // optimizer=...: steps each bucket's parameters once it is reduced; else null.
  std::shared_ptr<BucketSteps> steps;
};

class FusedHook final : public c10d::CppCommHookInterface<FusedHookConfig> {
 public:
  using c10d::CppCommHookInterface<FusedHookConfig>::CppCommHookInterface;

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    RECORD_FUNCTION("ddpx::fused_hook", std::vector<c10::IValue>());
    auto reduced = reduce(bucket);
    if (!state_.steps) return reduced;
    return state_.steps->after(reduced, bucket);
  }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> reduce(c10d::GradBucket& bucket) {
    // DDP allocated the bucket in ordinary memory (its group is not ddpx's, or comm memory is
    // off): from here on it lies in the arena, and so do the gradients that view it, so this
    // all-reduce and every later one of the bucket copy nothing in or out. DDP's rebuilt buckets
    // after the first step are new storages, moved when first met in turn; a sparse bucket has
    // no storage of its own and stays where it is.
    if (state_.into_arena) Arena::process().adopt(bucket.getBufferRef());
    Request request{state_.scale, state_.wire,
                    "gradient bucket " + std::to_string(bucket.getIndex()),
                    /*dense_wire_only=*/true};
    // DDP launches the buckets in index order and waits for all of them once the last is in:
    // until then each may stay in flight while the next ones start (collectives.h).
    request.defer = !bucket.isLast();
    if (!state_.feedback)
      return state_.engine->run_async(bucket.getBufferRef(), std::move(request));
    const auto parts = state_.feedback->parts(bucket);
    const at::Tensor& buffer = bucket.getBufferRef();
    if (parts.size() == 1 && parts[0].pieces.size() == 1) {
      request.residual = parts[0].residual;
      return state_.engine->run_async(buffer, std::move(request));
    }
    // The first step after a resume (error_feedback.h): each saved bucket's gradients gathered
    // as that bucket held them, reduced, and put back.
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> reduced(
        c10::FutureType::create(c10::TensorType::get()));
    for (const ErrorFeedback::Part& part : parts) {
      std::vector<at::Tensor> views;
      for (const auto& [offset, length] : part.pieces)
        views.push_back(buffer.narrow(0, offset, length));
      Request piece = request;
      piece.residual = part.residual;
      piece.defer = request.defer || &part != &parts.back();
      reduced.push_back(state_.engine->run_async(at::cat(views), std::move(piece))
                            ->then(
                                [views](c10::ivalue::Future& done) {
                                  const at::Tensor sum = done.value().toTensor();
                                  int64_t at = 0;
                                  for (const at::Tensor& view : views) {
                                    view.copy_(sum.narrow(0, at, view.numel()));
                                    at += view.numel();
                                  }
                                  return c10::IValue(sum);
                                },
                                c10::TensorType::get()));
    }
    // then() runs its callback on a failed future too: value() passes a part's error on.
    return c10::collectAll(reduced)->then(
        [buffer](c10::ivalue::Future& all) {
          all.value();
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }
};

}  // namespace ddpx
