// The engine for CUDA buckets, built only where CUDA is usable. Without compression a bucket is
// one all-reduce of the process group with the 1/world_size scale fused into it (NCCL's
// premultiplied sum). With bf16/fp16 on the wire, and for bf16/fp16 buckets, it is
//   scale_cast (bucket -> staged, in the wire dtype)  -> all-to-all of slices
//   -> sum_slices (each rank sums its slice of every rank in float32, rounds once)
//   -> all-gather of the sums -> scale_cast with scale 1 (staged -> bucket),
// the same bytes on the wire as torch's bf16_compress_hook with one rounding of the sum instead of
// world_size - 1. That chain runs on a side stream of the engine's, after the work queued on the
// caller's stream, so that backward goes on computing the next buckets' gradients meanwhile; the
// future's completion is an event on the side stream, which DDP's wait (at the end of backward)
// makes its stream wait for. The host never waits on NCCL. The group's own timeout bounds each
// collective (ddpx/engine.py gives the engine a group of its own for another timeout): NCCL
// reads no per-call timeout.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "../common/torch_compat.h"
#include "../engine/engine.h"
#include "compress_kernels.h"

namespace ddpx {
namespace {

namespace py = pybind11;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// Elements per slice are a multiple of this, so every slice starts on a 16-byte boundary and the
// kernels take their vector path.
constexpr int64_t kSliceAlign = 8;

DType kernel_type(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "ddpx: ", name, " must be a CUDA tensor, got one on ", t.device());
  const auto type = to_dtype(t.scalar_type());
  TORCH_CHECK(type && *type != DType::Float64, "ddpx: ", name,
              " must be float32, bfloat16 or float16, got ", t.scalar_type());
  return *type;
}

class CudaEngine final : public Engine {
 public:
  explicit CudaEngine(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)),
        backend_(group_->getBackend(c10::DeviceType::CUDA)->getBackendName()) {}

  std::string describe() const override {
    return "ddpx CUDA engine (" + backend_ +
           "): " + (backend_ == "nccl" ? "premultiplied-sum" : "scale-then-sum") +
           " all-reduce; bf16/fp16 summed in float32 between an all-to-all and an all-gather, "
           "on a side stream";
  }

 protected:
  FuturePtr reduce_async(at::Tensor tensor, Request request) override {
    const std::string why = invalid_input(tensor, request, c10::DeviceType::CUDA);
    TORCH_CHECK_VALUE(why.empty(), why);
    const at::ScalarType wire = wire_dtype(as_real(tensor).scalar_type(), request);
    const c10::cuda::CUDAGuard device(tensor.device());
    if (tensor.numel() == 0) return completed(tensor);
    if (wire == at::kFloat || wire == at::kDouble) {
      return scaled_allreduce(*group_, tensor, request.scale, backend_ == "nccl",
                              "ddpx: " + request.what + " failed in " + backend_ + "'s all-reduce");
    }
    return allreduce_compressed(tensor, wire, request.scale);
  }

  void reduce(at::Tensor tensor, const Request& request) override {
    // For a CUDA future this makes the current stream wait; the host goes on.
    reduce_async(std::move(tensor), request)->waitAndThrow();
  }

