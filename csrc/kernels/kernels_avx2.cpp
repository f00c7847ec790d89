// AVX2 + F16C kernels, compiled for those instructions function by function (never -march) and
// used only when the CPU reports them at run time.
#include "kernels.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "kernel_dispatch.h"
#include "quantize.h"

#define DDPX_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace ddpx {
namespace {

DDPX_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

DDPX_AVX2 inline __m256 load8(const BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

DDPX_AVX2 inline __m256 load8(const Float16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The bfloat16 bits of v in the low half of each 32-bit lane: round to nearest even on the bit
// pattern, exactly as from_float<BFloat16> does, and NaN -> 0x7fc0.
DDPX_AVX2 inline __m256i bfloat16_lanes(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  if (_mm256_testz_ps(nan, nan)) return r;  // the common case skips the blend
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}

DDPX_AVX2 inline __m128i bfloat16x8(__m256 v) {
  const __m256i r = bfloat16_lanes(v);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8));
}

// Sixteen at once: one pack and one lane permute per 32-byte write instead of two per 16 bytes.
DDPX_AVX2 inline __m256i bfloat16x16(__m256 lo, __m256 hi) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bfloat16_lanes(lo), bfloat16_lanes(hi)),
                                  0xd8);
}

// Streaming stores need dst aligned to the vector (32 bytes for float, 16 for the halves).
template <bool Stream>
DDPX_AVX2 inline void store8(float* p, __m256 v) {
  if constexpr (Stream) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

template <bool Stream>
DDPX_AVX2 inline void store8_bits(void* p, __m128i bits) {
  if constexpr (Stream) {
    _mm_stream_si128(static_cast<__m128i*>(p), bits);
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(p), bits);
  }
}

template <bool Stream>
DDPX_AVX2 inline void store8(BFloat16* p, __m256 v) {
  store8_bits<Stream>(p, bfloat16x8(v));
}

template <bool Stream>
DDPX_AVX2 inline void store8(Float16* p, __m256 v) {
  store8_bits<Stream>(p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// Elements to write with scalar stores before dst reaches a 32-byte boundary.
template <class D>
int64_t head_to_align(const D* dst, int64_t n) {
  const auto misalign = reinterpret_cast<uintptr_t>(dst) % 32;
  if (misalign == 0) return 0;
  if (misalign % sizeof(D) != 0) return n;  // never aligns: everything takes the scalar path
  return std::min<int64_t>(n, int64_t((32 - misalign) / sizeof(D)));
}

struct Avx2Loops {
  template <class D, class S>
  static void convert(D* dst, const S* src, int64_t n, float scale, Write write) {
    if (write == Write::Streaming) {
      const int64_t head = head_to_align(dst, n);
      ScalarLoops::convert(dst, src, head, scale);
      convert_body<true>(dst + head, src + head, n - head, scale);
      _mm_sfence();
    } else {
      convert_body<false>(dst, src, n, scale);
    }
  }

  template <class D, class S>
  static void reduce(D* dst, const S* const* srcs, int nsrc, int64_t n, float scale, Write write) {
    if (write == Write::Streaming) {
      const int64_t head = head_to_align(dst, n);
      ScalarLoops::reduce(dst, srcs, nsrc, head, scale);
      const S* rest[kMaxSources];
      for (int k = 0; k < nsrc; ++k) rest[k] = srcs[k] + head;
      reduce_body<true>(dst + head, rest, nsrc, n - head, scale);
      _mm_sfence();
    } else {
      reduce_body<false>(dst, srcs, nsrc, n, scale);
    }
  }

  template <bool Stream, class D, class S>
  DDPX_AVX2 static void convert_body(D* dst, const S* src, int64_t n, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8<Stream>(dst + i, _mm256_mul_ps(load8(src + i), s));
    ScalarLoops::convert(dst + i, src + i, n - i, scale);
  }

  // The cast to bfloat16 is the costly one (no instruction for it), so it goes 16 at a time.
  template <bool Stream, class S>
  DDPX_AVX2 static void convert_body(BFloat16* dst, const S* src, int64_t n, float scale) {
    const __m256 s = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m256i bits =
          bfloat16x16(_mm256_mul_ps(load8(src + i), s), _mm256_mul_ps(load8(src + i + 8), s));
      auto* out = reinterpret_cast<__m256i*>(dst + i);
      if constexpr (Stream) {
        _mm256_stream_si256(out, bits);
      } else {
        _mm256_storeu_si256(out, bits);
      }
    }
    ScalarLoops::convert(dst + i, src + i, n - i, scale);
  }

  template <bool Stream, class D, class S>
  DDPX_AVX2 static void reduce_body(D* dst, const S* const* srcs, int nsrc, int64_t n,
                                    float scale) {
    const __m256 f = _mm256_set1_ps(scale);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const S* s0 = srcs[0] + i;
      __m256 a0 = load8(s0), a1 = load8(s0 + 8), a2 = load8(s0 + 16), a3 = load8(s0 + 24);
      for (int k = 1; k < nsrc; ++k) {
        const S* s = srcs[k] + i;
        a0 = _mm256_add_ps(a0, load8(s));
        a1 = _mm256_add_ps(a1, load8(s + 8));
        a2 = _mm256_add_ps(a2, load8(s + 16));
        a3 = _mm256_add_ps(a3, load8(s + 24));
      }
      store8<Stream>(dst + i, _mm256_mul_ps(a0, f));
      store8<Stream>(dst + i + 8, _mm256_mul_ps(a1, f));
      store8<Stream>(dst + i + 16, _mm256_mul_ps(a2, f));
      store8<Stream>(dst + i + 24, _mm256_mul_ps(a3, f));
    }
    for (; i + 8 <= n; i += 8) {
      __m256 a = load8(srcs[0] + i);
      for (int k = 1; k < nsrc; ++k) a = _mm256_add_ps(a, load8(srcs[k] + i));
      store8<Stream>(dst + i, _mm256_mul_ps(a, f));
    }
    if (i == n) return;
    const S* tails[kMaxSources];
    for (int k = 0; k < nsrc; ++k) tails[k] = srcs[k] + i;
    ScalarLoops::reduce(dst + i, tails, nsrc, n - i, scale);
  }
};

