#include "shm_channel.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "errors.h"
#include "shm_p2p.h"
#include "waiting.h"

namespace ddpx {
namespace {

constexpr uint64_t kMagic = 0x3878706464ULL;  // "ddpx8": shared all-reduces' block counters
// Waiting for peers goes through three stages, none unbounded (see wait_all). Polling with
// sched_yield alone costs a time slice per synchronisation once a process outside the job shares
// the core, and spinning without looking at where the awaited rank runs costs twice the time
// under that load (docs/under-load.md).
constexpr auto kSpinFor = std::chrono::microseconds(50);  // pause-spin while peers may run
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
// A rank that shares its core with a CPU-bound process waits for it about half the time; one
// on an idle machine is preempted hundreds of times a second (by every short task that wakes on
// its core while it spins) but waits for well under 1% of it.
constexpr double kBusyDelayShare = 0.1;
constexpr auto kDelaySpan = std::chrono::milliseconds(100);  // measured over at least this

// How long the calling thread has waited on a run queue for a CPU (ns), -1 if the kernel will
// not say (no schedstats).
int64_t run_delay_ns() {
  std::ifstream stat_file("/proc/thread-self/schedstat");
  int64_t running = 0, waiting = -1;
  stat_file >> running >> waiting;
  return stat_file ? waiting : -1;
}

// Adds a wait's time to total_ns however the wait ends: ready, or an error.
struct TimedWait {
  std::chrono::steady_clock::time_point start;
  std::atomic<uint64_t>& total_ns;
  ~TimedWait() {
    const auto ns = std::chrono::nanoseconds(std::chrono::steady_clock::now() - start).count();
    total_ns.fetch_add(uint64_t(ns), std::memory_order_relaxed);
  }
};

uint64_t pid_namespace() {
  struct stat st{};
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

// The CPUs this process may run on; all of them if the kernel will not say.
cpu_set_t allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &set);
  }
  return set;
}

}  // namespace

struct alignas(64) ShmChannel::RankControl {
  std::atomic<uint64_t> arrived;  // last step whose block this rank has put in its input slot
  char pad0[56];
  std::atomic<uint64_t> reduced;      // last step whose slice this rank has summed (two-phase)
  std::atomic<int32_t> cpu;           // the CPU this rank last published from
  std::atomic<int64_t> published_ns;  // when this rank last published, on the steady clock
  char pad1[44];
  // Peers waiting for this rank sleep on `wake`, which it bumps when it publishes while
  // `sleepers` > 0: a publish wakes only the ranks that wait for this one.
  std::atomic<uint32_t> sleepers;
  std::atomic<uint32_t> wake;
  char pad2[56];
  CallMeta meta[2];   // per slot parity: what the call starting at that step is
  cpu_set_t allowed;  // the CPUs this rank may run on, as of its last call
  int32_t pid;
  uint64_t pid_ns;
  uint64_t probe_address;      // where this rank's probe word lies in its process
  std::atomic<int32_t> reach;  // a ShmChannel::Reach: whether this rank reaches its peers' memory
  // When this rank last found, at the start of a call, that its calling thread had waited for a
  // CPU a good share of the time lately (steady clock): another process or thread wanted it.
  std::atomic<int64_t> cpu_waited_ns;
  // 1 + the shared block this rank is claiming or summing, 0 while it holds none: whom a wait for
  // the blocks to be done is waiting for.
  std::atomic<uint64_t> summing;
  char message[512];  // why this rank rejected its input or aborted
};

struct ShmChannel::Header {
  uint64_t magic;
  int32_t nranks;
  uint64_t block_bytes;
  uint64_t wide_bytes;
  alignas(64) std::atomic<int32_t> aborted_by;  // 0, or the local rank + 1 that gave up
  // Shared all-reduces: the blocks claimed and the blocks done, counted over every call, and the
  // word their waiters sleep on.
  alignas(64) std::atomic<uint64_t> claimed_blocks;
  alignas(64) std::atomic<uint64_t> done_blocks;
  std::atomic<uint32_t> done_sleepers;
  std::atomic<uint32_t> done_wake;
};

size_t ShmLayout::control_offset() { return round_up(sizeof(ShmChannel::Header), 64); }

size_t ShmLayout::data_offset() const {
  return round_up(control_offset() + size_t(nranks) * sizeof(ShmChannel::RankControl), kPage);
}

