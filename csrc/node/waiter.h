// How a rank waits for its peers through words in shared memory, for the node's collectives
// (shm_channel.h) and its point-to-point (shm_p2p.h): the constants, the word waiters sleep on,
// the staged wait with its bound, and the errors that end a wait before its peers come.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

namespace ddpx {

// How long a waiter spins (or yields) before it sleeps while the ranks it waits for may be
// running: their next publish usually comes sooner, and a sleeper pays a wake-up for it.
constexpr auto kSpinFor = std::chrono::microseconds(50);
// How often a sleeper wakes to check on its peers: an exit, the timeout, a rank that gave up.
constexpr auto kPoll = std::chrono::milliseconds(100);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// A word that waiters sleep on (a futex) and that wakers bump. It may lie in memory that several
// processes map, for waiters in any of them; it holds nothing else, so a segment can embed it.
struct WakeWord {
  std::atomic<uint32_t> sleepers;
  std::atomic<uint32_t> word;

  // Wakes the sleepers, if any. What they wait for must be published before, with a seq_cst
  // store or fence: a sleeper counts itself before it looks, so either it sees what was
  // published or this sees it.
  void ring() {
    if (sleepers.load(std::memory_order_seq_cst) > 0) wake();
  }
  // Wakes every sleeper, counted or not.
  void wake();
  // Sleeps until the word is rung, for at most timeout, unless still_waiting() says no; it runs
  // once this thread counts as a sleeper, so a ring after what it saw is never missed. Returns
  // its answer: whether the thread slept.
  template <class StillWaiting>
  bool sleep(StillWaiting still_waiting, std::chrono::nanoseconds timeout) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = word.load(std::memory_order_seq_cst);
    const bool sleeps = still_waiting();
    if (sleeps) sleep_unless_bumped(seen, timeout);
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
    return sleeps;
  }

 private:
  void sleep_unless_bumped(uint32_t seen, std::chrono::nanoseconds timeout);
};

// A set of the local ranks of a node, a bit each (a node has at most 64).
using RankSet = uint64_t;

// What a rank's waits for its peers have done so far.
struct WaitStats {
  uint64_t waited_ns;    // time spent in waits, spinning, yielding or asleep
  uint64_t waits;        // synchronisations at which some peer was not there yet
  uint64_t sleeps;       // futex sleeps
  uint64_t yields;       // sched_yield calls; only with more local ranks than CPUs
  uint64_t lost_yields;  // yields that gave the CPU away to a process outside the job
};

// A rank's waits for its peers, in stages, none unbounded:
// 1. With more local ranks than the CPUs they may run on together, the rank waited for is most
//    likely queued behind this one, and sched_yield hands it the CPU: poll with it for a while.
//    A yield that lasts a scheduler tick gave the CPU to a process outside the job for a whole
//    time slice (a busy machine): then yield no more for a while, longer while it keeps
//    happening, and spin instead. A wait that does not yield sleeps at once.
// 2. Otherwise spin with a pause instruction while the ranks waited for may be running on other
//    CPUs, longer when none of them may run on this one (ranks bound to cores of their own);
//    stop when they are surely off their CPUs. Spinning keeps the CPU: a sleeper woken under
//    load may wait a time slice for it.
// 3. Sleep on a futex until a peer publishes; every kPoll, check whether a rank has given up
//    or a peer has exited, and give up at the timeout.
class Waiter {
 public:
  using Clock = std::chrono::steady_clock;

  // What a wait is for, as the errors that end it say; a peer's exit ends it.
  class Stall {
   public:
    // How the error names the waiting rank: "rank 0".
    virtual std::string me() const = 0;
    // The first rank awaited whose process has exited, as an error names it ("rank 1 (pid 4)");
    // empty while none has.
    virtual std::string exited() const = 0;
    // What the wait is for, said of the rank that exited (gone: "for it to send its block of
    // X", "to receive 40 bytes (tag 7) from it") or of those late at the timeout ("for rank(s)
    // 1, 3 to send ...").
    virtual std::string waited_for(bool gone) const = 0;
    // What to do about a timeout, said after it.
    virtual std::string fix() const { return "; raise the timeout if a peer can be this slow"; }

