// The node communicator: what every collective of ddpx's engine goes through, within a node and,
// with a cross-node link, across nodes. It numbers the calls and the steps, checks each call
// against the peers' (and the other nodes') before any data moves, lets a rank reject its input
// so that every rank's call raises, and turns a failed transfer between nodes into an error on
// every rank. The collectives themselves are free functions over it (collectives.h), one file
// each, which open each call through opening.h, where how its data moves is chosen; the
// all-reduce's choice of schedule is one object it holds (schedule.h).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "../kernels/kernels.h"
#include "../node/shm_channel.h"
#include "../node/workers.h"
#include "schedule.h"

namespace ddpx {

class CrossNode;  // cross_node.h

// What a call's description names as its collective (CallMeta::op).
enum class Collective : int32_t {
  AllReduce,
  AllGather,
  Broadcast,
  ReduceScatter,
  AllToAll,
  Barrier
};

// Results at least this large go out with streaming stores: they would not stay in the cache.
constexpr size_t kStreamBytes = size_t(8) << 20;

// The end of a call whose last chunks are still crossing nodes when it returns (allreduce.cpp):
// run once they are handed out, with their failure if they fail.
using CallEnd = std::function<void(std::exception_ptr)>;

// An all-reduce's chunk that is crossing nodes, to be handed out to the node's ranks once it is
// back: hand_out waits for it and copies it out; end, where set, ends its call.
struct InFlight {
  std::function<void()> hand_out;
  CallEnd end;
};

// What the collectives keep from one call to the next.
struct CallBuffers {
  uint64_t shared_blocks = 0;  // the blocks of the all-reduce's shared calls so far
  // Buffers for an all-reduce's slices summed within the node, then across nodes: one no
  // transfer holds any more (whose only owner is this), at least `bytes` long.
  std::shared_ptr<std::vector<char>> node_sums(size_t bytes);
  // What a collective other than the all-reduce trades across nodes, grown as needed.
  char* lanes(size_t bytes) {
    if (lanes_.size() < bytes) lanes_.resize(bytes);
    return lanes_.data();
  }

 private:
  std::vector<std::shared_ptr<std::vector<char>>> node_sums_;
  std::vector<char> lanes_;
};

class NodeComm {
 public:
  // ranks[i] is the process-group rank of local rank i, used in error messages. The creator of the
  // segment passes initialize=true before anyone else attaches.
  NodeComm(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
           std::vector<int> ranks, size_t one_shot_bytes, std::chrono::milliseconds timeout,
           bool initialize);
  ~NodeComm();
  NodeComm(const NodeComm&) = delete;
  NodeComm& operator=(const NodeComm&) = delete;

  // Makes the collectives hierarchical: each call is also checked against the other nodes' before
  // any data crosses, and the all-reduce's slices cross in chunks of about chunk_bytes of the
  // message. node_ranks: the group rank of each node's local ranks, node by node.
  void set_cross_node(std::shared_ptr<CrossNode> cross_node, size_t chunk_bytes,
                      std::vector<int> node_ranks);
  bool spans_nodes() const { return cross_node_ != nullptr; }
  CrossNode& cross_node() const { return *cross_node_; }
  size_t chunk_bytes() const { return chunk_bytes_; }
  const std::vector<int>& node_ranks() const { return node_ranks_; }
  // The group: every node's ranks, this one's place among them.
  int group_size() const;
  int group_rank() const;

