#include "engine.h"

#include <torch/version.h>

#include <atomic>
#include <cstring>
#include <future>
#include <mutex>
#include <thread>
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

namespace {

// Where a rank that gives up says so to every rank of its job: a key of the job's store. A
// thread of its own talks to the store, which may be out of reach (the link to its host cut):
// neither a wait nor a rank that gives up ever blocks on it. It reads the key only while some
// wait has lasted kAbortPoll, so a job's store sees no traffic from waits that end in time.
class AbortWatch {
 public:
  AbortWatch(c10::intrusive_ptr<c10d::Store> store, std::string key)
      : store_(std::move(store)), key_(std::move(key)) {}

  static void start(const std::shared_ptr<AbortWatch>& watch) {
    watch->thread_ = std::thread(loop, watch);
  }

  // Ends the thread; one still inside a store call (its host out of reach) is left to finish.
  void stop() {
    bool in_store;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      in_store = in_store_;
    }
    cv_.notify_all();
    if (in_store) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }

  void give_up(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (mine_.empty()) mine_ = why;
    }
    cv_.notify_all();
  }

  // Waits for a transfer and throws its failure, or why another rank gave up.
  void await(c10d::Work& work) {
    struct Done {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    auto done = std::make_shared<Done>();
    work.getFuture()->addCallback([done](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(done->mu);
      done->done = true;
      done->cv.notify_all();
    });
    bool watching = false;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(done->mu);
        if (done->cv.wait_for(lock, kAbortPoll, [&] { return done->done; })) break;
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (!theirs_.empty()) {
        if (watching) --long_waits_;
        throw std::runtime_error("another rank gave up: " + theirs_);
      }
      if (!watching) {
        watching = true;
        ++long_waits_;
      }
    }
    if (watching) {
      std::lock_guard<std::mutex> lock(mu_);
      --long_waits_;
    }
    work.wait();
  }

 private:
  static constexpr auto kAbortPoll = std::chrono::milliseconds(100);

  static void loop(std::shared_ptr<AbortWatch> w) {
    std::unique_lock<std::mutex> lock(w->mu_);
    bool said = false;
    while (true) {
      w->cv_.wait_for(lock, kAbortPoll,
                      [&] { return w->stopping_ || (!said && !w->mine_.empty()); });
      if (w->stopping_) return;
      const bool say = !said && !w->mine_.empty();
      const bool look = w->long_waits_ > 0 && w->theirs_.empty();
      if (!say && !look) continue;
      const std::string mine = w->mine_;
      w->in_store_ = true;
      lock.unlock();
      std::string theirs;
      bool reachable = true;
      try {
        if (say) {
          w->store_->compareSet(w->key_, std::vector<uint8_t>(),
                                std::vector<uint8_t>(mine.begin(), mine.end()));
        } else if (w->store_->check({w->key_})) {
          const std::vector<uint8_t> why = w->store_->get(w->key_);
          theirs.assign(why.begin(), why.end());
        }
      } catch (const std::exception&) {
        reachable = false;  // the transfers still fail by themselves, at their timeout
      }
      lock.lock();
      w->in_store_ = false;
      if (!reachable) return;
      said = said || say;
      if (!theirs.empty()) w->theirs_ = theirs;
    }
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string key_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::string mine_;    // why this rank gave up, to be said
  std::string theirs_;  // why a rank gave up, as the store says
  int long_waits_ = 0;  // waits that have lasted kAbortPoll
  bool in_store_ = false;
};

}  // namespace

