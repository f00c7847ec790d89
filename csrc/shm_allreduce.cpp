#include "shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>


namespace ddpx {
namespace {

constexpr uint64_t kMagic = 0x3678706464ULL;  // "ddpx6": rank 0 picks one-shot too
constexpr size_t kPage = 4096;
// Waiting for peers goes through three stages, none unbounded (see wait_all). The numbers were
// measured on 2 vCPUs (docs/under-load.md): polling with sched_yield alone costs a time slice
// per synchronisation once a process outside the job shares the core (25 MB: 330 ms instead of
// 5 ms), and spinning without looking at where the awaited rank runs costs 2x under that load.
constexpr auto kSpinFor = std::chrono::microseconds(50);    // pause-spin while peers may run
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
constexpr auto kPoll = std::chrono::milliseconds(100);  // how often a sleeper checks its peers
constexpr size_t kStreamBytes = size_t(8) << 20;
// Local rank 0 tries a schedule it times slower after every this many calls of a class in the
// fastest, so that a change in the machine's load shows, less often when it was far slower; a
// trial is this many calls, the first of them not counted.
constexpr uint32_t kRetryEvery = 32;
constexpr uint32_t kRetryFarSlowerEvery = 128;
constexpr double kFarSlower = 1.5;
constexpr uint32_t kTrialCalls = 3;
// Chunks started across nodes and not yet all-gathered, per rank (docs/benchmarks.md, "Across a
// network").
constexpr int64_t kCrossChunksInFlight = 6;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

std::string system_error(const std::string& what, int err) {
  return "ddpx: " + what + ": " + std::strerror(err);
}

uint64_t pid_namespace() {
  struct stat st {};
  return stat("/proc/self/ns/pid", &st) == 0 ? uint64_t(st.st_ino) : 0;
}

// A process that is gone or a zombie; only meaningful inside our own pid namespace.
bool process_exited(int pid) {
  std::ifstream stat_file("/proc/" + std::to_string(pid) + "/stat");
  if (!stat_file) return true;
  std::string line;
  std::getline(stat_file, line);
  const size_t paren = line.rfind(')');
  if (paren == std::string::npos || paren + 2 >= line.size()) return false;
  const char state = line[paren + 2];
  return state == 'Z' || state == 'X';
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// The CPUs this process may run on; all of them if the kernel will not say.
cpu_set_t allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &set);
  }
  return set;
}

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  timespec ts{};
  ts.tv_sec = time_t(timeout.count() / 1000000000);
  ts.tv_nsec = long(timeout.count() % 1000000000);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

struct ShmAllreduce::CallMeta {
  uint64_t call;
  int64_t numel;  // -1: this rank rejected its input, see RankControl::message; bytes if untyped
  int32_t dtype;  // -1 for the collectives that move bytes
  int32_t wire;
  double scale;
  int32_t op;     // a Collective
  int32_t root;   // broadcast's source rank, else 0
  uint64_t schedules;  // local rank 0's only: the schedule mask of the calls after this one
};

struct alignas(64) ShmAllreduce::RankControl {
  std::atomic<uint64_t> arrived;  // last step whose block this rank has put in its input slot
  char pad0[56];
  std::atomic<uint64_t> reduced;  // last step whose slice this rank has summed (two-phase)
  std::atomic<int32_t> cpu;       // the CPU this rank last published from
  std::atomic<int64_t> published_ns;  // when this rank last published, on the steady clock
  char pad1[44];
  // Peers waiting for this rank sleep on `wake`, which it bumps when it publishes while
  // `sleepers` > 0: a publish wakes only the ranks that wait for this one.
  std::atomic<uint32_t> sleepers;
  std::atomic<uint32_t> wake;
  char pad2[56];
  CallMeta meta[2];               // per slot parity: what the call starting at that step is
  cpu_set_t allowed;              // the CPUs this rank may run on, as of its last call
  int32_t pid;
  uint64_t pid_ns;
  char message[512];              // why this rank rejected its input or aborted
};

struct ShmAllreduce::Header {
  uint64_t magic;
  int32_t nranks;
  uint64_t block_bytes;
  uint64_t wide_bytes;
  alignas(64) std::atomic<int32_t> aborted_by;  // 0, or the local rank + 1 that gave up
};

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word must be plain");

std::shared_ptr<ShmSegment> ShmSegment::create(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(system_error("cannot create shared memory " + name, errno));
  int err = posix_fallocate(fd, 0, off_t(bytes));
  void* p = err == 0 ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (err == 0 && p == MAP_FAILED) err = errno;
  close(fd);
  if (err != 0) {
    shm_unlink(name.c_str());
    throw std::runtime_error(system_error(
        "cannot reserve " + std::to_string(bytes >> 20) + " MiB of shared memory in /dev/shm", err));
  }
  return std::shared_ptr<ShmSegment>(new ShmSegment(static_cast<char*>(p), bytes));
}