DDPX_AVX2 void copy_bytes(void* dst, const void* src, size_t bytes, Write write) {
  const size_t misalign = reinterpret_cast<uintptr_t>(dst) % 32;
  const size_t head = std::min(bytes, misalign == 0 ? 0 : 32 - misalign);
  if (write == Write::Cached || bytes - head < 256) {
    std::memcpy(dst, src, bytes);
    return;
  }
  std::memcpy(dst, src, head);
  auto* out = reinterpret_cast<__m256i*>(static_cast<char*>(dst) + head);
  const char* in = static_cast<const char*>(src) + head;
  const size_t vectors = (bytes - head) / 32;
  for (size_t i = 0; i < vectors; ++i) {
    _mm256_stream_si256(out + i, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in) + i));
  }
  const size_t done = head + vectors * 32;
  std::memcpy(static_cast<char*>(dst) + done, static_cast<const char*>(src) + done, bytes - done);
  _mm_sfence();
}

// Block-scaled integers (quantize.h), a block of 64 values as eight vectors: the portable loops'
// multiplies, adds and subtractions in the same order (the build never fuses them), so the same
// bits. A block that is partial or holds a value that is not finite takes the portable loop.
constexpr int kBlockVectors = int(kBlock / 8);

// The eight vectors' values, each an integer in [-127, 127] (int4: [-7, 7]), as 64 bytes in
// order.
DDPX_AVX2 inline void store_int8x64(int8_t* out, const __m256i* q) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int half = 0; half < 2; ++half) {
    const __m256i* h = q + 4 * half;
    // packs works within 128-bit lanes: the bytes come out as 4-byte groups of the four vectors'
    // low halves, then of their high halves, which the permute puts back in order.
    const __m256i bytes =
        _mm256_packs_epi16(_mm256_packs_epi32(h[0], h[1]), _mm256_packs_epi32(h[2], h[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * half),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
}

DDPX_AVX2 void quantize_blocks_avx2(void* out, const BlockLayout& layout, const float* x,
                                    float* residual, int64_t count, int64_t first, int64_t end) {
  static_assert(kBlock % 32 == 0, "a block is whole vectors and whole 32-byte stores");
  auto* scales = static_cast<float*>(out);
  const int64_t whole = std::clamp(count / kBlock, first, end);
  const float levels = layout.levels();
  const __m256 sign = _mm256_set1_ps(-0.0f), top = _mm256_set1_ps(FLT_MAX);
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // quantize.cpp's round_even
  for (int64_t b = first; b < whole; ++b) {
    const int64_t lo = b * kBlock, at = lo - first * kBlock;
    __m256 v[kBlockVectors];
    __m256 largest = _mm256_setzero_ps(), unbounded = _mm256_setzero_ps();
    for (int j = 0; j < kBlockVectors; ++j) {
      v[j] = _mm256_loadu_ps(x + at + 8 * j);
      if (residual != nullptr) v[j] = _mm256_add_ps(v[j], _mm256_loadu_ps(residual + at + 8 * j));
      const __m256 a = _mm256_andnot_ps(sign, v[j]);
      unbounded = _mm256_or_ps(unbounded, _mm256_cmp_ps(a, top, _CMP_NLE_UQ));
      largest = _mm256_max_ps(largest, a);
    }
    if (!_mm256_testz_ps(unbounded, unbounded)) {
      detail::quantize_blocks_portable(out, layout, x + at, residual ? residual + at : nullptr,
                                       count, b, b + 1);
      continue;
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float most = _mm_cvtss_f32(m);
    const bool tiny = most < kBlockSmallest;
    const float scale = tiny ? 0.0f : most / levels;
    const __m256 s = _mm256_set1_ps(scale);
    const __m256 inverse = _mm256_set1_ps(tiny ? 0.0f : levels / most);
    scales[b] = scale;
    __m256i q[kBlockVectors];
    for (int j = 0; j < kBlockVectors; ++j) {
      const __m256 rounded =
          _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v[j], inverse), magic), magic);
      q[j] = _mm256_cvtps_epi32(rounded);
      if (residual != nullptr) {
        _mm256_storeu_ps(residual + at + 8 * j, _mm256_sub_ps(v[j], _mm256_mul_ps(rounded, s)));
      }
    }
    if (layout.bits == 8) {
      store_int8x64(static_cast<int8_t*>(out) + layout.block_offset(b), q);
    } else {
      alignas(32) int8_t bytes[kBlock];
      store_int8x64(bytes, q);
      put_block_values(out, layout, b, bytes, kBlock);
    }
  }
  const int64_t done = (whole - first) * kBlock;
  detail::quantize_blocks_portable(out, layout, x + done, residual ? residual + done : nullptr,
                                   count, whole, end);
}

