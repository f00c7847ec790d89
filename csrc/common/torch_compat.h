// The process group's single-tensor collectives under the names of the torch being built against
// (torch 2.13 renamed them and deprecated the old names).
#pragma once

#include <ATen/ATen.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>

namespace ddpx {

#define DDPX_TORCH_AT_LEAST_2_13 \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))
#define DDPX_TORCH_AT_LEAST_2_9 \
  (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9))

// PREMUL_SUM's factor: torch 2.13 names it PreMulSumSupplement (the old name an alias kept for
// now), torch 2.11 only NCCLPreMulSumSupplement.
#if DDPX_TORCH_AT_LEAST_2_13
using PreMulSumFactor = c10d::PreMulSumSupplement;
#else
using PreMulSumFactor = c10d::NCCLPreMulSumSupplement;
#endif

// All-to-all in equal slices, and all-gather. The default timeout is the group's own.
c10::intrusive_ptr<c10d::Work> all_to_all(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in,
                                          std::chrono::milliseconds timeout = c10d::kUnsetTimeout);
c10::intrusive_ptr<c10d::Work> all_gather(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in,
                                          std::chrono::milliseconds timeout = c10d::kUnsetTimeout);

}  // namespace ddpx