std::shared_ptr<ShmSegment> ShmSegment::attach(const std::string& name, size_t bytes) {
  const int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(system_error("cannot open shared memory " + name, errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    close(fd);
    throw std::runtime_error("ddpx: shared memory " + name + " has " + std::to_string(st.st_size) +
                             " bytes, expected " + std::to_string(bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) throw std::runtime_error(system_error("cannot map shared memory " + name, err));
  return std::shared_ptr<ShmSegment>(new ShmSegment(static_cast<char*>(p), bytes));
}

void ShmSegment::unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmSegment::~ShmSegment() { munmap(data_, size_); }

size_t ShmLayout::control_offset() { return round_up(sizeof(ShmAllreduce::Header), 64); }

size_t ShmLayout::data_offset() const {
  return round_up(control_offset() + size_t(nranks) * sizeof(ShmAllreduce::RankControl), kPage);
}

size_t ShmLayout::segment_bytes() const {
  // Two input slots per rank, then two output slots that hold a wide block's sum in float32:
  // twice the bytes of a block in the narrowest wire dtype.
  return data_offset() + 2 * size_t(nranks) * wide_bytes + 2 * 2 * wide_bytes;
}

ShmAllreduce::ShmAllreduce(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
                           std::vector<int> ranks, size_t one_shot_bytes,
                           std::chrono::milliseconds timeout, bool initialize)
    : segment_(std::move(segment)),
      layout_(layout),
      me_(local_rank),
      ranks_(std::move(ranks)),
      one_shot_bytes_(one_shot_bytes),
      timeout_(timeout) {
  if (layout_.nranks < 1 || layout_.nranks > kMaxLocalRanks || me_ < 0 || me_ >= layout_.nranks ||
      int(ranks_.size()) != layout_.nranks) {
    throw std::invalid_argument("ddpx: bad shared-memory group: local rank " + std::to_string(me_) +
                                " of " + std::to_string(layout_.nranks) + " (at most " +
                                std::to_string(kMaxLocalRanks) + " ranks per node)");
  }
  if (layout_.block_bytes == 0 || layout_.block_bytes % kPage != 0) {
    throw std::invalid_argument("ddpx: block size must be a positive multiple of 4 KiB");
  }
  if (layout_.wide_bytes < layout_.block_bytes || layout_.wide_bytes % layout_.block_bytes != 0) {
    throw std::invalid_argument("ddpx: the wide block must be a multiple of the block");
  }
  if (segment_->size() != layout_.segment_bytes()) {
    throw std::invalid_argument("ddpx: shared memory segment does not match its layout");
  }
  header_ = reinterpret_cast<Header*>(segment_->data());
  control_ = reinterpret_cast<RankControl*>(segment_->data() + ShmLayout::control_offset());
  data_ = segment_->data() + layout_.data_offset();
  if (initialize) {
    header_->nranks = layout_.nranks;
    header_->block_bytes = layout_.block_bytes;
    header_->wide_bytes = layout_.wide_bytes;
    header_->magic = kMagic;
  } else if (header_->magic != kMagic || header_->nranks != layout_.nranks ||
             header_->block_bytes != layout_.block_bytes ||
             header_->wide_bytes != layout_.wide_bytes) {
    throw std::runtime_error("ddpx: shared memory segment was made by another ddpx version or layout");
  }
  yield_ban_ = kFirstYieldBan;
  control_[me_].allowed = allowed_cpus();
  control_[me_].pid = int32_t(getpid());
  control_[me_].pid_ns = pid_namespace();
}

char* ShmAllreduce::input_slot(int rank, uint64_t step) const {
  return data_ + (2 * size_t(rank) + (step & 1)) * layout_.wide_bytes;
}

char* ShmAllreduce::output_slot(uint64_t step) const {
  return data_ + (2 * size_t(layout_.nranks) + 2 * (step & 1)) * layout_.wide_bytes;
}

int ShmAllreduce::size_class(size_t bytes) {
  return bytes < 2 ? 0 : std::min(kClasses - 1, 63 - __builtin_clzll(bytes - 1));
}

bool ShmAllreduce::may_run(int k, Schedule s) const {
  const size_t lo = size_t(1) << k, hi = 2 * lo;  // class k is (lo, hi]
  switch (s) {
    case kNarrow:
      return true;
    case kWide:
      return !cross_node_ && layout_.wide_bytes > layout_.block_bytes && lo >= layout_.block_bytes;
    case kOneShot:
      return !cross_node_ && lo >= kOneShotAlways && hi <= one_shot_bytes();
    default:
      return false;
  }
}

int ShmAllreduce::timed_class(size_t bytes) const {
  const int k = size_class(bytes);
  return bytes > kOneShotAlways && (may_run(k, kWide) || may_run(k, kOneShot)) ? k : -1;
}

ShmAllreduce::Schedule ShmAllreduce::scheduled(uint64_t mask, int k) {
  return mask >> (32 + k) & 1 ? kOneShot : mask >> k & 1 ? kWide : kNarrow;
}

// Local rank 0 decides for all, from its own times: after the first step the ranks work in step,
// so its time is the call's. A schedule is tried in a run of consecutive calls of the class whose
// first is not counted, as it finds the schedule's slots cold after another ran; the rest start
// its average afresh, so a trial stands for the schedule as the machine is now. A class's first
// runs try each schedule that may serve it in turn; then the fastest goes on, and every
// kRetryEvery of its calls (kRetryFarSlowerEvery when the one due was far slower) the others
// take turns at a trial.
void ShmAllreduce::time_schedule(int k, Schedule ran, size_t bytes, WaitClock::duration took) {
  ScheduleTimes& t = times_[k];
  Schedule candidates[kSchedules];
  int n = 0;
  for (int s = 0; s < kSchedules; ++s) {
    if (may_run(k, Schedule(s))) candidates[n++] = Schedule(s);
  }
  auto fastest = [&] {
    Schedule best = candidates[0];
    for (int i = 1; i < n; ++i) {
      if (t.ns_per_byte[candidates[i]] < t.ns_per_byte[best]) best = candidates[i];
    }
    return best;
  };
  const bool explored = std::all_of(candidates, candidates + n, [&](Schedule s) {
    return t.timed[s] > 0;
  });
  if (ran != t.last && explored && ran != fastest()) ++t.trials;
  t.run = ran == t.last ? t.run + 1 : 1;
  t.last = ran;
  if (t.run > 1) {
    const double ns_per_byte = double(std::chrono::nanoseconds(took).count()) / double(bytes);
    double& average = t.ns_per_byte[ran];
    average = t.run == 2 ? ns_per_byte : average + (ns_per_byte - average) / 4;
    ++t.timed[ran];
  }

  Schedule next = ran;
  if (t.run >= kTrialCalls) {
    const Schedule* untried =
        std::find_if(candidates, candidates + n, [&](Schedule s) { return t.timed[s] == 0; });
    if (untried != candidates + n) {
      next = *untried;
    } else {
      const Schedule best = fastest();
      next = best;
      if (ran == best && n > 1) {
        Schedule others[kSchedules];
        int m = 0;
        for (int i = 0; i < n; ++i) {
          if (candidates[i] != best) others[m++] = candidates[i];
        }
        const Schedule due = others[t.trials % uint32_t(m)];
        const bool far = t.ns_per_byte[due] > kFarSlower * t.ns_per_byte[best];
        if (t.run >= (far ? kRetryFarSlowerEvery : kRetryEvery)) next = due;
      }
    }
  }
  const uint64_t wide = uint64_t(1) << k, one_shot = uint64_t(1) << (32 + k);
  chosen_ &= ~(wide | one_shot);
  if (next == kWide) chosen_ |= wide;
  if (next == kOneShot) chosen_ |= one_shot;
}

// The ranges of classes whose bit is set in the mask's word at shift, merged, as "a-b KiB".
static std::string class_ranges(uint64_t mask, int shift) {
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

std::string ShmAllreduce::wide_sizes() const {
  const Steps steps = this->steps();
  if (!may_run(kClasses - 1, kWide) || steps == Steps::Narrow) return "";
  if (steps == Steps::Wide) return "over " + std::to_string(layout_.block_bytes >> 10) + " KiB";
  return class_ranges(schedules_.load(std::memory_order_relaxed), 0);
}

size_t ShmAllreduce::always_one_shot_bytes() const {
  if (cross_node_) return 0;
  return steps() == Steps::Timed ? std::min(kOneShotAlways, one_shot_bytes()) : one_shot_bytes();
}

std::string ShmAllreduce::one_shot_sizes() const {
  if (cross_node_) return "";
  const size_t fixed = always_one_shot_bytes();
  std::string out = fixed ? "up to " + std::to_string(fixed >> 10) + " KiB" : "";
  if (steps() != Steps::Timed) return out;
  const std::string timed = class_ranges(schedules_.load(std::memory_order_relaxed), 32);
  return out.empty() || timed.empty() ? out + timed : out + ", " + timed;
}

std::string ShmAllreduce::rank_name(int local) const {
  return "rank " + std::to_string(ranks_[size_t(local)]);
}

void ShmAllreduce::publish(Phase phase, uint64_t step) {
  RankControl& mine = control_[me_];
  mine.cpu.store(sched_getcpu(), std::memory_order_relaxed);
  mine.published_ns.store(WaitClock::now().time_since_epoch().count(), std::memory_order_relaxed);
  counter(me_, phase).store(step, std::memory_order_seq_cst);
  // Paired with the sleeper's increment-then-recheck: either it sees our step or we see it.
  if (mine.sleepers.load(std::memory_order_seq_cst) > 0) {
    mine.wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&mine.wake);
  }
}

void ShmAllreduce::check_not_aborted() const {
  const int32_t by = header_->aborted_by.load(std::memory_order_acquire);
  if (by == 0 || by == me_ + 1) return;
  throw std::runtime_error("ddpx: the shared-memory all-reduce was aborted by " + rank_name(by - 1) +
                           ": " + control_[by - 1].message);
}

void ShmAllreduce::fail(const std::string& message) {
  failure_ = message;
  auto& mine = control_[me_].message;
  std::snprintf(mine, sizeof mine, "%s", message.c_str());
  int32_t none = 0;
  header_->aborted_by.compare_exchange_strong(none, me_ + 1, std::memory_order_acq_rel);
  for (int r = 0; r < layout_.nranks; ++r) {
    control_[r].wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&control_[r].wake);
  }
  if (cross_node_) cross_node_->abort(message);
  throw std::runtime_error(message);
}

std::atomic<uint64_t>& ShmAllreduce::counter(int rank, Phase phase) const {
  return phase == Phase::Arrive ? control_[rank].arrived : control_[rank].reduced;
}

bool ShmAllreduce::behind(int rank, Phase phase, uint64_t step) const {
  return rank != me_ && counter(rank, phase).load(std::memory_order_seq_cst) < step;
}

bool ShmAllreduce::peers_at(Phase phase, uint64_t step) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step)) return false;
  }
  return true;
}