// The node-to-node step of the hierarchical all-reduce, for one chunk of one rank's slices.
// Uncompressed, the chunk is all-reduced as it is. Compressed, it crosses in the wire dtype both
// ways and is still summed in float32: an all-to-all deals each node one piece of every node's
// chunk, each rank sums its piece over the nodes in node order and rounds the sum once, and an
// all-gather hands the pieces back. Every rank holding the chunk ends with the same bits, and the
// bytes on the network are those of the wire dtype.
//
// Nothing here waits for a transfer it could overlap: the caller's thread deals a chunk (or
// starts its all-reduce) as soon as it is summed within the node, a link thread sums the dealt
// pieces of each chunk as they arrive and starts gathering them back, and the caller finishes
// the chunks in order. A lane is two process groups, one that deals and one that gathers, so
// each sees its transfers in chunk order on every rank whatever the threads' timing; chunks take
// turns on the lanes, and every transfer fails after the engine's timeout.
class AcrossNodes final : public CrossNode {
 public:
  // groups: the dealing and the gathering group of each lane, in turn.
  AcrossNodes(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
              std::chrono::milliseconds timeout, std::shared_ptr<AbortWatch> watch)
      : groups_(std::move(groups)), timeout_(timeout), link_(std::make_shared<Link>()) {
    TORCH_INTERNAL_ASSERT(!groups_.empty() && groups_.size() % 2 == 0,
                          "ddpx: a lane across nodes is two process groups");
    nodes_ = groups_[0]->getSize();
    if (nodes_ > kMaxSources) {
      throw std::invalid_argument("ddpx: the hierarchical all-reduce sums at most " +
                                  std::to_string(kMaxSources) + " nodes, this job has " +
                                  std::to_string(nodes_));
    }
    // The threads start once nothing here can throw: a thread left running by a constructor
    // that throws would end the process.
    link_->timeout = timeout;
    link_->watch = std::move(watch);
    AbortWatch::start(link_->watch);
    link_->thread = std::thread(link_loop, link_);
  }

  ~AcrossNodes() override {
    {
      std::lock_guard<std::mutex> lock(link_->mu);
      link_->stopping = true;
    }
    link_->cv.notify_all();
    // A link thread still waiting on a transfer that a failure abandoned gets its error at the
    // timeout; the process need not wait for that. It owns all it touches.
    if (link_->busy) {
      link_->thread.detach();
    } else {
      link_->thread.join();
    }
    link_->watch->stop();
  }

