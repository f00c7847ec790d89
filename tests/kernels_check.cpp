// Bit-for-bit checks of every element-kernel implementation this CPU runs (kernels_for("portable"),
// and "avx2" where built and supported) against a scalar reference written here, without torch,
// so that the kernels can be checked where torch does not run (aarch64 under qemu).
//
//     g++ -std=c++17 -O3 -Wall -ffp-contract=off -Icsrc/kernels tests/kernels_check.cpp
//         csrc/kernels/*.cpp -o kernels_check
//
// Prints one line per check and ends with "N passed, M failed" (a case is one kernel call);
// exits 1 if any case failed. Inputs are random from fixed seeds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels.h"
#include "quantize.h"

using ddpx::DType;
using ddpx::Kernels;
using ddpx::Write;

namespace {

// ---- The reference: element values as doubles, which hold every value of all four types. ----

template <class To, class From>
To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From), "same size");
  To to;
  std::memcpy(&to, &from, sizeof to);
  return to;
}

// x rounded to the nearest value, ties to even, of a binary format with `digits` significand bits
// whose smallest normal is 2^emin; below 2^emin the spacing stays 2^(emin - digits + 1), which
// gives the subnormals. Dividing by a power of two is exact, so the only rounding is nearbyint's,
// which rounds ties to even in the default mode. No exponent limit: the caller maps overflow.
double round_to_grid(double x, int digits, int emin) {
  if (x == 0 || !std::isfinite(x)) return x;
  int e;
  std::frexp(x, &e);  // |x| in [2^(e-1), 2^e)
  const double ulp = std::ldexp(1.0, std::max(e - 1, emin) - digits + 1);
  return std::nearbyint(x / ulp) * ulp;
}

uint16_t bfloat16_bits(double x) {
  if (std::isnan(x)) return 0x7fc0;
  // The rounded value is a float (2^128, past the largest bfloat16, becomes infinity), and a
  // bfloat16 is the upper half of a float.
  return uint16_t(bit_cast<uint32_t>(float(round_to_grid(x, 8, -126))) >> 16);
}

uint16_t float16_bits(double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return sign | 0x7e00;
  const double a = std::fabs(round_to_grid(x, 11, -14));
  if (a >= 65536) return sign | 0x7c00;                 // past 65504 after rounding: infinity
  if (a < 0x1p-14) return sign | uint16_t(a * 0x1p24);  // subnormal: a count of 2^-24
  int e;
  const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  return sign | uint16_t((e + 14) << 10) | uint16_t((2 * m - 1) * 1024);
}

