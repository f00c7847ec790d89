// The shared-memory all-reduce between the ranks of one node.
//
// Every rank owns two input slots in one POSIX shared-memory segment; a message goes through in
// blocks ("steps"), alternating slots, so a rank fills its next block while its peers still read
// the last one. Each rank publishes a monotonic step counter when its block is in; readers wait
// for every peer's counter, never for a global barrier. An all-reduce goes through one of three
// schedules. One-shot: every rank sums every block (one synchronisation per step). Two-phase:
// each rank sums its slice of a block into a shared float32 output slot, and all copy the whole
// result out, in narrow blocks, which stay in the cache, or in wide ones, which need fewer
// synchronisations (on a busy machine each can cost a peer's time slice). All sum the ranks in
// rank order in float32, so every rank gets the same bits, whichever schedule ran. By default
// messages up to one_shot_bytes go one-shot and larger ones in narrow two-phase steps; with
// timed steps local rank 0 times the schedules per size class as the job runs and picks for
// all (see time_schedule).
//
// Reusing a slot needs no extra synchronisation: a rank writes step s's slots only after every
// peer has arrived at step s-1, which each does only after it finished reading step s-2, the
// last user of those slots.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels.h"

namespace ddpx {

constexpr int kMaxLocalRanks = kMaxSources;

// A mapped POSIX shared-memory segment. The creator reserves its pages up front (fallocate), so a
// full /dev/shm fails here with a message instead of a SIGBUS later.
class ShmSegment {
 public:
  static std::shared_ptr<ShmSegment> create(const std::string& name, size_t bytes);
  static std::shared_ptr<ShmSegment> attach(const std::string& name, size_t bytes);
  // Removes the name; mappings stay valid. Safe to call for a name that is already gone.
  static void unlink(const std::string& name);

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  ShmSegment(char* data, size_t size) : data_(data), size_(size) {}
  char* data_;
  size_t size_;
};

struct ShmLayout {
  int nranks;
  size_t block_bytes;  // bytes of one rank's narrow block, in the wire dtype
  size_t wide_bytes;   // bytes of a wide one, a multiple of block_bytes; the slots hold one

  size_t segment_bytes() const;

 private:
  friend class ShmAllreduce;
  static size_t control_offset();
  size_t data_offset() const;
};

// The link between the ranks of one local index on every node, for the hierarchical all-reduce.
class CrossNode {
 public:
  virtual ~CrossNode() = default;
  virtual int nodes() const = 0;
  virtual int node() const = 0;  // this rank's node, 0 .. nodes() - 1
  // Starts trading words with the other nodes (each passes the same number); finish_gather
  // returns every node's, in node order. Both throw on failure.
  virtual void start_gather(const std::vector<int64_t>& mine) = 0;
  virtual std::vector<int64_t> finish_gather() = 0;
  // Starts summing n accumulation-dtype elements in place over the nodes, sending them in the
  // wire dtype; `data` stays owned by the transfer until it ends. finish_reduce waits for the
  // oldest transfer still running and throws its failure. Both throw on failure.
  virtual void start_reduce(std::shared_ptr<void> data, DType acc, DType wire, int64_t n) = 0;
  virtual void finish_reduce() = 0;
  // Tells every other rank of the job that this one gave up (why), so that their waits across
  // nodes end now instead of at their timeout. Does not throw.
  virtual void abort(const std::string& why) noexcept = 0;
};

class ShmAllreduce {
 public:
  friend struct ShmLayout;

  // ranks[i] is the process-group rank of local rank i, used in error messages. The creator of the
  // segment passes initialize=true before anyone else attaches.
  ShmAllreduce(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
               std::vector<int> ranks, size_t one_shot_bytes, std::chrono::milliseconds timeout,
               bool initialize);

  // data[i] = sum over ranks of wire(data_r[i] * scale), accumulated in float (double for
  // float64) and written back in data's dtype. Blocking; what names the call in error messages.
  void allreduce(void* data, DType dtype, int64_t numel, DType wire, double scale,
                 const std::string& what);

