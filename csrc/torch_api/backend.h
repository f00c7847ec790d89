// ddpx as a torch.distributed backend for CPU tensors ("ddpx", "cpu:ddpx,cuda:nccl"): the
// collectives that sum or move a group's tensors run on the node's shared-memory engine
// (hierarchically, on a job of several nodes), sends and receives on the node's point-to-point
// rings, and what neither serves (across nodes all-to-all, gather, scatter and point-to-point)
// goes to an inner gloo backend of the same ranks.
//
// In a torch.profiler trace each call shows as a range named after the torch.distributed call
// ("ddpx::all_reduce") on the caller's thread, and the engine's run of it as "ddpx::all_reduce
// (engine)": on the engine's thread for an async call, within the call's range for one that waits.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../collectives/shm_p2p.h"
#include "../common/torch_compat.h"
#include "../engine/engine.h"
#include "backend_tasks.h"

namespace ddpx {

class Backend final : public c10d::Backend {
 public:
  // engine is null where shared memory cannot serve the group (why_not says why): then every
  // collective goes to gloo.
  Backend(int rank, int size, std::chrono::milliseconds timeout,
          c10::intrusive_ptr<c10d::Backend> gloo, std::shared_ptr<ShmEngine> engine,
          std::string why_not);

  const std::string getBackendName() const override { return "ddpx"; }
  // The group's options as init_process_group and new_group gave them (its timeout above all),
  // which torch.distributed and ddpx's own hook read from a group's backend (torch declares
  // getBackendOptions from 2.9 on; Python reads `options` on any torch).
  c10::intrusive_ptr<Options> options() const;
  // The timeout of the calls that give none of their own from now on (torch.distributed's
  // _set_pg_timeout), on the engine and the inner gloo.
  void set_timeout(std::chrono::milliseconds timeout);
#if DDPX_TORCH_AT_LEAST_2_9
  c10::intrusive_ptr<Options> getBackendOptions() override { return options(); }
#endif
  bool supportsCoalescing() const override { return true; }
#if DDPX_TORCH_AT_LEAST_2_9
  // Communication memory (DDP's buckets, FSDP2's buffers) in the process's arena (arena.h), where
  // the group lies on one node: collectives on it copy nothing in or out.
  bool supportsTensorAlloc(c10::DeviceIndex device) override;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
#endif
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // One number per call of the backend, the same on every rank while the ranks make the same
  // calls: TORCH_DISTRIBUTED_DEBUG=DETAIL checks it across ranks before each collective.
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  // Which path serves this group, and how many calls of each collective each path took.
  enum class Route { kEngine, kGloo };
  struct RouteCounts {
    uint64_t engine = 0;
    uint64_t gloo = 0;
  };
  std::string describe() const;
  std::map<std::string, RouteCounts> routes() const;
  const std::shared_ptr<ShmEngine>& engine() const { return engine_; }

  // ProcessGroup.abort() (torchft's, a watchdog's), from any thread: the engine's call in flight
  // and every later one raise on this rank and on its peers of the node, as do point-to-point's
  // pending sends and receives. The inner gloo has no abort: a call blocked there ends at its
  // timeout.
  void abort() override;
  // destroy_process_group(): the engine's and point-to-point's threads stop, the segment is
  // unmapped, the inner gloo (and its threads) dropped; every call after raises.
  void shutdown() override;
  const std::string& why_not() const { return why_not_; }

 private:
  // Runs tasks in order on the engine's thread (on this one once the engine is idle, for a
  // caller that waits at once: !async); the work completes with outputs after the last.
  c10::intrusive_ptr<c10d::Work> on_engine(const char* name, bool async,
                                           std::chrono::milliseconds timeout,
                                           std::vector<at::Tensor> outputs,
                                           std::vector<Task> tasks);
  // The same, with the call's options: their asyncOp, and their timeout (kUnsetTimeout: the
  // group's) for every wait of the tasks.
  template <class Options>
  c10::intrusive_ptr<c10d::Work> on_engine(const char* name, const Options& opts,
                                           std::vector<at::Tensor> outputs,
                                           std::vector<Task> tasks) {
    return on_engine(name, opts.asyncOp, opts.timeout, std::move(outputs), std::move(tasks));
  }
  c10::intrusive_ptr<c10d::Work> on_gloo(const char* name, c10::intrusive_ptr<c10d::Work> work);
  // The inner gloo; raises once the backend is shut down.
  const c10::intrusive_ptr<c10d::Backend>& gloo() const;
  // A call this rank's own tensors make impossible: raises why here, on the caller's thread, and
  // rejects the collective on the engine so that the peers' calls of it raise too.
  [[noreturn]] void refuse(const char* name, const std::string& why);
  // A send or receive: on the rings for a group on one node, else on gloo.
  c10::intrusive_ptr<c10d::Work> point_to_point(const char* name, std::vector<at::Tensor>& tensors,
                                                int peer, int tag, bool is_send);
  void count(const char* name, Route route);
  bool local() const { return engine_ && !engine_->comm().spans_nodes(); }

  std::atomic<std::chrono::milliseconds> timeout_;
  c10::intrusive_ptr<c10d::Backend> gloo_;
  std::shared_ptr<ShmEngine> engine_;
  std::unique_ptr<ShmPointToPoint> p2p_;  // after engine_: its rings are in the engine's segment
  std::string why_not_;
  mutable std::mutex mu_;
  std::map<std::string, RouteCounts> routes_;
  uint64_t sequence_ = 0;
  bool coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_;
};

}  // namespace ddpx
