// The engines (engine.h): where a tensor goes, the shared-memory engine's queue and communication
// thread, the front door of the node's all-reduce, and the process group's path.
#include "engine.h"

#include <ATen/Parallel.h>
#include <Python.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <exception>
#include <sstream>
#include <utility>

#include "../collectives/collectives.h"
#include "../common/caller_profiler.h"
#include "../common/errors.h"
#include "../common/idle_work.h"
#include "../common/thread_name.h"
#include "../common/torch_compat.h"
#include "../node/arena.h"

namespace ddpx {

namespace {

// The error of a failed group all-reduce as ddpx raises it: `failure`, then the group's own.
std::exception_ptr failed(const std::string& failure, const std::exception_ptr& cause) {
  try {
    std::rethrow_exception(cause);
  } catch (const std::exception& error) {
    try {
      C10_THROW_ERROR(DistBackendError, failure + ": " + error.what());
    } catch (...) {
      return std::current_exception();
    }
  } catch (...) {
  }
  return cause;
}

}  // namespace

c10::intrusive_ptr<c10::ivalue::Future> scaled_allreduce(c10d::ProcessGroup& group,
                                                         at::Tensor tensor, double scale,
                                                         bool premul_sum, std::string failure) {
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
    // then() runs its callback on a failed future too: the group's error must be passed on.
    return done->then(
        [tensor, failure = std::move(failure)](c10::ivalue::Future& reduced) {
          if (reduced.hasError()) std::rethrow_exception(failed(failure, reduced.exception_ptr()));
          return c10::IValue(tensor);
        },
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
  done->addCallback(
      [work, result, tensor, caller, failure = std::move(failure)](c10::ivalue::Future& finished) {
        if (finished.hasError()) {
          result->setError(failed(failure, finished.exception_ptr()));
          return;
        }
        const c10::StreamGuard on_caller(caller);
        work->synchronize();
        result->markCompleted(c10::IValue(tensor));
      });
  return result;
}

ShmEngine::ShmEngine(std::unique_ptr<NodeComm> comm, std::shared_ptr<CrossNode> cross_node,
                     size_t chunk_bytes, std::vector<int> node_ranks)
    : queue_(std::make_shared<Queue>()), cross_node_(std::move(cross_node)) {
  if (cross_node_) comm->set_cross_node(cross_node_, chunk_bytes, std::move(node_ranks));
  queue_->comm = std::move(comm);
}

uint64_t ShmEngine::cross_node_bytes() const { return cross_node_ ? cross_node_->bytes_sent() : 0; }

ShmEngine::~ShmEngine() { shutdown(); }

void ShmEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stopping = true;
  }
  queue_->cv.notify_all();
  if (worker_.joinable() && worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();  // it holds the queue and ends after its current job
    return;
  }
  if (worker_.joinable() && Py_IsInitialized() && PyGILState_Check()) {
    // A backend that Python frees gets here holding the GIL, which the worker may need to drop
    // the last reference to a finished job's tensors: joining with it held would never end.
    PyThreadState* state = PyEval_SaveThread();
    worker_.join();
    PyEval_RestoreThread(state);
  } else if (worker_.joinable()) {
    worker_.join();
  }
  const std::lock_guard<std::mutex> lock(queue_->mu);
  queue_->comm.reset();
  cross_node_.reset();
}

void ShmEngine::abort(const std::string& why) {
  const std::lock_guard<std::mutex> lock(queue_->mu);
  if (queue_->comm) queue_->comm->channel().abort(why);
}

NodeComm& ShmEngine::comm() {
  TORCH_CHECK(queue_->comm, "ddpx: the engine was shut down (its process group was destroyed)");
  return *queue_->comm;
}

const NodeComm& ShmEngine::comm() const { return const_cast<ShmEngine*>(this)->comm(); }

void all_reduce(NodeComm& comm, const at::Tensor& input, const Request& request) {
  // A call that may end later takes the job's end (NodeComm::offer_call_end) and gives it back
  // if it ended after all.
  CallEnd end = request.defer ? comm.take_call_end() : nullptr;
  try {
    const std::string why = invalid_input(input, request, c10::DeviceType::CPU);
    if (!why.empty()) comm.reject(why, request.what, end != nullptr);
    const at::Tensor tensor = as_real(input);
    const DType dtype = *to_dtype(tensor.scalar_type());
    const BlocksAcross quantized{quantized_bits(request), request.residual};
    const DType wire =
        quantized.bits != 0 ? dtype : *to_dtype(wire_dtype(tensor.scalar_type(), request));
    allreduce(comm, tensor.data_ptr(), dtype, tensor.numel(), wire, request.scale, request.what,
              quantized.bits != 0 ? &quantized : nullptr, end ? &end : nullptr);
  } catch (...) {
    if (end) comm.offer_call_end(std::move(end));
    throw;
  }
  if (end) comm.offer_call_end(std::move(end));
}

c10::intrusive_ptr<c10::ivalue::Future> Engine::run_async(at::Tensor tensor, Request request) {
  if (!tensor.is_sparse()) return reduce_async(std::move(tensor), std::move(request));
  return scaled_allreduce(
      *sparse_group(request), std::move(tensor), request.scale,
      /*premul_sum=*/false,
      "ddpx: " + request.what + " (sparse) failed in the process group's all-reduce");
}

