#include "engine.h"

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <exception>
#include <sstream>
#include <utility>

#include "errors.h"
#include "torch_compat.h"

namespace ddpx {

c10::intrusive_ptr<c10::ivalue::Future> scaled_allreduce(c10d::ProcessGroup& group,
                                                         at::Tensor tensor, double scale,
                                                         bool premul_sum) {
  c10d::AllreduceOptions opts;
  if (scale != 1.0 && premul_sum) {
    opts.reduceOp.op_ = c10d::ReduceOp::PREMUL_SUM;
    opts.reduceOp.supplement_ = c10::make_intrusive<PreMulSumFactor>(scale);
  } else if (scale != 1.0) {
    tensor.mul_(scale);
  }
  std::vector<at::Tensor> tensors{as_real(tensor)};
  auto work = group.allreduce(tensors, opts);
  auto done = work->getFuture();
  if (tensor.device().is_cpu() || !done->devices().empty()) {
    return done->then([tensor](c10::ivalue::Future&) { return c10::IValue(tensor); },
                      c10::TensorType::get());
  }
  // gloo reduces CUDA tensors in host memory and copies the sum back on a stream of its own; its
  // future knows no device, so a wait on it would not order the caller's stream after that copy.
  // This future's completion is an event on the caller's stream, recorded once that stream waits
  // for the copy (Work::synchronize).
  auto result = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(),
                                                         std::vector<c10::Device>{tensor.device()});
  const c10::impl::VirtualGuardImpl guard_impl(tensor.device().type());
  const c10::Stream caller = guard_impl.getStream(tensor.device());
  done->addCallback([work, result, tensor, caller](c10::ivalue::Future& finished) {
    if (finished.hasError()) {
      result->setError(finished.exception_ptr());
      return;
    }
    const c10::StreamGuard on_caller(caller);
    work->synchronize();
    result->markCompleted(c10::IValue(tensor));
  });
  return result;
}

ShmEngine::ShmEngine(std::unique_ptr<ShmAllreduce> shm, std::shared_ptr<CrossNode> cross_node,
                     size_t chunk_bytes, std::vector<int> node_ranks)
    : queue_(std::make_shared<Queue>()), cross_node_(std::move(cross_node)) {
  if (cross_node_) shm->set_cross_node(cross_node_, chunk_bytes, std::move(node_ranks));
  queue_->shm = std::move(shm);
}

uint64_t ShmEngine::cross_node_bytes() const { return cross_node_ ? cross_node_->bytes_sent() : 0; }

ShmEngine::~ShmEngine() { shutdown(); }

void ShmEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stopping = true;
  }
  queue_->cv.notify_all();
  if (!worker_.joinable()) return;
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();  // it holds the queue and ends after its current job
  } else {
    worker_.join();
  }
}

void ShmEngine::execute(ShmAllreduce& shm, const at::Tensor& input, const Request& request) {
  const std::string why = invalid_input(input, request, c10::DeviceType::CPU);
  if (!why.empty()) shm.reject(why, request.what);
  const at::Tensor tensor = as_real(input);
  const DType dtype = *to_dtype(tensor.scalar_type());
  const DType wire = request.wire ? *to_dtype(*request.wire) : dtype;
  shm.allreduce(tensor.data_ptr(), dtype, tensor.numel(), wire, request.scale, request.what);
}

c10::intrusive_ptr<c10::ivalue::Future> ShmEngine::run_async(at::Tensor tensor, Request request) {
  return submit(
      [tensor = std::move(tensor), request = std::move(request)](ShmAllreduce& shm) {
        execute(shm, tensor, request);
        return c10::IValue(tensor);
      },
      c10::TensorType::get());
}

c10::intrusive_ptr<c10::ivalue::Future> ShmEngine::submit(Op op, c10::TypePtr type) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(std::move(type));
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    TORCH_CHECK(!queue_->stopping, "ddpx: the engine was shut down");
    if (!worker_.joinable()) worker_ = std::thread(worker_loop, queue_);
    queue_->jobs.push_back(Queue::Job{std::move(op), future});
  }
  queue_->cv.notify_all();
  return future;
}

void ShmEngine::run(at::Tensor tensor, const Request& request) {
  run([&](ShmAllreduce& shm) { execute(shm, tensor, request); });
}

