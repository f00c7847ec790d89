// Element kernels of the shared-memory all-reduce: the fused scale-and-cast that moves data into
// shared memory, and the reduction that sums the ranks' blocks in a fixed order.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddpx {

constexpr int kMaxSources = 64;  // ranks a reduction sums at most

// Int8 and Int4 name compression="int8" and "int4" on the wire between nodes in a call's
// description; they are block-scaled (quantize.h), and no kernel here but those of quantize.h
// takes them.
enum class DType : int32_t {
  Float32 = 0,
  Float64 = 1,
  BFloat16 = 2,
  Float16 = 3,
  Int8 = 4,
  Int4 = 5
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);

// How a kernel writes dst: Streaming bypasses the caches (non-temporal stores), for outputs too
// large to stay cached, where it saves reading every line before overwriting it.
enum class Write { Cached, Streaming };

// dst[i] = DstT(float(src[i]) * scale), rounding to nearest even once. Float64 data is only ever
// paired with Float64 and scaled in double.
using ConvertFn = void (*)(void* dst, DType dst_t, const void* src, DType src_t, int64_t n,
                           double scale, Write write);

// dst[i] = DstT((srcs[0][i] + srcs[1][i] + ... + srcs[nsrc-1][i]) * scale), summed left to right
// in float (double for Float64) and scaled as convert scales, rounding once, so every caller that
// passes the same sources in the same order gets the same bits whatever the instruction set, and
// the same as a sum converted into dst with the scale. dst may alias srcs[k] element for element.
using ReduceFn = void (*)(void* dst, DType dst_t, const void* const* srcs, int nsrc, DType src_t,
                          int64_t n, double scale, Write write);

// dst[0..bytes) = src[0..bytes), any bits; dst and src do not overlap.
using CopyFn = void (*)(void* dst, const void* src, size_t bytes, Write write);

// Block-scaled integers' rounding and their dequantized sum, over blocks [first, end) of a layout
// (quantize.h says what each does).
struct BlockLayout;
using QuantizeBlocksFn = void (*)(void* out, const BlockLayout& layout, const float* x,
                                  float* residual, int64_t count, int64_t first, int64_t end);
using DequantizeSumBlocksFn = void (*)(float* dst, const void* const* srcs, int nsrc,
                                       const BlockLayout& layout, int64_t count, int64_t first,
                                       int64_t end);

struct Kernels {
  const char* isa;
  ConvertFn convert;
  ReduceFn reduce;
  CopyFn copy;
  QuantizeBlocksFn quantize_blocks;
  DequantizeSumBlocksFn dequantize_sum_blocks;
};

// The widest kernels this CPU runs, chosen once at first use ("avx2" or "portable").
const Kernels& kernels();

// Kernels by ISA name, for tests that hold each implementation against the reference.
// Returns nullptr for an ISA that was not built or that this CPU lacks.
const Kernels* kernels_for(const char* isa);

namespace detail {
const Kernels* avx2_kernels();  // nullptr when not built for x86-64
}  // namespace detail

}  // namespace ddpx