bool ShmAllreduce::awaited_on_cpu(Phase phase, uint64_t step, int cpu) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step) && control_[r].cpu.load(std::memory_order_relaxed) == cpu) {
      return true;
    }
  }
  return false;
}

bool ShmAllreduce::awaited_may_run_on(Phase phase, uint64_t step, int cpu) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step) && (cpu < 0 || CPU_ISSET(cpu, &control_[r].allowed))) return true;
  }
  return false;
}

bool ShmAllreduce::awaited_quiet(Phase phase, uint64_t step, int64_t since_ns) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step) &&
        control_[r].published_ns.load(std::memory_order_relaxed) >= since_ns) {
      return false;
    }
  }
  return true;
}

int ShmAllreduce::ranks_cpu_count() const {
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int r = 0; r < layout_.nranks; ++r) CPU_OR(&all, &all, &control_[r].allowed);
  return CPU_COUNT(&all);
}

std::string ShmAllreduce::wait_policy() const {
  bool apart = true;
  const cpu_set_t& mine = control_[me_].allowed;
  for (int r = 0; r < layout_.nranks; ++r) {
    cpu_set_t shared;
    CPU_AND(&shared, &mine, &control_[r].allowed);
    if (r != me_ && CPU_COUNT(&shared) > 0) apart = false;
  }
  const auto us = [](auto d) { return std::to_string(d.count()) + " us"; };
  const int cpus = ranks_cpu_count();
  if (layout_.nranks > cpus) {
    return "waits yield first (" + std::to_string(layout_.nranks) + " ranks may run on " +
           std::to_string(cpus) + " CPUs), then spin up to " + us(kSpinFor) +
           ", then sleep";
  }
  return "waits spin up to " + us(apart ? kSpinApart : kSpinFor) +
         (apart ? " (this rank is bound apart from its peers)" : "") +
         ", less once the awaited ranks are silent for " + us(kPeerQuiet) + ", then sleep";
}

