// How the ranks of one node hand each other blocks through a shared-memory segment, and wait
// for each other.
//
// Every rank owns two input slots in the segment, and the node two float32 output slots; a call
// goes through in steps, alternating slots, so a rank fills its next block while its peers still
// read the last one. Each rank publishes a monotonic counter per phase when its part of a step
// is in; readers wait for every peer's counter, never for a global barrier. Reusing a slot needs
// no extra synchronisation: a rank writes step s's slots only after every peer has arrived at
// step s-1, which each does only after it finished reading step s-2, the last user of those
// slots.
//
// A wait spins, yields or sleeps on a futex depending on where the ranks may run (waiter.h);
// every wait is bounded, ends when a peer's process exits, and once one rank gives up every
// other rank's wait ends with its reason.
//
// Each rank also keeps its flight record in the segment: its last calls, its engine's queue and
// what it waits for. Any rank reads every rank's, a stopped or dead one's included, and the errors
// that end a call carry it (flight_record).
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/kernels.h"
#include "arena.h"
#include "peer_memory.h"
#include "shm_segment.h"
#include "waiter.h"

namespace ddpx {

constexpr int kMaxLocalRanks = kMaxSources;
// How many of its last calls a rank keeps in its flight record.
constexpr int kRecordedCalls = 4;

// What the segment holds, for this many ranks and steps of this many bytes.
struct ShmLayout {
  int nranks;
  size_t block_bytes;  // bytes of one rank's narrow block, in the wire dtype
  size_t wide_bytes;   // bytes of a wide one, a multiple of block_bytes; the slots hold one

  size_t segment_bytes() const;
  static size_t control_offset();
  size_t data_offset() const;
  // Where the point-to-point rings start (shm_p2p.h), after the collectives' slots.
  size_t p2p_offset() const;
  // Where the slots' pages go on a machine of several NUMA nodes, rank_nodes[i] being the node
  // local rank i runs on: each rank's input slots on its node, the output slots page by page
  // over the ranks' nodes (every rank reads all of a sum, and which of its bytes a rank sums
  // depends on the call's dtype and step, so no node is nearer to all of them). The header, the
  // control blocks and the point-to-point rings go where they would have.
  std::vector<NumaRange> numa_ranges(const std::vector<int>& rank_nodes) const;
};

// What a rank says about the call that starts at a step, for its peers to check against theirs.
struct CallMeta {
  uint64_t call;
  int64_t numel;  // -1: this rank rejected its input (its message says why); bytes if untyped
  int32_t dtype;  // -1 for the collectives that move bytes
  int32_t wire;
  double scale;
  int32_t op;          // what the engine calls the collective
  int32_t root;        // broadcast's source rank, else 0
  uint64_t schedules;  // local rank 0's only: the schedule mask of the calls after this one
  // The tensors' c10::ScalarType, for the collectives that move bytes of typed tensors (the
  // ranks' dtypes must match as their sizes do); -1 otherwise.
  int32_t torch_dtype = -1;
  // Local rank 0's only: 1 when the all-reduces after this one go shared (schedule.h).
  uint32_t shared = 0;
  // Where this rank's tensor lies in its process, for an all-reduce the ranks share, and in its
  // arena, if it is there (arena.h) and this rank reaches its peers' memory.
  uint64_t address = 0;
  ArenaPlace arena;
  // 1 when this rank, as it posted this, had found it reaches every peer's memory (probe_peers).
  int32_t reaches = 0;
};

class ShmChannel {
 public:
  enum class Phase { Arrive, Reduce };
  using Clock = std::chrono::steady_clock;

  // ranks[i] is the process-group rank of local rank i, used in error messages. The creator of the
  // segment passes initialize=true before anyone else attaches.
  ShmChannel(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
             std::vector<int> ranks, std::chrono::milliseconds timeout, bool initialize);

