// What a call asks an engine for, and whether an engine can do it with the tensor it was given.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

#include "kernels.h"

namespace ddpx {

struct Request {
  double scale = 1.0;                  // applied to every rank's input before the sum
  std::optional<at::ScalarType> wire;  // dtype in transit; the tensor's own when empty
  std::string what;                    // names the call in errors ("gradient bucket 3")
};

// The kernels' dtype for a torch dtype, or none for one ddpx does not reduce.
std::optional<DType> to_dtype(at::ScalarType t);

// What the engines reduce for tensor: a complex tensor as its real and imaginary parts (a view of
// twice the elements in the real dtype), any other tensor itself.
at::Tensor as_real(const at::Tensor& tensor);

// Why an engine for `device` tensors cannot reduce this tensor as requested, or "".
std::string invalid_input(const at::Tensor& tensor, const Request& request, c10::DeviceType device);

}  // namespace ddpx