 private:
  // A future that completes when the work queued so far on the current stream is done.
  static FuturePtr completed(const at::Tensor& tensor) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(
        c10::TensorType::get(), std::vector<c10::Device>{tensor.device()});
    future->markCompleted(c10::IValue(tensor));
    return future;
  }

  c10::cuda::CUDAStream side_stream(c10::DeviceIndex device) {
    const std::lock_guard<std::mutex> lock(streams_mu_);
    auto found = side_streams_.find(device);
    if (found == side_streams_.end()) {
      found = side_streams_.emplace(device, c10::cuda::getStreamFromPool(false, device)).first;
    }
    return found->second;
  }

  FuturePtr allreduce_compressed(at::Tensor tensor, at::ScalarType wire, double scale) {
    const at::Tensor values = as_real(tensor);
    const int64_t world = group_->getSize();
    const int64_t me = group_->getRank();
    const int64_t n = values.numel();
    const int64_t slice = (n + world * kSliceAlign - 1) / (world * kSliceAlign) * kSliceAlign;
    const DType bucket_type = *to_dtype(values.scalar_type());
    const DType wire_t = *to_dtype(wire);

    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(values.get_device());
    const c10::cuda::CUDAStream side = side_stream(values.get_device());
    at::cuda::CUDAEvent ready;
    ready.record(caller);
    ready.block(side);
    // The bucket is the caller's memory, now used on the side stream too: the caching allocator
    // must not hand it out again before the side stream is done with it.
    c10::cuda::CUDACachingAllocator::recordStream(values.storage().data_ptr(), side);

    const c10::cuda::CUDAStreamGuard on_side(side);
    // Allocated on the side stream, where every later use of them is ordered (the waits below
    // put the collectives' ends there), so they are freed safely when this returns.
    at::Tensor staged = at::empty({slice * world}, values.options().dtype(wire));
    at::Tensor exchanged = at::empty_like(staged);
    C10_CUDA_CHECK(cuda::scale_cast(staged.data_ptr(), wire_t, values.data_ptr(), bucket_type, n,
                                    float(scale), side));
    // The padding travels and is summed like the data, then dropped; zeroed so that nothing
    // reads uninitialized memory.
    staged.narrow(0, n, slice * world - n).zero_();
    // Over NCCL, wait() makes the side stream wait for the collective; the host goes on. gloo
    // carries CUDA tensors through host memory and its wait() holds the host too.
    all_to_all(*group_, exchanged, staged)->wait();

    // exchanged holds this rank's slice from every rank, in rank order; the sum goes where
    // this rank's slice sits in staged, and the all-gather fills in the others' in place.
    at::Tensor mine = staged.narrow(0, me * slice, slice);
    C10_CUDA_CHECK(
        cuda::sum_slices(mine.data_ptr(), exchanged.data_ptr(), wire_t, world, slice, slice, side));
    all_gather(*group_, staged, mine)->wait();

    C10_CUDA_CHECK(
        cuda::scale_cast(values.data_ptr(), bucket_type, staged.data_ptr(), wire_t, n, 1.0f, side));
    return completed(tensor);  // its event is on the side stream, the current one here
  }

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string backend_;
  std::mutex streams_mu_;
  std::unordered_map<c10::DeviceIndex, c10::cuda::CUDAStream> side_streams_;
};

}  // namespace

void bind_cuda(py::module& m) {
  m.def(
      "make_cuda_engine",
      [](c10::intrusive_ptr<c10d::ProcessGroup> group) {
        return std::shared_ptr<Engine>(std::make_shared<CudaEngine>(std::move(group)));
      },
      py::arg("group"));

  // The kernels alone, on the current stream, for the tests that hold them against torch.
  m.def(
      "cuda_scale_cast",
      [](at::Tensor dst, const at::Tensor& src, double scale) {
        const DType dst_type = kernel_type(dst, "dst");
        const DType src_type = kernel_type(src, "src");
        TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "ddpx: pass contiguous tensors");
        TORCH_CHECK(dst.numel() == src.numel() && dst.device() == src.device(),
                    "ddpx: dst and src must have the same size and device");
        const c10::cuda::CUDAGuard device(dst.device());
        C10_CUDA_CHECK(cuda::scale_cast(dst.data_ptr(), dst_type, src.data_ptr(), src_type,
                                        src.numel(), float(scale),
                                        at::cuda::getCurrentCUDAStream()));
      },
      py::arg("dst"), py::arg("src"), py::arg("scale"));

  m.def(
      "cuda_sum_slices",
      [](at::Tensor dst, const at::Tensor& src) {
        const DType type = kernel_type(dst, "dst");
        TORCH_CHECK(
            src.dim() == 2 && src.size(0) >= 1 && src.stride(1) == 1 &&
                src.stride(0) >= src.size(1),
            "ddpx: src must be a (slices, n) tensor whose rows are contiguous and disjoint");
        TORCH_CHECK(dst.is_contiguous() && dst.numel() == src.size(1) &&
                        src.scalar_type() == dst.scalar_type() && src.device() == dst.device(),
                    "ddpx: dst must be contiguous, with n elements of src's dtype on src's device");
        const c10::cuda::CUDAGuard device(dst.device());
        C10_CUDA_CHECK(cuda::sum_slices(dst.data_ptr(), src.data_ptr(), type, src.size(0),
                                        src.stride(0), src.size(1),
                                        at::cuda::getCurrentCUDAStream()));
      },
      py::arg("dst"), py::arg("src"));
}

}  // namespace ddpx
