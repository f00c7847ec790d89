// The CUDA kernels of the compressed GPU all-reduce: raw pointers, element counts and a stream, no
// torch, so that nvcc compiles them anywhere (see csrc/cuda/compress_kernels.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../kernels/kernels.h"

namespace ddpx::cuda {

// The dtypes are the CPU kernels' (kernels.h, free of torch too); Float64 is refused
// (cudaErrorInvalidValue): the GPU path sends float64 uncompressed through the process group.

// dst[i] = Dst(float(src[i]) * scale) for i < n, rounded to nearest even once: the scale comes
// first so that fp16 does not overflow on data that fits once averaged. With scale 1 it widens or
// narrows.
cudaError_t scale_cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n,
                       float scale, cudaStream_t stream);

// dst[i] = src[0 * stride + i] + src[1 * stride + i] + ... for i < n over nslices slices of one
// type, summed in slice order in float32 and rounded once, so every caller gets the same bits.
cudaError_t sum_slices(void* dst, const void* src, DType type, int64_t nslices, int64_t stride,
                       int64_t n, cudaStream_t stream);

}  // namespace ddpx::cuda
