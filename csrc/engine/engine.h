// The engines that reduce a tensor across a process group, and the one front door into the node's
// collectives: the shared-memory engine, whose communication thread runs every collective of the
// group (the hook's, ddpx.all_reduce's and the ddpx backend's) on the node communicator, in order;
// or the process group's own all-reduce where shared memory cannot serve (no room in /dev/shm,
// ranks that cannot share memory). The fused hook and ddpx.all_reduce drive either one through
// this interface.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "../collectives/node_comm.h"
#include "../cross_node/cross_node.h"
#include "request.h"

namespace ddpx {

// The group's all-reduce of tensor with every rank's input scaled by `scale` (inside the
// reduction as a premultiplied sum with premul_sum, which NCCL has; else by a multiplication
// first). The future holds tensor; for a CUDA tensor it is a CUDA future (on every backend), so
// that waiting for it orders the waiter's stream after the sum. If the group's all-reduce fails,
// the future fails with a DistBackendError of `failure` (what failed, on which path), then the
// group's error.
c10::intrusive_ptr<c10::ivalue::Future> scaled_allreduce(c10d::ProcessGroup& group,
                                                         at::Tensor tensor, double scale,
                                                         bool premul_sum, std::string failure);

// The all-reduce of a tensor on the node, whoever asks: the input checked (invalid_input: a rank's
// invalid input is rejected, so every rank's call raises it), the wire dtype decided (wire_dtype)
// and the sum run, in place.
void all_reduce(NodeComm& comm, const at::Tensor& tensor, const Request& request);

class Engine {
 public:
  virtual ~Engine() = default;
  // Starts reducing tensor in place and returns at once; the future holds tensor when done.
  // Where a tensor goes is decided here, for the hooks, ddpx.all_reduce and torch.ops.ddpx alike:
  // a sparse COO tensor to the all-reduce of the engine's process group (set_group), in its own
  // dtype, as DDP's default sends sparse gradients (gloo sums sparse tensors; ddpx's engines
  // reduce dense ones); every other tensor to the engine's own path.
  c10::intrusive_ptr<c10::ivalue::Future> run_async(at::Tensor tensor, Request request);
  // The same, returning once tensor is reduced (a CUDA one: once the current stream waits for it).
  void run(at::Tensor tensor, const Request& request);
  // The process group whose tensors the engine reduces, for its sparse ones: set by engine_for
  // (ddpx/engine.py) for every engine it hands out. By name, resolved in c10d's registry when a
  // sparse tensor comes: a group of ddpx's backend holds its engine, which must not hold it back,
  // and under torch.compile's tracing engine_for sees a stand-in for the group, not the group.
  void set_group(std::string group_name);
  virtual std::string describe() const = 0;
  // What every local rank was doing: its last calls, its queue, what it waits for
  // (ShmChannel::flight_record); an engine without one says so.
  virtual std::string flight_record() const;
  // Whether all-reduces of tensors in the ranks' arenas (arena.h) copy nothing in or out here.
  virtual bool serves_arena() const { return false; }
  // Finishes the queued work and stops the engine's threads, if it has any; later calls raise.
  virtual void shutdown() {}

 protected:
  // The engine's own path, for dense tensors: run_async's and run's.
  virtual c10::intrusive_ptr<c10::ivalue::Future> reduce_async(at::Tensor tensor,
                                                               Request request) = 0;
  virtual void reduce(at::Tensor tensor, const Request& request) = 0;

 private:
  // The group that sums a sparse tensor for request; raises where there is none, or where the
  // request asks for compression it cannot drop.
  c10::intrusive_ptr<c10d::ProcessGroup> sparse_group(const Request& request) const;

  mutable std::mutex group_mu_;
  std::string group_name_;
};

// Makes engine the one torch.ops.ddpx operators use for `device` tensors on the process group
// named `group` (csrc/torch_api/ops.cpp), for as long as it lives.
void publish_engine(const std::string& group, c10::DeviceType device,
                    const std::shared_ptr<Engine>& engine);

class ShmEngine final : public Engine {
 public:
  // With a cross-node link, the collectives are hierarchical (NodeComm::set_cross_node):
  // an all-reduce's slices cross in chunks of about chunk_bytes of the message, in the wire
  // dtype when compressed; node_ranks are the group ranks of each node's local ranks.
  explicit ShmEngine(std::unique_ptr<NodeComm> comm, std::shared_ptr<CrossNode> cross_node = {},
                     size_t chunk_bytes = 0, std::vector<int> node_ranks = {});
  ~ShmEngine() override;

  using Engine::run;
  // Runs op on the calling thread once every earlier asynchronous call has finished.
  void run(const std::function<void(NodeComm&)>& op);
  // Runs op on the communication thread after every earlier call; the future, of `type`, holds
  // what op returns, or its error.
  using Op = std::function<c10::IValue(NodeComm&)>;
  c10::intrusive_ptr<c10::ivalue::Future> submit(Op op, c10::TypePtr type);
  std::string describe() const override;
  std::string flight_record() const override;
  bool serves_arena() const override;
  // Stops the communication thread once its current job ends and releases the communicator:
  // its helper threads, the segment's mapping and the link to other nodes with its threads.
  // Every call after raises.
  void shutdown() override;
  // ProcessGroup.abort(), from any thread: the call in flight and every queued and later one
  // raise why, on this rank and, within the node, its peers (ShmChannel::abort).
  void abort(const std::string& why);
  // The communication thread runs task when it has no collective to run, and in its waits for
  // the link (idle_work.h); after shutdown, ATen's inter-op threads do.
  void when_idle(std::function<void()> task);
  // Bytes this rank has sent to other nodes so far (CrossNode::bytes_sent); zero on one node.
  uint64_t cross_node_bytes() const;
  ShmChannel::WaitStats wait_stats() const { return comm().channel().wait_stats(); }
  // The communicator, for its settings and for set-up; collectives go through run and submit.
  // Raises once the engine is shut down.
  NodeComm& comm();
  const NodeComm& comm() const;
  // Where the node's slots lie on its NUMA nodes, in words (ddpx/_numa.py), for describe().
  void set_numa(std::string numa) { numa_ = std::move(numa); }
  const std::string& numa() const { return numa_; }

 protected:
  c10::intrusive_ptr<c10::ivalue::Future> reduce_async(at::Tensor tensor, Request request) override;
  // Runs on the calling thread once every earlier asynchronous call has finished.
  void reduce(at::Tensor tensor, const Request& request) override;

 private:
  // What the communication thread shares with the engine; it outlives the engine when the last
  // reference to the engine is dropped on that thread (in a future's callback).
  struct Queue {
    struct Job {
      Op op;
      c10::intrusive_ptr<c10::ivalue::Future> future;
    };
    std::unique_ptr<NodeComm> comm;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> jobs;
    std::deque<std::function<void()>> idle;  // when_idle's tasks
    bool busy = false;
    bool stopping = false;
  };

  static void worker_loop(const std::shared_ptr<Queue>& queue);
  // Runs the oldest idle task, if any, on the calling thread; says whether there was one.
  static bool run_idle_task(Queue& q);

  std::shared_ptr<Queue> queue_;
  std::thread worker_;
  std::shared_ptr<CrossNode> cross_node_;
  std::string numa_;
};

class ProcessGroupEngine final : public Engine {
 public:
  ProcessGroupEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string reason);

  std::string describe() const override;

 protected:
  c10::intrusive_ptr<c10::ivalue::Future> reduce_async(at::Tensor tensor, Request request) override;
  void reduce(at::Tensor tensor, const Request& request) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string reason_;
};

}  // namespace ddpx