void Engine::run(at::Tensor tensor, const Request& request) {
  if (!tensor.is_sparse()) return reduce(std::move(tensor), request);
  run_async(std::move(tensor), request)->waitAndThrow();
}

void Engine::set_group(std::string group_name) {
  std::lock_guard<std::mutex> lock(group_mu_);
  group_name_ = std::move(group_name);
}

c10::intrusive_ptr<c10d::ProcessGroup> Engine::sparse_group(const Request& request) const {
  TORCH_CHECK_VALUE(!request.wire || request.dense_wire_only,
                    "ddpx: a sparse tensor is summed by the process group in its own dtype; call ",
                    request.what, " on it without compression");
  std::string name;
  {
    std::lock_guard<std::mutex> lock(group_mu_);
    name = group_name_;
  }
  TORCH_CHECK_VALUE(!name.empty(), "ddpx: ", request.what,
                    " got a sparse tensor, which the process group sums, and this engine serves "
                    "no group: take the engine from ddpx.engine.engine_for(group)");
  try {
    return c10d::resolve_process_group(name);
  } catch (const c10::Error&) {
    C10_THROW_ERROR(ValueError, c10::str("ddpx: ", request.what,
                                         " got a sparse tensor, which the process group sums, and "
                                         "this engine's group '",
                                         name, "' was destroyed: reduce over a live group"));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> ShmEngine::reduce_async(at::Tensor tensor,
                                                                Request request) {
  return submit(
      [tensor = std::move(tensor), request = std::move(request),
       profiler = CallerProfiler()](NodeComm& comm) {
        const ProfilerGuard traced(profiler);
        RECORD_FUNCTION("ddpx::all_reduce (engine)", std::vector<c10::IValue>());
        all_reduce(comm, tensor, request);
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
    queue_->comm->channel().record_queued(queue_->jobs.size());
  }
  queue_->cv.notify_all();
  return future;
}

void ShmEngine::reduce(at::Tensor tensor, const Request& request) {
  RECORD_FUNCTION("ddpx::all_reduce", std::vector<c10::IValue>());
  run([&](NodeComm& comm) { all_reduce(comm, tensor, request); });
}

void ShmEngine::run(const std::function<void(NodeComm&)>& op) {
  Queue& q = *queue_;
  std::unique_lock<std::mutex> lock(q.mu);
  q.cv.wait(lock, [&] { return q.stopping || (q.jobs.empty() && !q.busy); });
  TORCH_CHECK(!q.stopping, "ddpx: the engine was shut down");
  q.busy = true;
  lock.unlock();
  std::exception_ptr error;
  try {
    op(*q.comm);
  } catch (...) {
    error = std::current_exception();
  }
  q.comm->channel().record_job_end(error != nullptr);
  lock.lock();
  q.busy = false;
  q.cv.notify_all();
  if (error) std::rethrow_exception(error);
}

void ShmEngine::when_idle(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    if (!queue_->stopping) {
      if (!worker_.joinable()) worker_ = std::thread(worker_loop, queue_);
      queue_->idle.push_back(std::move(task));
      task = nullptr;
    }
  }
  if (task) {
    at::launch(std::move(task));
  } else {
    queue_->cv.notify_all();
  }
}

bool ShmEngine::run_idle_task(Queue& q) {
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lock(q.mu);
    if (q.idle.empty()) return false;
    task = std::move(q.idle.front());
    q.idle.pop_front();
  }
  task();
  return true;
}

void ShmEngine::worker_loop(const std::shared_ptr<Queue>& queue) {
  name_this_thread("ddpx engine");
  Queue& q = *queue;
  idle_work = [&q] { return run_idle_task(q); };
  std::unique_lock<std::mutex> lock(q.mu);
  while (true) {
    q.cv.wait(lock, [&] {
      return (!q.jobs.empty() && !q.busy) || !q.idle.empty() || (q.stopping && q.jobs.empty());
    });
    if (q.jobs.empty() || q.busy) {
      if (q.idle.empty()) return;
      lock.unlock();
      run_idle_task(q);
      lock.lock();
      continue;
    }
    {
      Queue::Job job = std::move(q.jobs.front());
      q.jobs.pop_front();
      q.busy = true;
      q.comm->channel().record_queued(q.jobs.size());
      lock.unlock();
      // The job's end goes in the flight record before its future completes. A call that leaves
      // chunks crossing nodes takes the job's end, and completes the future once they are back.
      auto result = std::make_shared<c10::IValue>();
      q.comm->offer_call_end([future = job.future, result](std::exception_ptr error) {
        if (error) {
          future->setError(error);
        } else {
          future->markCompleted(*result);
        }
      });
      try {
        *result = job.op(*q.comm);
        q.comm->channel().record_job_end(false);
        if (CallEnd end = q.comm->take_call_end()) end(nullptr);
      } catch (...) {
        q.comm->channel().record_job_end(true);
        if (CallEnd end = q.comm->take_call_end()) end(std::current_exception());
      }
      // The job (its closure's tensors) is released here, before the queue's lock is taken
      // again: a tensor's last reference can take the GIL, which a thread waiting for that
      // lock (shutdown, from a backend freed by Python) may hold.
    }
    lock.lock();
    q.busy = false;
    q.cv.notify_all();
  }
}

std::string Engine::flight_record() const {
  return "ddpx: no flight record (" + describe() +
         "): its calls are the process group's, which torch's flight recorder holds for gloo "
         "and NCCL";
}

std::string ShmEngine::flight_record() const {
  const std::lock_guard<std::mutex> lock(queue_->mu);
  if (!queue_->comm) return "ddpx: no flight record: the engine was shut down";
  return queue_->comm->channel().flight_record();
}

bool ShmEngine::serves_arena() const { return queue_->comm && Arena::process().usable(); }

std::string ShmEngine::describe() const {
  if (!queue_->comm) return "ddpx shared-memory engine, shut down";
  std::ostringstream out;
  const NodeComm& comm = *queue_->comm;
  const ShmChannel& channel = comm.channel();
  const ScheduleChoice& choice = comm.schedule();
  using Policy = ScheduleChoice::Policy;
  const ShmLayout& layout = channel.layout();
  out << "ddpx shared-memory engine, " << channel.size() << " local rank"
      << (channel.size() == 1 ? "" : "s") << ", " << (layout.block_bytes >> 10) << " KiB steps";
  if (!cross_node_ && layout.wide_bytes > layout.block_bytes) {
    const std::string wide = choice.wide_sizes();
    const std::string wide_kib = std::to_string(layout.wide_bytes >> 10) + " KiB ones";
    if (choice.policy() == Policy::Timed) {
      out << " (" << wide_kib
          << " for the sizes timed faster so: " << (wide.empty() ? "none yet" : wide) << ")";
    } else if (!wide.empty()) {
      out << " (" << wide_kib << " for " << wide << ")";
    }
  }
  out << ", " << kernels().isa << " kernels, " << comm.threads() << " thread"
      << (comm.threads() == 1 ? "" : "s") << " per rank";
  if (!cross_node_) {
    const std::string one_shot = choice.one_shot_sizes();
    out << ", one-shot " << (one_shot.empty() ? "never" : one_shot);
    if (choice.policy() != Policy::Narrow && choice.policy() != Policy::Wide) {
      const std::string& because = comm.peer_memory().unreachable_because();
      const std::string now = choice.shared_sizes();
      out << ", shared over " << (choice.always_one_shot_bytes() >> 10) << " KiB";
      if (choice.policy() == Policy::Auto) {
        out << " while a rank waits for its CPU, over " << (ScheduleChoice::kThreadedBytes >> 10)
            << " KiB with several threads per rank, and where timed faster";
      } else if (choice.policy() == Policy::Timed) {
        out << " where timed faster";
      }
      out << " (any thread of any rank sums any block for all, in their tensors; "
          << (!because.empty() ? "off: " + because
              : now.empty()    ? "not now"
                               : "now: " + now)
          << ")";
    }
  }
  Arena& arena = Arena::process();
  const Arena::Usage use = arena.usage();
  out << "; arena ";
  if (!arena.usable()) {
    out << "off (" << arena.why_not() << ")";
  } else {
    out << use.chunks << " chunk" << (use.chunks == 1 ? "" : "s") << ", " << (use.bytes >> 10)
        << " KiB (" << (use.in_use >> 10) << " in use), " << comm.zero_copy_calls()
        << " zero-copy all-reduces";
    if (use.fell_back) out << ", some communication memory in ordinary memory";
    const std::string unmapped = comm.unmapped_because();
    if (!unmapped.empty()) {
      out << ", a peer's chunk read through the kernel, as it could not be mapped (" << unmapped
          << ")";
    }
  }
  if (!numa_.empty()) out << "; " << numa_;
  out << "; " << channel.wait_policy();
  if (cross_node_) {
    out << ", hierarchical across " << cross_node_->nodes() << " nodes through the process group";
  }
  return out.str();
}

ProcessGroupEngine::ProcessGroupEngine(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                       std::string reason)
    : group_(std::move(group)), reason_(std::move(reason)) {}

c10::intrusive_ptr<c10::ivalue::Future> ProcessGroupEngine::reduce_async(at::Tensor tensor,
                                                                         Request request) {
  TORCH_CHECK_VALUE(!request.wire || *request.wire == tensor.scalar_type(),
                    "ddpx: compression is not available on the process-group path (", reason_, ")");
  return scaled_allreduce(
      *group_, std::move(tensor), request.scale, /*premul_sum=*/false,
      "ddpx: " + request.what + " failed on the process-group path (" + reason_ + ")");
}

void ProcessGroupEngine::reduce(at::Tensor tensor, const Request& request) {
  auto future = reduce_async(std::move(tensor), request);
  future->waitAndThrow();
}

std::string ProcessGroupEngine::describe() const {
  return "ddpx process-group path (" + group_->getBackendName() + "): " + reason_;
}

}  // namespace ddpx
