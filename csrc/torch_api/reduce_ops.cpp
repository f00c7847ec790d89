// The rules of torch.distributed's reduce ops as ddpx runs them (reduce_ops.h).
#include "reduce_ops.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>

#include "../common/torch_compat.h"
#include "../engine/request.h"

namespace ddpx {
namespace {

using c10d::ReduceOp;

bool is_sum(const ReduceOp& op) {
  return op.op_ == ReduceOp::SUM || op.op_ == ReduceOp::AVG || op.op_ == ReduceOp::PREMUL_SUM;
}

}  // namespace

bool kernel_sum(const at::Tensor& t, const ReduceOp& op) {
  return is_sum(op) && to_dtype(t.scalar_type()).has_value();
}

const char* op_name(const ReduceOp& op) {
  static const char* const names[] = {"SUM",  "AVG", "PRODUCT", "MIN",        "MAX",
                                      "BAND", "BOR", "BXOR",    "PREMUL_SUM", "UNUSED"};
  return names[std::min<int>(op.op_, ReduceOp::UNUSED)];
}

double sum_scale(const ReduceOp& op, int world) {
  if (op.op_ == ReduceOp::AVG) return 1.0 / world;
  if (op.op_ != ReduceOp::PREMUL_SUM) return 1.0;
  const auto* factor = dynamic_cast<const PreMulSumFactor*>(op.supplement_.get());
  TORCH_CHECK(factor, "ddpx: PREMUL_SUM without its factor");
  return factor->tensor_factor.defined() ? factor->tensor_factor.item<double>()
                                         : factor->double_factor;
}

std::string invalid_reduction(const at::Tensor& t, const ReduceOp& op, const std::string& what) {
  std::ostringstream why;
  const bool floating = at::isFloatingType(t.scalar_type());
  if (op.op_ >= ReduceOp::UNUSED) {
    why << "ddpx: " << what << " got an unknown reduce op";
  } else if (is_sum(op) && op.op_ != ReduceOp::SUM && !floating) {
    why << "ddpx: ReduceOp." << op_name(op) << " of a " << t.scalar_type() << " tensor in " << what
        << " would round every input: sum it (ReduceOp.SUM) and divide";
  } else if ((op.op_ == ReduceOp::BAND || op.op_ == ReduceOp::BOR || op.op_ == ReduceOp::BXOR) &&
             floating) {
    why << "ddpx: ReduceOp." << op_name(op) << " needs an integer or bool tensor, " << what
        << " has " << t.scalar_type();
  }
  return why.str();
}

void combine(at::Tensor& into, const at::Tensor& other, const ReduceOp& op) {
  switch (op.op_) {
    case ReduceOp::SUM:
      into.add_(other);
      break;
    case ReduceOp::PRODUCT:
      into.mul_(other);
      break;
    case ReduceOp::MIN:
      into.copy_(at::minimum(into, other));
      break;
    case ReduceOp::MAX:
      into.copy_(at::maximum(into, other));
      break;
    case ReduceOp::BAND:
      into.bitwise_and_(other);
      break;
    case ReduceOp::BOR:
      into.bitwise_or_(other);
      break;
    case ReduceOp::BXOR:
      into.bitwise_xor_(other);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "ddpx: no reduction for ", op_name(op));
  }
}

}  // namespace ddpx