ShmAllreduce::WaitStats ShmAllreduce::wait_stats() const {
  return {waited_ns_.load(std::memory_order_relaxed), waits_.load(std::memory_order_relaxed),
          sleeps_.load(std::memory_order_relaxed), yields_.load(std::memory_order_relaxed),
          lost_yields_.load(std::memory_order_relaxed)};
}

// The stages of a wait:
// 1. With more local ranks than the CPUs they may run on together (their bindings' union, read
//    at every call), the rank waited for is most likely queued behind this one,
//    and sched_yield hands it the CPU: poll with it for up to kYieldFor. A yield that returns
//    after kLostYield gave the CPU to a process outside the job for a whole time slice (a busy
//    machine): then yield no more for kFirstYieldBan, doubling up to kLastYieldBan while it
//    keeps happening.
// 2. Otherwise spin with a pause instruction for up to kSpinFor while the ranks waited for may be
//    running on other CPUs, kSpinApart when none of them may run on this one (ranks bound to
//    cores of their own); stop at once when one of them last published from this CPU, where
//    it cannot be running now (this thread is), and in narrow steps when none of them has
//    published for kPeerQuiet (descheduled). Spinning keeps the CPU: a sleeper woken under load
//    may wait a time slice for it.
// 3. Sleep on the futex until a peer publishes; every kPoll, check whether a peer has exited,
//    and give up at the timeout.
bool ShmAllreduce::yield_while_cheap(Phase phase, uint64_t step, WaitClock::time_point start) {
  for (auto asked = start; asked - start < kYieldFor;) {
    sched_yield();
    yields_.fetch_add(1, std::memory_order_relaxed);
    if (peers_at(phase, step)) return true;
    const auto back = WaitClock::now();
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

bool ShmAllreduce::spin_while_running(Phase phase, uint64_t step, WaitClock::time_point start) {
  const int cpu = sched_getcpu();
  const auto spin_for = awaited_may_run_on(phase, step, cpu) ? kSpinFor : kSpinApart;
  const int64_t quiet_ns = std::chrono::nanoseconds(kPeerQuiet).count();
  WaitClock::time_point now;
  do {
    for (int i = 0; i < 32; ++i) {
      if (peers_at(phase, step)) return true;
      cpu_relax();
    }
    now = WaitClock::now();
  } while (!awaited_on_cpu(phase, step, cpu) && now - start < spin_for &&
           (wide_steps_ ||
            !awaited_quiet(phase, step, now.time_since_epoch().count() - quiet_ns)));
  return false;
}

void ShmAllreduce::wait_all(Phase phase, uint64_t step, const std::string& what) {
  if (peers_at(phase, step)) return;
  waits_.fetch_add(1, std::memory_order_relaxed);
  const auto start = WaitClock::now();
  // Counts the wait's time however it ends: ready, or an error.
  struct Timed {
    WaitClock::time_point start;
    std::atomic<uint64_t>& total_ns;
    ~Timed() {
      const auto ns = std::chrono::nanoseconds(WaitClock::now() - start).count();
      total_ns.fetch_add(uint64_t(ns), std::memory_order_relaxed);
    }
  } timed{start, waited_ns_};
  if (oversubscribed_ && start >= yields_banned_until_) {
    if (yield_while_cheap(phase, step, start)) return;
  } else if (spin_while_running(phase, step, start)) {
    return;
  }
  const auto timeout = call_timeout_.count() > 0 ? call_timeout_ : timeout_;
  const auto deadline = start + timeout;
  const uint64_t my_ns = control_[me_].pid_ns;
  while (true) {
    check_not_aborted();
    // Sleep on the first rank still behind; the others are looked at once it has arrived.
    int awaited = 0;
    while (!behind(awaited, phase, step)) {
      if (++awaited == layout_.nranks) return;
    }
    RankControl& peer = control_[awaited];
    peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t epoch = peer.wake.load(std::memory_order_seq_cst);
    if (behind(awaited, phase, step) && header_->aborted_by.load(std::memory_order_seq_cst) == 0) {
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      futex_wait(&peer.wake, epoch,
                 std::min<std::chrono::nanoseconds>(kPoll, deadline - WaitClock::now()));
    }
    peer.sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (peers_at(phase, step)) return;
    if (!behind(awaited, phase, step)) continue;

    std::vector<int> late;
    for (int r = 0; r < layout_.nranks; ++r) {
      if (behind(r, phase, step)) late.push_back(r);
    }
    const char* doing = phase == Phase::Arrive ? "send its block of" : "reduce its slice of";
    for (int r : late) {
      const int pid = control_[r].pid;
      if (pid > 0 && control_[r].pid_ns == my_ns && process_exited(pid)) {
        fail("ddpx: " + rank_name(r) + " (pid " + std::to_string(pid) + ") exited while " +
             rank_name(me_) + " waited for it to " + doing + " " + what + " (step " +
             std::to_string(step) + ")");
      }
    }
    if (WaitClock::now() >= deadline) {
      std::ostringstream names;
      for (size_t i = 0; i < late.size(); ++i) names << (i ? ", " : "") << ranks_[size_t(late[i])];
      std::ostringstream secs;
      secs << std::chrono::duration<double>(timeout).count();
      fail("ddpx: " + rank_name(me_) + " timed out after " + secs.str() +
           " s waiting for rank(s) " + names.str() + " to " + doing + " " + what + " (step " +
           std::to_string(step) + "); raise the timeout if a peer can be this slow");
    }
  }
}

std::string ShmAllreduce::describe_call(const CallMeta& m) {
  static const char* const names[] = {"", "an all-gather of ", "a broadcast of ",
                                      "a reduce-scatter of ", "an all-to-all of parts up to "};
  std::string out = names[m.op] + std::to_string(m.numel);
  if (m.dtype < 0) {
    out += " bytes (";
  } else {
    out += std::string(" ") + dtype_name(DType(m.dtype)) + " elements (wire " +
           dtype_name(DType(m.wire)) + ", scale " + std::to_string(m.scale) + ", ";
  }
  if (Collective(m.op) == Collective::Broadcast) {
    out += "from local rank " + std::to_string(m.root) + ", ";
  }
  return out + "call " + std::to_string(m.call) + ")";
}

void ShmAllreduce::check_peers_agree(const CallMeta& mine, const std::string& what) {
  const int slot = int(step_ & 1);
  for (int r = 0; r < layout_.nranks; ++r) {
    if (r == me_) continue;
    const CallMeta& m = control_[r].meta[slot];
    if (m.numel < 0) {
      throw std::runtime_error("ddpx: " + rank_name(r) + " rejected its input to " + what + ": " +
                               control_[r].message);
    }
    if (m.numel != mine.numel || m.dtype != mine.dtype || m.wire != mine.wire ||
        m.scale != mine.scale || m.call != mine.call || m.op != mine.op || m.root != mine.root) {
      throw std::runtime_error(
          "ddpx: ranks disagree on " + what + ": " + rank_name(me_) + " has " +
          describe_call(mine) + ", " + rank_name(r) + " has " + describe_call(m) +
          ". Every rank must reduce the same sizes and dtypes in the same order: check that the "
          "model and its trainable parameters are the same on every rank");
    }
  }
}

// A call as the nodes trade it: the verdict (0: the node's ranks agree), then the CallMeta.
std::vector<int64_t> ShmAllreduce::node_words(const CallMeta& m, bool ok) {
  int64_t scale_bits;
  static_assert(sizeof scale_bits == sizeof m.scale);
  std::memcpy(&scale_bits, &m.scale, sizeof scale_bits);
  return {ok ? 0 : 1, int64_t(m.call), m.numel, m.dtype, m.wire, scale_bits};
}

void ShmAllreduce::start_node_check(const CallMeta& mine, bool ok, const std::string& what) {
  try {
    cross_node_->start_gather(node_words(mine, ok));
  } catch (const std::exception& e) {
    fail_node_check(what, e);
  }
}

void ShmAllreduce::fail_node_check(const std::string& what, const std::exception& e) {
  fail("ddpx: " + rank_name(me_) + ": checking " + what + " with the other nodes failed: " +
       e.what());
}

void ShmAllreduce::finish_node_check(const CallMeta& mine, const std::string& local_error,
                                     const std::string& what) {
  std::vector<int64_t> all;
  try {
    all = cross_node_->finish_gather();
  } catch (const std::exception& e) {
    fail_node_check(what, e);
  }
  if (!local_error.empty()) throw std::runtime_error(local_error);
  const std::vector<int64_t> words = node_words(mine, true);
  for (int node = 0; node < cross_node_->nodes(); ++node) {
    const int64_t* theirs = all.data() + size_t(node) * words.size();
    if (theirs[0] != 0) {
      throw std::runtime_error("ddpx: " + what + " failed on node " + std::to_string(node) +
                               " (a rank there rejected its input or disagreed with its node; its "
                               "error says which), so every node stops it");
    }
    if (!std::equal(words.begin() + 1, words.end(), theirs + 1)) {
      double scale;
      std::memcpy(&scale, &theirs[5], sizeof scale);
      const CallMeta other{uint64_t(theirs[1]), theirs[2], int32_t(theirs[3]), int32_t(theirs[4]),
                           scale, int32_t(Collective::AllReduce), 0};
      throw std::runtime_error(
          "ddpx: nodes disagree on " + what + ": " + rank_name(me_) + " on node " +
          std::to_string(cross_node_->node()) + " has " + describe_call(mine) + ", its peer on " +
          "node " + std::to_string(node) + " has " + describe_call(other) + ". Every rank must " +
          "reduce the same sizes and dtypes in the same order");
    }
  }
}

void ShmAllreduce::set_cross_node(std::shared_ptr<CrossNode> cross_node, size_t chunk_bytes) {
  if (chunk_bytes == 0) throw std::invalid_argument("ddpx: the cross-node chunk must have bytes");
  cross_node_ = std::move(cross_node);
  chunk_bytes_ = chunk_bytes;
}

void ShmAllreduce::begin_call() {
  if (!failure_.empty()) throw std::runtime_error(failure_ + " (the engine is unusable after this)");
  check_not_aborted();
  // The binding is the user's and may change between calls (taskset -p): each call reads it.
  // A peer's set may be a call old, or torn while it writes it; either only misjudges one wait.
  control_[me_].allowed = allowed_cpus();
  oversubscribed_ = layout_.nranks > ranks_cpu_count();
  schedules_.store(agreed_, std::memory_order_relaxed);
  wide_steps_ = false;
}

ShmAllreduce::CallMeta ShmAllreduce::call_meta(Collective op, int64_t numel, int32_t dtype,
                                               int32_t wire, double scale, int root) {
  return CallMeta{++calls_, numel, dtype, wire, scale, int32_t(op), root, chosen_};
}

void ShmAllreduce::agree_on_schedules(uint64_t first_step) {
  agreed_ = control_[0].meta[first_step & 1].schedules;
}

void ShmAllreduce::reject(const std::string& reason, const std::string& what) {
  begin_call();
  const uint64_t step = ++step_;
  const CallMeta rejected = call_meta(Collective::AllReduce, -1, 0, 0, 0.0, 0);
  control_[me_].meta[step & 1] = rejected;
  std::snprintf(control_[me_].message, sizeof control_[me_].message, "%s", reason.c_str());
  publish(Phase::Arrive, step);
  wait_all(Phase::Arrive, step, what);
  agree_on_schedules(step);
  if (cross_node_) {
    start_node_check(rejected, false, what);
    try {
      finish_node_check(rejected, reason, what);
    } catch (const std::runtime_error&) {
      // This rank's own reason is the one to raise.
    }
  }
  throw std::invalid_argument(reason);
}

void ShmAllreduce::allreduce(void* data, DType dtype, int64_t numel, DType wire, double scale,
                             const std::string& what) {
  begin_call();
  if (numel < 0) throw std::invalid_argument("ddpx: negative element count");
  const Kernels& k = kernels();
  const size_t wire_size = dtype_size(wire);
  const size_t data_size = dtype_size(dtype);
  // Two-phase sums stay in the accumulation dtype in shared memory, so a result is rounded into
  // the tensor's dtype once, and is the same bits whichever schedule reduced it.
  const DType acc = dtype == DType::Float64 ? DType::Float64 : DType::Float32;
  const size_t acc_size = dtype_size(acc);
  const size_t bytes = size_t(numel) * wire_size;
  const Steps steps = this->steps();
  const int timed = steps == Steps::Timed ? timed_class(bytes) : -1;
  Schedule schedule = kNarrow;
  if (timed >= 0) {
    schedule = scheduled(agreed_, timed);
  } else if (!cross_node_ && bytes <= always_one_shot_bytes()) {
    schedule = kOneShot;
  } else if (steps == Steps::Wide && may_run(size_class(bytes), kWide)) {
    schedule = kWide;
  }
  const bool wide = schedule == kWide;
  wide_steps_ = wide;
  // A call's time, as local rank 0 times the schedules, leaves out its wait for the ranks to
  // arrive at the first step: that is the skew the calls before left, which one-shot calls,
  // ending without a synchronisation, pass on to whichever call comes next.
  const auto started = WaitClock::now();
  WaitClock::duration skew{};
  const int64_t per_block =
      int64_t((wide ? layout_.wide_bytes : layout_.block_bytes) / wire_size);
  const int64_t blocks = numel == 0 ? 1 : (numel + per_block - 1) / per_block;
  const bool one_shot = schedule == kOneShot;
  const int n = layout_.nranks;
  // Results larger than the last-level cache go out with streaming stores.
  const Store out_store =
      size_t(numel) * data_size >= kStreamBytes ? Store::Streaming : Store::Cached;
  const CallMeta mine =
      call_meta(Collective::AllReduce, numel, int32_t(dtype), int32_t(wire), scale, 0);
  const void* srcs[kMaxLocalRanks];

  auto block_count = [&](int64_t b) {
    return std::max<int64_t>(0, std::min(per_block, numel - b * per_block));
  };
  auto local_block = [&](int64_t b) {
    return static_cast<char*>(data) + size_t(b * per_block) * data_size;
  };
  // This rank's slice of a block. Slices are whole cache lines, so no two ranks write the same
  // line of the output slot.
  auto my_slice = [&](int64_t count) {
    const int64_t line = int64_t(64 / wire_size);
    const int64_t slice = (count + n * line - 1) / (n * line) * line;
    const int64_t lo = std::min<int64_t>(count, me_ * slice);
    return std::make_pair(lo, std::min<int64_t>(count, lo + slice));
  };
  // The two-phase schedule sums this rank's slice of its own block straight from the tensor
  // when the wire holds the tensor's values unchanged, so that slice is never copied in: the
  // same bits as packed, a sixth less memory traffic at 2 ranks. Only for a tensor that fits
  // in the cache: from memory, reading it in the sum was up to 2x slower at 25 MiB than
  // copying it in first.
  const bool own_slice_direct =
      !one_shot && wire == dtype && scale == 1.0 && out_store == Store::Cached;
  // Puts block b in this rank's input slot (less the slice it sums itself, where that is read in
  // place) and waits for every peer's; returns its step.
  auto arrive = [&](int64_t b) {
    const uint64_t step = ++step_;
    const int64_t count = block_count(b);
    if (b == 0) control_[me_].meta[step & 1] = mine;
    if (count > 0 && own_slice_direct) {
      const auto [lo, hi] = my_slice(count);
      k.pack(input_slot(me_, step), wire, local_block(b), dtype, lo, scale, Store::Cached);
      k.pack(input_slot(me_, step) + size_t(hi) * wire_size, wire,
             local_block(b) + size_t(hi) * data_size, dtype, count - hi, scale, Store::Cached);
    } else if (count > 0) {
      k.pack(input_slot(me_, step), wire, local_block(b), dtype, count, scale, Store::Cached);
    }
    publish(Phase::Arrive, step);
    const auto waits_from = WaitClock::now();
    wait_all(Phase::Arrive, step, what);
    if (b == 0) skew = WaitClock::now() - waits_from;
    if (b == 0) agree_on_schedules(step);
    if (b == 0 && !cross_node_) {
      check_peers_agree(mine, what);
    } else if (b == 0) {
      std::string local_error;
      try {
        check_peers_agree(mine, what);
      } catch (const std::runtime_error& e) {
        local_error = e.what();
      }
      start_node_check(mine, local_error.empty(), what);
      if (!local_error.empty()) finish_node_check(mine, local_error, what);
    }
    return step;
  };
  auto sum_my_slice = [&](uint64_t step, int64_t b, int64_t lo, int64_t hi, void* out) {
    for (int r = 0; r < n; ++r) srcs[r] = input_slot(r, step) + size_t(lo) * wire_size;
    if (own_slice_direct) srcs[me_] = local_block(b) + size_t(lo) * data_size;
    k.reduce(out, acc, srcs, n, wire, hi - lo, Store::Cached);
  };
  // Publishes this rank's slice of the output slot, waits for the others', copies the block out.
  auto gather = [&](uint64_t step, int64_t b) {
    publish(Phase::Reduce, step);
    wait_all(Phase::Reduce, step, what);
    k.pack(local_block(b), dtype, output_slot(step), acc, block_count(b), 1.0, out_store);
  };

  if (!cross_node_) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint64_t step = arrive(b);
      const int64_t count = block_count(b);
      if (one_shot) {
        for (int r = 0; r < n; ++r) srcs[r] = input_slot(r, step);
        k.reduce(local_block(b), dtype, srcs, n, wire, count, out_store);
        continue;
      }
      const auto [lo, hi] = my_slice(count);
      sum_my_slice(step, b, lo, hi, output_slot(step) + size_t(lo) * acc_size);
      gather(step, b);
    }
    if (me_ == 0 && timed >= 0) {
      time_schedule(timed, schedule, bytes, WaitClock::now() - started - skew);
    }
    return;
  }

  // Across nodes, this rank's slices of the blocks are summed within the node into node_sums_,
  // which crosses nodes in chunks of whole blocks: a network round trip per block would cost far
  // more than the extra pass over the slices. Chunks are started as soon as they are summed and
  // all-gathered once back, a few in flight, so the link carries one chunk while the node sums
  // the next and hands out the last. A block's output slot is written only after every peer
  // published its previous step, and they do that after reading the slot's last contents.
  const int64_t full_slice = [&] {
    const auto [lo, hi] = my_slice(std::min(per_block, numel));
    return hi - lo;
  }();
  // Where block b's slice starts in node_sums_, in elements; every block but the last is full.
  auto slice_offset = [&](int64_t b) {
    if (b < blocks) return b * full_slice;
    const auto [lo, hi] = my_slice(block_count(blocks - 1));
    return (blocks - 1) * full_slice + (hi - lo);
  };
  const int64_t total = slice_offset(blocks);
  if (!node_sums_ || node_sums_->size() < size_t(total) * acc_size) {
    node_sums_ = std::make_shared<std::vector<char>>(size_t(total) * acc_size);
  }
  char* sums = node_sums_->data();
  // Chunk c is blocks [chunk_start(c), chunk_start(c + 1)).
  const int64_t chunk_blocks =
      std::max<int64_t>(1, int64_t(chunk_bytes_ / (size_t(per_block) * data_size)));
  const int64_t chunks = (blocks + chunk_blocks - 1) / chunk_blocks;
  auto chunk_start = [&](int64_t c) { return std::min(blocks, c * chunk_blocks); };
  auto chunk_elements = [&](int64_t c) {
    return slice_offset(chunk_start(c + 1)) - slice_offset(chunk_start(c));
  };
  auto across = [&](auto&& transfer) {
    try {
      transfer();
    } catch (const std::exception& e) {
      fail("ddpx: " + rank_name(me_) + ": the all-reduce across nodes of " + what + " failed: " +
           e.what());
    }
  };
  auto gather_chunk = [&](int64_t c) {
    if (chunk_elements(c) > 0) across([&] { cross_node_->finish_reduce(); });
    for (int64_t b = chunk_start(c); b < chunk_start(c + 1); ++b) {
      const uint64_t step = ++step_;
      const auto [lo, hi] = my_slice(block_count(b));
      k.pack(output_slot(step) + size_t(lo) * acc_size, acc,
             sums + size_t(slice_offset(b)) * acc_size, acc, hi - lo, 1.0, Store::Cached);
      gather(step, b);
    }
  };
  int64_t gathered = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = chunk_start(c);
    for (int64_t b = first; b < chunk_start(c + 1); ++b) {
      const uint64_t step = arrive(b);
      const auto [lo, hi] = my_slice(block_count(b));
      sum_my_slice(step, b, lo, hi, sums + size_t(slice_offset(b)) * acc_size);
    }
    // The check across nodes started with the first block and ran while the node summed it.
    if (c == 0) finish_node_check(mine, "", what);
    if (chunk_elements(c) > 0) {
      const std::shared_ptr<void> chunk(node_sums_, sums + size_t(slice_offset(first)) * acc_size);
      across([&] { cross_node_->start_reduce(chunk, acc, wire, chunk_elements(c)); });
    }
    if (c + 1 - gathered >= kCrossChunksInFlight) gather_chunk(gathered++);
  }
  while (gathered < chunks) gather_chunk(gathered++);
}

