// The collectives of the ranks of one node over a shared-memory channel (shm_channel.h), and the
// hierarchical collectives that add a link across nodes.
//
// An all-reduce goes through one of three schedules. One-shot: every rank sums every block (one
// synchronisation per step). Two-phase: each rank sums its slice of a block into a shared float32
// output slot, and all copy the whole result out, in narrow blocks, which stay in the cache, or
// in wide ones, which need fewer synchronisations (on a busy machine each can cost a peer's time
// slice). All sum the ranks in rank order in float32, so every rank gets the same bits, whichever
// schedule ran. By default messages up to one_shot_bytes go one-shot and larger ones in narrow
// two-phase steps; with timed steps local rank 0 times the schedules per size class as the job
// runs and picks for all (shm_schedules.cpp). Across nodes (shm_hierarchical.cpp) the node's
// two phases frame a cross-node sum of each rank's slices.
//
// The files: shm_allreduce.cpp (calls and their agreement, the one-node all-reduce),
// shm_schedules.cpp, shm_hierarchical.cpp, shm_collectives.cpp (all-gather, broadcast,
// reduce-scatter, barrier, all-to-all), shm_hierarchical_collectives.cpp (those across nodes).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"
#include "shm_channel.h"

namespace ddpx {

class CrossNode;  // cross_node.h

class ShmAllreduce {
 public:
  // ranks[i] is the process-group rank of local rank i, used in error messages. The creator of the
  // segment passes initialize=true before anyone else attaches.
  ShmAllreduce(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
               std::vector<int> ranks, size_t one_shot_bytes, std::chrono::milliseconds timeout,
               bool initialize);

  // data[i] = sum over ranks of wire(data_r[i] * scale), accumulated in float (double for
  // float64) and written back in data's dtype. Blocking; what names the call in error messages.
  void allreduce(void* data, DType dtype, int64_t numel, DType wire, double scale,
                 const std::string& what);

  // The collectives that move bytes or sum slices. Each is checked against the other ranks'
  // call like allreduce. On one node each goes through in blocks, one synchronisation per block;
  // across nodes, see shm_hierarchical_collectives.cpp. Ranks are the group's: outs and ins hold
  // group_size() pointers, root is a group rank. allgather: every rank's `bytes` bytes of in land
  // at outs[rank] on every rank (in may be outs[me]). broadcast: rank root's data lands in every
  // rank's. reduce_scatter: out (count elements) = the sum over ranks of their ins[me], each
  // scaled and rounded into wire, summed in float (double for float64) and rounded into dtype,
  // in rank order on one node, within each node then over the nodes in node order across nodes.
  // barrier: returns once every rank has called it. torch_dtype: the c10::ScalarType of the
  // tensors whose bytes allgather, broadcast and alltoall move, which the ranks check as they do
  // the sizes.
  void allgather(const void* in, size_t bytes, int32_t torch_dtype, void* const* outs,
                 const std::string& what);
  void broadcast(void* data, size_t bytes, int32_t torch_dtype, int root, const std::string& what);
  void reduce_scatter(const void* const* ins, void* out, DType dtype, DType wire, int64_t count,
                      double scale, const std::string& what);
  void barrier(const std::string& what);
  // alltoall: this rank's ins[r] (sends[r] bytes) goes to rank r, and outs[r] (receives[r]
  // bytes) receives rank r's part for this rank. longest, the largest part any rank sends, must
  // be the same on every rank (the ranks check it): it sets the steps. Across nodes every part
  // must be `longest` bytes.
  void alltoall(const void* const* ins, const size_t* sends, void* const* outs,
                const size_t* receives, size_t longest, int32_t torch_dtype,
                const std::string& what);
  bool spans_nodes() const { return cross_node_ != nullptr; }
  // The group: every node's ranks, this one's place among them.
  int group_size() const;
  int group_rank() const;

  // The largest message (in the wire dtype) that may go one-shot: with fixed steps, every one up
  // to it does; with timed steps, those up to kOneShotAlways do, and the size classes above it
  // that lie wholly under it are timed one-shot too. Every rank of the node must set the same
  // value, between calls.
  size_t one_shot_bytes() const { return one_shot_bytes_.load(std::memory_order_relaxed); }
  void set_one_shot_bytes(size_t bytes) { one_shot_bytes_.store(bytes, std::memory_order_relaxed); }

