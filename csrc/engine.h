// The engines that reduce a tensor across a process group: the node's shared-memory all-reduce
// driven by a communication thread, or the process group's own all-reduce where shared memory
// cannot serve (ranks on several nodes, no room in /dev/shm). The fused hook and ddpx.all_reduce
// drive either one through this interface.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shm_allreduce.h"

namespace ddpx {

// The kernels' dtype for a torch dtype, or none for one ddpx does not reduce.
std::optional<DType> to_dtype(at::ScalarType t);

// The process group's single-tensor all-to-all (equal slices) and all-gather, under the names of
// the torch being built against. The default timeout is the group's own.
c10::intrusive_ptr<c10d::Work> all_to_all(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in,
                                          std::chrono::milliseconds timeout = c10d::kUnsetTimeout);
c10::intrusive_ptr<c10d::Work> all_gather(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in,
                                          std::chrono::milliseconds timeout = c10d::kUnsetTimeout);

struct Request {
  double scale = 1.0;                   // applied to every rank's input before the sum
  std::optional<at::ScalarType> wire;   // dtype in transit; the tensor's own when empty
  std::string what;                     // names the call in errors ("gradient bucket 3")
};

// What the engines reduce for tensor: a complex tensor as its real and imaginary parts (a view of
// twice the elements in the real dtype), any other tensor itself.
at::Tensor as_real(const at::Tensor& tensor);

// Why an engine for `device` tensors cannot reduce this tensor as requested, or "".
std::string invalid_input(const at::Tensor& tensor, const Request& request, c10::DeviceType device);

// The group's all-reduce of tensor with every rank's input scaled by `scale` (inside the
// reduction as a premultiplied sum with premul_sum, which NCCL has; else by a multiplication
// first). The future holds tensor.
c10::intrusive_ptr<c10::ivalue::Future> scaled_allreduce(
    c10d::ProcessGroup& group, at::Tensor tensor, double scale, bool premul_sum,
    std::chrono::milliseconds timeout = c10d::kUnsetTimeout);

class AcrossNodes;

class Engine {
 public:
  virtual ~Engine() = default;
  // Starts reducing tensor in place and returns at once; the future holds tensor when done.
  virtual c10::intrusive_ptr<c10::ivalue::Future> run_async(at::Tensor tensor, Request request) = 0;
  virtual void run(at::Tensor tensor, const Request& request) = 0;
  virtual std::string describe() const = 0;
};

// Makes engine the one torch.ops.ddpx operators use for `device` tensors on the process group
// named `group` (csrc/ops.cpp), for as long as it lives.
void publish_engine(const std::string& group, c10::DeviceType device,
                    const std::shared_ptr<Engine>& engine);

class ShmEngine final : public Engine {
 public:
  // With across_nodes (process groups of the ranks of this local index on every node, a
  // dealing and a gathering one per lane), each rank's slices are summed across nodes between
  // the node's two phases, in chunks of about chunk_bytes of the message, in the wire dtype when
  // compressed; every transfer fails after `timeout`, or as soon as a rank of the job puts why
  // it gave up under `abort_key` in `store` (which this rank does when it gives up).
  explicit ShmEngine(std::unique_ptr<ShmAllreduce> shm,
                     std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> across_nodes = {},
                     std::chrono::milliseconds timeout = {}, size_t chunk_bytes = 0,
                     c10::intrusive_ptr<c10d::Store> store = {}, std::string abort_key = {});
  ~ShmEngine() override;

  c10::intrusive_ptr<c10::ivalue::Future> run_async(at::Tensor tensor, Request request) override;
  // Runs on the calling thread once every earlier asynchronous call has finished.
  void run(at::Tensor tensor, const Request& request) override;
  void run(const std::function<void(ShmAllreduce&)>& op);
  // Runs op on the communication thread after every earlier call; the future, of `type`, holds
  // what op returns, or its error.
  using Op = std::function<c10::IValue(ShmAllreduce&)>;
  c10::intrusive_ptr<c10::ivalue::Future> submit(Op op, c10::TypePtr type);
  std::string describe() const override;
  // Finishes the queued work and joins the communication thread; later calls raise.
  void shutdown();
  // Bytes this rank has sent to other nodes so far, counted as a bandwidth-optimal collective
  // sends them: 2(N-1)/N of the data for an all-reduce over N nodes, (N-1)/N for an all-to-all or
  // an all-gather. Zero on a single node.
  uint64_t bytes_across_nodes() const;
  ShmAllreduce::WaitStats wait_stats() const { return queue_->shm->wait_stats(); }
  ShmAllreduce& shm() { return *queue_->shm; }

 private:
  // What the communication thread shares with the engine; it outlives the engine when the last
  // reference to the engine is dropped on that thread (in a future's callback).
  struct Queue {
    struct Job {
      Op op;
      c10::intrusive_ptr<c10::ivalue::Future> future;
    };
    std::unique_ptr<ShmAllreduce> shm;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> jobs;
    bool busy = false;
    bool stopping = false;
  };

  static void execute(ShmAllreduce& shm, const at::Tensor& tensor, const Request& request);
  static void worker_loop(const std::shared_ptr<Queue>& queue);

  std::shared_ptr<Queue> queue_;
  std::thread worker_;
  std::shared_ptr<AcrossNodes> across_nodes_;
};

class ProcessGroupEngine final : public Engine {
 public:
  ProcessGroupEngine(c10::intrusive_ptr<c10d::ProcessGroup> group, std::string reason);

  c10::intrusive_ptr<c10::ivalue::Future> run_async(at::Tensor tensor, Request request) override;
  void run(at::Tensor tensor, const Request& request) override;
  std::string describe() const override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::string reason_;
};

}  // namespace ddpx