  // The collectives that move bytes or sum slices, one node only (they refuse a hierarchical
  // engine). Each goes through in blocks, one synchronisation per block, and is checked against
  // the other ranks' call like allreduce. allgather: every rank's `bytes` bytes of in land at
  // outs[rank] on every rank (in may be outs[me]). broadcast: local rank root's data lands in
  // every rank's. reduce_scatter: out (count elements) = the sum over ranks of their ins[me],
  // each scaled and rounded into wire, summed in rank order in float (double for float64) and
  // rounded into dtype. outs and ins hold local_size() pointers.
  void allgather(const void* in, size_t bytes, void* const* outs, const std::string& what);
  void broadcast(void* data, size_t bytes, int root, const std::string& what);
  void reduce_scatter(const void* const* ins, void* out, DType dtype, DType wire, int64_t count,
                      double scale, const std::string& what);
  // alltoall: this rank's ins[r] (sends[r] bytes) goes to local rank r, and outs[r]
  // (receives[r] bytes) receives local rank r's part for this rank. longest, the largest part
  // any rank sends, must be the same on every rank (the ranks check it): it sets the steps.
  void alltoall(const void* const* ins, const size_t* sends, void* const* outs,
                const size_t* receives, size_t longest, const std::string& what);
  bool spans_nodes() const { return cross_node_ != nullptr; }

  // The largest message (in the wire dtype) that may go one-shot: with fixed steps, every one up
  // to it does; with timed steps, those up to kOneShotAlways do, and the size classes above it
  // that lie wholly under it are timed one-shot too. Every rank of the node must set the same
  // value, between calls.
  size_t one_shot_bytes() const { return one_shot_bytes_.load(std::memory_order_relaxed); }
  void set_one_shot_bytes(size_t bytes) { one_shot_bytes_.store(bytes, std::memory_order_relaxed); }

  // Makes the all-reduce hierarchical: intra-node reduce-scatter of a block, a cross-node
  // all-reduce of this rank's slice of it, intra-node all-gather. Slices cross in chunks of about
  // chunk_bytes of the message, pipelined: while chunks cross, the node reduce-scatters the next
  // and all-gathers the ones that are back. Each call is also checked against the other nodes'
  // before any data crosses.
  void set_cross_node(std::shared_ptr<CrossNode> cross_node, size_t chunk_bytes);

  // How the all-reduce picks its schedule: in narrow (the default) or wide steps, one-shot up
  // to one_shot_bytes, or timed (by local rank 0, see time_schedule). Every rank must set the
  // same, between calls.
  enum class Steps { Timed, Narrow, Wide };
  // Below this, one synchronisation costs more than any schedule saves: timed steps go one-shot.
  static constexpr size_t kOneShotAlways = size_t(32) << 10;
  void set_steps(Steps steps) { steps_.store(steps, std::memory_order_relaxed); }
  Steps steps() const { return steps_.load(std::memory_order_relaxed); }
  // Which sizes the next all-reduce calls go in wide steps and one-shot for, as "a-b KiB" ranges.
  std::string wide_sizes() const;
  std::string one_shot_sizes() const;
  // Messages up to this size go one-shot whatever else is chosen.
  size_t always_one_shot_bytes() const;

  // Takes part in the next call without data: every rank's call raises, naming this rank and
  // reason, and the engine stays in step. For input one rank finds invalid before the exchange.
  void reject(const std::string& reason, const std::string& what);

  // What this rank's waits for its peers have done so far (see wait_all in the .cpp).
  struct WaitStats {
    uint64_t waited_ns;    // time spent in waits, spinning, yielding or asleep
    uint64_t waits;        // synchronisations at which some peer was not there yet
    uint64_t sleeps;       // futex sleeps
    uint64_t yields;       // sched_yield calls; only with more local ranks than CPUs
    uint64_t lost_yields;  // yields that gave the CPU away to a process outside the job
  };
  WaitStats wait_stats() const;
  // How this rank's waits go, for the CPUs the ranks were bound to at their last call.
  std::string wait_policy() const;

  // Bounds the waits of the calls made until it is reset (zero: the engine's own timeout).
  void set_call_timeout(std::chrono::milliseconds timeout) { call_timeout_ = timeout; }

  int local_size() const { return layout_.nranks; }
  int local_rank() const { return me_; }
  size_t block_bytes() const { return layout_.block_bytes; }
  size_t wide_bytes() const { return layout_.wide_bytes; }

 private:
  struct Header;
  struct RankControl;
  struct CallMeta;
  enum class Phase { Arrive, Reduce };
  enum class Collective : int32_t { AllReduce, AllGather, Broadcast, ReduceScatter, AllToAll };