size_t ShmLayout::p2p_offset() const {
  // Two input slots per rank, then two output slots that hold a wide block's sum in float32:
  // twice the bytes of a block in the narrowest wire dtype.
  return data_offset() + 2 * size_t(nranks) * wide_bytes + 2 * 2 * wide_bytes;
}

size_t ShmLayout::segment_bytes() const { return p2p_offset() + P2PLayout{nranks}.bytes(); }

ShmChannel::ShmChannel(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
                       std::vector<int> ranks, std::chrono::milliseconds timeout, bool initialize)
    : segment_(std::move(segment)),
      layout_(layout),
      me_(local_rank),
      ranks_(std::move(ranks)),
      timeout_(timeout) {
  TORCH_CHECK_VALUE(layout_.nranks >= 1 && layout_.nranks <= kMaxLocalRanks && me_ >= 0 &&
                        me_ < layout_.nranks && int(ranks_.size()) == layout_.nranks,
                    "ddpx: bad shared-memory group: local rank ", me_, " of ", layout_.nranks,
                    " (at most ", kMaxLocalRanks, " ranks per node)");
  TORCH_CHECK_VALUE(layout_.block_bytes > 0 && layout_.block_bytes % kPage == 0,
                    "ddpx: block size must be a positive multiple of 4 KiB");
  TORCH_CHECK_VALUE(
      layout_.wide_bytes >= layout_.block_bytes && layout_.wide_bytes % layout_.block_bytes == 0,
      "ddpx: the wide block must be a multiple of the block");
  TORCH_CHECK_VALUE(segment_->size() == layout_.segment_bytes(),
                    "ddpx: shared memory segment does not match its layout");
  header_ = reinterpret_cast<Header*>(segment_->data());
  control_ = reinterpret_cast<RankControl*>(segment_->data() + ShmLayout::control_offset());
  data_ = segment_->data() + layout_.data_offset();
  if (initialize) {
    header_->nranks = layout_.nranks;
    header_->block_bytes = layout_.block_bytes;
    header_->wide_bytes = layout_.wide_bytes;
    header_->magic = kMagic;
  } else {
    TORCH_CHECK(header_->magic == kMagic && header_->nranks == layout_.nranks &&
                    header_->block_bytes == layout_.block_bytes &&
                    header_->wide_bytes == layout_.wide_bytes,
                "ddpx: shared memory segment was made by another ddpx version or layout");
  }
  yield_ban_ = kFirstYieldBan;
  control_[me_].allowed = allowed_cpus();
  control_[me_].pid = int32_t(getpid());
  control_[me_].pid_ns = pid_namespace();
  probe_word_ = uint64_t(getpid());
  control_[me_].probe_address = reinterpret_cast<uint64_t>(&probe_word_);
}

char* ShmChannel::input_slot(int rank, uint64_t step) const {
  return data_ + (2 * size_t(rank) + (step & 1)) * layout_.wide_bytes;
}

char* ShmChannel::output_slot(uint64_t step) const {
  return data_ + (2 * size_t(layout_.nranks) + 2 * (step & 1)) * layout_.wide_bytes;
}

void ShmChannel::post(uint64_t step, const CallMeta& meta) { control_[me_].meta[step & 1] = meta; }

const CallMeta& ShmChannel::posted(int rank, uint64_t step) const {
  return control_[rank].meta[step & 1];
}

void ShmChannel::set_message(const std::string& text) {
  std::snprintf(control_[me_].message, sizeof control_[me_].message, "%s", text.c_str());
}

std::string ShmChannel::message(int rank) const { return control_[rank].message; }

std::string ShmChannel::rank_name(int local) const {
  return "rank " + std::to_string(ranks_[size_t(local)]);
}

void ShmChannel::publish(Phase phase, uint64_t step) {
  RankControl& mine = control_[me_];
  mine.cpu.store(sched_getcpu(), std::memory_order_relaxed);
  mine.published_ns.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  counter(me_, phase).store(step, std::memory_order_seq_cst);
  // Paired with the sleeper's increment-then-recheck: either it sees our step or we see it.
  if (mine.sleepers.load(std::memory_order_seq_cst) > 0) {
    mine.wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&mine.wake);
  }
}

bool ShmChannel::exited(int rank) const {
  const int pid = control_[rank].pid;
  return pid > 0 && control_[rank].pid_ns == control_[me_].pid_ns && process_exited(pid);
}