  // Makes the collectives hierarchical. The all-reduce: intra-node reduce-scatter of a block, a
  // cross-node all-reduce of this rank's slice of it, intra-node all-gather. Slices cross in
  // chunks of about chunk_bytes of the message, pipelined: while chunks cross, the node
  // reduce-scatters the next and all-gathers the ones that are back. Each call is also checked
  // against the other nodes' before any data crosses. node_ranks: the group rank of each node's
  // local ranks, node by node.
  void set_cross_node(std::shared_ptr<CrossNode> cross_node, size_t chunk_bytes,
                      std::vector<int> node_ranks);

  // How the all-reduce picks its schedule: in narrow (the default) or wide steps, one-shot up
  // to one_shot_bytes, or timed (by local rank 0, see time_schedule). Every rank must set the
  // same, between calls.
  // Shared: messages over the one-shot sizes go in blocks any rank sums for all
  // (ShmChannel::claim_block), once every rank can reach its peers' memory, in narrow steps
  // where they cannot. Auto (the default): shared while the machine is busy (a rank of the node
  // waited for its CPU a tenth of the time within kBusyWindow), narrow otherwise, which an idle
  // machine runs faster (docs/under-load.md).
  enum class Steps { Timed, Narrow, Wide, Shared, Auto };
  static constexpr std::chrono::milliseconds kBusyWindow{1000};
  // Below this, one synchronisation costs more than any schedule saves: timed steps go one-shot.
  static constexpr size_t kOneShotAlways = size_t(32) << 10;
  void set_steps(Steps steps) { steps_.store(steps, std::memory_order_relaxed); }
  Steps steps() const { return steps_.load(std::memory_order_relaxed); }
  // Which sizes the next all-reduce calls go in wide steps and one-shot for, as "a-b KiB" ranges.
  std::string wide_sizes() const;
  std::string one_shot_sizes() const;
  // Whether this call went shared (the last call, between calls).
  bool shared_now() const { return shared_now_.load(std::memory_order_relaxed); }
  // Messages up to this size go one-shot whatever else is chosen.
  size_t always_one_shot_bytes() const;

  // Takes part in the next call without data: every rank's call raises, naming this rank and
  // reason, and the engine stays in step. For input one rank finds invalid before the exchange.
  void reject(const std::string& reason, const std::string& what);

  using WaitStats = ShmChannel::WaitStats;
  const ShmChannel& channel() const { return channel_; }
  WaitStats wait_stats() const { return channel_.wait_stats(); }
  std::string wait_policy() const { return channel_.wait_policy(); }
  // Bounds the waits of the calls made until it is reset (zero: the engine's own timeout).
  void set_call_timeout(std::chrono::milliseconds timeout) { channel_.set_call_timeout(timeout); }

  int local_size() const { return channel_.size(); }
  int local_rank() const { return channel_.me(); }
  size_t block_bytes() const { return channel_.layout().block_bytes; }
  size_t wide_bytes() const { return channel_.layout().wide_bytes; }

 private:
  using Phase = ShmChannel::Phase;
  using Clock = ShmChannel::Clock;
  enum class Collective : int32_t { AllReduce, AllGather, Broadcast, ReduceScatter, AllToAll };
  // Results at least this large go out with streaming stores: they would not stay in the cache.
  static constexpr size_t kStreamBytes = size_t(8) << 20;