ShmAllreduce::CallMeta ShmAllreduce::local_call(Collective op, int64_t numel, int32_t dtype,
                                                double scale, int root, const std::string& what) {
  begin_call();
  if (cross_node_) {
    throw std::invalid_argument("ddpx: " + what + " spans nodes; the shared-memory engine "
                                "all-reduces across nodes, the other collectives stay on one");
  }
  return call_meta(op, numel, dtype, dtype, scale, root);
}

uint64_t ShmAllreduce::exchange(const CallMeta& mine, bool first,
                                const std::function<void(char*)>& fill, const std::string& what) {
  const uint64_t step = ++step_;
  if (first) control_[me_].meta[step & 1] = mine;
  fill(input_slot(me_, step));
  publish(Phase::Arrive, step);
  wait_all(Phase::Arrive, step, what);
  if (first) {
    agree_on_schedules(step);
    check_peers_agree(mine, what);
  }
  return step;
}

void ShmAllreduce::allgather(const void* in, size_t bytes, void* const* outs,
                             const std::string& what) {
  const CallMeta mine = local_call(Collective::AllGather, int64_t(bytes), -1, 1.0, 0, what);
  const size_t block = layout_.block_bytes;
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const Store store = bytes * size_t(layout_.nranks) >= kStreamBytes ? Store::Streaming
                                                                       : Store::Cached;
  const char* src = static_cast<const char*>(in);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = exchange(
        mine, b == 0, [&](char* slot) { k.copy(slot, src + lo, count, Store::Cached); }, what);
    for (int r = 0; r < layout_.nranks; ++r) {
      char* part = static_cast<char*>(outs[r]) + lo;
      const char* from = r == me_ ? src + lo : input_slot(r, step);
      if (part != from) k.copy(part, from, count, store);
    }
  }
}

