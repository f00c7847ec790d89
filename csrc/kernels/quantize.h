// Block-scaled integers, what compression="int8" and "int4" put on the link between nodes: each
// block of kBlock values travels as one float32 scale (the block's largest magnitude / its levels)
// and a signed integer in [-levels, levels] per value: a byte for int8 (127 levels each way), 0.266
// of float32's bytes; half a byte for int4 (7 levels each way, two values a byte, the first in the
// low half), 0.141. Blocks of 64, not 256: Adam magnifies the error in a block's small values, and
// 256 ended an int8 converge run 2% off float32's loss (docs/design.md).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ddpx {

constexpr int64_t kBlock = 64;
// A block whose largest magnitude is below this travels as zeros and keeps its values whole in the
// residual: levels / largest would overflow further down. Error feedback shrinks a residual that
// gets no new gradient (a dead unit's) by 254x a step in int8, and would reach that in about 15
// steps.
constexpr float kBlockSmallest = 0x1p-100f;

// Where n values of `bits` (8 or 4) lie in their wire bytes: the blocks' scales first, then the
// values, block after block.
struct BlockLayout {
  int64_t n, blocks;
  int bits;
  BlockLayout(int64_t count, int value_bits)
      : n(count), blocks((count + kBlock - 1) / kBlock), bits(value_bits) {}
  float levels() const { return bits == 8 ? 127.0f : 7.0f; }
  size_t value_bytes(int64_t values) const {
    return bits == 8 ? size_t(values) : size_t(values + 1) / 2;
  }
  size_t bytes() const { return size_t(blocks) * sizeof(float) + value_bytes(n); }
  size_t values_offset() const { return size_t(blocks) * sizeof(float); }
  // Where block b's values start (kBlock is even: an int4 block starts on a byte).
  size_t block_offset(int64_t b) const { return values_offset() + value_bytes(b * kBlock); }
};

// Puts block b's values q[0, room) (room: the block's values within the layout) into the wire.
inline void put_block_values(void* wire, const BlockLayout& layout, int64_t b, const int8_t* q,
                             int64_t room) {
  auto* out = static_cast<uint8_t*>(wire) + layout.block_offset(b);
  if (layout.bits == 8) {
    std::memcpy(out, q, size_t(room));
    return;
  }
  for (int64_t i = 0; i < room / 2; ++i) {
    out[i] = uint8_t((uint8_t(q[2 * i]) & 0xF) | (uint8_t(q[2 * i + 1]) << 4));
  }
  if (room % 2 != 0) out[room / 2] = uint8_t(q[room - 1]) & 0xF;
}

// Block b's first len values, one byte each: where they lie (int8), or unpacked into room (int4).
inline const int8_t* block_values(const void* wire, const BlockLayout& layout, int64_t b,
                                  int64_t len, int8_t* room) {
  const auto* in = static_cast<const uint8_t*>(wire) + layout.block_offset(b);
  if (layout.bits == 8) return reinterpret_cast<const int8_t*>(in);
  for (int64_t i = 0; i < (len + 1) / 2; ++i) {
    // Each half moved to the byte's top and shifted back down, which extends its sign.
    room[2 * i] = int8_t(int8_t(uint8_t(in[i] << 4)) >> 4);
    room[2 * i + 1] = int8_t(int8_t(in[i]) >> 4);
  }
  return room;
}

// The two operations on the format, each a Kernels entry (kernels.h) that gives the same bits in
// every instruction set, over the layout's blocks [first, end): x, residual and dst hold the
// values from block first's first one, and values from `count` (<= layout.n) on are zeros.
//
// quantize_blocks(out, layout, x, residual, count, first, end) puts x + residual into those blocks
// of out (layout's bytes), rounding to nearest even, and leaves in residual what the rounding lost:
// residual = (x + residual) - its dequantized value. A block whose largest magnitude is not finite
// travels as such (its values dequantize to NaN) and its residual is reset to zero, so one
// overflowing step does not poison the next; one below kBlockSmallest travels as zeros. residual
// may be null (no error feedback).
//
// dequantize_sum_blocks(dst, srcs, nsrc, layout, count, first, end): dst[i] = dequantized
// srcs[0][i] + srcs[1][i] + ... for those blocks' values below count, of nsrc buffers of `layout`,
// summed left to right in float32 and rounded once per addition, so every caller that passes the
// same buffers in the same order gets the same bits.
namespace detail {
// The portable loops: the whole of the portable kernels, and the vector kernels' partial and
// non-finite blocks.
void quantize_blocks_portable(void* out, const BlockLayout& layout, const float* x, float* residual,
                              int64_t count, int64_t first, int64_t end);
void dequantize_sum_blocks_portable(float* dst, const void* const* srcs, int nsrc,
                                    const BlockLayout& layout, int64_t count, int64_t first,
                                    int64_t end);
}  // namespace detail

}  // namespace ddpx
