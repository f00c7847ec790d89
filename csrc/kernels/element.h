// Scalar element types and their exact conversions to and from float: the portable kernels use
// them for everything, the vector kernels for the tails, so both round identically.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "kernels.h"

namespace ddpx {

struct BFloat16 {
  uint16_t bits;
};
struct Float16 {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float to_float(float x) { return x; }
inline float to_float(BFloat16 x) { return bits_float(uint32_t(x.bits) << 16); }

inline float to_float(Float16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t em = x.bits & 0x7fffu;
  if (em >= 0x7c00u) return bits_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em < 0x400u) return bits_float(sign | float_bits(float(em) * 0x1p-24f));
  return bits_float(sign | ((em << 13) + 0x38000000u));
}

template <class T>
T from_float(float f);

template <>
inline float from_float<float>(float f) {
  return f;
}

template <>
inline BFloat16 from_float<BFloat16>(float f) {
  const uint32_t u = float_bits(f);
  if (f != f) return {0x7fc0};
  return {uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

template <>
inline Float16 from_float<Float16>(float f) {
  uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return {uint16_t(sign | 0x7e00u)};
  if (u >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // 65520 and up round to infinity
  if (u < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 puts the value's bits at the ulp of 2^-24,
    // and the FPU's own round-to-nearest-even does the rounding.
    return {uint16_t(sign | (float_bits(bits_float(u) + 0.5f) - 0x3f000000u))};
  }
  u += 0xc8000fffu + ((u >> 13) & 1u);  // rebias the exponent by -112, round to nearest even
  return {uint16_t(sign | (u >> 13))};
}

// Calls fn with a null pointer of the C++ type that stands for t.
template <class Fn>
decltype(auto) dispatch_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::Float32:
      return fn(static_cast<float*>(nullptr));
    case DType::Float64:
      return fn(static_cast<double*>(nullptr));
    case DType::BFloat16:
      return fn(static_cast<BFloat16*>(nullptr));
    case DType::Float16:
      return fn(static_cast<Float16*>(nullptr));
    case DType::Int8:
    case DType::Int4:
      break;  // block-scaled: quantize.h
  }
  throw std::invalid_argument("ddpx: unknown dtype code");
}

}  // namespace ddpx