   protected:
    ~Stall() = default;
  };

  // What the stages of a wait ask of it.
  class Waitable {
   public:
    // The word to sleep on until the wait may be over (the first awaited rank's, or one that
    // all of them ring); null once it is over. Asked between spins: a few loads.
    virtual WakeWord* word() const = 0;
    // Whether a rank still awaited may be scheduled on cpu (-1: unknown), as its binding allows.
    virtual bool may_run_on(int cpu) const = 0;
    // Whether the ranks still awaited are surely off their CPUs: one last published from cpu,
    // where this thread runs, or none has published since since_ns (steady clock).
    virtual bool descheduled(int cpu, int64_t since_ns) const = 0;
    // Whether the wait yields its CPU to the awaited ranks when they outnumber their CPUs.
    virtual bool yields() const = 0;

   protected:
    ~Waitable() = default;
  };

  // One wait that the waiter runs to its end: ShmChannel's for its steps and its shared blocks.
  class Awaited : public Waitable, public Stall {
   public:
    // Whether a rank has given up; and raising why, if one has.
    virtual bool aborted() const = 0;
    virtual void check_not_aborted() const = 0;
    // Ends the wait, and every peer's, with why.
    [[noreturn]] virtual void fail(const std::string& why) = 0;

   protected:
    ~Awaited() = default;
  };

  Waiter();

  // Whether the local ranks outnumber the CPUs they may run on together, as of this call.
  void set_oversubscribed(bool oversubscribed) { oversubscribed_ = oversubscribed; }
  // Returns once awaited.word() is null. Raises when a rank has given up, and through
  // awaited.fail when a rank awaited has exited or timeout has passed. The caller checks first:
  // a wait whose peers are there costs no call.
  void wait(Awaited& awaited, std::chrono::milliseconds timeout);
  // The same stages for a wait whose errors are its caller's to find (point-to-point's: each of
  // its sends and receives has a peer and a deadline of its own): true once awaited.word() is
  // null, false once `bound` has passed, for the caller to check and wait again.
  bool wait_for(const Waitable& awaited, Clock::duration bound);
  // Why a wait that started a timeout before deadline must end, or empty while it may go on:
  // a rank awaited has exited, or the deadline has passed.
  //   "ddpx: rank 1 (pid 4) exited while rank 0 waited for it to send its block of ..."
  //   "ddpx: rank 0 timed out after 1 s waiting for rank(s) 1 to send ...; raise the timeout ..."
  static std::string stalled(const Stall& stall, Clock::time_point deadline,
                             std::chrono::milliseconds timeout);

  WaitStats stats() const;
  // How the waits go for nranks ranks that may run on cpus CPUs together; apart: no peer may
  // run on a CPU this rank may.
  static std::string policy(int nranks, int cpus, bool apart);

 private:
  // Stages 1 and 2, from the wait's start; true when the wait is over.
  bool before_sleeping(const Waitable& awaited, Clock::time_point start);
  bool yield_while_cheap(const Waitable& awaited, Clock::time_point start);
  bool spin_while_running(const Waitable& awaited, Clock::time_point start);
  // One sleep of stage 3 on word, for at most nap, unless the wait is over or interrupted()
  // first; returns the word to sleep on next (another once the rank slept on has come), null
  // once the wait is over.
  template <class Interrupted>
  WakeWord* sleep_on(const Waitable& awaited, WakeWord* word, std::chrono::nanoseconds nap,
                     Interrupted interrupted);

  bool oversubscribed_ = false;
  Clock::time_point yields_banned_until_{};
  std::chrono::milliseconds yield_ban_;
  std::atomic<uint64_t> waited_ns_{0}, waits_{0}, sleeps_{0}, yields_{0}, lost_yields_{0};
};

}  // namespace ddpx
