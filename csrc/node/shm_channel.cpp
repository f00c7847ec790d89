// The node's shared-memory channel: the segment's layout, the ranks' counters and call
// descriptions, the waits for them (through the waiter), and aborts.
#include "shm_channel.h"

#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "../collectives/shm_p2p.h"
#include "../common/errors.h"

namespace ddpx {
namespace {

constexpr uint64_t kMagic = 0x3878706464ULL;  // "ddpx8": shared all-reduces' block counters
// A rank that shares its core with a CPU-bound process waits for it a large share of the time;
// one on an idle machine, though preempted often (by every short task that wakes on its core
// while it spins), hardly at all (docs/under-load.md has the figures).
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
  // Peers waiting for this rank sleep on `wake`, which it rings when it publishes: a publish
  // wakes only the ranks that wait for this one.
  WakeWord wake;
  char pad2[56];
  CallMeta meta[2];   // per slot parity: what the call starting at that step is
  cpu_set_t allowed;  // the CPUs this rank may run on, as of its last call
  int32_t pid;
  uint64_t pid_ns;
  PeerMemoryWords memory;  // its probe word, and whether it reaches its peers' memory
  // When this rank last found, at the start of a call, that its calling thread had waited for a
  // CPU a good share of the time lately (steady clock): another process or thread wanted it.
  std::atomic<int64_t> cpu_waited_ns;
  // How many of this rank's threads are claiming or summing a shared block: whom a wait for the
  // blocks to be done is waiting for.
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
  WakeWord done_wake;
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

std::vector<NumaRange> ShmLayout::numa_ranges(const std::vector<int>& rank_nodes) const {
  TORCH_CHECK_VALUE(int(rank_nodes.size()) == nranks, "ddpx: ", rank_nodes.size(),
                    " ranks' NUMA nodes for a segment of ", nranks, " ranks");
  // As ShmChannel::input_slot and output_slot lay them out: a rank's two input slots together.
  const size_t inputs = data_offset();
  const size_t outputs = inputs + 2 * size_t(nranks) * wide_bytes;
  std::vector<NumaRange> ranges;
  for (int r = 0; r < nranks; ++r) {
    const int node = rank_nodes[size_t(r)];
    ranges.push_back(NumaRange{
        inputs + 2 * size_t(r) * wide_bytes, 2 * wide_bytes, NumaRange::Mode::Preferred, {node}});
  }
  std::vector<int> nodes(rank_nodes);
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  const auto mode = nodes.size() == 1 ? NumaRange::Mode::Preferred : NumaRange::Mode::Interleaved;
  ranges.push_back(NumaRange{outputs, p2p_offset() - outputs, mode, nodes});
  return ranges;
}

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
  control_[me_].allowed = allowed_cpus();
  control_[me_].pid = int32_t(getpid());
  control_[me_].pid_ns = pid_namespace();
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
  mine.wake.ring();
}

bool ShmChannel::exited(int rank) const {
  const int pid = control_[rank].pid;
  return pid > 0 && same_pid_namespace(rank) && process_exited(pid);
}

void ShmChannel::check_not_aborted() const {
  // This rank's own give-up too: a wait on another of its threads (an abort's target, a helper)
  // ends with it rather than waiting out its timeout.
  const int32_t by = header_->aborted_by.load(std::memory_order_acquire);
  if (by == 0) return;
  C10_THROW_ERROR(DistBackendError, "ddpx: the collective was aborted by " + rank_name(by - 1) +
                                        ": " + control_[by - 1].message);
}

void ShmChannel::fail(const std::string& message) {
  failure_ = message;
  abort(message);
  C10_THROW_ERROR(DistBackendError, message);
}

void ShmChannel::abort(const std::string& why) {
  set_message(why);
  int32_t none = 0;
  header_->aborted_by.compare_exchange_strong(none, me_ + 1, std::memory_order_acq_rel);
  for (int r = 0; r < layout_.nranks; ++r) control_[r].wake.wake();
  header_->done_wake.wake();
  if (on_fail_) on_fail_(why);
}

std::atomic<uint64_t>& ShmChannel::counter(int rank, Phase phase) const {
  return phase == Phase::Arrive ? control_[rank].arrived : control_[rank].reduced;
}

RankSet ShmChannel::peers() const {
  return ~RankSet(0) >> (64 - layout_.nranks) & ~(RankSet(1) << me_);
}

RankSet ShmChannel::late(Phase phase, uint64_t step) const {
  RankSet late = 0;
  for (int r = 0; r < layout_.nranks; ++r) {
    if (r != me_ && counter(r, phase).load(std::memory_order_seq_cst) < step) {
      late |= RankSet(1) << r;
    }
  }
  return late;
}

bool ShmChannel::may_run_on(RankSet ranks, const cpu_set_t& cpus) const {
  for (; ranks != 0; ranks &= ranks - 1) {
    cpu_set_t shared;
    CPU_AND(&shared, &cpus, &control_[__builtin_ctzll(ranks)].allowed);
    if (CPU_COUNT(&shared) > 0) return true;
  }
  return false;
}

std::string ShmChannel::numbers(RankSet ranks) const {
  std::string text;
  for (; ranks != 0; ranks &= ranks - 1) {
    text += (text.empty() ? "" : ", ") + std::to_string(ranks_[size_t(__builtin_ctzll(ranks))]);
  }
  return text;
}

int ShmChannel::ranks_cpu_count() const {
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int r = 0; r < layout_.nranks; ++r) CPU_OR(&all, &all, &control_[r].allowed);
  return CPU_COUNT(&all);
}