void ShmChannel::check_not_aborted() const {
  const int32_t by = header_->aborted_by.load(std::memory_order_acquire);
  if (by == 0 || by == me_ + 1) return;
  C10_THROW_ERROR(DistBackendError, "ddpx: the shared-memory all-reduce was aborted by " +
                                        rank_name(by - 1) + ": " + control_[by - 1].message);
}

void ShmChannel::fail(const std::string& message) {
  failure_ = message;
  set_message(message);
  int32_t none = 0;
  header_->aborted_by.compare_exchange_strong(none, me_ + 1, std::memory_order_acq_rel);
  for (int r = 0; r < layout_.nranks; ++r) {
    control_[r].wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&control_[r].wake);
  }
  header_->done_wake.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&header_->done_wake);
  if (on_fail_) on_fail_(message);
  C10_THROW_ERROR(DistBackendError, message);
}

std::atomic<uint64_t>& ShmChannel::counter(int rank, Phase phase) const {
  return phase == Phase::Arrive ? control_[rank].arrived : control_[rank].reduced;
}

bool ShmChannel::behind(int rank, Phase phase, uint64_t step) const {
  return rank != me_ && counter(rank, phase).load(std::memory_order_seq_cst) < step;
}

bool ShmChannel::peers_at(Phase phase, uint64_t step) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step)) return false;
  }
  return true;
}

bool ShmChannel::awaited_on_cpu(Phase phase, uint64_t step, int cpu) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step) && control_[r].cpu.load(std::memory_order_relaxed) == cpu) {
      return true;
    }
  }
  return false;
}

bool ShmChannel::may_run_on(int rank, int cpu) const {
  return cpu < 0 || CPU_ISSET(cpu, &control_[rank].allowed);
}

bool ShmChannel::awaited_may_run_on(Phase phase, uint64_t step, int cpu) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step) && may_run_on(r, cpu)) return true;
  }
  return false;
}

bool ShmChannel::awaited_quiet(Phase phase, uint64_t step, int64_t since_ns) const {
  for (int r = 0; r < layout_.nranks; ++r) {
    if (behind(r, phase, step) &&
        control_[r].published_ns.load(std::memory_order_relaxed) >= since_ns) {
      return false;
    }
  }
  return true;
}

int ShmChannel::ranks_cpu_count() const {
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int r = 0; r < layout_.nranks; ++r) CPU_OR(&all, &all, &control_[r].allowed);
  return CPU_COUNT(&all);
}

std::string ShmChannel::wait_policy() const {
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
           std::to_string(cpus) + " CPUs), then spin up to " + us(kSpinFor) + ", then sleep";
  }
  return "waits spin up to " + us(apart ? kSpinApart : kSpinFor) +
         (apart ? " (this rank is bound apart from its peers)" : "") +
         ", less once the awaited ranks are silent for " + us(kPeerQuiet) + ", then sleep";
}

ShmChannel::WaitStats ShmChannel::wait_stats() const {
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
bool ShmChannel::yield_while_cheap(Phase phase, uint64_t step, Clock::time_point start) {
  for (auto asked = start; asked - start < kYieldFor;) {
    sched_yield();
    yields_.fetch_add(1, std::memory_order_relaxed);
    if (peers_at(phase, step)) return true;
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

bool ShmChannel::spin_while_running(Phase phase, uint64_t step, Clock::time_point start,
                                    bool wide) {
  const int cpu = sched_getcpu();
  const auto spin_for = awaited_may_run_on(phase, step, cpu) ? kSpinFor : kSpinApart;
  const int64_t quiet_ns = std::chrono::nanoseconds(kPeerQuiet).count();
  Clock::time_point now;
  do {
    for (int i = 0; i < 32; ++i) {
      if (peers_at(phase, step)) return true;
      cpu_relax();
    }
    now = Clock::now();
  } while (!awaited_on_cpu(phase, step, cpu) && now - start < spin_for &&
           (wide || !awaited_quiet(phase, step, now.time_since_epoch().count() - quiet_ns)));
  return false;
}

void ShmChannel::wait_all(Phase phase, uint64_t step, const std::string& what, bool wide) {
  if (peers_at(phase, step)) return;
  waits_.fetch_add(1, std::memory_order_relaxed);
  const auto start = Clock::now();
  const TimedWait timed{start, waited_ns_};
  if (oversubscribed_ && start >= yields_banned_until_) {
    if (yield_while_cheap(phase, step, start)) return;
  } else if (spin_while_running(phase, step, start, wide)) {
    return;
  }
  const auto timeout = wait_timeout();
  const auto deadline = start + timeout;
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
                 std::min<std::chrono::nanoseconds>(kPoll, deadline - Clock::now()));
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
      if (exited(r)) {
        fail("ddpx: " + rank_name(r) + " (pid " + std::to_string(control_[r].pid) +
             ") exited while " + rank_name(me_) + " waited for it to " + doing + " " + what +
             " (step " + std::to_string(step) + ")");
      }
    }
    if (Clock::now() >= deadline) {
      std::ostringstream names;
      for (size_t i = 0; i < late.size(); ++i) names << (i ? ", " : "") << ranks_[size_t(late[i])];
      fail("ddpx: " + rank_name(me_) + " timed out after " + seconds_text(timeout) +
           " s waiting for rank(s) " + names.str() + " to " + doing + " " + what + " (step " +
           std::to_string(step) + "); raise the timeout if a peer can be this slow");
    }
  }
}

