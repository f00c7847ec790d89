// The DDP communication hook in C++: DDP hands it each gradient bucket on the autograd thread,
// it queues the bucket on the engine and returns the engine's future at once, so backward keeps
// computing while the bucket is reduced. No Python and no GIL on this path. A sparse gradient
// (DDP gives each its own bucket) goes where the engine sends every sparse tensor
// (Engine::run_async), uncompressed.
#pragma once

#include <ATen/record_function.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>
#include <optional>

#include "../engine/engine.h"
#include "../node/arena.h"

namespace ddpx {

struct FusedHookConfig {
  std::shared_ptr<Engine> engine;
  double scale;                        // 1 / world size: DDP averages gradients
  std::optional<at::ScalarType> wire;  // compression dtype of the dense buckets, or none
  // Moves each bucket's storage into the arena the first time the hook meets it (arena.h).
  bool into_arena;
};

class FusedHook final : public c10d::CppCommHookInterface<FusedHookConfig> {
 public:
  using c10d::CppCommHookInterface<FusedHookConfig>::CppCommHookInterface;

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    RECORD_FUNCTION("ddpx::fused_hook", std::vector<c10::IValue>());
    // DDP allocated the bucket in ordinary memory (its group is not ddpx's, or comm memory is
    // off): from here on it lies in the arena, and so do the gradients that view it, so this
    // all-reduce and every later one of the bucket copy nothing in or out. DDP's rebuilt buckets
    // after the first step are new storages, moved when first met in turn; a sparse bucket has
    // no storage of its own and stays where it is.
    if (state_.into_arena) Arena::process().adopt(bucket.getBufferRef());
    Request request{state_.scale, state_.wire,
                    "gradient bucket " + std::to_string(bucket.getIndex()),
                    /*dense_wire_only=*/true};
    return state_.engine->run_async(bucket.getBufferRef(), std::move(request));
  }
};

}  // namespace ddpx
