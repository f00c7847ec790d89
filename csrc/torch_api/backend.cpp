// The c10d surface of the ddpx backend: each override opens the call's profiler range, picks its
// route (the engine or the inner gloo) and dispatches; the tasks the engine runs are in
// backend_tasks.cpp, the works it returns in backend_work.cpp.
#include "backend.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <utility>

#include "../common/caller_profiler.h"
#include "../node/arena.h"
#include "backend_work.h"

namespace ddpx {
namespace {

// gloo's checks of a root (TORCH_CHECKs there: RuntimeError here too), or "".
std::string root_error(const char* name, int64_t root, int64_t root_tensor, int size) {
  std::ostringstream why;
  if (root < 0 || root >= size) {
    why << "ddpx: " << name << ": invalid root rank " << root << ": the group's ranks are 0 to "
        << size - 1;
  } else if (root_tensor != 0) {
    why << "ddpx: " << name << ": invalid root tensor " << root_tensor
        << ": with one tensor a rank, rootTensor is 0";
  }
  return why.str();
}

// The first two of a list's tensors that share memory, if any.
std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<at::Tensor>& parts) {
  for (size_t i = 0; i < parts.size(); ++i) {
    for (size_t j = i + 1; j < parts.size(); ++j) {
      if (overlaps(parts[i], parts[j])) return std::make_pair(i, j);
    }
  }
  return std::nullopt;
}

// Why two of a list's parts, each of which the call writes, cannot both be written, or "".
std::string overlapping_parts(const std::vector<at::Tensor>& parts, const char* name,
                              const char* role) {
  const auto pair = first_overlap(parts);
  if (!pair) return {};
  std::ostringstream why;
  why << "ddpx: " << name << "'s " << role << " " << pair->first << " and " << pair->second
      << " share memory: give each part a tensor of its own";
  return why.str();
}

// Why the coalesced lists cannot pair each output with its input, the one of them that holds
// the world's parts (`whole`: the output of an all-gather, the input of a reduce-scatter) being
// world times the other, or cannot write every output; or "".
std::string coalesced_error(const std::vector<at::Tensor>& outputs,
                            const std::vector<at::Tensor>& inputs, const char* name,
                            bool output_whole, int world) {
  if (outputs.size() != inputs.size()) {
    return std::string("ddpx: ") + name + " takes as many outputs as inputs, got " +
           std::to_string(outputs.size()) + " and " + std::to_string(inputs.size());
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string why =
        output_whole ? whole_error(outputs[i], inputs[i], world, name, "output", "input")
                     : whole_error(inputs[i], outputs[i], world, name, "input", "output");
    if (!why.empty()) return why;
  }
  return overlapping_parts(outputs, name, "outputs");
}

// The inputs, those that share memory with another entry's output copied first: the entries run
// one after another, and an input must still hold its value at the call when its turn comes.
std::vector<at::Tensor> apart_from_outputs(const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out = inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    for (size_t j = 0; j < outputs.size(); ++j) {
      if (i != j && overlaps(inputs[i], outputs[j])) {
        out[i] = inputs[i].clone();
        break;
      }
    }
  }
  return out;
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
  return c10::make_intrusive<Options>(getBackendName(), timeout_.load());
}

void Backend::set_timeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(timeout.count() > 0, "ddpx: a process group's timeout must be above zero");
  timeout_ = timeout;
#if DDPX_TORCH_AT_LEAST_2_13
  gloo()->setTimeout(timeout);
#endif
}

#if DDPX_TORCH_AT_LEAST_2_9
bool Backend::supportsTensorAlloc(c10::DeviceIndex device) {
  // A CPU device has no index; a group that also serves CUDA tensors may be asked for theirs.
  return device < 0 && engine_ && engine_->serves_arena();
}

at::Tensor Backend::allocateTensor(long size, at::TensorOptions options) {
  return Arena::process().allocate(size, options);
}
#endif

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
                                                  std::vector<Task> tasks) {
  count(name, Route::kEngine);
  const auto type = c10::ListType::create(c10::TensorType::get());
  if (timeout == c10d::kUnsetTimeout) timeout = timeout_.load();
  auto run_all = [name, profiler = CallerProfiler(), outputs = c10::List<at::Tensor>(outputs),
                  tasks = std::move(tasks), timeout](NodeComm& comm) {
    const ProfilerGuard traced(profiler);
    RECORD_FUNCTION(std::string("ddpx::") + name + " (engine)", std::vector<c10::IValue>());
    struct CallTimeout {
      NodeComm& comm;
      ~CallTimeout() { comm.set_call_timeout(std::chrono::milliseconds(0)); }
    } reset{comm};
    comm.set_call_timeout(timeout);
    for (const Task& task : tasks) task(comm);
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
      engine_->run([&](NodeComm& comm) { result = run_all(comm); });
    } catch (...) {
      future->setError(std::current_exception());
    }
    if (!future->completed()) future->markCompleted(std::move(result));
  }
  auto work = c10::make_intrusive<EngineWork>(std::move(future), c10d::OpType::UNKNOWN);
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

