#include "engine.h"

#include <sstream>
#include <stdexcept>

namespace ddpx {

std::optional<DType> to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Float16;
    default: return std::nullopt;
  }
}

namespace {

// torch's name of a dtype ("int64", not ScalarType's "Long"), as users wrote it.
std::string_view dtype_name(at::ScalarType t) { return c10::getDtypeNames(t).first; }

// Why the shared-memory engine cannot take this tensor, or an empty string.
std::string invalid_input(const at::Tensor& tensor, const Request& request) {
  std::ostringstream why;
  if (!tensor.defined()) {
    why << "ddpx: " << request.what << " got an undefined tensor";
  } else if (!tensor.device().is_cpu()) {
    why << "ddpx: the shared-memory engine reduces CPU tensors, " << request.what << " is on "
        << tensor.device() << "; move it to the CPU or reduce it with torch.distributed";
  } else if (!tensor.is_contiguous()) {
    why << "ddpx: " << request.what << " is not contiguous (strides " << tensor.strides()
        << "): pass tensor.contiguous() and copy the result back";
  } else if (!to_dtype(tensor.scalar_type())) {
    why << "ddpx: " << request.what << " has dtype " << dtype_name(tensor.scalar_type())
        << "; ddpx reduces float32, float64, bfloat16 and float16 (use torch.distributed.all_reduce "
           "for other dtypes)";
  } else if (request.wire && !to_dtype(*request.wire)) {
    why << "ddpx: compression to " << dtype_name(*request.wire) << " is not supported";
  } else if (request.wire && (*request.wire == at::kDouble) != (tensor.scalar_type() == at::kDouble)) {
    why << "ddpx: " << request.what << " is " << dtype_name(tensor.scalar_type())
        << " and cannot travel as " << dtype_name(*request.wire)
        << "; compress float32/bfloat16/float16 data only";
  }
  return why.str();
}

}  // namespace

ShmEngine::ShmEngine(std::unique_ptr<ShmAllreduce> shm,
                     c10::intrusive_ptr<c10d::ProcessGroup> across_nodes)
    : queue_(std::make_shared<Queue>()) {
  if (across_nodes) {
    nodes_ = across_nodes->getSize();
    shm->set_cross_node([group = std::move(across_nodes)](void* data, DType acc, int64_t n) {
      const auto dtype = acc == DType::Float64 ? at::kDouble : at::kFloat;
      std::vector<at::Tensor> slice{at::from_blob(data, {n}, at::TensorOptions().dtype(dtype))};
      group->allreduce(slice)->wait();
    });
  }
  queue_->shm = std::move(shm);
}

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

void ShmEngine::execute(ShmAllreduce& shm, const at::Tensor& tensor, const Request& request) {
  const std::string why = invalid_input(tensor, request);
  if (!why.empty()) shm.reject(why, request.what);
  const DType dtype = *to_dtype(tensor.scalar_type());
  const DType wire = request.wire ? *to_dtype(*request.wire) : dtype;
  shm.allreduce(tensor.data_ptr(), dtype, tensor.numel(), wire, request.scale, request.what);
}

c10::intrusive_ptr<c10::ivalue::Future> ShmEngine::run_async(at::Tensor tensor, Request request) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    if (queue_->stopping) throw std::runtime_error("ddpx: the engine was shut down");
    if (!worker_.joinable()) worker_ = std::thread(worker_loop, queue_);
    queue_->jobs.push_back(Queue::Job{std::move(tensor), std::move(request), future});
  }
  queue_->cv.notify_all();
  return future;
}

void ShmEngine::run(at::Tensor tensor, const Request& request) {
  Queue& q = *queue_;
  std::unique_lock<std::mutex> lock(q.mu);
  q.cv.wait(lock, [&] { return q.stopping || (q.jobs.empty() && !q.busy); });
  if (q.stopping) throw std::runtime_error("ddpx: the engine was shut down");
  q.busy = true;
  lock.unlock();
  std::exception_ptr error;
  try {
    execute(*q.shm, tensor, request);
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
      execute(*q.shm, job.tensor, job.request);
      job.future->markCompleted(c10::IValue(job.tensor));
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
      << (shm.local_size() == 1 ? "" : "s") << ", " << (shm.block_bytes() >> 10) << " KiB blocks, "
      << kernels().isa << " kernels";
  if (nodes_ > 1) out << ", hierarchical across " << nodes_ << " nodes through the process group";
  return out.str();
}

ProcessGroupEngine::ProcessGroupEngine(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                       std::string reason)
    : group_(std::move(group)), reason_(std::move(reason)) {}

c10::intrusive_ptr<c10::ivalue::Future> ProcessGroupEngine::run_async(at::Tensor tensor,
                                                                       Request request) {
  if (request.wire && *request.wire != tensor.scalar_type()) {
    throw std::invalid_argument("ddpx: compression is not available on the process-group path (" +
                                reason_ + ")");
  }
  if (request.scale != 1.0) tensor.mul_(request.scale);
  std::vector<at::Tensor> tensors{tensor};
  auto work = group_->allreduce(tensors);
  return work->getFuture()->then(
      [tensor](c10::ivalue::Future&) { return c10::IValue(tensor); }, c10::TensorType::get());
}

void ProcessGroupEngine::run(at::Tensor tensor, const Request& request) {
  auto future = run_async(std::move(tensor), request);
  future->waitAndThrow();
}

std::string ProcessGroupEngine::describe() const {
  return "ddpx process-group path (" + group_->getBackendName() + "): " + reason_;
}

}  // namespace ddpx
