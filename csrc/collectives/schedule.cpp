// The all-reduce's choice of schedule: per size class, by the policy, or timed by local rank 0
// for all.
#include "schedule.h"

#include <algorithm>

namespace ddpx {
namespace {

// Local rank 0 tries a schedule it times slower after every this many calls of a class in the
// fastest, so that a change in the machine's load shows, less often when it was far slower; a
// trial is this many calls, the first of them not counted.
constexpr uint32_t kRetryEvery = 32;
constexpr uint32_t kRetryFarSlowerEvery = 128;
constexpr double kFarSlower = 1.5;
constexpr uint32_t kTrialCalls = 3;

// The ranges of classes whose bit is set in the mask's word at shift, merged, as "a-b KiB".
std::string class_ranges(uint64_t mask, int shift) {
  std::string out;
  for (int k = 0; k < 32;) {
    if (!(mask >> (shift + k) & 1)) {
      ++k;
      continue;
    }
    int last = k;
    while (last + 1 < 32 && (mask >> (shift + last + 1) & 1)) ++last;
    out += (out.empty() ? "" : ", ") + std::to_string((size_t(1) << k) >> 10) + "-" +
           (last == 31 ? std::string("") : std::to_string((size_t(2) << last) >> 10)) + " KiB";
    k = last + 1;
  }
  return out;
}

}  // namespace

int ScheduleChoice::size_class(size_t bytes) {
  return bytes < 2 ? 0 : std::min(kClasses - 1, 63 - __builtin_clzll(bytes - 1));
}

uint32_t ScheduleChoice::classes_over(size_t bytes) {
  uint32_t mask = 0;
  for (int k = 0; k < kClasses; ++k) {
    if ((size_t(1) << k) >= bytes) mask |= uint32_t(1) << k;
  }
  return mask;
}

bool ScheduleChoice::fits(int k, Schedule s) const {
  const size_t lo = size_t(1) << k, hi = 2 * lo;  // class k is (lo, hi]
  switch (s) {
    case kNarrow:
      return true;
    case kWide:
      return !spans_nodes_ && wide_bytes_ > block_bytes_ && lo >= block_bytes_;
    case kOneShot:
      return !spans_nodes_ && lo >= kOneShotAlways && hi <= one_shot_bytes();
    case kShared:
      return !spans_nodes_ && reachable_ && lo >= always_one_shot_bytes();
    default:
      return false;
  }
}

bool ScheduleChoice::may_run(int k, Schedule s) const {
  switch (policy()) {
    case Policy::Timed:
      return fits(k, s);
    case Policy::Auto:
      return (s == kNarrow || s == kShared) && fits(k, s);
    default:
      return false;
  }
}

int ScheduleChoice::candidates(int k, Schedule* out) const {
  int n = 0;
  for (int s = 0; s < kSchedules; ++s) {
    if (may_run(k, Schedule(s))) out[n++] = Schedule(s);
  }
  return n;
}

int ScheduleChoice::timed_class(size_t bytes, Schedule ran) const {
  const int k = size_class(bytes);
  if (bytes <= always_one_shot_bytes() || (agreed_forced_ >> k & 1) || !may_run(k, ran)) return -1;
  Schedule each[kSchedules];
  return candidates(k, each) > 1 ? k : -1;
}

// Local rank 0 decides for all, from its own times: after the first step the ranks work in step,
// so its time is the call's. A schedule is tried in a run of consecutive calls of the class whose
// first is not counted, as it finds the schedule's slots cold after another ran; the rest start
// its average afresh, so a trial stands for the schedule as the machine is now. A class's first
// runs try each schedule that may serve it in turn; then the fastest goes on, and every
// kRetryEvery of its calls (kRetryFarSlowerEvery when the one due was far slower) the others
// take turns at a trial.
void ScheduleChoice::time(int k, Schedule ran, size_t bytes, ShmChannel::Clock::duration took) {
  ScheduleTimes& t = times_[k];
  Schedule each[kSchedules];
  const int n = candidates(k, each);
  auto fastest = [&] {
    Schedule best = each[0];
    for (int i = 1; i < n; ++i) {
      if (t.ns_per_byte[each[i]] < t.ns_per_byte[best]) best = each[i];
    }
    return best;
  };
  const bool explored = std::all_of(each, each + n, [&](Schedule s) { return t.timed[s] > 0; });
  if (ran != t.last && explored && ran != fastest()) ++t.trials;
  t.run = ran == t.last ? t.run + 1 : 1;
  t.last = ran;
  if (t.run > 1) {
    const double ns_per_byte = double(std::chrono::nanoseconds(took).count()) / double(bytes);
    double& average = t.ns_per_byte[ran];
    average = t.run == 2 ? ns_per_byte : average + (ns_per_byte - average) / 4;
    ++t.timed[ran];
  }

  // A choice applies from the call after the next (stamp, agree), so the call after a choice
  // still runs the one before: until a run is long enough to judge, the choice stands.
  const uint64_t wide = uint64_t(1) << k, one_shot = uint64_t(1) << (32 + k);
  const uint32_t shared = uint32_t(1) << k;
  Schedule next = chosen_shared_ & shared ? kShared
                  : chosen_ & one_shot    ? kOneShot
                  : chosen_ & wide        ? kWide
                                          : kNarrow;
  if (t.run >= kTrialCalls) {
    const Schedule* untried =
        std::find_if(each, each + n, [&](Schedule s) { return t.timed[s] == 0; });
    if (untried != each + n) {
      next = *untried;
    } else {
      const Schedule best = fastest();
      next = best;
      if (ran == best && n > 1) {
        Schedule others[kSchedules];
        int m = 0;
        for (int i = 0; i < n; ++i) {
          if (each[i] != best) others[m++] = each[i];
        }
        const Schedule due = others[t.trials % uint32_t(m)];
        const bool far = t.ns_per_byte[due] > kFarSlower * t.ns_per_byte[best];
        if (t.run >= (far ? kRetryFarSlowerEvery : kRetryEvery)) next = due;
      }
    }
  }
  chosen_ &= ~(wide | one_shot);
  chosen_shared_ &= ~shared;
  if (next == kWide) chosen_ |= wide;
  if (next == kOneShot) chosen_ |= one_shot;
  if (next == kShared) chosen_shared_ |= shared;
}

ScheduleChoice::Schedule ScheduleChoice::schedule_for(size_t bytes) const {
  if (!spans_nodes_ && bytes <= always_one_shot_bytes()) return kOneShot;
  const int k = size_class(bytes);
  // Every rank sets the same policy between calls; a mask agreed under another applies only
  // where this one sends sizes to more than one schedule.
  switch (policy()) {
    case Policy::Narrow:
      return kNarrow;
    case Policy::Wide:
      return fits(k, kWide) ? kWide : kNarrow;
    case Policy::Timed:
      if (agreed_ >> (32 + k) & 1) return kOneShot;
      if (agreed_ >> k & 1) return kWide;
      break;
    default:
      break;
  }
  return agreed_shared_ >> k & 1 ? kShared : kNarrow;
}

void ScheduleChoice::begin_call() {
  schedules_.store(agreed_, std::memory_order_relaxed);
  shared_now_.store(agreed_shared_, std::memory_order_relaxed);
}

void ScheduleChoice::stamp(CallMeta& mine) {
  // A class the times chose shared stays with them only while every rank reaches its peers.
  mine.schedules = chosen_;
  mine.shared = forced_shared_ | (reachable_ ? chosen_shared_ : 0);
  stamped_forced_ = forced_shared_;
}

void ScheduleChoice::agree(const CallMeta& zero, const ShmChannel& channel,
                           const PeerMemory& memory) {
  agreed(zero);
  if (spans_nodes_ || channel.size() == 1 || channel.me() != 0) return;
  decide(memory.reachable() == PeerMemory::Reach::Yes,
         policy() == Policy::Auto && channel.waited_for_cpu_within(kBusyWindow));
}

void ScheduleChoice::agreed(const CallMeta& zero) {
  agreed_ = zero.schedules;
  agreed_shared_ = zero.shared;
}

// Every call over the one-shot sizes goes shared always (Policy::Shared) or while the machine is
// busy (Policy::Auto), and those over kThreadedBytes while local rank 0 has several threads
// (Policy::Auto); all need every rank to reach every peer's memory, which each rank finds out
// once all have attached (at the first call); local rank 0 learns the verdicts at a later call's
// first step, after each rank published its own.
void ScheduleChoice::decide(bool reachable, bool busy) {
  agreed_forced_ = stamped_forced_;
  reachable_ = reachable;
  uint32_t forced = 0;
  if (policy() == Policy::Shared || (policy() == Policy::Auto && busy)) {
    forced = classes_over(always_one_shot_bytes());
  } else if (policy() == Policy::Auto && threads_.load(std::memory_order_relaxed) > 1) {
    forced = classes_over(kThreadedBytes);
  }
  forced_shared_ = reachable_ ? forced : 0;
}

std::string ScheduleChoice::wide_sizes() const {
  const Policy policy = this->policy();
  if (!fits(kClasses - 1, kWide) || policy == Policy::Narrow) return "";
  if (policy == Policy::Wide) return "over " + std::to_string(block_bytes_ >> 10) + " KiB";
  return class_ranges(schedules_.load(std::memory_order_relaxed), 0);
}

std::string ScheduleChoice::shared_sizes() const {
  return class_ranges(shared_now_.load(std::memory_order_relaxed), 0);
}

size_t ScheduleChoice::always_one_shot_bytes() const {
  if (spans_nodes_) return 0;
  return policy() == Policy::Timed ? std::min(kOneShotAlways, one_shot_bytes()) : one_shot_bytes();
}

std::string ScheduleChoice::one_shot_sizes() const {
  if (spans_nodes_) return "";
  const size_t fixed = always_one_shot_bytes();
  std::string out = fixed ? "up to " + std::to_string(fixed >> 10) + " KiB" : "";
  if (policy() != Policy::Timed) return out;
  const std::string timed = class_ranges(schedules_.load(std::memory_order_relaxed), 32);
  return out.empty() || timed.empty() ? out + timed : out + ", " + timed;
}

}  // namespace ddpx