std::string ShmChannel::wait_policy() const {
  return Waiter::policy(layout_.nranks, ranks_cpu_count(),
                        !may_run_on(peers(), control_[me_].allowed));
}

// What the channel's waits share: the peers' bindings, their exits, the abort.
class ShmChannel::Wait : public Waiter::Awaited {
 public:
  Wait(ShmChannel& channel, const std::string& what) : ch_(channel), what_(what) {}

  std::string me() const override { return ch_.rank_name(ch_.me_); }
  std::string exited() const override {
    for (RankSet r = awaited(); r != 0; r &= r - 1) {
      const int rank = __builtin_ctzll(r);
      if (ch_.exited(rank)) {
        return ch_.rank_name(rank) + " (pid " + std::to_string(ch_.control_[rank].pid) + ")";
      }
    }
    return "";
  }
  bool may_run_on(int cpu) const override {
    if (cpu < 0) return awaited() != 0;
    cpu_set_t here;
    CPU_ZERO(&here);
    CPU_SET(cpu, &here);
    return ch_.may_run_on(awaited(), here);
  }
  bool aborted() const override {
    return ch_.header_->aborted_by.load(std::memory_order_seq_cst) != 0;
  }
  void check_not_aborted() const override { ch_.check_not_aborted(); }
  void fail(const std::string& why) override { ch_.fail(why); }

 protected:
  // The ranks the wait may still be waiting for: whose binding decides the spin, and whose exit
  // ends the wait.
  virtual RankSet awaited() const = 0;

  ShmChannel& ch_;
  const std::string& what_;
};

// A wait for every peer to publish a step in a phase.
class ShmChannel::StepWait final : public ShmChannel::Wait {
 public:
  StepWait(ShmChannel& channel, Phase phase, uint64_t step, const std::string& what, bool wide)
      : Wait(channel, what), phase_(phase), step_(step), wide_(wide) {}

  WakeWord* word() const override {
    const RankSet late = awaited();
    return late == 0 ? nullptr : &ch_.control_[__builtin_ctzll(late)].wake;
  }
  // A rank that last published from this CPU cannot be running now (this thread is); a wide
  // step's ranks publish too seldom to be judged descheduled by their silence.
  bool descheduled(int cpu, int64_t since_ns) const override {
    bool quiet = !wide_;
    for (RankSet r = awaited(); r != 0; r &= r - 1) {
      const RankControl& peer = ch_.control_[__builtin_ctzll(r)];
      if (peer.cpu.load(std::memory_order_relaxed) == cpu) return true;
      if (peer.published_ns.load(std::memory_order_relaxed) >= since_ns) quiet = false;
    }
    return quiet;
  }
  bool yields() const override { return true; }
  std::string waited_for(bool gone) const override {
    return "for " + (gone ? std::string("it") : "rank(s) " + ch_.numbers(awaited())) + " to " +
           (phase_ == Phase::Arrive ? "send its block of " : "reduce its slice of ") + what_ +
           " (step " + std::to_string(step_) + ")";
  }

