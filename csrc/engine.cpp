#include "engine.h"

#include <torch/version.h>

#include <atomic>
#include <cstring>
#include <future>
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

// torch 2.13 renamed the single-tensor collectives and deprecated the old names.
c10::intrusive_ptr<c10d::Work> all_to_all(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in, std::chrono::milliseconds timeout) {
  std::vector<int64_t> equal_splits;
  c10d::AllToAllOptions opts;
  opts.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
  return group.all_to_all_single(out, in, equal_splits, equal_splits, opts);
#else
  return group.alltoall_base(out, in, equal_splits, equal_splits, opts);
#endif
}

c10::intrusive_ptr<c10d::Work> all_gather(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in, std::chrono::milliseconds timeout) {
  c10d::AllgatherOptions opts;
  opts.timeout = timeout;
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 13
  return group.all_gather_single(out, in, opts);
#else
  return group._allgather_base(out, in, opts);
#endif
}

// The node-to-node step of the hierarchical all-reduce, for one chunk of one rank's slices.
// Uncompressed, the chunk is all-reduced as it is. Compressed, it crosses in the wire dtype both
// ways and is still summed in float32: an all-to-all deals each node one piece of every node's
// chunk, each rank sums its piece over the nodes in node order and rounds the sum once, and an
// all-gather hands the pieces back. Every rank holding the chunk ends with the same bits, and the
// bytes on the network are those of the wire dtype.
//
// Chunks go round-robin to lanes, each a thread with its own process group (its own
// connections), so one chunk's casts and sums overlap another's transfers and the link never
// waits for the CPU. Every rank of a lane's group sees the same chunks in the same order.
class AcrossNodes final : public CrossNode {
 public:
  AcrossNodes(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
              std::chrono::milliseconds timeout)
      : nodes_(groups.at(0)->getSize()), node_(groups[0]->getRank()), timeout_(timeout) {
    if (nodes_ > kMaxSources) {
      throw std::invalid_argument("ddpx: the hierarchical all-reduce sums at most " +
                                  std::to_string(kMaxSources) + " nodes, this job has " +
                                  std::to_string(nodes_));
    }
    for (auto& group : groups) {
      auto lane = std::make_shared<Lane>();
      lane->group = std::move(group);
      lane->timeout = timeout;
      lane->bytes_sent = bytes_sent_;
      lane->thread = std::thread(lane_loop, lane);
      lanes_.push_back(std::move(lane));
    }
  }

  ~AcrossNodes() override {
    for (auto& lane : lanes_) {
      {
        std::lock_guard<std::mutex> lock(lane->mu);
        lane->stopping = true;
      }
      lane->cv.notify_all();
      // A lane still inside a transfer that a failure abandoned ends at its timeout; the
      // process need not wait for that. The lane owns all it touches, the chunk's data too.
      if (lane->busy) {
        lane->thread.detach();
      } else {
        lane->thread.join();
      }
    }
  }

  int nodes() const override { return nodes_; }
  int node() const override { return node_; }
  int lanes() const override { return int(lanes_.size()); }
  uint64_t bytes_sent() const { return bytes_sent_->load(std::memory_order_relaxed); }

  void start_gather(const std::vector<int64_t>& mine) override {
    const int64_t n = int64_t(mine.size());
    words_in_ = at::tensor(at::IntArrayRef(mine), at::kLong);
    words_out_ = at::empty({n * nodes_}, at::kLong);
    gathering_ = all_gather(*lanes_[0]->group, words_out_, words_in_, timeout_);
  }

  std::vector<int64_t> finish_gather() override {
    auto work = std::move(gathering_);
    work->wait();
    const int64_t* words = words_out_.const_data_ptr<int64_t>();
    return std::vector<int64_t>(words, words + words_out_.numel());
  }

  void start_reduce(std::shared_ptr<void> data, DType acc, DType wire, int64_t n) override {
    Chunk chunk{std::move(data), acc, wire, n, std::make_shared<std::promise<void>>()};
    pending_.push_back(chunk.done->get_future());
    Lane& lane = *lanes_[next_lane_];
    next_lane_ = (next_lane_ + 1) % lanes_.size();
    {
      std::lock_guard<std::mutex> lock(lane.mu);
      lane.chunks.push_back(std::move(chunk));
    }
    lane.cv.notify_all();
  }

