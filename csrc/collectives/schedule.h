// How the node's all-reduce picks its schedule, as one object: the policy the user set, and, with
// timed steps, local rank 0's measurements, whose choice every rank reads at each call's first
// step, so that all ranks run the same schedule.
//
// The schedules. One-shot: every rank sums every block (one synchronisation per step). Two-phase:
// each rank sums its slice of a block into a shared float32 output slot, and all copy the whole
// result out, in narrow blocks, which stay in the cache, or in wide ones, which need fewer
// synchronisations (on a busy machine each can cost a peer's time slice). Shared: any rank sums
// any block for all, straight from and into every rank's tensor. All sum the ranks in rank order
// in float32, so every rank gets the same bits, whichever schedule ran.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "../node/shm_channel.h"

namespace ddpx {

class ScheduleChoice {
 public:
  // How the schedule is chosen. Narrow and Wide: two-phase steps of that width, one-shot up to
  // one_shot_bytes. Timed: local rank 0 times the schedules (shared among
  // them once every rank can reach its peers' memory) per size class as the job runs and picks
  // for all. Shared: messages over the one-shot sizes go shared once every rank can reach its
  // peers' memory, narrow where they cannot. Auto (the default): shared while the machine is busy
  // (a rank of the node waited for its CPU a tenth of the time within kBusyWindow), and idle,
  // whichever of narrow and shared local rank 0 times faster per size class: which is faster
  // idle depends on what the kernel's cross-process copies cost on the machine
  // (docs/under-load.md).
  enum class Policy { Timed, Narrow, Wide, Shared, Auto };
  enum Schedule { kNarrow, kWide, kOneShot, kShared, kSchedules };
  static constexpr std::chrono::milliseconds kBusyWindow{1000};
  // All-reduces over this go shared, on an idle machine too, while local rank 0 has several
  // threads (Auto): every thread of every rank claims their blocks (workers.h).
  static constexpr size_t kThreadedBytes = size_t(1) << 20;
  // Below this, one synchronisation costs more than any schedule saves: timed steps go one-shot.
  static constexpr size_t kOneShotAlways = size_t(32) << 10;

  ScheduleChoice(const ShmLayout& layout, size_t one_shot_bytes)
      : block_bytes_(layout.block_bytes),
        wide_bytes_(layout.wide_bytes),
        one_shot_bytes_(one_shot_bytes) {}

  // Every rank of the node must set the same policy and one-shot bytes, between calls.
  void set_policy(Policy policy) { policy_.store(policy, std::memory_order_relaxed); }
  Policy policy() const { return policy_.load(std::memory_order_relaxed); }
  // The largest message (in the wire dtype) that may go one-shot: with fixed steps, every one up
  // to it does; with timed steps, those up to kOneShotAlways do, and the size classes above it
  // that lie wholly under it are timed one-shot too.
  size_t one_shot_bytes() const { return one_shot_bytes_.load(std::memory_order_relaxed); }
  void set_one_shot_bytes(size_t bytes) { one_shot_bytes_.store(bytes, std::memory_order_relaxed); }
  // This rank's threads (NodeComm::set_threads); local rank 0's decide Auto's choice for all.
  void set_threads(int threads) { threads_.store(threads, std::memory_order_relaxed); }
  // Across nodes every all-reduce goes in narrow two-phase steps.
  void set_spans_nodes() { spans_nodes_ = true; }

  // The schedule an all-reduce of this many bytes (in the wire dtype) runs, as agreed.
  Schedule schedule_for(size_t bytes) const;
  // Local rank 0 only: the size class of an all-reduce that ran `ran` whose time counts towards
  // the choice (its class is timed and the schedule was the timed one, not one the policy or a
  // busy machine imposed), else -1; and counting such a call's time, choosing its class's
  // schedule for the calls after.
  int timed_class(size_t bytes, Schedule ran) const;
  void time(int timed, Schedule ran, size_t bytes, ShmChannel::Clock::duration took);

  // At a call's start: what describe() reports is the schedule agreed for this call.
  void begin_call();
  // Puts local rank 0's choice for the calls after this one into its description of the call.
  void stamp(CallMeta& mine);
  // After a call's first step: every rank reads local rank 0's choice (zero: its description of
  // the call), and local rank 0 decides which calls after go shared whatever the times say. The
  // two parts: agreed (every rank), and decide (local rank 0), from whether every rank reaches
  // its peers' memory and whether a rank waited for its CPU within kBusyWindow.
  void agree(const CallMeta& zero, const ShmChannel& channel, const PeerMemory& memory);
  void agreed(const CallMeta& zero);
  void decide(bool reachable, bool busy);

  // For describe(): which sizes the next calls go wide, one-shot and shared for, as "a-b KiB"
  // ranges; the sizes that go one-shot whatever else is chosen.
  std::string wide_sizes() const;
  std::string one_shot_sizes() const;
  std::string shared_sizes() const;
  bool shared_now() const { return shared_now_.load(std::memory_order_relaxed) != 0; }
  size_t always_one_shot_bytes() const;

 private:
  // Size class k holds the all-reduces of (2^k, 2^(k+1)] bytes in the wire dtype; a schedule mask
  // has bit k of its low word set when class k goes wide, of its high word when it goes one-shot;
  // a shared mask, bit k when class k goes shared; narrow two-phase steps where none is set.
  static constexpr int kClasses = 32;
  static int size_class(size_t bytes);
  // The classes whose every size is over `bytes`.
  static uint32_t classes_over(size_t bytes);
  // Whether schedule s may serve every size of class k here; whether the policy times it there
  // (a class is timed when two may).
  bool fits(int k, Schedule s) const;
  bool may_run(int k, Schedule s) const;
  // The schedules the policy times for class k, into out (kSchedules long); how many.
  int candidates(int k, Schedule* out) const;

  const size_t block_bytes_, wide_bytes_;
  bool spans_nodes_ = false;
  std::atomic<size_t> one_shot_bytes_;
  std::atomic<Policy> policy_{Policy::Auto};
  std::atomic<int> threads_{1};
  // This call's, agreed at the previous call's first step; describe() reads them between calls.
  std::atomic<uint64_t> schedules_{0};
  std::atomic<uint32_t> shared_now_{0};
  uint64_t agreed_ = 0;         // local rank 0's schedule mask, read at this call's first step
  uint32_t agreed_shared_ = 0;  // and its shared mask
  // Local rank 0's own: the times' choice, published with each call; the classes the policy or a
  // busy machine sends shared whatever the times say, as last decided, as published with this
  // call, and as agreed for the next; whether every rank reaches its peers' memory.
  uint64_t chosen_ = 0;
  uint32_t chosen_shared_ = 0;
  uint32_t forced_shared_ = 0, stamped_forced_ = 0, agreed_forced_ = 0;
  bool reachable_ = false;
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