 private:
  RankSet awaited() const override { return ch_.late(phase_, step_); }

  Phase phase_;
  uint64_t step_;
  bool wide_;
};

void ShmChannel::wait_all(Phase phase, uint64_t step, const std::string& what, bool wide) {
  if (late(phase, step) == 0) return;
  StepWait wait(*this, phase, step, what, wide);
  waiter_.wait(wait, wait_timeout());
}

bool ShmChannel::claim_block(uint64_t end, uint64_t* block) {
  std::atomic<uint64_t>& summing = control_[me_].summing;
  // Said before the claim, so a rank stopped between the two is still named as holding it.
  summing.fetch_add(1, std::memory_order_relaxed);
  uint64_t next = header_->claimed_blocks.load(std::memory_order_relaxed);
  while (next < end) {
    if (header_->claimed_blocks.compare_exchange_weak(next, next + 1, std::memory_order_acq_rel)) {
      *block = next;
      return true;
    }
  }
  summing.fetch_sub(1, std::memory_order_relaxed);
  return false;
}

void ShmChannel::block_done(uint64_t end) {
  control_[me_].summing.fetch_sub(1, std::memory_order_relaxed);
  // Paired with the sleeper's increment-then-recheck, as in publish.
  const uint64_t done = header_->done_blocks.fetch_add(1, std::memory_order_seq_cst) + 1;
  if (done == end) header_->done_wake.ring();
}

// A wait for a shared call's blocks to be done. Its last blocks are being summed by ranks that
// are running (they claimed them): the wait spins while they may run elsewhere, then sleeps.
class ShmChannel::BlocksWait final : public ShmChannel::Wait {
 public:
  BlocksWait(ShmChannel& channel, uint64_t end, const std::string& what)
      : Wait(channel, what), end_(end) {}

  WakeWord* word() const override {
    const bool done = ch_.header_->done_blocks.load(std::memory_order_acquire) >= end_;
    return done ? nullptr : &ch_.header_->done_wake;
  }
  // The claimers publish nothing while they sum.
  bool descheduled(int, int64_t) const override { return false; }
  bool yields() const override { return false; }
  std::string waited_for(bool gone) const override {
    if (gone) return "for the ranks to sum " + what_;
    RankSet summing = 0;
    for (int r = 0; r < ch_.layout_.nranks; ++r) {
      if (r != ch_.me_ && ch_.control_[r].summing.load(std::memory_order_relaxed) > 0) {
        summing |= RankSet(1) << r;
      }
    }
    return "for " + (summing == 0 ? std::string("the ranks") : "rank(s) " + ch_.numbers(summing)) +
           " to sum their blocks of " + what_;
  }

 private:
  // Any peer may claim a block until all are claimed.
  RankSet awaited() const override { return ch_.peers(); }

  uint64_t end_;
};

void ShmChannel::wait_blocks_done(uint64_t end, const std::string& what) {
  if (header_->done_blocks.load(std::memory_order_acquire) >= end) return;
  BlocksWait wait(*this, end, what);
  waiter_.wait(wait, wait_timeout());
}

pid_t ShmChannel::pid(int rank) const { return control_[rank].pid; }

PeerMemoryWords& ShmChannel::memory_words(int rank) const { return control_[rank].memory; }

bool ShmChannel::same_pid_namespace(int rank) const {
  return control_[rank].pid_ns == control_[me_].pid_ns;
}

void ShmChannel::begin_call() {
  if (!failure_.empty()) {
    C10_THROW_ERROR(DistBackendError, failure_ + " (the engine is unusable after this)");
  }
  check_not_aborted();
  // The binding is the user's and may change between calls (taskset -p): each call reads it.
  // A peer's set may be a call old, or torn while it writes it; either only misjudges one wait.
  control_[me_].allowed = allowed_cpus();
  waiter_.set_oversubscribed(oversubscribed());
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