  // One all-reduce's blocks: the tensor's, in the dtype it is reduced in, and this rank's slice
  // of each, which it sums for the node in the two-phase schedules.
  struct Blocks {
    char* data;
    DType dtype, wire, acc;       // acc: the dtype of the sums, float32 (float64 for float64)
    int64_t numel, per_block, n;  // n: how many blocks
    size_t data_size, wire_size, acc_size;
    int ranks, me;
    int64_t elements(int64_t b) const {  // in block b
      return std::max<int64_t>(0, std::min(per_block, numel - b * per_block));
    }
    char* at(int64_t b) const { return data + size_t(b * per_block) * data_size; }
    // This rank's slice [lo, hi) of a block of n elements. Slices are whole cache lines, so no
    // two ranks write the same line of the output slot.
    std::pair<int64_t, int64_t> slice(int64_t n) const;
  };
  // What an all-reduce does at every block: the blocks, the call's description, and how.
  struct AllreduceCall {
    Blocks blocks;
    CallMeta meta;
    double scale;
    bool wide;              // wide steps
    bool own_slice_direct;  // see allreduce
    Store out_store;
    const std::string& what;
    Clock::duration skew{};  // the wait for the ranks to arrive at the first step
  };
  // Puts block b into this rank's input slot (less its own slice, when read in place), waits for
  // every peer's, and at the first block checks the call against the peers' (and nodes');
  // returns the block's step.
  uint64_t arrive(AllreduceCall& call, int64_t b);
  // Sums this rank's slice [lo, hi) of block b over the ranks into out, in the accumulation dtype.
  void sum_slice(const AllreduceCall& call, uint64_t step, int64_t b, int64_t lo, int64_t hi,
                 void* out);
  // Publishes this rank's slice of the output slot, waits for the others', copies the block out.
  void copy_out(const AllreduceCall& call, uint64_t step, int64_t b);
  void allreduce_in_node(AllreduceCall& call, bool one_shot);
  // The shared schedule: blocks claimed by whichever rank gets there first, each summed by its
  // claimer straight from every rank's tensor into every rank's tensor.
  void allreduce_shared(AllreduceCall& call);
  void sum_block_for_all(const AllreduceCall& call, uint64_t step, int64_t b);
  // A shared call's blocks: narrow ones, smaller for messages of less than two per rank.
  static constexpr size_t kMinSharedBlock = size_t(16) << 10;
  size_t shared_block_bytes(size_t bytes) const;
  void allreduce_across_nodes(AllreduceCall& call);

  // Raises if an earlier call failed here or on a peer; then the call may start.
  void begin_call();
  // Starts the next step of a node-local call: fill writes this rank's block into its input
  // slot, then every peer's is awaited; a call's first step also checks that the ranks agree.
  uint64_t exchange(const CallMeta& mine, bool first, const std::function<void(char*)>& fill,
                    const std::string& what);
  // The node-local steps of the collectives; first: the first step checks the call (mine).
  // allgather's place(r, lo, from, count) puts bytes [lo, lo + count) of rank r's in, at from.
  using Place = std::function<void(int r, size_t lo, const char* from, size_t count)>;
  void allgather_in_node(const CallMeta& mine, bool first, const void* in, size_t bytes,
                         const Place& place, const std::string& what);
  void broadcast_in_node(const CallMeta& mine, bool first, void* data, size_t bytes, int root,
                         const std::string& what);
  void reduce_scatter_in_node(const CallMeta& mine, bool first, const void* const* ins, DType dtype,
                              void* out, DType out_dtype, DType wire, int64_t count, double scale,
                              const std::string& what);
  // Across nodes (shm_hierarchical_collectives.cpp).
  CallMeta checked_across_nodes(Collective op, int64_t numel, int32_t dtype, int32_t wire,
                                double scale, int root, int32_t torch_dtype,
                                const std::string& what);
  void allgather_across_nodes(const void* in, size_t bytes, int32_t torch_dtype, void* const* outs,
                              const std::string& what);
  void broadcast_across_nodes(void* data, size_t bytes, int32_t torch_dtype, int root,
                              const std::string& what);
  void alltoall_in_node(const CallMeta& mine, bool first, const void* const* ins,
                        const size_t* sends, void* const* outs, const size_t* receives,
                        size_t longest, const std::string& what);
  void alltoall_across_nodes(const void* const* ins, void* const* outs, size_t bytes,
                             int32_t torch_dtype, const std::string& what);
  void reduce_scatter_across_nodes(const void* const* ins, void* out, DType dtype, DType wire,
                                   int64_t count, double scale, const std::string& what);
  // Runs a transfer between the nodes; its failure fails the engine, on every rank, as "the
  // <kind> across nodes of <what> failed".
  void across(const char* kind, const std::string& what, const std::function<void()>& transfer);
  char* lane_buffer(size_t bytes);
  CallMeta local_call(Collective op, int64_t numel, int32_t dtype, double scale, int root,
                      const std::string& what, int32_t torch_dtype = -1);
  static std::string describe_call(const CallMeta& m);
  void check_peers_agree(const CallMeta& mine, const std::string& what);
  // Checks a call's first step against the peers' and, across nodes, starts its trade with the
  // other nodes (finish_node_check ends it): raises on every rank where the ranks disagree.
  void check_call(const CallMeta& mine, const std::string& what);
  // Hierarchical only: sends this call's description and the node's verdict on it (ok: the
  // node's ranks agree) to the other nodes; the finish raises on every rank if any node found a
  // problem (local_error: this node's) or the nodes disagree. Every rank trades once per call, so
  // all stay in step whatever went wrong where; the trade overlaps the node's own summing.
  static std::vector<int64_t> node_words(const CallMeta& m, bool ok);
  void start_node_check(const CallMeta& mine, bool ok, const std::string& what);
  [[noreturn]] void fail_node_check(const std::string& what, const std::exception& e);
  void finish_node_check(const CallMeta& mine, const std::string& local_error,
                         const std::string& what);
  // The schedules local rank 0 times. Size class k holds the all-reduces of (2^k, 2^(k+1)]
  // bytes in the wire dtype; a schedule mask has bit k of its low word set when class k goes
  // wide, of its high word when it goes one-shot, neither for narrow two-phase steps.
  // kShared is not timed: it comes after the timed ones, out of ScheduleTimes' arrays.
  enum Schedule { kNarrow, kWide, kOneShot, kSchedules, kShared = kSchedules };
  static constexpr int kClasses = 32;
  static int size_class(size_t bytes);
  // Whether schedule s may serve every size of class k here; a class is timed when two can.
  bool may_run(int k, Schedule s) const;
  int timed_class(size_t bytes) const;  // -1 when the size is not timed
  static Schedule scheduled(uint64_t mask, int k);
  // The schedule of an all-reduce of this many bytes in the wire dtype; timed: its class, or -1.
  Schedule schedule_for(size_t bytes, int timed) const;
  // A call's description, with local rank 0's choice of schedules for the calls after it.
  // torch_dtype: the tensors' c10::ScalarType where the collective moves bytes.
  CallMeta call_meta(Collective op, int64_t numel, int32_t dtype, int32_t wire, double scale,
                     int root, int32_t torch_dtype = -1);
  // Every rank reads local rank 0's choice after a call's first step, whatever the call.
  void agree_on_schedules(uint64_t first_step);
  // Local rank 0 only: counts a call's time and chooses its class's schedule for the calls after.
  void time_schedule(int k, Schedule ran, size_t bytes, Clock::duration took);