DDPX_AVX2 void dequantize_sum_blocks_avx2(float* dst, const void* const* srcs, int nsrc,
                                          const BlockLayout& layout, int64_t count, int64_t first,
                                          int64_t end) {
  const int64_t whole = std::clamp(count / kBlock, first, end);
  int8_t room[kBlock];
  for (int64_t b = first; b < whole; ++b) {
    const int64_t at = (b - first) * kBlock;
    __m256 sum[kBlockVectors] = {};
    for (int k = 0; k < nsrc; ++k) {
      const auto* from = static_cast<const char*>(srcs[k]);
      const __m256 s = _mm256_set1_ps(reinterpret_cast<const float*>(from)[b]);
      const int8_t* q = block_values(from, layout, b, kBlock, room);
      for (int j = 0; j < kBlockVectors; ++j) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * j));
        const __m256 one = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s);
        sum[j] = k == 0 ? one : _mm256_add_ps(sum[j], one);
      }
    }
    for (int j = 0; j < kBlockVectors; ++j) _mm256_storeu_ps(dst + at + 8 * j, sum[j]);
  }
  detail::dequantize_sum_blocks_portable(dst + (whole - first) * kBlock, srcs, nsrc, layout, count,
                                         whole, end);
}

const Kernels kAvx2{"avx2",      &convert_dispatch<Avx2Loops>, &reduce_dispatch<Avx2Loops>,
                    &copy_bytes, &quantize_blocks_avx2,        &dequantize_sum_blocks_avx2};

}  // namespace

namespace detail {
const Kernels* avx2_kernels() {
  static const bool usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                             __builtin_cpu_supports("f16c");
  return usable ? &kAvx2 : nullptr;
}
}  // namespace detail

}  // namespace ddpx

#else

namespace ddpx::detail {
const Kernels* avx2_kernels() { return nullptr; }
}  // namespace ddpx::detail

#endif
