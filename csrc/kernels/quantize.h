// Block-scaled int8, what compression="int8" puts on the link between nodes: each block of
// kInt8Block values travels as one float32 scale (the block's largest magnitude / 127) and a
// signed byte per value, 0.266 of float32's bytes. Blocks of 64, not 256: Adam magnifies the error
// in a block's small values, and 256 ended a converge run 2% off float32's loss (docs/design.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ddpx {

constexpr int64_t kInt8Block = 64;
// A block whose largest magnitude is below this travels as zeros and keeps its values whole in the
// residual: 127 / largest would overflow further down. Error feedback shrinks a residual that gets
// no new gradient (a dead unit's) by 254x a step, and would reach that in about 15 steps.
constexpr float kInt8Smallest = 0x1p-100f;

// Where n values lie in their wire bytes: the blocks' scales first, then the bytes.
struct Int8Layout {
  int64_t n, blocks;
  explicit Int8Layout(int64_t count) : n(count), blocks((count + kInt8Block - 1) / kInt8Block) {}
  size_t bytes() const { return size_t(blocks) * sizeof(float) + size_t(n); }
  size_t values_offset() const { return size_t(blocks) * sizeof(float); }
};

// The two operations on the format, each a Kernels entry (kernels.h) that gives the same bits in
// every instruction set, over the layout's blocks [first, end): x, residual and dst hold the
// values from block first's first one, and values from `count` (<= layout.n) on are zeros.
//
// quantize_int8(out, layout, x, residual, count, first, end) puts x + residual into those blocks of
// out (layout's bytes), rounding to nearest even, and leaves in residual what the rounding lost:
// residual = (x + residual) - its dequantized value. A block whose largest magnitude is not finite
// travels as such (its values dequantize to NaN) and its residual is reset to zero, so one
// overflowing step does not poison the next; one below kInt8Smallest travels as zeros. residual
// may be null (no error feedback).
//
// dequantize_sum_int8(dst, srcs, nsrc, layout, count, first, end): dst[i] = dequantized
// srcs[0][i] + srcs[1][i] + ... for those blocks' values below count, of nsrc buffers of `layout`,
// summed left to right in float32 and rounded once per addition, so every caller that passes the
// same buffers in the same order gets the same bits.
namespace detail {
// The portable loops: the whole of the portable kernels, and the vector kernels' partial and
// non-finite blocks.
void quantize_int8_portable(void* out, const Int8Layout& layout, const float* x, float* residual,
                            int64_t count, int64_t first, int64_t end);
void dequantize_sum_int8_portable(float* dst, const void* const* srcs, int nsrc,
                                  const Int8Layout& layout, int64_t count, int64_t first,
                                  int64_t end);
}  // namespace detail

}  // namespace ddpx
