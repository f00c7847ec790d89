// The engines' validator and wire rule (request.h).
#include "request.h"

#include <ATen/ops/view_as_real.h>

#include <sstream>
#include <string_view>

namespace ddpx {

std::optional<DType> to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::Float32;
    case at::kDouble:
      return DType::Float64;
    case at::kBFloat16:
      return DType::BFloat16;
    case at::kHalf:
      return DType::Float16;
    default:
      return std::nullopt;
  }
}

namespace {

// torch's name of a dtype ("int64", not ScalarType's "Long"), as users wrote it.
std::string_view torch_name(at::ScalarType t) { return c10::getDtypeNames(t).first; }

}  // namespace

int quantized_bits(const Request& request) {
  if (request.wire == at::kChar) return 8;
  if (request.wire == at::ScalarType::Int4) return 4;
  return 0;
}

at::ScalarType wire_dtype(at::ScalarType data, const Request& request) {
  return request.wire.value_or(data);
}

at::Tensor as_real(const at::Tensor& tensor) {
  return tensor.defined() && tensor.layout() == at::kStrided && tensor.is_complex()
             ? at::view_as_real(tensor)
             : tensor;
}

std::string invalid_input(const at::Tensor& input, const Request& request, c10::DeviceType device) {
  const at::Tensor tensor = as_real(input);
  // The common case, valid and uncompressed, returns before a message is built.
  if (tensor.defined() && tensor.layout() == at::kStrided && tensor.device().type() == device &&
      tensor.is_contiguous() && to_dtype(tensor.scalar_type()) &&
      (!request.wire || *request.wire == tensor.scalar_type())) {
    return {};
  }
  const bool cpu = device == c10::DeviceType::CPU;
  const bool quantized = quantized_bits(request) != 0;
  if (quantized && cpu && tensor.defined() && tensor.layout() == at::kStrided && tensor.is_cpu() &&
      tensor.is_contiguous() && to_dtype(tensor.scalar_type()) &&
      tensor.scalar_type() != at::kDouble) {
    return {};
  }
  std::ostringstream why;
  if (!tensor.defined()) {
    why << "ddpx: " << request.what << " got an undefined tensor";
  } else if (tensor.layout() != at::kStrided) {
    why << "ddpx: " << request.what << " is a " << tensor.layout()
        << " tensor; ddpx's engines reduce dense (strided) tensors: reduce it with "
           "torch.distributed.all_reduce";
  } else if (tensor.device().type() != device) {
    why << "ddpx: the " << (cpu ? "shared-memory engine reduces CPU" : "CUDA engine reduces CUDA")
        << " tensors, " << request.what << " is on " << tensor.device()
        << (cpu ? "; move it to the CPU or reduce it with torch.distributed"
                : "; reduce it with the engine of its device");
  } else if (!tensor.is_contiguous()) {
    why << "ddpx: " << request.what << " is not contiguous (strides " << tensor.strides()
        << "): pass tensor.contiguous() and copy the result back";
  } else if (!to_dtype(tensor.scalar_type())) {
    why << "ddpx: " << request.what << " has dtype " << torch_name(tensor.scalar_type())
        << "; ddpx reduces float32, float64, bfloat16, float16 and complex64/128 (use "
           "torch.distributed.all_reduce for other dtypes)";
  } else if (quantized && !cpu) {
    why << "ddpx: compression to " << torch_name(*request.wire)
        << " crosses nodes from CPU buckets, and " << request.what << " is on " << tensor.device()
        << ": use bf16 for CUDA buckets";
  } else if (quantized) {
    why << "ddpx: " << request.what << " is " << torch_name(tensor.scalar_type())
        << " and cannot travel as " << torch_name(*request.wire)
        << "; compress float32/bfloat16/float16 data only";
  } else if (request.wire && !to_dtype(*request.wire)) {
    why << "ddpx: compression to " << torch_name(*request.wire) << " is not supported";
  } else if (request.wire && *request.wire != tensor.scalar_type()) {
    // Compression narrows float32/bfloat16/float16 data to a 16-bit wire dtype, nothing else.
    const at::ScalarType dtype = tensor.scalar_type(), wire = *request.wire;
    const auto refuse = [&](const char* instead) {
      why << "ddpx: " << request.what << " is " << torch_name(dtype) << " and cannot travel as "
          << torch_name(wire) << "; " << instead;
    };
    if (dtype == at::kDouble) {
      refuse("compress float32/bfloat16/float16 data only");
    } else if (wire == at::kFloat || wire == at::kDouble) {
      refuse("send it in its own dtype, bfloat16 or float16");
    }
  }
  return why.str();
}

}  // namespace ddpx