double float16_value(uint16_t h) {
  const double sign = (h & 0x8000) ? -1 : 1;
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return m ? std::numeric_limits<double>::quiet_NaN() : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

size_t size_of(DType t) { return t == DType::Float64 ? 8 : t == DType::Float32 ? 4 : 2; }

// Element i of an array of t. Elements are read and written as the low bytes of a 64-bit word:
// both x86-64 and aarch64 Linux are little-endian.
double get(DType t, const void* p, int64_t i) {
  uint64_t u = 0;
  std::memcpy(&u, static_cast<const char*>(p) + i * size_of(t), size_of(t));
  if (t == DType::Float64) return bit_cast<double>(u);
  if (t == DType::Float16) return float16_value(uint16_t(u));
  if (t == DType::BFloat16) u <<= 16;  // a bfloat16 is the upper half of a float
  return bit_cast<float>(uint32_t(u));
}

// Stores x rounded once to t (to float for Float32).
void put(DType t, void* p, int64_t i, double x) {
  uint64_t u = bit_cast<uint64_t>(x);
  if (t == DType::Float32) u = bit_cast<uint32_t>(float(x));
  if (t == DType::BFloat16) u = bfloat16_bits(x);
  if (t == DType::Float16) u = float16_bits(x);
  std::memcpy(static_cast<char*>(p) + i * size_of(t), &u, size_of(t));
}

// The contract: the source widened to float and multiplied by float(scale) (both in double for
// Float64), then rounded once to the destination type.
void reference_convert(void* dst, DType dst_t, const void* src, DType src_t, int64_t n, double s) {
  for (int64_t i = 0; i < n; ++i) {
    const double x = get(src_t, src, i);
    put(dst_t, dst, i, dst_t == DType::Float64 ? x * s : float(x) * float(s));
  }
}

// The contract: the sources summed in rank order, in float (double for Float64), scaled as
// reference_convert scales, rounded once.
void reference_reduce(void* dst, DType dst_t, const std::vector<const void*>& srcs, DType src_t,
                      int64_t n, double s) {
  for (int64_t i = 0; i < n; ++i) {
    if (dst_t == DType::Float64) {
      double acc = get(src_t, srcs[0], i);
      for (size_t k = 1; k < srcs.size(); ++k) acc += get(src_t, srcs[k], i);
      put(dst_t, dst, i, acc * s);
    } else {
      float acc = float(get(src_t, srcs[0], i));
      for (size_t k = 1; k < srcs.size(); ++k) acc += float(get(src_t, srcs[k], i));
      put(dst_t, dst, i, acc * float(s));
    }
  }
}

// ---- Buffers, inputs and bookkeeping. ----

constexpr unsigned char kGuard = 0xa5;

// `bytes` bytes starting `offset` bytes past a 64-byte boundary, with guard bytes on both sides,
// so that a kernel writing outside [p, p + bytes) is caught.
struct Buffer {
  std::vector<unsigned char> storage;
  unsigned char* p;
  size_t bytes;
  Buffer(size_t bytes, size_t offset) : storage(bytes + offset + 192, kGuard), bytes(bytes) {
    const auto base = (reinterpret_cast<uintptr_t>(storage.data()) + 127) & ~uintptr_t(63);
    p = reinterpret_cast<unsigned char*>(base) + offset;
  }
  bool guards_intact() const {
    for (const unsigned char* q = storage.data(); q < storage.data() + storage.size(); ++q) {
      if ((q < p || q >= p + bytes) && *q != kGuard) return false;
    }
    return true;
  }
};

// Rounding ties, overflow, underflow and subnormals of the three narrow types, and the specials.
const double kSpecials[] = {0.0,        -0.0,      1.0,     -1.0,    INFINITY, -INFINITY,
                            NAN,        65504.0,   65519.0, 65520.0, 70000.0,  1e-8,
                            6e-8,       0x1p-25,   3e-5,    1e-40,   3.0e38,   3.4e38,
                            1.00390625, 1.0078125, 2049.0,  2050.0,  2051.0,   -0x1.7fp-3};

// n elements of t: the specials first, then random values, about one in `raw` a random bit pattern
// (every NaN, infinity and subnormal included) and the rest in (-2^k, 2^k) for k up to 10.
std::vector<unsigned char> values(DType t, int64_t n, std::mt19937_64& rng, unsigned raw = 4) {
  std::vector<unsigned char> out(n * size_of(t));
  const int64_t nspecial = int64_t(sizeof kSpecials / sizeof kSpecials[0]);
  for (int64_t i = 0; i < n; ++i) {
    if (i < nspecial) {
      put(t, out.data(), i, kSpecials[i]);
    } else if (rng() % raw == 0) {
      const uint64_t bits = rng();
      std::memcpy(out.data() + i * size_of(t), &bits, size_of(t));  // little-endian: low bytes
    } else {
      const double mantissa = int32_t(rng());
      put(t, out.data(), i, std::ldexp(mantissa, int(rng() % 11) - 31));
    }
  }
  return out;
}

// Index of the first element whose bits differ (two NaNs count as equal: payloads do not count),
// or -1.
int64_t first_mismatch(DType t, const void* got, const void* want, int64_t n) {
  const size_t w = size_of(t);
  for (int64_t i = 0; i < n; ++i) {
    const auto* g = static_cast<const char*>(got) + i * w;
    const bool same = std::memcmp(g, static_cast<const char*>(want) + i * w, w) == 0;
    if (!same && !(std::isnan(get(t, got, i)) && std::isnan(get(t, want, i)))) return i;
  }
  return -1;
}

struct Tally {
  std::string name;
  long passed = 0, failed = 0;
};
std::deque<Tally> tallies;  // a deque: a Tally& stays valid while checks are added

Tally& check(const std::string& name) {
  tallies.push_back({name});
  return tallies.back();
}

// Counts one case; on a failure prints what and where (the first three of a check).
void record(Tally& t, bool ok, const std::string& what) {
  if (ok) {
    ++t.passed;
  } else if (++t.failed <= 3) {
    std::printf("FAIL %s: %s\n", t.name.c_str(), what.c_str());
  }
}

// Compares a kernel's output with the reference's and the guards around it.
void compare(Tally& t, const std::string& what, DType dt, const Buffer& got, const void* want,
             int64_t n) {
  const int64_t i = first_mismatch(dt, got.p, want, n);
  std::string why;
  if (i >= 0) {
    char s[160];
    std::snprintf(s, sizeof s, " element %lld is %.9g, the reference %.9g", (long long)i,
                  get(dt, got.p, i), get(dt, want, i));
    why = s;
  } else if (!got.guards_intact()) {
    why = " wrote outside its output";
  }
  record(t, why.empty(), what + why);
}

const DType kNarrow[] = {DType::Float32, DType::BFloat16, DType::Float16};
const Write kWrites[] = {Write::Cached, Write::Streaming};
const int64_t kSizes[] = {0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 65, 255, 256, 257, 4099};
const size_t kOffsets[] = {0, 1, 5};  // elements past a 64-byte boundary

std::string describe(const char* op, DType dt, DType st, int64_t n, Write write, size_t off,
                     const std::string& more = "") {
  return std::string(op) + " " + ddpx::dtype_name(st) + "->" + ddpx::dtype_name(dt) +
         " n=" + std::to_string(n) + (write == Write::Streaming ? " streaming" : " cached") +
         " offset=" + std::to_string(off) + more;
}

// ---- The checks of one implementation. ----

void check_casts(const Kernels& k) {
  // Every bfloat16 and float16 widens exactly; random float bit patterns narrow as the reference.
  Tally& t = check(std::string(k.isa) + " casts");
  std::mt19937_64 rng(1);
  std::vector<unsigned char> patterns(1 << 18 << 2);
  for (auto& b : patterns) b = static_cast<unsigned char>(rng());
  for (Write write : kWrites) {
    for (DType half : {DType::BFloat16, DType::Float16}) {
      std::vector<uint16_t> all(1 << 16);
      std::iota(all.begin(), all.end(), uint16_t(0));
      Buffer wide(all.size() * 4, 0);
      std::vector<unsigned char> want(wide.bytes);
      k.convert(wide.p, DType::Float32, all.data(), half, int64_t(all.size()), 1.0, write);
      reference_convert(want.data(), DType::Float32, all.data(), half, int64_t(all.size()), 1.0);
      compare(t, describe("widen", DType::Float32, half, 1 << 16, write, 0), DType::Float32, wide,
              want.data(), int64_t(all.size()));

      const int64_t n = int64_t(patterns.size() / 4);
      Buffer narrow(n * 2, 0);
      want.assign(n * 2, 0);
      k.convert(narrow.p, half, patterns.data(), DType::Float32, n, 1.0, write);
      reference_convert(want.data(), half, patterns.data(), DType::Float32, n, 1.0);
      compare(t, describe("narrow", half, DType::Float32, n, write, 0), half, narrow, want.data(),
              n);
    }
  }
}

// The (dst, src) type pairs the kernels take: Float64 only with itself.
std::vector<std::pair<DType, DType>> type_pairs() {
  std::vector<std::pair<DType, DType>> pairs{{DType::Float64, DType::Float64}};
  for (DType dt : kNarrow) {
    for (DType st : kNarrow) pairs.push_back({dt, st});
  }
  return pairs;
}

void check_convert(const Kernels& k) {
  Tally& t = check(std::string(k.isa) + " convert (scale and cast)");
  std::mt19937_64 rng(2);
  for (auto [dt, st] : type_pairs()) {
    for (double scale : {1.0, 0.25, 1.0 / 3}) {
      for (Write write : kWrites) {
        for (int64_t n : kSizes) {
          for (size_t off : kOffsets) {
            const auto src = values(st, n + 3, rng);  // from element 3: an unaligned source
            const void* s = src.data() + 3 * size_of(st);
            std::vector<unsigned char> want(n * size_of(dt));
            reference_convert(want.data(), dt, s, st, n, scale);
            Buffer dst(want.size(), off * size_of(dt));
            k.convert(dst.p, dt, s, st, n, scale, write);
            compare(t, describe("convert", dt, st, n, write, off), dt, dst, want.data(), n);
            if (dt != st) continue;
            Buffer in_place(want.size(), off * size_of(dt));  // dst == src
            if (n > 0) std::memcpy(in_place.p, s, want.size());
            k.convert(in_place.p, dt, in_place.p, st, n, scale, write);
            compare(t, describe("convert in place", dt, st, n, write, off), dt, in_place,
                    want.data(), n);
          }
        }
      }
    }
  }
}

void check_reduce(const Kernels& k) {
  Tally& t = check(std::string(k.isa) + " reduce (sum in rank order)");
  std::mt19937_64 rng(3);
  for (auto [dt, st] : type_pairs()) {
    for (int nsrc : {1, 2, 3, 4, 8}) {
      // Unscaled, and an average's scale, which no float holds exactly.
      const double scale = nsrc == 3 ? 1.0 / 3 : 1.0;
      for (Write write : kWrites) {
        for (int64_t n : kSizes) {
          for (size_t off : kOffsets) {
            // Source r starts r elements in, so each has its own alignment; few raw bit
            // patterns, as sums of them are mostly infinities and NaNs.
            std::vector<std::vector<unsigned char>> data;
            std::vector<const void*> srcs;
            for (int r = 0; r < nsrc; ++r) {
              data.push_back(values(st, n + r, rng, 64));
              srcs.push_back(data.back().data() + r * size_of(st));
            }
            const std::string sources =
                " nsrc=" + std::to_string(nsrc) + " scale=" + std::to_string(scale);
            Buffer dst(n * size_of(dt), off * size_of(dt));
            std::vector<unsigned char> want(dst.bytes);
            k.reduce(dst.p, dt, srcs.data(), nsrc, st, n, scale, write);
            reference_reduce(want.data(), dt, srcs, st, n, scale);
            compare(t, describe("reduce", dt, st, n, write, off, sources), dt, dst, want.data(), n);

            // dst aliasing a source, element for element: the first, and the last.
            if (dt != st || nsrc < 2) continue;
            for (int alias : {0, nsrc - 1}) {
              Buffer into(n * size_of(dt), off * size_of(dt));
              if (n > 0) std::memcpy(into.p, srcs[alias], into.bytes);
              std::vector<const void*> with_alias = srcs;
              with_alias[alias] = into.p;
              k.reduce(into.p, dt, with_alias.data(), nsrc, st, n, scale, write);
              const std::string which = sources + " into source " + std::to_string(alias);
              compare(t, describe("reduce", dt, st, n, write, off, which), dt, into, want.data(),
                      n);
            }
          }
        }
      }
    }
  }
}

void check_copy(const Kernels& k) {
  // Any bytes (signalling NaN patterns included); dst at every offset from a 64-byte boundary,
  // and the source too (off * 37 runs through all 64).
  Tally& t = check(std::string(k.isa) + " copy (bytes)");
  std::mt19937_64 rng(4);
  std::vector<unsigned char> bytes(65541 + 64);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  for (Write write : kWrites) {
    for (size_t n : {0, 1, 31, 32, 33, 255, 256, 257, 4109, 65541}) {
      for (size_t off = 0; off < 64; ++off) {
        const unsigned char* src = bytes.data() + (off * 37 + 11) % 64;
        Buffer dst(n, off);
        k.copy(dst.p, src, n, write);
        const bool ok = (n == 0 || std::memcmp(dst.p, src, n) == 0) && dst.guards_intact();
        record(t, ok,
               "copy n=" + std::to_string(n) + " dst offset=" + std::to_string(off) +
                   (write == Write::Streaming ? " streaming" : " cached"));
      }
    }
  }
}

// Value i of a block-scaled wire, read plainly: a signed byte (int8), or a signed half byte, the
// low half first (int4).
float wire_value(const std::vector<unsigned char>& wire, const ddpx::BlockLayout& layout,
                 int64_t i) {
  if (layout.bits == 8) return float(static_cast<int8_t>(wire[layout.values_offset() + size_t(i)]));
  const int half = (wire[layout.values_offset() + size_t(i / 2)] >> (4 * (i % 2))) & 0xF;
  return float(half >= 8 ? half - 16 : half);
}

// Block-scaled int8 and int4 (quantize.h) against the rounding written plainly: per block of 64,
// the scale is the largest magnitude / levels (127, 7), each value becomes
// nearbyint(v * (levels / largest)), and what that lost is kept; a block with a NaN or an infinity
// travels as NaN, its residual zeroed. Then the dequantized sum of two such buffers, in order.
// Case 3 rounds without error feedback (a null residual, as if zero).
void check_quantize(const Kernels& k, int bits) {
  Tally& t =
      check(std::string(k.isa) + " int" + std::to_string(bits) + " quantize, dequantize-sum");
  const float levels = bits == 8 ? 127.0f : 7.0f;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  for (int64_t n : {0, 1, 63, 64, 65, 255, 256, 257, 1000, 4097}) {
    for (int special = 0; special < 4; ++special) {
      const size_t count = static_cast<size_t>(n);
      std::vector<float> x(count), residual(count), want_residual(count);
      for (int64_t i = 0; i < n; ++i) {
        x[size_t(i)] = normal(rng) * float(1 + i % 7);
        residual[size_t(i)] = special == 3 ? 0.0f : normal(rng) * 0.01f;
      }
      if (n > 300 && special == 1) x[300] = std::numeric_limits<float>::quiet_NaN();
      if (n > 300 && special == 2) x[3] = std::numeric_limits<float>::infinity();
      // A block of residuals only (a dead unit's), and one so small that levels / largest
      // overflows.
      if (special == 2 && n > 600) std::fill(x.begin() + 512, x.begin() + 768, 0.0f);
      if (special == 1 && n > 600) {
        for (int64_t i = 512; i < 768; ++i) x[size_t(i)] = residual[size_t(i)] = 1e-39f;
      }
      const ddpx::BlockLayout layout(n, bits);
      std::vector<float> want_values(count);
      std::vector<float> want_scales(static_cast<size_t>(layout.blocks));
      for (int64_t b = 0; b < layout.blocks; ++b) {
        const int64_t lo = b * ddpx::kBlock, hi = std::min(n, lo + ddpx::kBlock);
        float largest = 0.0f;
        bool finite = true;
        for (int64_t i = lo; i < hi; ++i) {
          const float v = x[size_t(i)] + residual[size_t(i)];
          finite = finite && std::isfinite(v);
          largest = std::max(largest, std::fabs(v));
        }
        const bool tiny = largest < 0x1p-100f;  // travels as zeros, kept whole
        const float scale = tiny ? 0.0f : largest / levels;
        want_scales[size_t(b)] = finite ? scale : NAN;
        const float inverse = tiny ? 0.0f : levels / largest;
        for (int64_t i = lo; i < hi; ++i) {
          const float v = x[size_t(i)] + residual[size_t(i)];
          // + 0: an integer holds no negative zero.
          const float q = finite ? std::nearbyint(v * inverse) + 0.0f : 0.0f;
          want_values[size_t(i)] = q;
          want_residual[size_t(i)] = finite ? v - q * scale : 0.0f;
        }
      }
      std::vector<unsigned char> wire(layout.bytes() + 1, 0xAB);
      // Also in pieces of 3 blocks (and what is left), each from its own first value: the same
      // bytes and residuals as the whole.
      std::vector<unsigned char> pieced(layout.bytes() + 1, 0xAB);
      std::vector<float> pieced_residual = residual;
      for (int64_t b = 0; b < layout.blocks; b += 3) {
        const int64_t at = b * ddpx::kBlock;
        k.quantize_blocks(pieced.data(), layout, x.data() + at,
                          special == 3 ? nullptr : pieced_residual.data() + at, n, b,
                          std::min(layout.blocks, b + 3));
      }
      k.quantize_blocks(wire.data(), layout, x.data(), special == 3 ? nullptr : residual.data(), n,
                        0, layout.blocks);
      bool ok = wire.back() == 0xAB && pieced == wire &&
                std::memcmp(pieced_residual.data(), residual.data(), count * sizeof(float)) == 0;
      for (int64_t b = 0; b < layout.blocks; ++b) {
        float scale;
        std::memcpy(&scale, wire.data() + 4 * b, 4);
        const float want = want_scales[size_t(b)];
        ok = ok && (std::isnan(want) ? std::isnan(scale) : scale == want);
      }
      for (int64_t i = 0; i < n; ++i) {
        ok = ok && wire_value(wire, layout, i) == want_values[size_t(i)] &&
             (special == 3 || bit_cast<uint32_t>(residual[size_t(i)]) ==
                                  bit_cast<uint32_t>(want_residual[size_t(i)]));
      }
      // int4's odd last value shares its byte with a zero.
      if (bits == 4 && n % 2 == 1) ok = ok && wire_value(wire, layout, n) == 0.0f;
      // Three buffers (this one, and two more rounded by the kernel just checked), summed in
      // order: floats do not add associatively, so a kernel that sums in another order differs.
      std::vector<std::vector<unsigned char>> wires(3, wire);
      for (int w = 1; w < 3; ++w) {
        std::vector<float> other(count);
        for (int64_t i = 0; i < n; ++i) other[size_t(i)] = normal(rng) * float(1 << (8 * w));
        k.quantize_blocks(wires[size_t(w)].data(), layout, other.data(), nullptr, n, 0,
                          layout.blocks);
      }
      std::vector<float> sum(count), pieced_sum(count);
      const void* three[3] = {wires[0].data(), wires[1].data(), wires[2].data()};
      k.dequantize_sum_blocks(sum.data(), three, 3, layout, n, 0, layout.blocks);
      for (int64_t b = 0; b < layout.blocks; b += 3) {
        k.dequantize_sum_blocks(pieced_sum.data() + b * ddpx::kBlock, three, 3, layout, n, b,
                                std::min(layout.blocks, b + 3));
      }
      ok = ok && std::memcmp(pieced_sum.data(), sum.data(), count * sizeof(float)) == 0;
      for (int64_t i = 0; i < n; ++i) {
        float want = 0.0f;
        for (int w = 0; w < 3; ++w) {
          const unsigned char* from = wires[size_t(w)].data();
          float scale;
          std::memcpy(&scale, from + 4 * (i / ddpx::kBlock), 4);
          const float one = wire_value(wires[size_t(w)], layout, i) * scale;
          want = w == 0 ? one : want + one;
        }
        ok = ok &&
             (std::isnan(want) ? std::isnan(sum[size_t(i)])
                               : bit_cast<uint32_t>(sum[size_t(i)]) == bit_cast<uint32_t>(want));
      }
      record(t, ok, "n=" + std::to_string(n) + " case " + std::to_string(special));
    }
  }
}

}  // namespace