bool ShmChannel::claim_block(uint64_t end, uint64_t* block) {
  std::atomic<uint64_t>& summing = control_[me_].summing;
  uint64_t next = header_->claimed_blocks.load(std::memory_order_relaxed);
  while (next < end) {
    // Said before the claim, so a rank stopped between the two is still named as holding it.
    summing.store(next + 1, std::memory_order_relaxed);
    if (header_->claimed_blocks.compare_exchange_weak(next, next + 1, std::memory_order_acq_rel)) {
      *block = next;
      return true;
    }
  }
  summing.store(0, std::memory_order_relaxed);
  return false;
}

void ShmChannel::block_done(uint64_t end) {
  control_[me_].summing.store(0, std::memory_order_relaxed);
  // Paired with the sleeper's increment-then-recheck, as in publish.
  const uint64_t done = header_->done_blocks.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (done == end && header_->done_sleepers.load(std::memory_order_seq_cst) > 0) {
    header_->done_wake.fetch_add(1, std::memory_order_seq_cst);
    futex_wake_all(&header_->done_wake);
  }
}

// A shared call's last blocks are being summed by ranks that are running (they claimed them), so
// the wait spins as wait_all's does while they may run elsewhere, then sleeps; every kPoll it
// checks that no peer has exited and that the timeout has not passed.
void ShmChannel::wait_blocks_done(uint64_t end, const std::string& what) {
  const auto done = [&] { return header_->done_blocks.load(std::memory_order_acquire) >= end; };
  if (done()) return;
  waits_.fetch_add(1, std::memory_order_relaxed);
  const auto start = Clock::now();
  const TimedWait timed{start, waited_ns_};
  if (!oversubscribed_) {
    const int cpu = sched_getcpu();
    bool apart = true;
    for (int r = 0; r < layout_.nranks; ++r) {
      if (r != me_ && may_run_on(r, cpu)) apart = false;
    }
    const auto spin_for = apart ? kSpinApart : kSpinFor;
    do {
      for (int i = 0; i < 32; ++i) {
        if (done()) return;
        cpu_relax();
      }
    } while (Clock::now() - start < spin_for);
  }
  const auto timeout = wait_timeout();
  const auto deadline = start + timeout;
  while (true) {
    check_not_aborted();
    header_->done_sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t epoch = header_->done_wake.load(std::memory_order_seq_cst);
    if (!done() && header_->aborted_by.load(std::memory_order_seq_cst) == 0) {
      sleeps_.fetch_add(1, std::memory_order_relaxed);
      futex_wait(&header_->done_wake, epoch,
                 std::min<std::chrono::nanoseconds>(kPoll, deadline - Clock::now()));
    }
    header_->done_sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (done()) return;
    for (int r = 0; r < layout_.nranks; ++r) {
      if (r != me_ && exited(r)) {
        fail("ddpx: " + rank_name(r) + " (pid " + std::to_string(control_[r].pid) +
             ") exited while " + rank_name(me_) + " waited for the ranks to sum " + what);
      }
    }
    if (Clock::now() >= deadline) {
      std::ostringstream names;
      for (int r = 0; r < layout_.nranks; ++r) {
        if (r != me_ && control_[r].summing.load(std::memory_order_relaxed) > 0) {
          names << (names.tellp() > 0 ? ", " : "") << ranks_[size_t(r)];
        }
      }
      fail("ddpx: " + rank_name(me_) + " timed out after " + seconds_text(timeout) +
           " s waiting for " +
           (names.tellp() > 0 ? "rank(s) " + names.str() : std::string("the ranks")) +
           " to sum their blocks of " + what + "; raise the timeout if a peer can be this slow");
    }
  }
}

