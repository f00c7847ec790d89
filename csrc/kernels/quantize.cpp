// Block-scaled int8 (quantize.h). Plain loops the compiler vectorizes; the build turns off
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

void quantize_int8_portable(void* out, const Int8Layout& layout, const float* x, float* residual,
                            int64_t count, int64_t first, int64_t end) {
  auto* scales = static_cast<float*>(out);
  auto* values = reinterpret_cast<int8_t*>(static_cast<char*>(out) + layout.values_offset());
  float v[kInt8Block];
  for (int64_t b = first; b < end; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t len = std::clamp<int64_t>(count - lo, 0, kInt8Block);
    const float* in = x + (lo - first * kInt8Block);
    float* kept = residual != nullptr ? residual + (lo - first * kInt8Block) : nullptr;
    for (int64_t i = 0; i < len; ++i) v[i] = kept != nullptr ? in[i] + kept[i] : in[i];
    float largest = 0.0f;
    const bool finite = largest_magnitude(v, len, &largest);
    int8_t* q = values + lo;
    if (!finite) {
      scales[b] = std::numeric_limits<float>::quiet_NaN();
      std::memset(q, 0, size_t(std::min<int64_t>(kInt8Block, layout.n - lo)));
      if (kept != nullptr) std::fill(kept, kept + len, 0.0f);
      continue;
    }
    const bool tiny = largest < kInt8Smallest;
    const float scale = tiny ? 0.0f : largest / 127.0f;
    const float inverse = tiny ? 0.0f : 127.0f / largest;
    scales[b] = scale;
    for (int64_t i = 0; i < len; ++i) {
      const float rounded = round_even(v[i] * inverse);
      q[i] = int8_t(rounded);
      if (kept != nullptr) kept[i] = v[i] - rounded * scale;
    }
    const int64_t room = std::min<int64_t>(kInt8Block, layout.n - lo);
    if (room > len) std::memset(q + len, 0, size_t(room - len));
  }
}

void dequantize_sum_int8_portable(float* dst, const void* const* srcs, int nsrc,
                                  const Int8Layout& layout, int64_t count, int64_t first,
                                  int64_t end) {
  for (int64_t b = first; b < end; ++b) {
    const int64_t lo = b * kInt8Block;
    const int64_t len = std::clamp<int64_t>(count - lo, 0, kInt8Block);
    for (int k = 0; k < nsrc; ++k) {
      const float scale = static_cast<const float*>(srcs[k])[b];
      const auto* q = reinterpret_cast<const int8_t*>(static_cast<const char*>(srcs[k]) +
                                                      layout.values_offset()) +
                      lo;
      float* d = dst + (lo - first * kInt8Block);
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
