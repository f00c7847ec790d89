#include "backend.h"

#include <algorithm>
#include <sstream>
#include <thread>
#include <utility>

#include "collectives.h"
#include "torch_compat.h"

namespace ddpx {
namespace {

using c10d::ReduceOp;

// The MIN, MAX, PRODUCT and bitwise reductions, and every reduction of integer and bool tensors,
// all-gather the ranks' data this much at a time (per rank) and reduce it here, in rank order.
constexpr int64_t kGatherChunkBytes = int64_t(1) << 20;

// A collective's work: done when the engine's thread has run it; wait() raises its error.
class EngineWork final : public c10d::Work {
 public:
  EngineWork(c10::intrusive_ptr<c10::ivalue::Future> future, c10d::OpType type)
      : Work(-1, type), future_(std::move(future)) {}

  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override {
    return future_->hasError() ? future_->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return future_->value().toTensorVector(); }
  // The engine's waits end at the group's timeout, so a finite timeout here adds nothing.
  bool wait(std::chrono::milliseconds /*timeout*/) override {
    future_->waitAndThrow();
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A send or receive on the inner gloo, whose works have no future: the first getFuture() starts a
// thread that waits for the work and then completes the future with its tensors.
class PointToPointWork final : public c10d::Work {
 public:
  PointToPointWork(c10::intrusive_ptr<c10d::Work> inner, std::vector<at::Tensor> tensors,
                   c10d::OpType type)
      : Work(-1, type), inner_(std::move(inner)), tensors_(std::move(tensors)) {}

  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  std::vector<at::Tensor> result() override { return tensors_; }
  bool wait(std::chrono::milliseconds timeout) override { return inner_->wait(timeout); }
  int sourceRank() const override { return inner_->sourceRank(); }
  void abort() override { inner_->abort(); }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::call_once(started_, [this] {
      future_ =
          c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
      std::thread([inner = inner_, future = future_, tensors = c10::List<at::Tensor>(tensors_)] {
        try {
          inner->wait();
          future->markCompleted(c10::IValue(tensors));
        } catch (...) {
          future->setError(std::current_exception());
        }
      }).detach();
    });
    return future_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::vector<at::Tensor> tensors_;
  std::once_flag started_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The calls made between startCoalescing and endCoalescing, as one work.
class CoalescedWork final : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : Work(-1, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override {
    return std::all_of(works_.begin(), works_.end(),
                       [](const auto& w) { return w->isCompleted(); });
  }
  bool isSuccess() const override {
    return std::all_of(works_.begin(), works_.end(), [](const auto& w) { return w->isSuccess(); });
  }
  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (auto error = w->exception()) return error;
    }
    return nullptr;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (const auto& w : works_) w->wait(timeout);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(
        c10::FutureType::create(c10::AnyType::get()));
    for (const auto& w : works_) futures.push_back(w->getFuture());
    return c10::collectAll(futures);
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

bool is_sum(const ReduceOp& op) {
  return op.op_ == ReduceOp::SUM || op.op_ == ReduceOp::AVG || op.op_ == ReduceOp::PREMUL_SUM;
}

// Sums the engine's kernels do: floating-point data summed in float32 (float64 for float64).
bool kernel_sum(const at::Tensor& t, const ReduceOp& op) {
  return is_sum(op) && to_dtype(t.scalar_type()).has_value();
}

const char* op_name(const ReduceOp& op) {
  static const char* const names[] = {"SUM",  "AVG", "PRODUCT", "MIN",        "MAX",
                                      "BAND", "BOR", "BXOR",    "PREMUL_SUM", "UNUSED"};
  return names[std::min<int>(op.op_, ReduceOp::UNUSED)];
}

// Every input's scale before the sum: 1/world for AVG, the factor for PREMUL_SUM.
double sum_scale(const ReduceOp& op, int world) {
  if (op.op_ == ReduceOp::AVG) return 1.0 / world;
  if (op.op_ != ReduceOp::PREMUL_SUM) return 1.0;
  const auto* factor = dynamic_cast<const PreMulSumFactor*>(op.supplement_.get());
  TORCH_CHECK(factor, "ddpx: PREMUL_SUM without its factor");
  return factor->tensor_factor.defined() ? factor->tensor_factor.item<double>()
                                         : factor->double_factor;
}

// Why this rank cannot take part in a reduction of t with op, or "".
std::string invalid_reduction(const at::Tensor& t, const ReduceOp& op, const std::string& what) {
  std::ostringstream why;
  const bool floating = at::isFloatingType(t.scalar_type());
  if (op.op_ >= ReduceOp::UNUSED) {
    why << "ddpx: " << what << " got an unknown reduce op";
  } else if (is_sum(op) && op.op_ != ReduceOp::SUM && !floating) {
    why << "ddpx: ReduceOp." << op_name(op) << " of a " << t.scalar_type() << " tensor in " << what
        << " would round every input: sum it (ReduceOp.SUM) and divide";
  } else if ((op.op_ == ReduceOp::BAND || op.op_ == ReduceOp::BOR || op.op_ == ReduceOp::BXOR) &&
             floating) {
    why << "ddpx: ReduceOp." << op_name(op) << " needs an integer or bool tensor, " << what
        << " has " << t.scalar_type();
  }
  return why.str();
}

void combine(at::Tensor& into, const at::Tensor& other, const ReduceOp& op) {
  switch (op.op_) {
    case ReduceOp::SUM:
      into.add_(other);
      break;
    case ReduceOp::PRODUCT:
      into.mul_(other);
      break;
    case ReduceOp::MIN:
      into.copy_(at::minimum(into, other));
      break;
    case ReduceOp::MAX:
      into.copy_(at::maximum(into, other));
      break;
    case ReduceOp::BAND:
      into.bitwise_and_(other);
      break;
    case ReduceOp::BOR:
      into.bitwise_or_(other);
      break;
    case ReduceOp::BXOR:
      into.bitwise_xor_(other);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "ddpx: no reduction for ", op_name(op));
  }
}

// Where the engine reads or writes each rank's part.
template <class Pointer>
std::vector<Pointer> pointers(const std::vector<at::Tensor>& parts) {
  std::vector<Pointer> out;
  for (const auto& t : parts) out.push_back(t.data_ptr());
  return out;
}

// The world parts of the contiguous flat, count elements each.
std::vector<at::Tensor> parts_of(const at::Tensor& flat, int world, int64_t count) {
  std::vector<at::Tensor> parts;
  for (int r = 0; r < world; ++r) parts.push_back(flat.view(-1).narrow(0, r * count, count));
  return parts;
}

// Reduces the contiguous `data` in place over the node's ranks with op: all-gathered a chunk at
// a time, combined in rank order, exactly (as gloo does, integer sums wrapping around).
void reduce_gathered(NodeComm& shm, const at::Tensor& data, const ReduceOp& op,
                     const std::string& what) {
  const int n = shm.group_size();
  const int64_t numel = data.numel();
  const int64_t per = std::max<int64_t>(1, kGatherChunkBytes / int64_t(data.element_size()));
  at::Tensor flat = data.view(-1);
  at::Tensor rows_buffer = at::empty({n * std::min(per, numel)}, data.options());
  for (int64_t lo = 0; lo == 0 || lo < numel; lo += per) {
    const int64_t todo = std::min(per, numel - lo);
    at::Tensor piece = flat.narrow(0, lo, todo);
    at::Tensor rows = rows_buffer.narrow(0, 0, n * todo).view({n, todo});
    std::vector<at::Tensor> row_list;
    for (int r = 0; r < n; ++r) row_list.push_back(rows[r]);
    ddpx::allgather(shm, piece.data_ptr(), size_t(todo) * data.element_size(),
                    int32_t(data.scalar_type()), pointers<void*>(row_list).data(), what);
    piece.copy_(rows[0]);
    for (int r = 1; r < n; ++r) combine(piece, rows[r], op);
  }
}

// t itself when the engine can write it in place, else a contiguous copy to write back.
at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void write_back(const at::Tensor& into, const at::Tensor& from) {
  if (!from.is_same(into)) into.copy_(from);
}

// A tensor that does not share memory with other, or a copy of it.
at::Tensor apart_from(const at::Tensor& t, const at::Tensor& other, const at::Tensor& allowed) {
  const auto begin = [](const at::Tensor& x) { return static_cast<const char*>(x.data_ptr()); };
  const auto end = [&](const at::Tensor& x) { return begin(x) + x.numel() * x.element_size(); };
  if (t.numel() == 0 || other.numel() == 0) return t;
  if (allowed.defined() && begin(t) == begin(allowed) && t.numel() == allowed.numel()) return t;
  return end(t) <= begin(other) || end(other) <= begin(t) ? t : t.clone();
}

void require(bool ok, const std::string& message) { TORCH_CHECK_VALUE(ok, message); }

// Why a list form's tensors cannot pair with `like` (one per rank, each like it), or "".
std::string list_error(const std::vector<at::Tensor>& list, const at::Tensor& like, int world,
                       const std::string& what, const char* role) {
  std::ostringstream why;
  if (int(list.size()) != world) {
    why << "ddpx: " << what << " needs a list of " << world << " " << role << ", got "
        << list.size();
    return why.str();
  }
  for (const auto& t : list) {
    if (t.numel() != like.numel() || t.scalar_type() != like.scalar_type()) {
      why << "ddpx: " << what << " needs all " << role << " of " << like.numel() << " "
          << like.scalar_type() << " elements, got " << t.numel() << " " << t.scalar_type();
      return why.str();
    }
  }
  return {};
}

// Why the tensor form's `whole` cannot hold world x `part`, or "".
std::string whole_error(const at::Tensor& whole, const at::Tensor& part, int world,
                        const std::string& what, const char* whole_role, const char* part_role) {
  if (whole.numel() == world * part.numel() && whole.scalar_type() == part.scalar_type()) return {};
  std::ostringstream why;
  why << "ddpx: " << what << " needs an " << whole_role << " of " << world << " x " << part.numel()
      << " " << part.scalar_type() << " elements (world size x " << part_role << "), got "
      << whole.numel() << " " << whole.scalar_type();
  return why.str();
}

// reduce_scatter on the node: output = the reduction over ranks of their parts[me].
void run_reduce_scatter(NodeComm& shm, const at::Tensor& output,
                        const std::vector<at::Tensor>& parts, const ReduceOp& op, int world,
                        const std::string& what) {
  at::Tensor out = dense(output);
  std::vector<at::Tensor> ins;
  for (const auto& part : parts) ins.push_back(apart_from(dense(part), out, at::Tensor()));
  if (kernel_sum(out, op)) {
    const DType dtype = *to_dtype(out.scalar_type());
    const Request request{sum_scale(op, world), std::nullopt, what};
    const DType wire = *to_dtype(wire_dtype(out.scalar_type(), request));
    ddpx::reduce_scatter(shm, pointers<const void*>(ins).data(), out.data_ptr(), dtype, wire,
                         out.numel(), request.scale, what);
  } else {
    const std::string why = invalid_reduction(out, op, what);
    if (!why.empty()) shm.reject(why, what);
    at::Tensor all = at::cat(ins);
    reduce_gathered(shm, all, op, what);
    out.view(-1).copy_(all.narrow(0, int64_t(shm.group_rank()) * out.numel(), out.numel()));
  }
  write_back(output, out);
}

}  // namespace

Backend::Backend(int rank, int size, std::chrono::milliseconds timeout,
                 c10::intrusive_ptr<c10d::Backend> gloo, std::shared_ptr<ShmEngine> engine,
                 std::string why_not)
    : c10d::Backend(rank, size),
      timeout_(timeout),
      gloo_(std::move(gloo)),
      engine_(std::move(engine)),
      why_not_(std::move(why_not)) {
  TORCH_INTERNAL_ASSERT(gloo_, "ddpx: the backend needs its inner gloo");
  if (local()) p2p_ = std::make_unique<ShmPointToPoint>(engine_->comm().channel());
}

c10::intrusive_ptr<c10d::Backend::Options> Backend::options() const {
  return c10::make_intrusive<Options>(getBackendName(), timeout_);
}

void Backend::count(const char* name, Route route) {
  std::lock_guard<std::mutex> lock(mu_);
  RouteCounts& counts = routes_[name];
  ++(route == Route::kEngine ? counts.engine : counts.gloo);
  ++sequence_;
}

void Backend::setSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lock(mu_);
  sequence_ = 0;
}

uint64_t Backend::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lock(mu_);
  return sequence_;
}

std::map<std::string, Backend::RouteCounts> Backend::routes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return routes_;
}