int main() {
#if defined(__aarch64__)
  const char* arch = "aarch64";
#elif defined(__x86_64__)
  const char* arch = "x86-64";
#else
  const char* arch = "another architecture";
#endif
  std::printf("kernels_check on %s: kernels() chooses %s\n", arch, ddpx::kernels().isa);
  Tally& api = check("kernels_for");
  record(api, ddpx::kernels_for("no-such-isa") == nullptr, "an unknown ISA was not nullptr");
  std::vector<const Kernels*> impls;
  for (const char* isa : {"portable", "avx2"}) {
    const Kernels* k = ddpx::kernels_for(isa);
    if (k != nullptr) impls.push_back(k);
    if (k == nullptr) std::printf("%s: not built for or not run by this CPU, skipped\n", isa);
  }
  record(api, !impls.empty() && std::strcmp(impls[0]->isa, "portable") == 0, "no portable kernels");
  const bool widest = !impls.empty() && std::strcmp(ddpx::kernels().isa, impls.back()->isa) == 0;
  record(api, widest, "kernels() is not the widest implementation available");
  for (const Kernels* k : impls) {
    check_quantize(*k, 8);
    check_quantize(*k, 4);
    check_casts(*k);
    check_convert(*k);
    check_reduce(*k);
    check_copy(*k);
  }
  long passed = 0, failed = 0;
  for (const Tally& t : tallies) {
    std::printf("%-34s %6ld passed, %ld failed\n", t.name.c_str(), t.passed, t.failed);
    passed += t.passed;
    failed += t.failed;
  }
  std::printf("%ld passed, %ld failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
