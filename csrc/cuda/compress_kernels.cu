// The kernels of the compressed GPU all-reduce. Each thread takes eight elements at a time with
// 16-byte loads and stores when every pointer is 16-byte aligned (the caching allocator's blocks
// and the engine's slices are), then a scalar loop takes the tail; grid-stride loops cover any size
// with a bounded grid. Only the explicit conversion intrinsics are used: torch builds CUDA code
// with the implicit half/bfloat16 conversions and operators switched off.
#include "compress_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace ddpx::cuda {
namespace {

constexpr int kThreads = 256;
// About one full wave on the largest GPUs (132 SMs x 2048 threads); the loops stride past it.
constexpr int64_t kMaxBlocks = 1024;
constexpr int kPack = 8;  // elements per vector step: 16 bytes of a 2-byte type, 32 of float32

template <typename T>
struct alignas(16) Pack {
  T v[kPack];
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Round to nearest even; overflow becomes inf and NaN stays NaN, as torch's own .to() does.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <typename T>
__device__ __forceinline__ Pack<T> load(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}

template <typename T>
__device__ __forceinline__ void store(T* p, const Pack<T>& pack) {
  *reinterpret_cast<Pack<T>*>(p) = pack;
}

template <typename Dst, typename Src>
__global__ void scale_cast_kernel(Dst* dst, const Src* src, int64_t n, float scale,
                                  bool vectorized) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = vectorized ? n / kPack : 0;
  for (int64_t p = first; p < packs; p += step) {
    const Pack<Src> in = load(src + p * kPack);
    Pack<Dst> out;
#pragma unroll
    for (int k = 0; k < kPack; ++k) out.v[k] = from_float<Dst>(to_float(in.v[k]) * scale);
    store(dst + p * kPack, out);
  }
  for (int64_t i = packs * kPack + first; i < n; i += step) {
    dst[i] = from_float<Dst>(to_float(src[i]) * scale);
  }
}

// The sum starts from slice 0 itself, not from 0.0f, so that -0.0 survives as torch's sum keeps it.
template <typename T>
__global__ void sum_slices_kernel(T* dst, const T* src, int64_t nslices, int64_t stride, int64_t n,
                                  bool vectorized) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t packs = vectorized ? n / kPack : 0;
  for (int64_t p = first; p < packs; p += step) {
    const Pack<T> in = load(src + p * kPack);
    float acc[kPack];
#pragma unroll
    for (int k = 0; k < kPack; ++k) acc[k] = to_float(in.v[k]);
    for (int64_t r = 1; r < nslices; ++r) {
      const Pack<T> more = load(src + r * stride + p * kPack);
#pragma unroll
      for (int k = 0; k < kPack; ++k) acc[k] += to_float(more.v[k]);
    }
    Pack<T> out;
#pragma unroll
    for (int k = 0; k < kPack; ++k) out.v[k] = from_float<T>(acc[k]);
    store(dst + p * kPack, out);
  }
  for (int64_t i = packs * kPack + first; i < n; i += step) {
    float acc = to_float(src[i]);
    for (int64_t r = 1; r < nslices; ++r) acc += to_float(src[r * stride + i]);
    dst[i] = from_float<T>(acc);
  }
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % sizeof(Pack<__half>) == 0; }

unsigned blocks_for(int64_t n, bool vectorized) {
  const int64_t threads = vectorized ? (n + kPack - 1) / kPack : n;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  return unsigned(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// Calls launch(T{}) with the element type T of a DType.
template <typename Launch>
cudaError_t with_type(DType type, Launch launch) {
  switch (type) {
    case DType::Float32:
      return launch(float{});
    case DType::BFloat16:
      return launch(__nv_bfloat16{});
    case DType::Float16:
      return launch(__half{});
    case DType::Float64:
    case DType::Int8:
    case DType::Int4:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t scale_cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n,
                       float scale, cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const bool vectorized = aligned(dst) && aligned(src);
  return with_type(dst_type, [&](auto dst_tag) {
    return with_type(src_type, [&](auto src_tag) {
      using Dst = decltype(dst_tag);
      using Src = decltype(src_tag);
      scale_cast_kernel<<<blocks_for(n, vectorized), kThreads, 0, stream>>>(
          static_cast<Dst*>(dst), static_cast<const Src*>(src), n, scale, vectorized);
      return cudaGetLastError();
    });
  });
}

cudaError_t sum_slices(void* dst, const void* src, DType type, int64_t nslices, int64_t stride,
                       int64_t n, cudaStream_t stream) {
  if (n < 0 || nslices < 1 || stride < n) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  // Every slice must start on a 16-byte boundary for the vector loads, not just the first.
  const bool vectorized = aligned(dst) && aligned(src) && stride % kPack == 0;
  return with_type(type, [&](auto tag) {
    using T = decltype(tag);
    sum_slices_kernel<<<blocks_for(n, vectorized), kThreads, 0, stream>>>(
        static_cast<T*>(dst), static_cast<const T*>(src), nslices, stride, n, vectorized);
    return cudaGetLastError();
  });
}

}  // namespace ddpx::cuda
