// The waiter: how a rank waits for its peers (the stages, the bound), and the errors that end
// a wait.
#include "waiter.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <ctime>

#include "../common/errors.h"

namespace ddpx {
namespace {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be plain");

// Spinning longer costs no awaited rank its CPU when each one is bound where this rank is not:
// then it competes only with what else runs on this CPU, which the scheduler shares out anyway,
// and a rank that sleeps through a peer's short descheduling waits a time slice to get back.
constexpr auto kSpinApart = std::chrono::microseconds(500);
// A rank working through narrow blocks publishes every few tens of microseconds; one silent for
// this long is off its CPU, and spinning on would only spend this rank's share of its own.
constexpr auto kPeerQuiet = std::chrono::microseconds(300);
constexpr auto kYieldFor = std::chrono::microseconds(1000);  // yield-poll, oversubscribed only
// A peer's share of one step takes well under this; a process outside the job, given the CPU by
// a yield, keeps it for a time slice (a scheduler tick, 4 ms at HZ=250).
constexpr auto kLostYield = std::chrono::microseconds(1000);
constexpr auto kFirstYieldBan = std::chrono::milliseconds(100);
constexpr auto kLastYieldBan = std::chrono::milliseconds(1600);

// Adds a wait's time to total_ns however the wait ends: over, or an error.
struct TimedWait {
  Waiter::Clock::time_point start;
  std::atomic<uint64_t>& total_ns;
  ~TimedWait() {
    const auto ns = std::chrono::nanoseconds(Waiter::Clock::now() - start).count();
    total_ns.fetch_add(uint64_t(ns), std::memory_order_relaxed);
  }
};

}  // namespace

void WakeWord::wake() {
  word.fetch_add(1, std::memory_order_seq_cst);
  // Not FUTEX_PRIVATE_FLAG: the sleepers may be in other processes that map the same memory.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void WakeWord::sleep_unless_bumped(uint32_t seen, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = time_t(timeout.count() / 1000000000);
  ts.tv_nsec = long(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

Waiter::Waiter() : yield_ban_(kFirstYieldBan) {}

WaitStats Waiter::stats() const {
  return {waited_ns_.load(std::memory_order_relaxed), waits_.load(std::memory_order_relaxed),
          sleeps_.load(std::memory_order_relaxed), yields_.load(std::memory_order_relaxed),
          lost_yields_.load(std::memory_order_relaxed)};
}

std::string Waiter::policy(int nranks, int cpus, bool apart) {
  const auto us = [](auto d) { return std::to_string(d.count()) + " us"; };
  if (nranks > cpus) {
    return "waits yield first (" + std::to_string(nranks) + " ranks may run on " +
           std::to_string(cpus) + " CPUs), then spin up to " + us(kSpinFor) + ", then sleep";
  }
  return "waits spin up to " + us(apart ? kSpinApart : kSpinFor) +
         (apart ? " (this rank is bound apart from its peers)" : "") +
         ", less once the awaited ranks are silent for " + us(kPeerQuiet) + ", then sleep";
}

bool Waiter::yield_while_cheap(const Waitable& awaited, Clock::time_point start) {
  for (auto asked = start; asked - start < kYieldFor;) {
    sched_yield();
    yields_.fetch_add(1, std::memory_order_relaxed);
    if (!awaited.word()) return true;
    const auto back = Clock::now();
    if (back - asked >= kLostYield) {
      lost_yields_.fetch_add(1, std::memory_order_relaxed);
      yields_banned_until_ = back + yield_ban_;
      yield_ban_ = std::min<std::chrono::milliseconds>(2 * yield_ban_, kLastYieldBan);
      return false;
    }
    yield_ban_ = kFirstYieldBan;
    asked = back;
  }
  return false;
}

bool Waiter::spin_while_running(const Waitable& awaited, Clock::time_point start) {
  const int cpu = sched_getcpu();
  const auto spin_for = awaited.may_run_on(cpu) ? kSpinFor : kSpinApart;
  const int64_t quiet_ns = std::chrono::nanoseconds(kPeerQuiet).count();
  Clock::time_point now;
  do {
    for (int i = 0; i < 32; ++i) {
      if (!awaited.word()) return true;
      cpu_relax();
    }
    now = Clock::now();
  } while (now - start < spin_for &&
           !awaited.descheduled(cpu, now.time_since_epoch().count() - quiet_ns));
  return false;
}

bool Waiter::before_sleeping(const Waitable& awaited, Clock::time_point start) {
  waits_.fetch_add(1, std::memory_order_relaxed);
  if (!oversubscribed_) return spin_while_running(awaited, start);
  if (!awaited.yields()) return false;
  return start >= yields_banned_until_ ? yield_while_cheap(awaited, start)
                                       : spin_while_running(awaited, start);
}

template <class Interrupted>
WakeWord* Waiter::sleep_on(const Waitable& awaited, WakeWord* word, std::chrono::nanoseconds nap,
                           Interrupted interrupted) {
  const bool slept = word->sleep([&] { return awaited.word() == word && !interrupted(); }, nap);
  if (slept) sleeps_.fetch_add(1, std::memory_order_relaxed);
  return awaited.word();
}

void Waiter::wait(Awaited& awaited, std::chrono::milliseconds timeout) {
  const auto start = Clock::now();
  const TimedWait timed{start, waited_ns_};
  if (before_sleeping(awaited, start)) return;
  const auto deadline = start + timeout;
  while (true) {
    awaited.check_not_aborted();
    WakeWord* word = awaited.word();
    if (!word) return;
    WakeWord* next =
        sleep_on(awaited, word, std::min<std::chrono::nanoseconds>(kPoll, deadline - Clock::now()),
                 [&] { return awaited.aborted(); });
    if (!next) return;
    if (next != word) continue;  // the rank slept on has come: sleep on the next one
    const std::string why = stalled(awaited, deadline, timeout);
    if (!why.empty()) awaited.fail(why);
  }
}

bool Waiter::wait_for(const Waitable& awaited, Clock::duration bound) {
  const auto start = Clock::now();
  const TimedWait timed{start, waited_ns_};
  if (before_sleeping(awaited, start)) return true;
  const auto until = start + bound;
  for (WakeWord* word = awaited.word(); word;
       word = sleep_on(awaited, word, until - Clock::now(), [] { return false; })) {
    if (Clock::now() >= until) return false;
  }
  return true;
}

std::string Waiter::stalled(const Stall& stall, Clock::time_point deadline,
                            std::chrono::milliseconds timeout) {
  const std::string gone = stall.exited();
  if (!gone.empty()) {
    return "ddpx: " + gone + " exited while " + stall.me() + " waited " + stall.waited_for(true);
  }
  if (Clock::now() < deadline) return "";
  return "ddpx: " + stall.me() + " timed out after " + seconds_text(timeout) + " s waiting " +
         stall.waited_for(false) + stall.fix();
}

}  // namespace ddpx