std::string Backend::describe() const {
  if (!engine_) return "gloo (ddpx's shared memory is unavailable: " + why_not_ + ")";
  return engine_->describe() + "; " +
         (p2p_ ? p2p_->describe()
               : "across nodes all-to-all of uneven parts, gather, scatter and point-to-point "
                 "go to gloo");
}

c10::intrusive_ptr<c10d::Work> Backend::on_engine(const char* name, bool async,
                                                  std::chrono::milliseconds timeout,
                                                  std::vector<at::Tensor> outputs,
                                                  std::vector<Step> steps) {
  count(name, Route::kEngine);
  const auto type = c10::ListType::create(c10::TensorType::get());
  if (timeout == c10d::kUnsetTimeout) timeout = std::chrono::milliseconds(0);
  auto run_all = [outputs = c10::List<at::Tensor>(outputs), steps = std::move(steps),
                  timeout](NodeComm& shm) {
    struct CallTimeout {
      NodeComm& shm;
      ~CallTimeout() { shm.set_call_timeout(std::chrono::milliseconds(0)); }
    } reset{shm};
    shm.set_call_timeout(timeout);
    for (const Step& step : steps) step(shm);
    return c10::IValue(outputs);
  };
  c10::intrusive_ptr<c10::ivalue::Future> future;
  if (async || coalescing_) {
    future = engine_->submit(std::move(run_all), type);
  } else {
    // The hand-off to the engine's thread and back costs two wake-ups, tens of microseconds.
    future = c10::make_intrusive<c10::ivalue::Future>(type);
    c10::IValue result;
    try {
      engine_->run([&](NodeComm& shm) { result = run_all(shm); });
    } catch (...) {
      future->setError(std::current_exception());
    }
    if (!future->completed()) future->markCompleted(std::move(result));
  }
  auto work = c10::make_intrusive<EngineWork>(std::move(future), c10d::OpType::UNKNOWN);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> Backend::on_gloo(const char* name,
                                                c10::intrusive_ptr<c10d::Work> work) {
  count(name, Route::kGloo);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

void Backend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "ddpx: coalescing has started already");
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> Backend::endCoalescing() {
  TORCH_CHECK(coalescing_, "ddpx: endCoalescing without startCoalescing");
  coalescing_ = false;
  return c10::make_intrusive<CoalescedWork>(std::exchange(coalesced_, {}));
}

Backend::Step Backend::allreduce_step(const at::Tensor& tensor, const ReduceOp& op) const {
  const std::string what = "torch.distributed.all_reduce (" + std::string(op_name(op)) + ")";
  const bool sum = kernel_sum(tensor, op);
  const double scale = sum ? sum_scale(op, getSize()) : 1.0;
  return [tensor, op, sum, scale, what](NodeComm& shm) {
    at::Tensor data = dense(tensor);
    if (sum) {
      ddpx::all_reduce(shm, data, Request{scale, std::nullopt, what});
    } else {
      const std::string why = invalid_reduction(data, op, what);
      if (!why.empty()) shm.reject(why, what);
      reduce_gathered(shm, data, op, what);
    }
    write_back(tensor, data);
  };
}

Backend::Step Backend::reduce_scatter_step(const at::Tensor& output, const at::Tensor& input,
                                           const ReduceOp& op) const {
  const int world = getSize();
  return [output, input, op, world](NodeComm& shm) {
    const std::string what =
        "torch.distributed.reduce_scatter_tensor (" + std::string(op_name(op)) + ")";
    const std::string why = whole_error(input, output, world, what, "input", "output");
    if (!why.empty()) shm.reject(why, what);
    run_reduce_scatter(shm, output, parts_of(dense(input), world, output.numel()), op, world, what);
  };
}

Backend::Step Backend::allgather_step(const at::Tensor& output, const at::Tensor& input) const {
  const int world = getSize();
  return [output, input, world](NodeComm& shm) {
    const std::string what = "torch.distributed.all_gather_into_tensor";
    const std::string why = whole_error(output, input, world, what, "output", "input");
    if (!why.empty()) shm.reject(why, what);
    at::Tensor out = dense(output);
    const at::Tensor own =
        out.view(-1).narrow(0, int64_t(shm.group_rank()) * input.numel(), input.numel());
    const at::Tensor in = apart_from(dense(input), out, own);
    ddpx::allgather(shm, in.data_ptr(), size_t(in.numel()) * in.element_size(),
                    int32_t(in.scalar_type()),
                    pointers<void*>(parts_of(out, world, input.numel())).data(), what);
    write_back(output, out);
  };
}

Backend::Step Backend::alltoall_step(std::vector<at::Tensor> outs, std::vector<at::Tensor> ins,
                                     bool equal_parts, std::string what) {
  return [outs = std::move(outs), ins = std::move(ins), equal_parts,
          what = std::move(what)](NodeComm& shm) {
    const int n = shm.group_size(), me = shm.group_rank();
    const auto bytes = [](const at::Tensor& t) { return t.defined() ? t.nbytes() : size_t(0); };
    const auto where = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
    std::vector<at::Tensor> dense_outs, dense_ins;
    for (const auto& out : outs) dense_outs.push_back(out.defined() ? dense(out) : out);
    for (const auto& in : ins) {
      at::Tensor part = in.defined() ? dense(in) : in;
      for (const auto& out : dense_outs) {
        if (part.defined() && out.defined()) part = apart_from(part, out, at::Tensor());
      }
      dense_ins.push_back(part);
    }
    std::vector<size_t> sends, receives;
    std::vector<const void*> from;
    std::vector<void*> to;
    for (int r = 0; r < n; ++r) {
      sends.push_back(bytes(dense_ins[size_t(r)]));
      receives.push_back(bytes(dense_outs[size_t(r)]));
      from.push_back(where(dense_ins[size_t(r)]));
      to.push_back(where(dense_outs[size_t(r)]));
    }
    size_t longest = std::max(*std::max_element(sends.begin(), sends.end()),
                              *std::max_element(receives.begin(), receives.end()));
    std::ostringstream why;
    if (equal_parts) {
      // Every part sent or received is as long as the longest: the other ranks' are too.
      for (int r = 0; r < n && why.tellp() == 0; ++r) {
        for (const at::Tensor* t : {&dense_ins[size_t(r)], &dense_outs[size_t(r)]}) {
          if (t->defined() && bytes(*t) != longest && why.tellp() == 0) {
            why << "ddpx: " << what << " needs parts of one size, got " << bytes(*t) << " and "
                << longest << " bytes";
          }
        }
      }
    } else {
      // Every rank's part sizes, so that all agree on the steps and check what they receive.
      std::vector<int64_t> mine(sends.begin(), sends.end()), all(size_t(n * n));
      std::vector<void*> rows;
      for (int r = 0; r < n; ++r) rows.push_back(all.data() + r * n);
      ddpx::allgather(shm, mine.data(), mine.size() * sizeof(int64_t), int32_t(at::kLong),
                      rows.data(), what);
      longest = size_t(*std::max_element(all.begin(), all.end()));
      for (int r = 0; r < n && why.tellp() == 0; ++r) {
        if (size_t(all[size_t(r * n + me)]) != receives[size_t(r)]) {
          why << "ddpx: " << what << ": local rank " << r << " sends " << all[size_t(r * n + me)]
              << " bytes to local rank " << me << ", which expects " << receives[size_t(r)]
              << ": the ranks' splits must match";
        }
      }
    }
    if (why.tellp() > 0) shm.reject(why.str(), what);
    int32_t torch_dtype = -1;
    for (const auto* parts : {&dense_ins, &dense_outs}) {
      for (const auto& t : *parts) {
        if (t.defined()) torch_dtype = int32_t(t.scalar_type());
      }
    }
    ddpx::alltoall(shm, from.data(), sends.data(), to.data(), receives.data(), longest, torch_dtype,
                   what);
    for (size_t r = 0; r < outs.size(); ++r) {
      if (outs[r].defined()) write_back(outs[r], dense_outs[r]);
    }
  };
}

bool Backend::rooted_shape(const std::vector<at::Tensor>& mine,
                           const std::vector<std::vector<at::Tensor>>& lists, int root) const {
  const int world = getSize();
  if (mine.size() != 1 || root < 0 || root >= world) return false;
  if (getRank() == root) return lists.size() == 1 && int(lists[0].size()) == world;
  return lists.empty() || lists[0].empty();
}

Backend::Step Backend::rooted_step(const at::Tensor& mine, const std::vector<at::Tensor>& list,
                                   int root, bool to_root, std::string what) const {
  const size_t world = size_t(getSize());
  // mine goes to or comes from the root only; the root's list has a part for every rank.
  std::vector<at::Tensor> with_root(world), with_all = list;
  with_root[size_t(root)] = mine;
  with_all.resize(world);
  return to_root ? alltoall_step(with_all, with_root, true, std::move(what))
                 : alltoall_step(with_root, with_all, true, std::move(what));
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  require(tensors.size() == 1, "ddpx: all_reduce takes one CPU tensor");
  const at::Tensor& t = tensors[0];
  if (t.layout() == at::kStrided && engine_) {
    return on_engine("all_reduce", opts, tensors, {allreduce_step(t, opts.reduceOp)});
  }
  return on_gloo("all_reduce", gloo_->allreduce(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  return on_gloo("all_reduce_sparse", gloo_->allreduce_sparse(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const bool engine = engine_ && std::all_of(tensors.begin(), tensors.end(), [&](const auto& t) {
                        return t.layout() == at::kStrided;
                      });
  if (!engine) return on_gloo("all_reduce_coalesced", gloo_->allreduce_coalesced(tensors, opts));
  std::vector<Step> steps;
  for (const auto& t : tensors) steps.push_back(allreduce_step(t, opts.reduceOp));
  return on_engine("all_reduce_coalesced", opts, tensors, std::move(steps));
}

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  require(tensors.size() == 1, "ddpx: broadcast takes one CPU tensor");
  if (!engine_) return on_gloo("broadcast", gloo_->broadcast(tensors, opts));
  const at::Tensor tensor = tensors[0];
  const int root = int(opts.rootRank);
  return on_engine("broadcast", opts, tensors, {[tensor, root](NodeComm& shm) {
                     at::Tensor data = dense(tensor);
                     ddpx::broadcast(
                         shm, data.data_ptr(), size_t(data.numel()) * data.element_size(),
                         int32_t(data.scalar_type()), root, "torch.distributed.broadcast");
                     write_back(tensor, data);
                   }});
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts) {
  require(inputs.size() == 1 && outputs.size() == 1, "ddpx: all_gather takes one CPU tensor");
  if (!engine_) return on_gloo("all_gather", gloo_->allgather(outputs, inputs, opts));
  const std::vector<at::Tensor> outs = outputs[0];
  const at::Tensor input = inputs[0];
  const int world = getSize();
  return on_engine(
      "all_gather", opts, outs, {[outs, input, world](NodeComm& shm) {
        const std::string what = "torch.distributed.all_gather";
        const std::string why = list_error(outs, input, world, what, "outputs");
        if (!why.empty()) shm.reject(why, what);
        std::vector<at::Tensor> dense_outs;
        for (const auto& out : outs) dense_outs.push_back(dense(out));
        at::Tensor in = dense(input);
        for (int r = 0; r < world; ++r) {
          in = apart_from(in, dense_outs[size_t(r)],
                          r == shm.group_rank() ? dense_outs[size_t(r)] : at::Tensor());
        }
        ddpx::allgather(shm, in.data_ptr(), size_t(in.numel()) * in.element_size(),
                        int32_t(in.scalar_type()), pointers<void*>(dense_outs).data(), what);
        for (size_t r = 0; r < outs.size(); ++r) write_back(outs[r], dense_outs[r]);
      }});
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  if (!engine_) {
    return on_gloo("all_gather_into_tensor", gloo_->_allgather_base(output, input, opts));
  }
  return on_engine("all_gather_into_tensor", opts, {output}, {allgather_step(output, input)});
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  if (!engine_) {
    return on_gloo("all_gather_into_tensor_coalesced",
                   gloo_->allgather_into_tensor_coalesced(outputs, inputs, opts));
  }
  require(outputs.size() == inputs.size(), "ddpx: as many outputs as inputs, please");
  std::vector<Step> steps;
  for (size_t i = 0; i < inputs.size(); ++i) steps.push_back(allgather_step(outputs[i], inputs[i]));
  return on_engine("all_gather_into_tensor_coalesced", opts, outputs, std::move(steps));
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  return on_gloo("all_gather_coalesced", gloo_->allgather_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  require(inputs.size() == 1 && outputs.size() == 1, "ddpx: reduce_scatter takes one CPU tensor");
  if (!engine_) return on_gloo("reduce_scatter", gloo_->reduce_scatter(outputs, inputs, opts));
  const at::Tensor output = outputs[0];
  const std::vector<at::Tensor> ins = inputs[0];
  const int world = getSize();
  const ReduceOp op = opts.reduceOp;
  return on_engine("reduce_scatter", opts, outputs, {[output, ins, op, world](NodeComm& shm) {
                     const std::string what =
                         "torch.distributed.reduce_scatter (" + std::string(op_name(op)) + ")";
                     const std::string why = list_error(ins, output, world, what, "inputs");
                     if (!why.empty()) shm.reject(why, what);
                     run_reduce_scatter(shm, output, ins, op, world, what);
                   }});
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (!engine_) {
    return on_gloo("reduce_scatter_tensor", gloo_->_reduce_scatter_base(output, input, opts));
  }
  return on_engine("reduce_scatter_tensor", opts, {output},
                   {reduce_scatter_step(output, input, opts.reduceOp)});
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  if (!engine_) {
    return on_gloo("reduce_scatter_tensor_coalesced",
                   gloo_->reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  }
  require(outputs.size() == inputs.size(), "ddpx: as many outputs as inputs, please");
  std::vector<Step> steps;
  for (size_t i = 0; i < inputs.size(); ++i) {
    steps.push_back(reduce_scatter_step(outputs[i], inputs[i], opts.reduceOp));
  }
  return on_engine("reduce_scatter_tensor_coalesced", opts, outputs, std::move(steps));
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  if (!engine_) return on_gloo("barrier", gloo_->barrier(opts));
  return on_engine("barrier", opts, {},
                   {[](NodeComm& shm) { ddpx::barrier(shm, "torch.distributed.barrier"); }});
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors,
                                               const c10d::ReduceOptions& opts) {
  require(tensors.size() == 1, "ddpx: reduce takes one CPU tensor");
  const at::Tensor& t = tensors[0];
  const int root = int(opts.rootRank);
  if (!engine_ || t.layout() != at::kStrided || root < 0 || root >= getSize()) {
    return on_gloo("reduce", gloo_->reduce(tensors, opts));
  }
  // The all-reduce, whose result the other ranks drop: their tensors keep their values.
  const at::Tensor data = getRank() == root ? t : t.clone();
  return on_engine("reduce", opts, tensors, {allreduce_step(data, opts.reduceOp)});
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::GatherOptions& opts) {
  const int root = int(opts.rootRank);
  if (!local() || !rooted_shape(inputs, outputs, root)) {
    return on_gloo("gather", gloo_->gather(outputs, inputs, opts));
  }
  const std::vector<at::Tensor> list = getRank() == root ? outputs[0] : std::vector<at::Tensor>{};
  return on_engine("gather", opts, list,
                   {rooted_step(inputs[0], list, root, true, "torch.distributed.gather")});
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  const int root = int(opts.rootRank);
  if (!local() || !rooted_shape(outputs, inputs, root)) {
    return on_gloo("scatter", gloo_->scatter(outputs, inputs, opts));
  }
  const std::vector<at::Tensor> list = getRank() == root ? inputs[0] : std::vector<at::Tensor>{};
  return on_engine("scatter", opts, outputs,
                   {rooted_step(outputs[0], list, root, false, "torch.distributed.scatter")});
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_splits,
                                                      std::vector<int64_t>& input_splits,
                                                      const c10d::AllToAllOptions& opts) {
  const bool equal = input_splits.empty() && output_splits.empty();
  if (!engine_ || input.scalar_type() != output.scalar_type() || (!local() && !equal)) {
    return on_gloo("all_to_all_single",
                   gloo_->alltoall_base(output, input, output_splits, input_splits, opts));
  }
  const std::string what = "torch.distributed.all_to_all_single";
  const int world = getSize();
  auto parts = [&](const at::Tensor& t, const std::vector<int64_t>& splits, const char* role) {
    std::vector<at::Tensor> out;
    const at::Tensor flat = t.view(-1);  // contiguous: checked below
    if (splits.empty()) {
      require(t.numel() % world == 0, "ddpx: " + what + " splits its " + role + " of " +
                                          std::to_string(t.numel()) + " elements into " +
                                          std::to_string(world) + " equal parts: pass splits");
      for (int r = 0; r < world; ++r)
        out.push_back(flat.narrow(0, r * (t.numel() / world), t.numel() / world));
      return out;
    }
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const int64_t row = rows == 0 ? 0 : t.numel() / rows;
    int64_t at_row = 0;
    require(int(splits.size()) == world, "ddpx: " + what + " takes one split per rank");
    for (int64_t split : splits) {
      require(split >= 0 && at_row + split <= rows, "ddpx: " + what + "'s " + role +
                                                        " splits add up to more than its " +
                                                        std::to_string(rows) + " rows");
      out.push_back(flat.narrow(0, at_row * row, split * row));
      at_row += split;
    }
    return out;
  };
  require(input.is_contiguous() && output.is_contiguous(),
          "ddpx: " + what + " takes contiguous tensors");
  return on_engine("all_to_all_single", opts, {output},
                   {alltoall_step(parts(output, output_splits, "output"),
                                  parts(input, input_splits, "input"), equal, what)});
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs,
                                                 std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  const int world = getSize();
  const auto other_dtype = [&](const at::Tensor& t) {
    return t.scalar_type() != inputs[0].scalar_type();
  };
  // Across nodes the parts must be of one size (the nodes trade them without their sizes).
  const auto other_size = [&](const at::Tensor& t) { return t.numel() != inputs[0].numel(); };
  if (!engine_ || int(inputs.size()) != world || int(outputs.size()) != world ||
      std::any_of(inputs.begin(), inputs.end(), other_dtype) ||
      std::any_of(outputs.begin(), outputs.end(), other_dtype) ||
      (!local() && (std::any_of(inputs.begin(), inputs.end(), other_size) ||
                    std::any_of(outputs.begin(), outputs.end(), other_size)))) {
    return on_gloo("all_to_all", gloo_->alltoall(outputs, inputs, opts));
  }
  return on_engine("all_to_all", opts, outputs,
                   {alltoall_step(outputs, inputs, !local(), "torch.distributed.all_to_all")});
}

c10::intrusive_ptr<c10d::Work> Backend::point_to_point(const char* name,
                                                       std::vector<at::Tensor>& tensors, int peer,
                                                       int tag, bool is_send) {
  if (!p2p_) {
    auto inner =
        is_send ? gloo_->send(tensors, peer, tag)
                : (peer < 0 ? gloo_->recvAnysource(tensors, tag) : gloo_->recv(tensors, peer, tag));
    const c10d::OpType type = inner->retrieveOpType();
    return on_gloo(name, c10::make_intrusive<PointToPointWork>(std::move(inner), tensors, type));
  }
  TORCH_CHECK_VALUE(tensors.size() == 1, "ddpx: ", name, " takes one tensor, not ", tensors.size());
  count(name, Route::kEngine);
  auto work = is_send ? p2p_->send(tensors[0], peer, tag) : p2p_->recv(tensors[0], peer, tag);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  return point_to_point("send", tensors, dst, tag, true);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  return point_to_point("recv", tensors, src, tag, false);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return point_to_point("recv", tensors, -1, tag, false);
}

}  // namespace ddpx
