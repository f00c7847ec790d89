// The portable kernels, and the choice of kernels for this CPU (kernels.h).
#include "kernels.h"

#include <cstring>

#include "kernel_dispatch.h"
#include "quantize.h"

namespace ddpx {

size_t dtype_size(DType t) {
  return dispatch_dtype(t, [](auto* p) { return sizeof(*p); });
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32:
      return "float32";
    case DType::Float64:
      return "float64";
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float16:
      return "float16";
    case DType::Int8:
      return "int8";
    case DType::Int4:
      return "int4";
  }
  return "unknown";
}

namespace {
void plain_copy(void* dst, const void* src, size_t bytes, Write) { std::memcpy(dst, src, bytes); }

const Kernels kPortable{
    "portable",  &convert_dispatch<ScalarLoops>,    &reduce_dispatch<ScalarLoops>,
    &plain_copy, &detail::quantize_blocks_portable, &detail::dequantize_sum_blocks_portable};
}  // namespace

const Kernels* kernels_for(const char* isa) {
  if (std::strcmp(isa, "portable") == 0) return &kPortable;
  if (std::strcmp(isa, "avx2") == 0) return detail::avx2_kernels();
  return nullptr;
}

const Kernels& kernels() {
  static const Kernels* chosen = [] {
    const Kernels* avx2 = detail::avx2_kernels();
    return avx2 != nullptr ? avx2 : &kPortable;
  }();
  return *chosen;
}

}  // namespace ddpx
