// How ddpx runs torch.distributed's reduce ops: the floating-point sums (SUM, AVG, PREMUL_SUM) on
// the engine's kernels, every input scaled first; the other ops, and every reduction of integer
// and bool tensors, by gathering the ranks' data and combining it in rank order
// (backend_tasks.cpp's reduce_gathered).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>

#include "../kernels/kernels.h"

namespace ddpx {

// Whether the engine's kernels sum t with op: floating-point data, summed in float32 (float64 for
// float64).
bool kernel_sum(const at::Tensor& t, const c10d::ReduceOp& op);

// The op's name in torch.distributed.ReduceOp ("SUM"), for messages.
const char* op_name(const c10d::ReduceOp& op);

// Every input's scale before the sum: 1/world for AVG, the factor for PREMUL_SUM, else 1.
double sum_scale(const c10d::ReduceOp& op, int world);

// Why this rank cannot take part in a reduction of t with op, or "".
std::string invalid_reduction(const at::Tensor& t, const c10d::ReduceOp& op,
                              const std::string& what);

// into = op(into, other), elementwise, for the ops the kernels do not sum.
void combine(at::Tensor& into, const at::Tensor& other, const c10d::ReduceOp& op);

}  // namespace ddpx