void ShmAllreduce::broadcast(void* data, size_t bytes, int root, const std::string& what) {
  if (root < 0 || root >= layout_.nranks) {
    throw std::invalid_argument("ddpx: broadcast from local rank " + std::to_string(root) +
                                " of " + std::to_string(layout_.nranks));
  }
  const CallMeta mine = local_call(Collective::Broadcast, int64_t(bytes), -1, 1.0, root, what);
  const size_t block = layout_.block_bytes;
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const Store store = bytes >= kStreamBytes ? Store::Streaming : Store::Cached;
  char* bytes_at = static_cast<char*>(data);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = exchange(mine, b == 0, [&](char* slot) {
      if (me_ == root) k.copy(slot, bytes_at + lo, count, Store::Cached);
    }, what);
    if (me_ != root) k.copy(bytes_at + lo, input_slot(root, step), count, store);
  }
}

void ShmAllreduce::reduce_scatter(const void* const* ins, void* out, DType dtype, DType wire,
                                  int64_t count, double scale, const std::string& what) {
  if (count < 0) throw std::invalid_argument("ddpx: negative element count");
  CallMeta mine = local_call(Collective::ReduceScatter, count, int32_t(dtype), scale, 0, what);
  mine.wire = int32_t(wire);
  const Kernels& k = kernels();
  const int n = layout_.nranks;
  const size_t size = dtype_size(dtype), wire_size = dtype_size(wire);
  // Each step's slot holds one part per destination rank, whole cache lines each.
  const int64_t line = int64_t(64 / wire_size);
  const int64_t part = int64_t(layout_.block_bytes / (wire_size * size_t(n))) / line * line;
  const int64_t steps = count == 0 ? 1 : (count + part - 1) / part;
  const Store store = size_t(count) * size >= kStreamBytes ? Store::Streaming : Store::Cached;
  char* dst = static_cast<char*>(out);
  const void* srcs[kMaxLocalRanks];
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t lo = s * part, todo = std::min(part, count - lo);
    const uint64_t step = exchange(mine, s == 0, [&](char* slot) {
      if (todo <= 0) return;
      for (int r = 0; r < n; ++r) {
        k.pack(slot + size_t(r * part) * wire_size, wire,
               static_cast<const char*>(ins[r]) + size_t(lo) * size, dtype, todo, scale,
               Store::Cached);
      }
    }, what);
    if (todo <= 0) continue;
    for (int r = 0; r < n; ++r) srcs[r] = input_slot(r, step) + size_t(me_ * part) * wire_size;
    k.reduce(dst + size_t(lo) * size, dtype, srcs, n, wire, todo, store);
  }
}