void ShmChannel::copy_with_peer(PeerCopy copy, const char* verb, int rank, void* local_bytes,
                                uint64_t remote_address, size_t bytes, const std::string& what) {
  for (size_t done = 0; done < bytes;) {
    iovec local{static_cast<char*>(local_bytes) + done, bytes - done};
    iovec remote{reinterpret_cast<void*>(remote_address + done), bytes - done};
    const ssize_t n = copy(control_[rank].pid, &local, 1, &remote, 1, 0);
    if (n <= 0) {
      const int error = errno;
      fail("ddpx: " + rank_name(me_) + " could not " + verb + " " + std::to_string(bytes) +
           " bytes of " + rank_name(rank) + "'s tensor (pid " + std::to_string(control_[rank].pid) +
           ") for " + what + ": " + std::strerror(error) +
           (error == ESRCH ? " (the process has exited)" : ""));
    }
    done += size_t(n);
  }
}

void ShmChannel::read_peer(int rank, void* to, uint64_t from, size_t bytes,
                           const std::string& what) {
  copy_with_peer(process_vm_readv, "read", rank, to, from, bytes, what);
}

void ShmChannel::write_peer(int rank, uint64_t to, const void* from, size_t bytes,
                            const std::string& what) {
  // process_vm_writev only reads the local bytes.
  copy_with_peer(process_vm_writev, "write", rank, const_cast<void*>(from), to, bytes, what);
}

void ShmChannel::probe_peers() {
  std::string because;
  for (int r = 0; r < layout_.nranks && because.empty(); ++r) {
    if (r == me_) continue;
    const RankControl& peer = control_[r];
    if (peer.pid_ns != control_[me_].pid_ns) {
      because = rank_name(r) + " runs in another pid namespace";
      continue;
    }
    uint64_t word = 0;
    errno = 0;
    iovec local{&word, sizeof word};
    iovec remote{reinterpret_cast<void*>(peer.probe_address), sizeof word};
    if (process_vm_readv(peer.pid, &local, 1, &remote, 1, 0) != ssize_t(sizeof word) ||
        word != uint64_t(peer.pid) ||
        process_vm_writev(peer.pid, &local, 1, &remote, 1, 0) != ssize_t(sizeof word)) {
      because = "process_vm_readv/writev to " + rank_name(r) +
                " failed: " + std::strerror(errno ? errno : EIO);
    }
  }
  unreachable_because_ = because;
  control_[me_].reach.store(int32_t(because.empty() ? Reach::Yes : Reach::No),
                            std::memory_order_release);
}

ShmChannel::Reach ShmChannel::reachable() const {
  Reach all = Reach::Yes;
  for (int r = 0; r < layout_.nranks; ++r) {
    const auto reach = Reach(control_[r].reach.load(std::memory_order_acquire));
    if (reach == Reach::No) return Reach::No;
    if (reach == Reach::Unknown) all = Reach::Unknown;
  }
  return all;
}

void ShmChannel::begin_call() {
  if (!failure_.empty()) {
    C10_THROW_ERROR(DistBackendError, failure_ + " (the engine is unusable after this)");
  }
  check_not_aborted();
  // The binding is the user's and may change between calls (taskset -p): each call reads it.
  // A peer's set may be a call old, or torn while it writes it; either only misjudges one wait.
  control_[me_].allowed = allowed_cpus();
  oversubscribed_ = oversubscribed();
  const auto now = Clock::now();
  if (now - delay_since_ < kDelaySpan) return;
  const int tid = int(gettid());
  const int64_t delay = run_delay_ns();
  if (tid == delay_tid_ && delay >= 0 && delay_at_ >= 0 &&
      double(delay - delay_at_) >= kBusyDelayShare * double((now - delay_since_).count())) {
    control_[me_].cpu_waited_ns.store(now.time_since_epoch().count(), std::memory_order_relaxed);
  }
  delay_tid_ = tid;
  delay_at_ = delay;
  delay_since_ = now;
}

bool ShmChannel::waited_for_cpu_within(Clock::duration window) const {
  const int64_t since = (Clock::now() - window).time_since_epoch().count();
  for (int r = 0; r < layout_.nranks; ++r) {
    if (control_[r].cpu_waited_ns.load(std::memory_order_relaxed) >= since) return true;
  }
  return false;
}

}  // namespace ddpx