  int size() const { return layout_.nranks; }
  int me() const { return me_; }
  const ShmLayout& layout() const { return layout_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  char* p2p_region() const { return segment_->data() + layout_.p2p_offset(); }
  // Whether the local ranks outnumber the CPUs they may run on, as each last published its
  // binding (at its last call).
  bool oversubscribed() const { return layout_.nranks > ranks_cpu_count(); }
  // Whether local rank `rank`'s process has exited (never for a peer in another pid namespace,
  // which this one cannot see).
  bool exited(int rank) const;
  pid_t pid(int rank) const;
  char* input_slot(int rank, uint64_t step) const;
  char* output_slot(uint64_t step) const;

  // This rank's description of the call that starts at step, and a peer's.
  void post(uint64_t step, const CallMeta& meta);
  const CallMeta& posted(int rank, uint64_t step) const;
  // Why this rank rejected its input, for its peers' errors; and a peer's reason.
  void set_message(const std::string& text);
  std::string message(int rank) const;

  void publish(Phase phase, uint64_t step);
  // Returns once every peer has published step in phase. wide: the call goes in wide steps,
  // whose peers publish too seldom to be judged descheduled by their silence.
  void wait_all(Phase phase, uint64_t step, const std::string& what, bool wide = false);

  // Raises if an earlier call failed here or on a peer; then reads this rank's binding, and how
  // long the calling thread has waited for a CPU lately. Returns when it started.
  Clock::time_point begin_call();
  // Whether any rank of the node found itself waiting for its CPU within this long: the machine
  // is busy, or the ranks outnumber their CPUs.
  bool waited_for_cpu_within(Clock::duration window) const;
  // Gives up: every peer's wait ends with message, then on_fail(message) runs, then this throws
  // it (DistBackendError) with the flight record. The channel is unusable after this.
  [[noreturn]] void fail(const std::string& message);
  // ProcessGroup.abort(), from any thread: every wait of this rank's calls and of its peers' ends
  // with why, as fail's do, and every call after raises it; nothing is thrown here.
  void abort(const std::string& why);
  void set_on_fail(std::function<void(const std::string&)> on_fail) {
    on_fail_ = std::move(on_fail);
  }
  std::string rank_name(int local) const;

  // What this rank's waits for its peers have done so far.
  using WaitStats = ddpx::WaitStats;
  WaitStats wait_stats() const { return waiter_.stats(); }
  // How this rank's waits go, for the CPUs the ranks were bound to at their last call.
  std::string wait_policy() const;
  // Bounds the waits of the calls made until it is reset (zero: the channel's own timeout).
  void set_call_timeout(std::chrono::milliseconds timeout) { call_timeout_ = timeout; }

  // Shared all-reduces (allreduce.cpp): any rank of the node may sum a block for all of them,
  // reading and writing the others' tensors where they lie (process_vm_readv, process_vm_writev),
  // so a rank whose peers are off their CPUs does their part instead of waiting for them. Blocks
  // are numbered across calls, so no counter is ever reset: a call's are [first, end).
  // Claims the next block below end; false once every one is claimed. Any thread of the rank.
  bool claim_block(uint64_t end, uint64_t* block);
  // Counts a claimed block as summed and written to every rank.
  void block_done(uint64_t end);
  // Returns once every block below end is done; bounded, and ended by a peer's exit, like
  // wait_all.
  void wait_blocks_done(uint64_t end, const std::string& what);
  // The flight record. How it names the collectives: names[op] for CallMeta::op (an array that
  // outlives the channel).
  void set_call_names(const char* const* names, int count) {
    call_names_ = names;
    call_name_count_ = count;
  }
  // This rank's call that meta describes began at `began` and goes through the slots from
  // first_step on; the call before it, if still in flight, is done.
  void record_call(const CallMeta& meta, uint64_t first_step, Clock::time_point began);
  // The end of an engine's job: its last call, if still in flight, is done or failed.
  void record_job_end(bool failed);
  // How many jobs wait in this rank's engine queue, not started yet.
  void record_queued(size_t jobs);
  // What every local rank was doing, as this rank reads their records now: its process state, the
  // step it last published, what it waits for, its queued jobs and its last calls, newest first;
  // then the rank(s) behind the others. Never raises.
  std::string flight_record() const;

  // Local rank `rank`'s words for reaching its memory (peer_memory.h), in its control block.
  PeerMemoryWords& memory_words(int rank) const;
  // Whether local rank `rank` runs in this rank's pid namespace, where its pid means its process.
  bool same_pid_namespace(int rank) const;

  // What the segment starts with, and each rank's part of it (defined in the .cpp).
  struct Header;
  struct RankControl;
  struct RecordedCall;
  struct RankRecord;  // a rank's flight record, as a reader copied it

 private:
  // The waits, as the waiter asks them (defined in the .cpp).
  class Wait;
  class StepWait;
  class BlocksWait;

  std::atomic<uint64_t>& counter(int rank, Phase phase) const;
  RankSet peers() const;  // every local rank but this one
  // The peers that have not yet published step in phase.
  RankSet late(Phase phase, uint64_t step) const;
  // How many CPUs the local ranks may run on together, as each last published its binding.
  int ranks_cpu_count() const;
  // Whether a rank of `ranks` may be scheduled on one of cpus, as it last published its binding.
  bool may_run_on(RankSet ranks, const cpu_set_t& cpus) const;
  // "1, 3": the process-group ranks of `ranks`.
  std::string numbers(RankSet ranks) const;
  // "rank 1", "ranks 1, 3"
  std::string ranks_text(RankSet ranks) const;
  void check_not_aborted() const;
  // The start and the end of a wait that is needed, in this rank's flight record: its kind (the
  // .cpp's WaitKind) and the step, or the shared blocks' end, it waits for.
  void record_wait(int32_t kind, uint64_t until);
  void record_wait_over();
  // Local rank `rank`'s flight record, copied out of its control block; and the line that names
  // the ranks behind the others, from every rank's (defined in the .cpp).
  RankRecord read_record(int rank) const;
  std::string behind(const std::vector<RankRecord>& records, int64_t now_ns) const;
  struct RecordedWait;  // a wait in the flight record while it lasts
  // What bounds a wait: the call's timeout, if one is set, else the channel's.
  std::chrono::milliseconds wait_timeout() const {
    return call_timeout_.count() > 0 ? call_timeout_ : timeout_;
  }

  std::shared_ptr<ShmSegment> segment_;
  ShmLayout layout_;
  int me_;
  std::vector<int> ranks_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds call_timeout_{0};
  Header* header_;
  RankControl* control_;
  char* data_;
  std::string failure_;
  std::function<void(const std::string&)> on_fail_;
  Waiter waiter_;
  // The calling thread's time on a run queue (ns, -1: unknown) when last read, which thread,
  // and when: at least kDelaySpan apart.
  int64_t delay_at_ = -1;
  int delay_tid_ = 0;
  Clock::time_point delay_since_{};
  uint64_t last_recorded_ = 0;  // the number of this rank's newest recorded call
  const char* const* call_names_ = nullptr;
  int call_name_count_ = 0;
};

}  // namespace ddpx