void ShmAllreduce::alltoall(const void* const* ins, const size_t* sends, void* const* outs,
                            const size_t* receives, size_t longest, const std::string& what) {
  const CallMeta mine = local_call(Collective::AllToAll, int64_t(longest), -1, 1.0, 0, what);
  const Kernels& k = kernels();
  const int n = layout_.nranks;
  // Each step's slot holds one part per destination rank, whole cache lines each.
  const size_t part = layout_.block_bytes / size_t(n) / 64 * 64;
  const size_t steps = longest == 0 ? 1 : (longest + part - 1) / part;
  size_t total = 0;
  for (int r = 0; r < n; ++r) total += receives[r];
  const Store store = total >= kStreamBytes ? Store::Streaming : Store::Cached;
  const auto piece = [&](size_t bytes, size_t lo) {
    return lo < bytes ? std::min(part, bytes - lo) : size_t(0);
  };
  for (size_t s = 0; s < steps; ++s) {
    const size_t lo = s * part;
    const uint64_t step = exchange(mine, s == 0, [&](char* slot) {
      for (int r = 0; r < n; ++r) {
        const size_t count = r == me_ ? 0 : piece(sends[r], lo);
        if (count > 0) {
          k.copy(slot + size_t(r) * part, static_cast<const char*>(ins[r]) + lo, count,
                 Store::Cached);
        }
      }
    }, what);
    for (int r = 0; r < n; ++r) {
      const size_t count = piece(receives[r], lo);
      if (count == 0) continue;
      const char* from = r == me_ ? static_cast<const char*>(ins[me_]) + lo
                                  : input_slot(r, step) + size_t(me_) * part;
      char* to = static_cast<char*>(outs[r]) + lo;
      if (to != from) k.copy(to, from, count, store);
    }
  }
}

}  // namespace ddpx