  int nodes() const override { return nodes_; }
  int node() const override { return groups_[0]->getRank(); }
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }

  void start_gather(const std::vector<int64_t>& mine) override {
    const int64_t n = int64_t(mine.size());
    words_in_ = at::tensor(at::IntArrayRef(mine), at::kLong);
    words_out_ = at::empty({n * nodes_}, at::kLong);
    gathering_ = all_gather(*groups_[0], words_out_, words_in_, timeout_);
  }

  std::vector<int64_t> finish_gather() override {
    auto work = std::move(gathering_);
    link_->watch->await(*work);
    const int64_t* words = words_out_.const_data_ptr<int64_t>();
    return std::vector<int64_t>(words, words + words_out_.numel());
  }

  void start_reduce(std::shared_ptr<void> data, DType acc, DType wire, int64_t n) override {
    auto chunk = std::make_shared<Chunk>();
    chunk->data = std::move(data);
    chunk->acc = acc;
    chunk->wire = wire;
    chunk->n = n;
    const size_t lane = 2 * (next_lane_++ % (groups_.size() / 2));
    if (wire == acc) {
      const auto dtype = acc == DType::Float64 ? at::kDouble : at::kFloat;
      std::vector<at::Tensor> tensors{
          at::from_blob(chunk->data.get(), {n}, at::TensorOptions().dtype(dtype))};
      c10d::AllreduceOptions opts;
      opts.timeout = timeout_;
      chunk->work = groups_[lane]->allreduce(tensors, opts);
      pending_.push_back(std::move(chunk));
      return;
    }
    const int64_t wire_size = int64_t(dtype_size(wire));
    chunk->piece = (n + nodes_ - 1) / nodes_;
    const int64_t bytes = nodes_ * chunk->piece * wire_size;
    chunk->dealt = at::empty({bytes}, at::kByte);
    chunk->received = at::empty({bytes}, at::kByte);
    chunk->mine = at::empty({chunk->piece * wire_size}, at::kByte);
    char* out = static_cast<char*>(chunk->dealt.data_ptr());
    kernels().pack(out, wire, chunk->data.get(), acc, n, 1.0, Store::Cached);
    std::memset(out + n * wire_size, 0, size_t(bytes - n * wire_size));
    chunk->gathering_group = groups_[lane + 1];
    chunk->work = all_to_all(*groups_[lane], chunk->received, chunk->dealt, timeout_);
    chunk->gathering = chunk->gathering_started.get_future();
    {
      std::lock_guard<std::mutex> lock(link_->mu);
      link_->dealt.push_back(chunk);
    }
    link_->cv.notify_all();
    pending_.push_back(std::move(chunk));
  }

  void finish_reduce() override {
    std::shared_ptr<Chunk> chunk = std::move(pending_.front());
    pending_.pop_front();
    const int64_t wire_size = int64_t(dtype_size(chunk->wire));
    if (chunk->wire == chunk->acc) {
      link_->watch->await(*chunk->work);
      count(2 * (nodes_ - 1) * chunk->n * wire_size / nodes_);
      return;
    }
    chunk->gathering.get();  // the link thread's failure, if it had one
    link_->watch->await(*chunk->work);
    kernels().pack(chunk->data.get(), chunk->acc, chunk->dealt.data_ptr(), chunk->wire, chunk->n,
                   1.0, Store::Cached);
    count(2 * (nodes_ - 1) * chunk->piece * wire_size);
  }

 private:
  struct Chunk {
    std::shared_ptr<void> data;  // n accumulation-dtype elements, summed in place
    DType acc, wire;
    int64_t n = 0, piece = 0;
    at::Tensor dealt, received, mine;  // compressed: the wire-dtype pieces
    c10::intrusive_ptr<c10d::Work> work;  // the transfer under way
    c10::intrusive_ptr<c10d::ProcessGroup> gathering_group;
    std::promise<void> gathering_started;  // set by the link thread once work gathers
    std::future<void> gathering;
  };
  struct Link {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<Chunk>> dealt;  // compressed chunks whose pieces are on the way
    bool stopping = false;
    std::atomic<bool> busy{false};
    std::chrono::milliseconds timeout{};
    std::shared_ptr<AbortWatch> watch;
  };

  // Sums each dealt chunk's pieces as they arrive, in chunk order, and starts gathering them.
  static void link_loop(std::shared_ptr<Link> link) {
    std::string broken;  // an earlier transfer failed: the groups are out of step since
    while (true) {
      std::shared_ptr<Chunk> c;
      {
        std::unique_lock<std::mutex> lock(link->mu);
        link->cv.wait(lock, [&] { return link->stopping || !link->dealt.empty(); });
        if (link->stopping) return;
        c = std::move(link->dealt.front());
        link->dealt.pop_front();
        link->busy = true;
      }
      try {
        if (!broken.empty()) throw std::runtime_error(broken);
        link->watch->await(*c->work);
        const int64_t wire_size = int64_t(dtype_size(c->wire));
        const int64_t nodes = c->gathering_group->getSize();
        const void* pieces[kMaxSources];
        for (int64_t i = 0; i < nodes; ++i) {
          pieces[i] = static_cast<const char*>(c->received.data_ptr()) + i * c->piece * wire_size;
        }
        kernels().reduce(c->mine.data_ptr(), c->wire, pieces, int(nodes), c->wire, c->piece,
                         Store::Cached);
        c->work = all_gather(*c->gathering_group, c->dealt, c->mine, link->timeout);
        c->gathering_started.set_value();
      } catch (const std::exception& e) {
        broken = std::string("an earlier transfer failed: ") + e.what();
        c->gathering_started.set_exception(std::current_exception());
      }
      link->busy = false;
    }
  }

  void abort(const std::string& why) noexcept override { link_->watch->give_up(why); }

  void count(int64_t bytes) { bytes_sent_.fetch_add(uint64_t(bytes), std::memory_order_relaxed); }

  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  int nodes_ = 0;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Link> link_;
  size_t next_lane_ = 0;
  std::deque<std::shared_ptr<Chunk>> pending_;  // started chunks, oldest first
  at::Tensor words_in_, words_out_;
  c10::intrusive_ptr<c10d::Work> gathering_;
  std::atomic<uint64_t> bytes_sent_{0};
};