void Backend::refuse(const char* name, const std::string& why) {
  count(name, Route::kEngine);
  // The peers' calls of this collective wait on the engine: the rejection ends them too, naming
  // this rank and why.
  engine_->submit([why, what = std::string("torch.distributed.") +
                               name](NodeComm& comm) -> c10::IValue { comm.reject(why, what); },
                  c10::NoneType::get());
  TORCH_CHECK(false, why);
}

const c10::intrusive_ptr<c10d::Backend>& Backend::gloo() const {
  TORCH_CHECK(gloo_, "ddpx: rank ", getRank(),
              "'s process group was destroyed (destroy_process_group): make a new group for "
              "further calls");
  return gloo_;
}

void Backend::abort() {
  const std::string why =
      "ddpx: rank " + std::to_string(getRank()) + "'s process group was aborted";
  if (engine_) engine_->abort(why);
  if (p2p_) p2p_->abort(why);
}

void Backend::shutdown() {
  p2p_.reset();
  if (engine_) engine_->shutdown();
  engine_.reset();
  gloo_.reset();
  why_not_ = "the group was destroyed";
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

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  RECORD_FUNCTION("ddpx::all_reduce", std::vector<c10::IValue>());
  // Several tensors a rank (reduced together, as gloo does) and other layouts: gloo's own.
  if (!engine_ || tensors.size() != 1 || tensors[0].layout() != at::kStrided) {
    return on_gloo("all_reduce", gloo()->allreduce(tensors, opts));
  }
  return on_engine("all_reduce", opts, tensors,
                   {all_reduce_task(tensors[0], opts.reduceOp, getSize())});
}