  // The node's ranks and the channel's slots and waits, as the collectives use them.
  int local_ranks() const { return channel_.size(); }
  int local_rank() const { return channel_.me(); }
  const ShmLayout& layout() const { return channel_.layout(); }
  char* input_slot(int rank, uint64_t step) const { return channel_.input_slot(rank, step); }
  char* output_slot(uint64_t step) const { return channel_.output_slot(step); }
  void publish(ShmChannel::Phase phase, uint64_t step) { channel_.publish(phase, step); }
  void wait_all(ShmChannel::Phase phase, uint64_t step, const std::string& what,
                bool wide = false) {
    channel_.wait_all(phase, step, what, wide);
  }
  bool claim_block(uint64_t end, uint64_t* block) { return channel_.claim_block(end, block); }
  void block_done(uint64_t end) { channel_.block_done(end); }
  void wait_blocks_done(uint64_t end, const std::string& what) {
    channel_.wait_blocks_done(end, what);
  }
  // The channel itself, for the engine's reports and the call's opening (opening.h).
  ShmChannel& channel() { return channel_; }
  const ShmChannel& channel() const { return channel_; }
  const PeerMemory& peer_memory() const { return memory_; }
  ScheduleChoice& schedule() { return schedule_; }
  const ScheduleChoice& schedule() const { return schedule_; }
  CallBuffers& buffers() { return buffers_; }
  // The threads that share a large call's blocks: this one and the helpers, with their scratch.
  // Resized only between calls.
  void set_threads(int threads);
  Workers& workers() { return workers_; }
  const Workers& workers() const { return workers_; }
  int threads() const { return workers_.threads(); }
  // How many threads a call that moves this many bytes runs on: the rank's from
  // ScheduleChoice::kThreadedBytes, one below.
  int threads_for(size_t bytes) const {
    return bytes >= ScheduleChoice::kThreadedBytes ? threads() : 1;
  }
  // The collectives so far that read every peer's tensor where it lay in its arena.
  uint64_t zero_copy_calls() const { return zero_copy_calls_.load(std::memory_order_relaxed); }
  void count_zero_copy() { zero_copy_calls_.fetch_add(1, std::memory_order_relaxed); }
  // Bounds the waits of the calls made until it is reset (zero: the engine's own timeout).
  void set_call_timeout(std::chrono::milliseconds timeout) { channel_.set_call_timeout(timeout); }

  // Starts a call: raises if an earlier one failed here or on a peer, and returns this rank's
  // description of it, with local rank 0's choice of schedules for the calls after it.
  // torch_dtype: the tensors' c10::ScalarType where the collective moves bytes.
  CallMeta begin(Collective op, int64_t numel, int32_t dtype, int32_t wire, double scale, int root,
                 int32_t torch_dtype = -1);
  // begin, for a collective that runs on one node only.
  CallMeta begin_local(Collective op, int64_t numel, int32_t dtype, double scale, int root,
                       const std::string& what, int32_t torch_dtype = -1);
  // The next synchronisation step of the node's channel.
  uint64_t next_step() { return ++step_; }
  // Starts the next step: fill (if any) writes this rank's block into its input slot, then every
  // peer's is awaited (wide: a wide block, ShmChannel::wait_all), that wait's length going to
  // waited if given; a call's first step also checks it (first_step).
  uint64_t exchange(const CallMeta& mine, bool first, const std::function<void(char*)>& fill,
                    const std::string& what, bool wide = false,
                    ShmChannel::Clock::duration* waited = nullptr);
  // The step block b of a call goes through the slots at: `carried` for the first block where
  // the call's opening carried it there (Opening::carried), else a new exchange with fill.
  uint64_t block_step(const CallMeta& mine, size_t b, uint64_t carried,
                      const std::function<void(char*)>& fill, const std::string& what,
                      bool wide = false) {
    return b == 0 && carried != 0 ? carried : exchange(mine, false, fill, what, wide);
  }
  // After a call's first step, which every rank posted its description at: every rank reads local
  // rank 0's choice of schedules, then checks the call against the peers' and, across nodes,
  // starts its trade with the other nodes (finish_node_check ends it). Raises on every rank where
  // the ranks disagree.
  void first_step(uint64_t step, const CallMeta& mine, const std::string& what);
  // Across nodes: the end of the call's check with the other nodes, raising on every rank if any
  // node found a problem (local_error: this node's) or the nodes disagree. Every rank trades once
  // per call, so all stay in step whatever went wrong where; the trade overlaps the node's own
  // work on the call.
  void finish_node_check(const CallMeta& mine, const std::string& local_error,
                         const std::string& what);
  // A call checked within the node (a step with no data) and with the other nodes, before any data
  // crosses: the nodes' transfers go only where every rank agreed.
  CallMeta begin_checked_across_nodes(Collective op, int64_t numel, int32_t dtype, int32_t wire,
                                      double scale, int root, int32_t torch_dtype,
                                      const std::string& what);
  // Runs a transfer between the nodes; its failure fails the engine, on every rank, as "the
  // <kind> across nodes of <what> failed".
  void across(const char* kind, const std::string& what, const std::function<void()>& transfer);

