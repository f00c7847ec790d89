// What a call asks an engine for, whether an engine can do it with the tensor it was given (the
// one validator of the engines' all-reduce), and what the call's data travels in (the one wire
// rule).
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <optional>
#include <string>

#include "../kernels/kernels.h"

namespace ddpx {

struct Residual;  // collectives.h

struct Request {
  double scale = 1.0;  // applied to every rank's input before the sum
  // dtype in transit; the tensor's own when empty. int8 (at::kChar) and int4 are
  // compression="int8" and "int4": block-scaled integers between nodes, the data's own dtype
  // within a node (collectives.h).
  std::optional<at::ScalarType> wire;
  std::string what;  // names the call in errors ("gradient bucket 3")
  // Whether wire is meant for dense tensors only: the hook's compression is of the dense buckets,
  // and a sparse gradient travels in its own dtype, as on DDP's default; ddpx.all_reduce's is of
  // the tensor it was given, and refused for a sparse one (Engine::run_async).
  bool dense_wire_only = false;
  std::shared_ptr<Residual> residual;  // int8's and int4's error feedback, or none
  // The call's future may complete after later calls start (collectives.h, allreduce's end):
  // the hook's gradient buckets but the last of a backward, whose waits DDP makes at its end.
  bool defer = false;
};

// The bits of a block-scaled wire (8 for int8, 4 for int4), or 0 for any other.
int quantized_bits(const Request& request);

// The kernels' dtype for a torch dtype, or none for one ddpx does not reduce.
std::optional<DType> to_dtype(at::ScalarType t);

// What the engines reduce for tensor: a complex tensor as its real and imaginary parts (a view of
// twice the elements in the real dtype), any other tensor itself.
at::Tensor as_real(const at::Tensor& tensor);

// Why an engine for `device` tensors cannot reduce this tensor as requested, or "".
std::string invalid_input(const at::Tensor& tensor, const Request& request, c10::DeviceType device);

// The dtype a sum of `data` travels in between ranks and nodes, for every engine and entry point
// (the hook, ddpx.all_reduce, the backend's sums): the compression dtype the call asked for, else
// the data's own. Never wider than asked: a bfloat16 model's gradients travel as bfloat16, as on
// DDP's own all-reduce, with the scale applied to each input as it enters the wire and the sum
// accumulated in float32 (docs/design.md, "One wire rule", measures the error).
at::ScalarType wire_dtype(at::ScalarType data, const Request& request);

}  // namespace ddpx