// c10d's own entry point for sparse tensors (ProcessGroup::allreduce dispatches them here, and
// an engine sends its sparse tensors through the process group, Engine::run_async): gloo sums
// them, the same rule, not a second one.
c10::intrusive_ptr<c10d::Work> Backend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  RECORD_FUNCTION("ddpx::all_reduce_sparse", std::vector<c10::IValue>());
  return on_gloo("all_reduce_sparse", gloo()->allreduce_sparse(tensors, opts));
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  RECORD_FUNCTION("ddpx::all_reduce_coalesced", std::vector<c10::IValue>());
  const auto strided_like_first = [&](const at::Tensor& t) {
    return t.layout() == at::kStrided && t.scalar_type() == tensors[0].scalar_type();
  };
  // An empty list, mixed dtypes or layouts, sparse tensors: gloo raises at the call, or sums.
  if (!engine_ || tensors.empty() ||
      !std::all_of(tensors.begin(), tensors.end(), strided_like_first)) {
    return on_gloo("all_reduce_coalesced", gloo()->allreduce_coalesced(tensors, opts));
  }
  std::vector<Task> tasks;
  if (first_overlap(tensors)) {
    // Reduced one after another in place, a tensor listed twice would be summed twice: as gloo
    // does, every entry is reduced from its value at the call, and written back in list order.
    std::vector<at::Tensor> flat;
    for (const auto& t : tensors) flat.push_back(t.reshape(-1));
    const at::Tensor values = at::cat(flat);
    tasks.push_back(all_reduce_task(values, opts.reduceOp, getSize()));
    tasks.push_back([tensors, values](NodeComm&) {
      int64_t at = 0;
      for (const auto& t : tensors) {
        t.copy_(values.narrow(0, at, t.numel()).view(t.sizes()));
        at += t.numel();
      }
    });
  } else {
    for (const auto& t : tensors) tasks.push_back(all_reduce_task(t, opts.reduceOp, getSize()));
  }
  return on_engine("all_reduce_coalesced", opts, tensors, std::move(tasks));
}

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  RECORD_FUNCTION("ddpx::broadcast", std::vector<c10::IValue>());
  // Several tensors a rank (the root's tensor opts.rootTensor to all of them): gloo's.
  if (!engine_ || tensors.size() != 1)
    return on_gloo("broadcast", gloo()->broadcast(tensors, opts));
  const std::string why = root_error("broadcast", opts.rootRank, opts.rootTensor, getSize());
  if (!why.empty()) refuse("broadcast", why);
  return on_engine("broadcast", opts, tensors, {broadcast_task(tensors[0], int(opts.rootRank))});
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts) {
  RECORD_FUNCTION("ddpx::all_gather", std::vector<c10::IValue>());
  // Several tensors a rank, or a list that does not hold a part per rank: gloo serves the one,
  // and raises at the call for the other.
  if (!engine_ || inputs.size() != 1 || outputs.size() != 1 ||
      int(outputs[0].size()) != getSize()) {
    return on_gloo("all_gather", gloo()->allgather(outputs, inputs, opts));
  }
  std::string why = list_error(outputs[0], inputs[0], getSize(), "all_gather", "outputs");
  if (why.empty()) why = overlapping_parts(outputs[0], "all_gather", "outputs");
  if (!why.empty()) refuse("all_gather", why);
  return on_engine("all_gather", opts, outputs[0],
                   {all_gather_task(outputs[0], inputs[0], getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  RECORD_FUNCTION("ddpx::all_gather_into_tensor", std::vector<c10::IValue>());
  if (!engine_) {
    return on_gloo("all_gather_into_tensor", gloo()->_allgather_base(output, input, opts));
  }
  const std::string why =
      whole_error(output, input, getSize(), "all_gather_into_tensor", "output", "input");
  if (!why.empty()) refuse("all_gather_into_tensor", why);
  return on_engine("all_gather_into_tensor", opts, {output},
                   {all_gather_into_tensor_task(output, input, getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  RECORD_FUNCTION("ddpx::all_gather_into_tensor_coalesced", std::vector<c10::IValue>());
  if (!engine_) {
    return on_gloo("all_gather_into_tensor_coalesced",
                   gloo()->allgather_into_tensor_coalesced(outputs, inputs, opts));
  }
  const char* name = "all_gather_into_tensor_coalesced";
  const std::string why = coalesced_error(outputs, inputs, name, true, getSize());
  if (!why.empty()) refuse(name, why);
  const std::vector<at::Tensor> ins = apart_from_outputs(inputs, outputs);
  std::vector<Task> tasks;
  for (size_t i = 0; i < inputs.size(); ++i) {
    tasks.push_back(all_gather_into_tensor_task(outputs[i], ins[i], getSize()));
  }
  return on_engine("all_gather_into_tensor_coalesced", opts, outputs, std::move(tasks));
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  RECORD_FUNCTION("ddpx::all_gather_coalesced", std::vector<c10::IValue>());
  return on_gloo("all_gather_coalesced", gloo()->allgather_coalesced(outputs, inputs, opts));
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  RECORD_FUNCTION("ddpx::reduce_scatter", std::vector<c10::IValue>());
  const auto uneven = [&](const at::Tensor& part) { return part.numel() != outputs[0].numel(); };
  // Several tensors a rank, a list without a part per rank, and parts of other sizes than the
  // output (each rank's part its own size): gloo computes them, or raises at the call.
  if (!engine_ || inputs.size() != 1 || outputs.size() != 1 || int(inputs[0].size()) != getSize() ||
      std::any_of(inputs[0].begin(), inputs[0].end(), uneven)) {
    return on_gloo("reduce_scatter", gloo()->reduce_scatter(outputs, inputs, opts));
  }
  const std::string why = list_error(inputs[0], outputs[0], getSize(), "reduce_scatter", "inputs");
  if (!why.empty()) refuse("reduce_scatter", why);
  return on_engine("reduce_scatter", opts, outputs,
                   {reduce_scatter_task(outputs[0], inputs[0], opts.reduceOp, getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  RECORD_FUNCTION("ddpx::reduce_scatter_tensor", std::vector<c10::IValue>());
  if (!engine_) {
    return on_gloo("reduce_scatter_tensor", gloo()->_reduce_scatter_base(output, input, opts));
  }
  const std::string why =
      whole_error(input, output, getSize(), "reduce_scatter_tensor", "input", "output");
  if (!why.empty()) refuse("reduce_scatter_tensor", why);
  return on_engine("reduce_scatter_tensor", opts, {output},
                   {reduce_scatter_tensor_task(output, input, opts.reduceOp, getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  RECORD_FUNCTION("ddpx::reduce_scatter_tensor_coalesced", std::vector<c10::IValue>());
  if (!engine_) {
    return on_gloo("reduce_scatter_tensor_coalesced",
                   gloo()->reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  }
  const char* name = "reduce_scatter_tensor_coalesced";
  const std::string why = coalesced_error(outputs, inputs, name, false, getSize());
  if (!why.empty()) refuse(name, why);
  const std::vector<at::Tensor> ins = apart_from_outputs(inputs, outputs);
  std::vector<Task> tasks;
  for (size_t i = 0; i < inputs.size(); ++i) {
    tasks.push_back(reduce_scatter_tensor_task(outputs[i], ins[i], opts.reduceOp, getSize()));
  }
  return on_engine("reduce_scatter_tensor_coalesced", opts, outputs, std::move(tasks));
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  RECORD_FUNCTION("ddpx::barrier", std::vector<c10::IValue>());
  if (!engine_) return on_gloo("barrier", gloo()->barrier(opts));
  return on_engine("barrier", opts, {}, {barrier_task()});
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors,
                                               const c10d::ReduceOptions& opts) {
  RECORD_FUNCTION("ddpx::reduce", std::vector<c10::IValue>());
  // gloo raises at the call for a list of other than one tensor, and reduces sparse ones.
  if (!engine_ || tensors.size() != 1 || tensors[0].layout() != at::kStrided) {
    return on_gloo("reduce", gloo()->reduce(tensors, opts));
  }
  const at::Tensor& t = tensors[0];
  const int root = int(opts.rootRank);
  const std::string why = root_error("reduce", opts.rootRank, opts.rootTensor, getSize());
  if (!why.empty()) refuse("reduce", why);
  // The all-reduce, whose result the other ranks drop: their tensors keep their values.
  const at::Tensor data = getRank() == root ? t : t.clone();
  return on_engine("reduce", opts, tensors, {all_reduce_task(data, opts.reduceOp, getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs,
                                               const c10d::GatherOptions& opts) {
  RECORD_FUNCTION("ddpx::gather", std::vector<c10::IValue>());
  const int root = int(opts.rootRank);
  if (!local() || !rooted_shape(inputs, outputs, root, getRank(), getSize())) {
    return on_gloo("gather", gloo()->gather(outputs, inputs, opts));
  }
  const std::vector<at::Tensor> list = getRank() == root ? outputs[0] : std::vector<at::Tensor>{};
  std::string why = getRank() == root ? list_error(list, inputs[0], getSize(), "gather", "outputs")
                                      : std::string();
  if (why.empty()) why = overlapping_parts(list, "gather", "outputs");
  if (!why.empty()) refuse("gather", why);
  return on_engine(
      "gather", opts, list,
      {rooted_task(inputs[0], list, root, true, "torch.distributed.gather", getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  RECORD_FUNCTION("ddpx::scatter", std::vector<c10::IValue>());
  const int root = int(opts.rootRank);
  if (!local() || !rooted_shape(outputs, inputs, root, getRank(), getSize())) {
    return on_gloo("scatter", gloo()->scatter(outputs, inputs, opts));
  }
  const std::vector<at::Tensor> list = getRank() == root ? inputs[0] : std::vector<at::Tensor>{};
  const std::string why =
      getRank() == root ? list_error(list, outputs[0], getSize(), "scatter", "inputs") : "";
  if (!why.empty()) refuse("scatter", why);
  return on_engine(
      "scatter", opts, outputs,
      {rooted_task(outputs[0], list, root, false, "torch.distributed.scatter", getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_splits,
                                                      std::vector<int64_t>& input_splits,
                                                      const c10d::AllToAllOptions& opts) {
  RECORD_FUNCTION("ddpx::all_to_all_single", std::vector<c10::IValue>());
  const bool equal = input_splits.empty() && output_splits.empty();
  if (!engine_ || input.scalar_type() != output.scalar_type() || (!local() && !equal)) {
    return on_gloo("all_to_all_single",
                   gloo()->alltoall_base(output, input, output_splits, input_splits, opts));
  }
  return on_engine(
      "all_to_all_single", opts, {output},
      {all_to_all_single_task(output, input, output_splits, input_splits, equal, getSize())});
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs,
                                                 std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  RECORD_FUNCTION("ddpx::all_to_all", std::vector<c10::IValue>());
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
    return on_gloo("all_to_all", gloo()->alltoall(outputs, inputs, opts));
  }
  return on_engine("all_to_all", opts, outputs,
                   {all_to_all_task(outputs, inputs, !local(), "torch.distributed.all_to_all")});
}

c10::intrusive_ptr<c10d::Work> Backend::point_to_point(const char* name,
                                                       std::vector<at::Tensor>& tensors, int peer,
                                                       int tag, bool is_send) {
  if (!p2p_) {
    auto inner = is_send ? gloo()->send(tensors, peer, tag)
                         : (peer < 0 ? gloo()->recvAnysource(tensors, tag)
                                     : gloo()->recv(tensors, peer, tag));
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
  RECORD_FUNCTION("ddpx::send", std::vector<c10::IValue>());
  return point_to_point("send", tensors, dst, tag, true);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  RECORD_FUNCTION("ddpx::recv", std::vector<c10::IValue>());
  return point_to_point("recv", tensors, src, tag, false);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  RECORD_FUNCTION("ddpx::recv", std::vector<c10::IValue>());
  return point_to_point("recv", tensors, -1, tag, false);
}

}  // namespace ddpx