  // The all-reduce's chunks crossing nodes, oldest first, from any number of calls: a call may
  // leave its last ones in flight (collectives.h, allreduce's `end`), so that the link carries
  // one gradient bucket after the other with no gap while the node goes on to the next.
  // Every rank of the node hands them out in the same order: at the same points of the same
  // calls. hand_out_in_flight(keep) hands out the oldest until `keep` are left; a failure ends
  // every call still in flight with it, and is rethrown.
  void put_in_flight(InFlight chunk) { in_flight_.push_back(std::move(chunk)); }
  size_t in_flight() const { return in_flight_.size(); }
  InFlight& last_in_flight() { return in_flight_.back(); }
  void hand_out_in_flight(size_t keep);
  // Ends every call still in flight with `error` and forgets their chunks.
  void fail_in_flight(std::exception_ptr error) noexcept;
  // Where an all-reduce's time across nodes went, summed over the calls (seconds): the node's own
  // work (its sums, the hand-outs, the checks), the waits for a chunk to come back, and the idle
  // work it took up before those waits (idle_work.h).
  struct AcrossTimes {
    double node_s = 0, link_wait_s = 0, idle_s = 0;
    uint64_t calls_left_in_flight = 0;  // all-reduces that returned with chunks still crossing
  };
  AcrossTimes across_times() const {
    const std::lock_guard<std::mutex> lock(times_mu_);
    return across_times_;
  }
  void add_across_times(double node_s, double link_wait_s, bool left_in_flight = false,
                        double idle_s = 0) {
    const std::lock_guard<std::mutex> lock(times_mu_);
    across_times_.node_s += node_s;
    across_times_.link_wait_s += link_wait_s;
    across_times_.idle_s += idle_s;
    across_times_.calls_left_in_flight += left_in_flight ? 1 : 0;
  }

  // Local rank r's arena chunk that a call's first step says place lies in, mapped here (arena.h);
  // null where the rank posted none or the chunk cannot be mapped (then its data is reached
  // through the kernel, and unmapped_because() says why the first chunk that could not be mapped
  // was not). For the call's opening (opening.h).
  char* map_peer(int r, const ArenaPlace& place);
  std::string unmapped_because() const;
  // The end of a call that read peers' tensors where they lie: returns once every rank has
  // finished reading, so that none writes or frees a tensor a peer still reads.
  void finish_reads(uint64_t step, const std::string& what);

  // Takes part in the next call without data: every rank's call raises, naming this rank and
  // reason, and the engine stays in step. For input one rank finds invalid before the exchange.
  // keep_in_flight: the call is an all-reduce given an end (collectives.h), which hands out no
  // chunks before its check, and whose failure forgets them.
  [[noreturn]] void reject(const std::string& reason, const std::string& what,
                           bool keep_in_flight = false);
  // The end of the job the engine's thread runs now, offered to an all-reduce that may leave its
  // chunks in flight (collectives.h): the engine ends the job itself unless the call took it.
  void offer_call_end(CallEnd end) { offered_end_ = std::move(end); }
  CallEnd take_call_end() { return std::exchange(offered_end_, nullptr); }

 private:
  [[noreturn]] void reject_call(const std::string& reason, const std::string& what);
  static std::string describe_call(const CallMeta& m);
  void check_peers_agree(const CallMeta& mine, const std::string& what);
  // A call as the nodes trade it: the verdict (ok: the node's ranks agree), then the CallMeta.
  static std::vector<int64_t> node_words(const CallMeta& m, bool ok);
  void start_node_check(const CallMeta& mine, bool ok, const std::string& what);
  [[noreturn]] void fail_node_check(const std::string& what, const std::exception& e);

  ShmChannel channel_;
  PeerMemory memory_{channel_};
  ScheduleChoice schedule_;
  uint64_t step_ = 0;
  uint64_t calls_ = 0;
  std::shared_ptr<CrossNode> cross_node_;
  size_t chunk_bytes_ = 0;
  std::vector<int> node_ranks_;
  mutable std::mutex unmapped_mu_;  // describe() reads it from the caller's thread
  std::string unmapped_because_;
  CallBuffers buffers_;
  std::deque<InFlight> in_flight_;
  CallEnd offered_end_;
  mutable std::mutex times_mu_;  // the engine's reports read them from the caller's thread
  AcrossTimes across_times_;
  Workers workers_;
  std::atomic<uint64_t> zero_copy_calls_{0};
};

}  // namespace ddpx