  ShmChannel channel_;
  std::atomic<size_t> one_shot_bytes_;
  uint64_t step_ = 0;
  uint64_t calls_ = 0;
  std::shared_ptr<CrossNode> cross_node_;
  size_t chunk_bytes_ = 0;
  std::vector<int> node_ranks_;
  std::vector<char> lane_buffer_;  // what a collective other than the all-reduce trades across
  // This rank's slices summed within the node, then across nodes; shared with the transfers.
  std::shared_ptr<std::vector<char>> node_sums_;
  std::atomic<Steps> steps_{Steps::Auto};
  // This call's, agreed at the previous call's first step; describe() reads it between calls.
  std::atomic<uint64_t> schedules_{0};
  uint64_t agreed_ = 0;  // local rank 0's mask, read at this call's first step
  uint64_t chosen_ = 0;  // local rank 0's own choice, published with each call
  // Whether the all-reduces over the one-shot sizes go shared: local rank 0's choice, published
  // with each call; the one agreed at this call's first step; this call's, for describe().
  uint32_t chosen_shared_ = 0;
  uint32_t agreed_shared_ = 0;
  std::atomic<bool> shared_now_{false};
  bool probed_ = false;
  uint64_t shared_blocks_ = 0;        // the blocks of the shared calls so far
  std::vector<char> shared_scratch_;  // the peers' blocks as the claimer reads them
  // Local rank 0's measurements per class: for each schedule, a moving average of the time per
  // byte since its last trial began, and how many calls it counted; which ran last, how many
  // calls in a row, and how many trials of a slower one there were.
  struct ScheduleTimes {
    double ns_per_byte[kSchedules] = {};
    uint32_t timed[kSchedules] = {};
    Schedule last = kNarrow;
    uint32_t run = 0;
    uint32_t trials = 0;
  };
  ScheduleTimes times_[kClasses];
};

}  // namespace ddpx