  void finish_reduce() override {
    std::future<void> done = std::move(pending_.front());
    pending_.pop_front();
    done.get();
  }

 private:
  struct Chunk {
    std::shared_ptr<void> data;
    DType acc, wire;
    int64_t n;
    std::shared_ptr<std::promise<void>> done;
  };
  struct Lane {
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    std::chrono::milliseconds timeout;
    std::shared_ptr<std::atomic<uint64_t>> bytes_sent;
    at::Tensor dealt, received, mine;  // compressed chunks' buffers, grown to the largest
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Chunk> chunks;
    bool stopping = false;
    std::atomic<bool> busy{false};
    std::string broken;  // why an earlier chunk failed: the lane's group is out of step since
  };

  static void lane_loop(std::shared_ptr<Lane> lane) {
    while (true) {
      Chunk chunk;
      {
        std::unique_lock<std::mutex> lock(lane->mu);
        lane->cv.wait(lock, [&] { return lane->stopping || !lane->chunks.empty(); });
        if (lane->stopping) return;
        chunk = std::move(lane->chunks.front());
        lane->chunks.pop_front();
        lane->busy = true;
      }
      try {
        if (!lane->broken.empty()) throw std::runtime_error(lane->broken);
        reduce(*lane, chunk);
        chunk.done->set_value();
      } catch (const std::exception& e) {
        lane->broken = std::string("an earlier transfer failed: ") + e.what();
        chunk.done->set_exception(std::current_exception());
      }
      lane->busy = false;
    }
  }

  // The first `bytes` of `storage`, which grows to the largest chunk and is then reused.
  static at::Tensor buffer(at::Tensor& storage, int64_t bytes) {
    if (!storage.defined() || storage.numel() < bytes) storage = at::empty({bytes}, at::kByte);
    return storage.narrow(0, 0, bytes);
  }

  static void reduce(Lane& lane, const Chunk& c) {
    c10d::ProcessGroup& group = *lane.group;
    const int64_t nodes = group.getSize(), n = c.n;
    const auto count = [&](int64_t bytes) {
      lane.bytes_sent->fetch_add(uint64_t(bytes), std::memory_order_relaxed);
    };
    const Kernels& k = kernels();
    const int64_t wire_size = int64_t(dtype_size(c.wire));
    if (c.wire == c.acc) {
      const auto dtype = c.acc == DType::Float64 ? at::kDouble : at::kFloat;
      std::vector<at::Tensor> chunk{
          at::from_blob(c.data.get(), {n}, at::TensorOptions().dtype(dtype))};
      c10d::AllreduceOptions opts;
      opts.timeout = lane.timeout;
      group.allreduce(chunk, opts)->wait();
      count(2 * (nodes - 1) * n * wire_size / nodes);
      return;
    }
    const int64_t piece = (n + nodes - 1) / nodes;
    const int64_t bytes = nodes * piece * wire_size;
    at::Tensor dealt = buffer(lane.dealt, bytes);
    at::Tensor received = buffer(lane.received, bytes);
    at::Tensor mine = buffer(lane.mine, piece * wire_size);
    char* out = static_cast<char*>(dealt.data_ptr());
    k.pack(out, c.wire, c.data.get(), c.acc, n, 1.0, Store::Cached);
    std::memset(out + n * wire_size, 0, size_t(bytes - n * wire_size));
    all_to_all(group, received, dealt, lane.timeout)->wait();
    const void* pieces[kMaxSources];
    for (int64_t i = 0; i < nodes; ++i) {
      pieces[i] = static_cast<const char*>(received.data_ptr()) + i * piece * wire_size;
    }
    k.reduce(mine.data_ptr(), c.wire, pieces, int(nodes), c.wire, piece, Store::Cached);
    all_gather(group, dealt, mine, lane.timeout)->wait();
    k.pack(c.data.get(), c.acc, out, c.wire, n, 1.0, Store::Cached);
    count(2 * (nodes - 1) * piece * wire_size);
  }

  int nodes_, node_;
  std::chrono::milliseconds timeout_;
  std::vector<std::shared_ptr<Lane>> lanes_;
  size_t next_lane_ = 0;
  std::deque<std::future<void>> pending_;  // started chunks, oldest first
  at::Tensor words_in_, words_out_;
  c10::intrusive_ptr<c10d::Work> gathering_;
  std::shared_ptr<std::atomic<uint64_t>> bytes_sent_ = std::make_shared<std::atomic<uint64_t>>(0);
};

