// Block-scaled integers (quantize.h). Plain loops the compiler vectorizes; the build turns off
// floating-point contraction, so a multiply and an add are never fused and every instruction set
// gives the same bits.
#include "quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace ddpx {
namespace {

// Rounds to the nearest integer, ties to even, for |v| <= 2^22: adding and taking away 1.5 * 2^23
// leaves the float32 rounding of v to an integer (in the default rounding mode, nearest even).
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// The largest magnitude of v[0..len), and whether every value is finite. In lanes, so that the
// compiler vectorizes it without reordering any rounding (a maximum rounds nothing).
bool largest_magnitude(const float* v, int64_t len, float* largest) {
  constexpr int kLanes = 8;
  float top[kLanes] = {};
  int finite[kLanes];
  std::fill(finite, finite + kLanes, 1);
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float a = std::fabs(v[i + j]);
      top[j] = a > top[j] ? a : top[j];
      finite[j] &= int(a <= std::numeric_limits<float>::max());
    }
  }
  for (; i < len; ++i) {
    const float a = std::fabs(v[i]);
    top[0] = a > top[0] ? a : top[0];
    finite[0] &= int(a <= std::numeric_limits<float>::max());
  }
  *largest = *std::max_element(top, top + kLanes);
  return std::all_of(finite, finite + kLanes, [](int f) { return f != 0; });
}

}  // namespace

namespace detail {

void quantize_blocks_portable(void* out, const BlockLayout& layout, const float* x, float* residual,
                              int64_t count, int64_t first, int64_t end) {
  auto* scales = static_cast<float*>(out);
  const float levels = layout.levels();
  float v[kBlock];
  int8_t q[kBlock];
  for (int64_t b = first; b < end; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::clamp<int64_t>(count - lo, 0, kBlock);
    const int64_t room = std::min<int64_t>(kBlock, layout.n - lo);
    const float* in = x + (lo - first * kBlock);
    float* kept = residual != nullptr ? residual + (lo - first * kBlock) : nullptr;
    for (int64_t i = 0; i < len; ++i) v[i] = kept != nullptr ? in[i] + kept[i] : in[i];
    std::memset(q, 0, sizeof(q));
    float largest = 0.0f;
    if (!largest_magnitude(v, len, &largest)) {
      scales[b] = std::numeric_limits<float>::quiet_NaN();
      put_block_values(out, layout, b, q, room);
      if (kept != nullptr) std::fill(kept, kept + len, 0.0f);
      continue;
    }
    const bool tiny = largest < kBlockSmallest;
    const float scale = tiny ? 0.0f : largest / levels;
    const float inverse = tiny ? 0.0f : levels / largest;
    scales[b] = scale;
    for (int64_t i = 0; i < len; ++i) {
      const float rounded = round_even(v[i] * inverse);
      q[i] = int8_t(rounded);
      if (kept != nullptr) kept[i] = v[i] - rounded * scale;
    }
    put_block_values(out, layout, b, q, room);
  }
}

void dequantize_sum_blocks_portable(float* dst, const void* const* srcs, int nsrc,
                                    const BlockLayout& layout, int64_t count, int64_t first,
                                    int64_t end) {
  int8_t room[kBlock];
  for (int64_t b = first; b < end; ++b) {
    const int64_t lo = b * kBlock;
    const int64_t len = std::clamp<int64_t>(count - lo, 0, kBlock);
    for (int k = 0; k < nsrc; ++k) {
      const float scale = static_cast<const float*>(srcs[k])[b];
      const int8_t* q = block_values(srcs[k], layout, b, len, room);
      float* d = dst + (lo - first * kBlock);
      if (k == 0) {
        for (int64_t i = 0; i < len; ++i) d[i] = float(q[i]) * scale;
      } else {
        for (int64_t i = 0; i < len; ++i) d[i] += float(q[i]) * scale;
      }
    }
  }
}

}  // namespace detail
}  // namespace ddpx