  char* input_slot(int rank, uint64_t step) const;
  char* output_slot(uint64_t step) const;
  void publish(Phase phase, uint64_t step);
  using WaitClock = std::chrono::steady_clock;
  std::atomic<uint64_t>& counter(int rank, Phase phase) const;
  bool behind(int rank, Phase phase, uint64_t step) const;  // false for this rank itself
  bool peers_at(Phase phase, uint64_t step) const;
  bool awaited_on_cpu(Phase phase, uint64_t step, int cpu) const;
  // How many CPUs the local ranks may run on together, as each last published its binding.
  int ranks_cpu_count() const;
  // Whether no rank still awaited has published since since_ns (steady clock): all seem to be
  // off their CPUs, descheduled, rather than working.
  bool awaited_quiet(Phase phase, uint64_t step, int64_t since_ns) const;
  // Whether a rank still awaited may be scheduled on `cpu` (its binding allows it).
  bool awaited_may_run_on(Phase phase, uint64_t step, int cpu) const;
  // The first two stages of wait_all, from the wait's start; true when the peers are there.
  bool yield_while_cheap(Phase phase, uint64_t step, WaitClock::time_point start);
  bool spin_while_running(Phase phase, uint64_t step, WaitClock::time_point start);
  void wait_all(Phase phase, uint64_t step, const std::string& what);
  // Raises if an earlier call failed here or on a peer; then the call may start.
  void begin_call();
  // Starts the next step of a node-local call: fill writes this rank's block into its input
  // slot, then every peer's is awaited; a call's first step also checks that the ranks agree.
  uint64_t exchange(const CallMeta& mine, bool first, const std::function<void(char*)>& fill,
                    const std::string& what);
  CallMeta local_call(Collective op, int64_t numel, int32_t dtype, double scale, int root,
                      const std::string& what);
  static std::string describe_call(const CallMeta& m);
  void check_peers_agree(const CallMeta& mine, const std::string& what);
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
  enum Schedule { kNarrow, kWide, kOneShot, kSchedules };
  static constexpr int kClasses = 32;
  static int size_class(size_t bytes);
  // Whether schedule s may serve every size of class k here; a class is timed when two can.
  bool may_run(int k, Schedule s) const;
  int timed_class(size_t bytes) const;  // -1 when the size is not timed
  static Schedule scheduled(uint64_t mask, int k);
  // A call's description, with local rank 0's choice of schedules for the calls after it.
  CallMeta call_meta(Collective op, int64_t numel, int32_t dtype, int32_t wire, double scale,
                     int root);
  // Every rank reads local rank 0's choice after a call's first step, whatever the call.
  void agree_on_schedules(uint64_t first_step);
  // Local rank 0 only: counts a call's time and chooses its class's schedule for the calls after.
  void time_schedule(int k, Schedule ran, size_t bytes, WaitClock::duration took);
  std::string rank_name(int local) const;
  [[noreturn]] void fail(const std::string& message);
  void check_not_aborted() const;

  std::shared_ptr<ShmSegment> segment_;
  ShmLayout layout_;
  int me_;
  std::vector<int> ranks_;
  std::atomic<size_t> one_shot_bytes_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds call_timeout_{0};
  Header* header_;
  RankControl* control_;
  char* data_;
  uint64_t step_ = 0;
  uint64_t calls_ = 0;
  std::string failure_;
  std::shared_ptr<CrossNode> cross_node_;
  size_t chunk_bytes_ = 0;
  // This rank's slices summed within the node, then across nodes; shared with the transfers.
  std::shared_ptr<std::vector<char>> node_sums_;
  std::atomic<Steps> steps_{Steps::Narrow};
  // This call's, agreed at the previous call's first step; describe() reads it between calls.
  std::atomic<uint64_t> schedules_{0};
  bool wide_steps_ = false;  // whether this call goes in wide steps
  uint64_t agreed_ = 0;      // local rank 0's mask, read at this call's first step
  uint64_t chosen_ = 0;      // local rank 0's own choice, published with each call
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
  bool oversubscribed_ = false;  // more local ranks than CPUs all of them may run on
  WaitClock::time_point yields_banned_until_{};
  std::chrono::milliseconds yield_ban_;
  std::atomic<uint64_t> waited_ns_{0}, waits_{0}, sleeps_{0}, yields_{0}, lost_yields_{0};
};

}  // namespace ddpx
