// Turns a set of typed loops (one instruction set's) into the type-erased Kernels entry points.
// Float64 never meets the vector loops: it is summed in double by the plain loops below.
#pragma once

#include <cstring>
#include <type_traits>

#include "element.h"

namespace ddpx {

inline void convert_float64(double* dst, const double* src, int64_t n, double scale) {
  if (scale == 1.0) {
    if (dst != src) std::memmove(dst, src, size_t(n) * sizeof(double));
    return;
  }
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * scale;
}

inline void reduce_float64(double* dst, const double* const* srcs, int nsrc, int64_t n,
                           double scale) {
  for (int64_t i = 0; i < n; ++i) {
    double acc = srcs[0][i];
    for (int k = 1; k < nsrc; ++k) acc += srcs[k][i];
    dst[i] = acc * scale;
  }
}

inline void require_float64_pair(DType a, DType b) {
  if ((a == DType::Float64) != (b == DType::Float64)) {
    throw std::invalid_argument(
        std::string("ddpx: float64 data can only be reduced as float64, got ") + dtype_name(a) +
        " with " + dtype_name(b));
  }
}

// Calls fn(D*, S*) with null pointers of the element types of a (dst, src) pair of the float
// kinds the vector loops take (float64 is handled before it gets here).
template <class Fn>
void dispatch_float_pair(DType dst_t, DType src_t, Fn&& fn) {
  dispatch_dtype(dst_t, [&](auto* d) {
    dispatch_dtype(src_t, [&](auto* s) {
      using D = std::remove_pointer_t<decltype(d)>;
      using S = std::remove_pointer_t<decltype(s)>;
      if constexpr (!std::is_same_v<D, double> && !std::is_same_v<S, double>) fn(d, s);
    });
  });
}

template <class Loops>
void convert_dispatch(void* dst, DType dst_t, const void* src, DType src_t, int64_t n, double scale,
                      Write write) {
  require_float64_pair(dst_t, src_t);
  if (dst_t == DType::Float64) {
    convert_float64(static_cast<double*>(dst), static_cast<const double*>(src), n, scale);
    return;
  }
  if (dst_t == src_t && scale == 1.0) {
    if (dst != src) std::memmove(dst, src, size_t(n) * dtype_size(dst_t));
    return;
  }
  dispatch_float_pair(dst_t, src_t, [&](auto* d, auto* s) {
    using D = std::remove_pointer_t<decltype(d)>;
    using S = std::remove_pointer_t<decltype(s)>;
    Loops::template convert<D, S>(static_cast<D*>(dst), static_cast<const S*>(src), n, float(scale),
                                  write);
  });
}

template <class Loops>
void reduce_dispatch(void* dst, DType dst_t, const void* const* srcs, int nsrc, DType src_t,
                     int64_t n, double scale, Write write) {
  require_float64_pair(dst_t, src_t);
  if (dst_t == DType::Float64) {
    reduce_float64(static_cast<double*>(dst), reinterpret_cast<const double* const*>(srcs), nsrc, n,
                   scale);
    return;
  }
  dispatch_float_pair(dst_t, src_t, [&](auto* d, auto* s) {
    using D = std::remove_pointer_t<decltype(d)>;
    using S = std::remove_pointer_t<decltype(s)>;
    Loops::template reduce<D, S>(static_cast<D*>(dst), reinterpret_cast<const S* const*>(srcs),
                                 nsrc, n, float(scale), write);
  });
}

// The scalar loops: the whole job for the portable kernels, the heads and tails for the vector
// ones. They always write through the cache.
struct ScalarLoops {
  template <class D, class S>
  static void convert(D* dst, const S* src, int64_t n, float scale, Write = Write::Cached) {
    for (int64_t i = 0; i < n; ++i) dst[i] = from_float<D>(to_float(src[i]) * scale);
  }

  template <class D, class S>
  static void reduce(D* dst, const S* const* srcs, int nsrc, int64_t n, float scale,
                     Write = Write::Cached) {
    constexpr int64_t kTile = 256;  // accumulators stay in registers/L1 across the nsrc passes
    float acc[kTile];
    for (int64_t base = 0; base < n; base += kTile) {
      const int64_t m = n - base < kTile ? n - base : kTile;
      for (int64_t j = 0; j < m; ++j) acc[j] = to_float(srcs[0][base + j]);
      for (int k = 1; k < nsrc; ++k) {
        for (int64_t j = 0; j < m; ++j) acc[j] += to_float(srcs[k][base + j]);
      }
      for (int64_t j = 0; j < m; ++j) dst[base + j] = from_float<D>(acc[j] * scale);
    }
  }
};

}  // namespace ddpx