namespace {

// torch's name of a dtype ("int64", not ScalarType's "Long"), as users wrote it.
std::string_view dtype_name(at::ScalarType t) { return c10::getDtypeNames(t).first; }

}  // namespace

std::string invalid_input(const at::Tensor& tensor, const Request& request,
                          c10::DeviceType device) {
  // The common case, valid and uncompressed, returns before a message is built.
  if (tensor.defined() && tensor.device().type() == device && tensor.is_contiguous() &&
      to_dtype(tensor.scalar_type()) && (!request.wire || *request.wire == tensor.scalar_type())) {
    return {};
  }
  const bool cpu = device == c10::DeviceType::CPU;
  std::ostringstream why;
  if (!tensor.defined()) {
    why << "ddpx: " << request.what << " got an undefined tensor";
  } else if (tensor.device().type() != device) {
    why << "ddpx: the " << (cpu ? "shared-memory engine reduces CPU" : "CUDA engine reduces CUDA")
        << " tensors, " << request.what << " is on " << tensor.device()
        << (cpu ? "; move it to the CPU or reduce it with torch.distributed"
                : "; reduce it with the engine of its device");
  } else if (!tensor.is_contiguous()) {
    why << "ddpx: " << request.what << " is not contiguous (strides " << tensor.strides()
        << "): pass tensor.contiguous() and copy the result back";
  } else if (!to_dtype(tensor.scalar_type())) {
    why << "ddpx: " << request.what << " has dtype " << dtype_name(tensor.scalar_type())
        << "; ddpx reduces float32, float64, bfloat16 and float16 (use torch.distributed.all_reduce "
           "for other dtypes)";
  } else if (request.wire && !to_dtype(*request.wire)) {
    why << "ddpx: compression to " << dtype_name(*request.wire) << " is not supported";
  } else if (request.wire && *request.wire != tensor.scalar_type()) {
    // Compression narrows float32/bfloat16/float16 data to a 16-bit wire dtype, nothing else.
    const at::ScalarType dtype = tensor.scalar_type(), wire = *request.wire;
    const auto refuse = [&](const char* instead) {
      why << "ddpx: " << request.what << " is " << dtype_name(dtype) << " and cannot travel as "
          << dtype_name(wire) << "; " << instead;
    };
    if (dtype == at::kDouble) {
      refuse("compress float32/bfloat16/float16 data only");
    } else if (wire == at::kFloat || wire == at::kDouble) {
      refuse("send it in its own dtype, bfloat16 or float16");
    }
  }
  return why.str();
}

c10::intrusive_ptr<c10::ivalue::Future> scaled_allreduce(c10d::ProcessGroup& group,
                                                         at::Tensor tensor, double scale,
                                                         bool premul_sum,
                                                         std::chrono::milliseconds timeout) {
  c10d::AllreduceOptions opts;
  opts.timeout = timeout;
  if (scale != 1.0 && premul_sum) {
    opts.reduceOp.op_ = c10d::ReduceOp::PREMUL_SUM;
    opts.reduceOp.supplement_ = c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(scale);
  } else if (scale != 1.0) {
    tensor.mul_(scale);
  }
  std::vector<at::Tensor> tensors{tensor};
  auto work = group.allreduce(tensors, opts);
  return work->getFuture()->then(
      [tensor](c10::ivalue::Future&) { return c10::IValue(tensor); }, c10::TensorType::get());
}

ShmEngine::ShmEngine(std::unique_ptr<ShmAllreduce> shm,
                     std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> across_nodes,
                     std::chrono::milliseconds timeout, size_t chunk_bytes)
    : queue_(std::make_shared<Queue>()) {
  if (!across_nodes.empty()) {
    across_nodes_ = std::make_shared<AcrossNodes>(std::move(across_nodes), timeout);
    shm->set_cross_node(across_nodes_, chunk_bytes);
  }
  queue_->shm = std::move(shm);
}

uint64_t ShmEngine::bytes_across_nodes() const {
  return across_nodes_ ? across_nodes_->bytes_sent() : 0;
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
  const std::string why = invalid_input(tensor, request, c10::DeviceType::CPU);
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
  if (across_nodes_) {
    out << ", hierarchical across " << across_nodes_->nodes() << " nodes through the process group";
  }
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