namespace {

// torch's name of a dtype ("int64", not ScalarType's "Long"), as users wrote it.
std::string_view dtype_name(at::ScalarType t) { return c10::getDtypeNames(t).first; }

}  // namespace

at::Tensor as_real(const at::Tensor& tensor) {
  return tensor.defined() && tensor.layout() == at::kStrided && tensor.is_complex()
             ? at::view_as_real(tensor)
             : tensor;
}

std::string invalid_input(const at::Tensor& input, const Request& request,
                          c10::DeviceType device) {
  const at::Tensor tensor = as_real(input);
  // The common case, valid and uncompressed, returns before a message is built.
  if (tensor.defined() && tensor.layout() == at::kStrided && tensor.device().type() == device &&
      tensor.is_contiguous() &&
      to_dtype(tensor.scalar_type()) && (!request.wire || *request.wire == tensor.scalar_type())) {
    return {};
  }
  const bool cpu = device == c10::DeviceType::CPU;
  std::ostringstream why;
  if (!tensor.defined()) {
    why << "ddpx: " << request.what << " got an undefined tensor";
  } else if (tensor.layout() != at::kStrided) {
    why << "ddpx: " << request.what << " is a " << tensor.layout()
        << " tensor; ddpx's engines reduce dense (strided) tensors: reduce it with "
           "torch.distributed.all_reduce"
        << (tensor.is_sparse() ? " (ddpx.all_reduce does for a sparse COO tensor)" : "");
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
        << "; ddpx reduces float32, float64, bfloat16, float16 and complex64/128 (use "
           "torch.distributed.all_reduce for other dtypes)";
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
  std::vector<at::Tensor> tensors{as_real(tensor)};
  auto work = group.allreduce(tensors, opts);
  return work->getFuture()->then(
      [tensor](c10::ivalue::Future&) { return c10::IValue(tensor); }, c10::TensorType::get());
}

ShmEngine::ShmEngine(std::unique_ptr<ShmAllreduce> shm,
                     std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> across_nodes,
                     std::chrono::milliseconds timeout, size_t chunk_bytes,
                     c10::intrusive_ptr<c10d::Store> store, std::string abort_key)
    : queue_(std::make_shared<Queue>()) {
  if (!across_nodes.empty()) {
    TORCH_INTERNAL_ASSERT(store, "ddpx: across nodes, an engine needs the job's store");
    across_nodes_ = std::make_shared<AcrossNodes>(
        std::move(across_nodes), timeout,
        std::make_shared<AbortWatch>(std::move(store), std::move(abort_key)));
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
    if (queue_->stopping) throw std::runtime_error("ddpx: the engine was shut down");
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
  if (q.stopping) throw std::runtime_error("ddpx: the engine was shut down");
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
  if (!across_nodes_ && shm.wide_bytes() > shm.block_bytes()) {
    const std::string wide = shm.wide_sizes();
    const std::string wide_kib = std::to_string(shm.wide_bytes() >> 10) + " KiB ones";
    if (shm.steps() == ShmAllreduce::Steps::Timed) {
      out << " (" << wide_kib << " for the sizes timed faster so: "
          << (wide.empty() ? "none yet" : wide) << ")";
    } else if (!wide.empty()) {
      out << " (" << wide_kib << " for " << wide << ")";
    }
  }
  out << ", " << kernels().isa << " kernels";
  if (!across_nodes_) {
    const std::string one_shot = shm.one_shot_sizes();
    out << ", one-shot " << (one_shot.empty() ? "never" : one_shot);
  }
  out << "; " << shm.wait_policy();
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