void ShmEngine::run(const std::function<void(ShmAllreduce&)>& op) {
  Queue& q = *queue_;
  std::unique_lock<std::mutex> lock(q.mu);
  q.cv.wait(lock, [&] { return q.stopping || (q.jobs.empty() && !q.busy); });
  TORCH_CHECK(!q.stopping, "ddpx: the engine was shut down");
  q.busy = true;
  lock.unlock();
  std::exception_ptr error;
  try {
    op(*q.shm);
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  q.busy = false;
  q.cv.notify_all();
  if (error) std::rethrow_exception(error);
}

void ShmEngine::worker_loop(const std::shared_ptr<Queue>& queue) {
  Queue& q = *queue;
  std::unique_lock<std::mutex> lock(q.mu);
  while (true) {
    q.cv.wait(lock, [&] { return (!q.jobs.empty() && !q.busy) || (q.stopping && q.jobs.empty()); });
    if (q.jobs.empty()) return;
    Queue::Job job = std::move(q.jobs.front());
    q.jobs.pop_front();
    q.busy = true;
    lock.unlock();
    try {
      job.future->markCompleted(job.op(*q.shm));
    } catch (...) {
      job.future->setError(std::current_exception());
    }
    lock.lock();
    q.busy = false;
    q.cv.notify_all();
  }
}

std::string ShmEngine::describe() const {
  std::ostringstream out;
  const ShmAllreduce& shm = *queue_->shm;
  out << "ddpx shared-memory engine, " << shm.local_size() << " local rank"
      << (shm.local_size() == 1 ? "" : "s") << ", " << (shm.block_bytes() >> 10) << " KiB steps";
  if (!cross_node_ && shm.wide_bytes() > shm.block_bytes()) {
    const std::string wide = shm.wide_sizes();
    const std::string wide_kib = std::to_string(shm.wide_bytes() >> 10) + " KiB ones";
    if (shm.steps() == ShmAllreduce::Steps::Timed) {
      out << " (" << wide_kib
          << " for the sizes timed faster so: " << (wide.empty() ? "none yet" : wide) << ")";
    } else if (!wide.empty()) {
      out << " (" << wide_kib << " for " << wide << ")";
    }
  }
  out << ", " << kernels().isa << " kernels";
  if (!cross_node_) {
    const std::string one_shot = shm.one_shot_sizes();
    out << ", one-shot " << (one_shot.empty() ? "never" : one_shot);
    using Steps = ShmAllreduce::Steps;
    if (shm.steps() == Steps::Shared || shm.steps() == Steps::Auto) {
      const std::string& because = shm.channel().unreachable_because();
      out << ", shared over " << (shm.always_one_shot_bytes() >> 10) << " KiB";
      if (shm.steps() == Steps::Auto) {
        out << " while a rank waits for its CPU";
      }
      out << " (any rank sums any block for all, in their tensors; "
          << (!because.empty()    ? "off: " + because
              : !shm.shared_now() ? std::string("not now")
                                  : std::string("now"))
          << ")";
    }
  }
  out << "; " << shm.wait_policy();
  if (cross_node_) {
    out << ", hierarchical across " << cross_node_->nodes() << " nodes through the process group";
  }
  return out.str();
}

ProcessGroupEngine::ProcessGroupEngine(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                       std::string reason)
    : group_(std::move(group)), reason_(std::move(reason)) {}

c10::intrusive_ptr<c10::ivalue::Future> ProcessGroupEngine::run_async(at::Tensor tensor,
                                                                      Request request) {
  TORCH_CHECK_VALUE(!request.wire || *request.wire == tensor.scalar_type(),
                    "ddpx: compression is not available on the process-group path (", reason_, ")");
  return scaled_allreduce(*group_, std::move(tensor), request.scale, /*premul_sum=*/false);
}

void ProcessGroupEngine::run(at::Tensor tensor, const Request& request) {
  auto future = run_async(std::move(tensor), request);
  future->waitAndThrow();
}

std::string ProcessGroupEngine::describe() const {
  return "ddpx process-group path (" + group_->getBackendName() + "): " + reason_;
}

}  // namespace ddpx
