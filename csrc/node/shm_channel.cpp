// The node's shared-memory channel: the segment's layout, the ranks' counters and call
// descriptions, the waits for them (through the waiter), and aborts.
#include "shm_channel.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "../collectives/shm_p2p.h"
#include "../common/errors.h"

namespace ddpx {
namespace {

constexpr uint64_t kMagic = 0x3978706464ULL;  // "ddpx9": the flight record
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

// A process's state letter in /proc/<pid>/stat ('R', 'S', 'T', ...): 'X' once it is gone, 0 where
// the line cannot be parsed. Only meaningful inside our own pid namespace.
char process_state_letter(int pid) {
  std::ifstream stat_file("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!stat_file || !std::getline(stat_file, line)) return 'X';
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() ? 0 : line[paren + 2];
}

// A process that is gone or a zombie.
bool process_exited(int pid) {
  const char state = process_state_letter(pid);
  return state == 'Z' || state == 'X';
}

// A process's state in words.
std::string process_state(int pid) {
  switch (const char state = process_state_letter(pid)) {
    case 0:
      return "of unknown state";
    case 'R':
      return "running";
    case 'S':
      return "sleeping";
    case 'D':
      return "in uninterruptible sleep";
    case 'T':
      return "stopped (SIGSTOP)";
    case 't':
      return "stopped by a debugger";
    case 'Z':
    case 'X':
      return "exited";
    default:
      return std::string("in state ") + state;
  }
}

// A call's state, and what a rank waits for, in its flight record.
enum CallState : int32_t { kInFlight = 1, kDone = 2, kFailed = 3 };
enum WaitKind : int32_t { kNotWaiting = 0, kWaitArrive = 1, kWaitReduce = 2, kWaitBlocks = 3 };

// A time as the flight record prints it: "12 us", "0.8 ms", "10.0 s".
std::string duration_text(int64_t ns) {
  char text[32];
  if (ns < 1000000) {
    std::snprintf(text, sizeof text, "%lld us",
                  static_cast<long long>(std::max<int64_t>(ns, 0) / 1000));
  } else if (ns < 1000000000) {
    std::snprintf(text, sizeof text, "%.1f ms", double(ns) / 1e6);
  } else {
    std::snprintf(text, sizeof text, "%.1f s", double(ns) / 1e9);
  }
  return text;
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

// A call in its rank's flight record. Only the rank writes it; `call` is the sequence word of a
// seqlock as well (0 while the rank rewrites the record), so that a peer reading a running rank
// can tell a torn copy. Times are on the steady clock, which every process of the machine shares.
struct alignas(64) ShmChannel::RecordedCall {
  std::atomic<uint64_t> call;  // the call's number (CallMeta::call); 0: none, or being written
  std::atomic<int32_t> state;  // CallState
  std::atomic<int32_t> op;     // CallMeta's op, numel, dtype, wire and torch_dtype
  std::atomic<int32_t> dtype;
  std::atomic<int32_t> wire;
  std::atomic<int32_t> torch_dtype;
  std::atomic<int64_t> numel;
  std::atomic<uint64_t> first_step;
  std::atomic<int64_t> began_ns;
  std::atomic<int64_t> ended_ns;
};
static_assert(sizeof(ShmChannel::RecordedCall) == 64, "a recorded call is one cache line");

// A rank's flight record as a reader copied it.
struct ShmChannel::RankRecord {
  struct Call {
    uint64_t call;
    int32_t state, op, dtype, wire, torch_dtype;
    int64_t numel;
    uint64_t first_step;
    int64_t began_ns, ended_ns;
  };
  uint64_t arrived, reduced, queued, waiting_for;
  int32_t waiting;
  int64_t waiting_since_ns;
  std::string process;      // "pid 4242, stopped (SIGSTOP)"
  std::string state;        // "stopped (SIGSTOP)", or empty where its pid cannot be seen
  std::vector<Call> calls;  // newest first
  uint64_t newest() const { return calls.empty() ? 0 : calls.front().call; }
};

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
  // The flight record, on lines of its own: the rank writes them at every call and every wait it
  // has to make, and its peers read them only to report, so no hot wait shares their lines.
  alignas(64) std::atomic<uint64_t> queued;  // jobs waiting in its engine behind the one running
  std::atomic<int32_t> waiting;              // WaitKind
  std::atomic<uint64_t> waiting_for;         // the step, or the shared blocks' end
  std::atomic<int64_t> waiting_since_ns;     // steady clock
  RecordedCall calls[kRecordedCalls];        // call n in calls[n % kRecordedCalls]
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
                                        ": " + control_[by - 1].message + "\n" + flight_record());
}

void ShmChannel::fail(const std::string& message) {
  failure_ = message;
  // Read before the peers are let go: the record of the moment this rank gave up.
  const std::string record = flight_record();
  abort(message);
  C10_THROW_ERROR(DistBackendError, message + "\n" + record);
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

// A wait in this rank's flight record while it lasts.
struct ShmChannel::RecordedWait {
  RecordedWait(ShmChannel& channel, int32_t kind, uint64_t until) : ch(channel) {
    ch.record_wait(kind, until);
  }
  ~RecordedWait() { ch.record_wait_over(); }
  ShmChannel& ch;
};

void ShmChannel::wait_all(Phase phase, uint64_t step, const std::string& what, bool wide) {
  if (late(phase, step) == 0) return;
  const RecordedWait recorded(*this, phase == Phase::Arrive ? kWaitArrive : kWaitReduce, step);
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
  const RecordedWait recorded(*this, kWaitBlocks, end);
  BlocksWait wait(*this, end, what);
  waiter_.wait(wait, wait_timeout());
}

pid_t ShmChannel::pid(int rank) const { return control_[rank].pid; }

PeerMemoryWords& ShmChannel::memory_words(int rank) const { return control_[rank].memory; }

bool ShmChannel::same_pid_namespace(int rank) const {
  return control_[rank].pid_ns == control_[me_].pid_ns;
}

ShmChannel::Clock::time_point ShmChannel::begin_call() {
  if (!failure_.empty()) {
    C10_THROW_ERROR(DistBackendError, failure_ + " (the engine is unusable after this)");
  }
  check_not_aborted();
  // The binding is the user's and may change between calls (taskset -p): each call reads it.
  // A peer's set may be a call old, or torn while it writes it; either only misjudges one wait.
  control_[me_].allowed = allowed_cpus();
  waiter_.set_oversubscribed(oversubscribed());
  const auto now = Clock::now();
  if (now - delay_since_ < kDelaySpan) return now;
  const int tid = int(gettid());
  const int64_t delay = run_delay_ns();
  if (tid == delay_tid_ && delay >= 0 && delay_at_ >= 0 &&
      double(delay - delay_at_) >= kBusyDelayShare * double((now - delay_since_).count())) {
    control_[me_].cpu_waited_ns.store(now.time_since_epoch().count(), std::memory_order_relaxed);
  }
  delay_tid_ = tid;
  delay_at_ = delay;
  delay_since_ = now;
  return now;
}

bool ShmChannel::waited_for_cpu_within(Clock::duration window) const {
  const int64_t since = (Clock::now() - window).time_since_epoch().count();
  for (int r = 0; r < layout_.nranks; ++r) {
    if (control_[r].cpu_waited_ns.load(std::memory_order_relaxed) >= since) return true;
  }
  return false;
}

void ShmChannel::record_call(const CallMeta& meta, uint64_t first_step, Clock::time_point began) {
  RankControl& mine = control_[me_];
  const int64_t now = began.time_since_epoch().count();
  RecordedCall& before = mine.calls[(meta.call - 1) % kRecordedCalls];
  if (before.state.load(std::memory_order_relaxed) == kInFlight) {
    before.ended_ns.store(now, std::memory_order_relaxed);
    before.state.store(kDone, std::memory_order_release);
  }
  RecordedCall& r = mine.calls[meta.call % kRecordedCalls];
  r.call.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  r.state.store(kInFlight, std::memory_order_relaxed);
  r.op.store(meta.op, std::memory_order_relaxed);
  r.dtype.store(meta.dtype, std::memory_order_relaxed);
  r.wire.store(meta.wire, std::memory_order_relaxed);
  r.torch_dtype.store(meta.torch_dtype, std::memory_order_relaxed);
  r.numel.store(meta.numel, std::memory_order_relaxed);
  r.first_step.store(first_step, std::memory_order_relaxed);
  r.began_ns.store(now, std::memory_order_relaxed);
  r.ended_ns.store(0, std::memory_order_relaxed);
  r.call.store(meta.call, std::memory_order_release);
  last_recorded_ = meta.call;
}

void ShmChannel::record_job_end(bool failed) {
  RecordedCall& r = control_[me_].calls[last_recorded_ % kRecordedCalls];
  if (last_recorded_ == 0 || r.state.load(std::memory_order_relaxed) != kInFlight) return;
  r.ended_ns.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  r.state.store(failed ? kFailed : kDone, std::memory_order_release);
}

void ShmChannel::record_queued(size_t jobs) {
  control_[me_].queued.store(jobs, std::memory_order_relaxed);
}

void ShmChannel::record_wait(int32_t kind, uint64_t until) {
  RankControl& mine = control_[me_];
  mine.waiting_for.store(until, std::memory_order_relaxed);
  mine.waiting_since_ns.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
  mine.waiting.store(kind, std::memory_order_release);
}

void ShmChannel::record_wait_over() {
  control_[me_].waiting.store(kNotWaiting, std::memory_order_relaxed);
}

ShmChannel::RankRecord ShmChannel::read_record(int rank) const {
  const RankControl& c = control_[rank];
  RankRecord out{};
  out.arrived = c.arrived.load(std::memory_order_relaxed);
  out.reduced = c.reduced.load(std::memory_order_relaxed);
  out.queued = c.queued.load(std::memory_order_relaxed);
  out.waiting = c.waiting.load(std::memory_order_acquire);
  out.waiting_for = c.waiting_for.load(std::memory_order_relaxed);
  out.waiting_since_ns = c.waiting_since_ns.load(std::memory_order_relaxed);
  const int pid = c.pid;
  if (pid <= 0) {
    out.process = "not attached yet";
  } else if (!same_pid_namespace(rank)) {
    out.process = "pid " + std::to_string(pid) + " in another pid namespace";
  } else {
    out.state = process_state(pid);
    out.process = "pid " + std::to_string(pid) + ", " + out.state;
  }
  for (const RecordedCall& r : c.calls) {
    // A running rank may rewrite the record as it is read: read again, a few times.
    for (int attempt = 0; attempt < 100; ++attempt) {
      RankRecord::Call copy{};
      copy.call = r.call.load(std::memory_order_acquire);
      if (copy.call == 0) break;  // a slot no call has used yet
      copy.state = r.state.load(std::memory_order_acquire);
      copy.op = r.op.load(std::memory_order_relaxed);
      copy.dtype = r.dtype.load(std::memory_order_relaxed);
      copy.wire = r.wire.load(std::memory_order_relaxed);
      copy.torch_dtype = r.torch_dtype.load(std::memory_order_relaxed);
      copy.numel = r.numel.load(std::memory_order_relaxed);
      copy.first_step = r.first_step.load(std::memory_order_relaxed);
      copy.began_ns = r.began_ns.load(std::memory_order_relaxed);
      copy.ended_ns = r.ended_ns.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (r.call.load(std::memory_order_relaxed) != copy.call) continue;
      out.calls.push_back(copy);
      break;
    }
  }
  std::sort(out.calls.begin(), out.calls.end(),
            [](const RankRecord::Call& a, const RankRecord::Call& b) { return a.call > b.call; });
  return out;
}

namespace {

using RankRecord = ShmChannel::RankRecord;

// "#57 all_reduce of 1048576 float32 (bfloat16 on the wire)", named by names[op].
std::string call_text(const RankRecord::Call& c, const char* const* names, int name_count) {
  std::ostringstream out;
  out << "#" << c.call;
  if (c.numel < 0) {
    out << " (this rank rejected its input)";
    return out.str();
  }
  if (c.op >= 0 && c.op < name_count) {
    out << " " << names[c.op];
  } else {
    out << " collective " << c.op;
  }
  if (c.numel == 0 && c.dtype < 0) return out.str();  // a barrier, or no bytes
  out << " of " << c.numel;
  if (c.dtype < 0) {
    out << " bytes";
    if (c.torch_dtype >= 0) out << " of " << c10::ScalarType(c.torch_dtype);
  } else {
    out << " " << dtype_name(DType(c.dtype));
    if (c.wire != c.dtype && c.wire >= 0) {
      out << " (" << dtype_name(DType(c.wire)) << " on the wire)";
    }
  }
  return out.str();
}

// "in flight for 10.0 s since step 1230", "done in 0.8 ms, 10.1 s ago"
std::string state_text(const RankRecord::Call& c, int64_t now) {
  if (c.state == kInFlight) {
    return "in flight for " + duration_text(now - c.began_ns) + " since step " +
           std::to_string(c.first_step);
  }
  return std::string(c.state == kFailed ? "failed after " : "done in ") +
         duration_text(c.ended_ns - c.began_ns) + ", " + duration_text(now - c.ended_ns) + " ago";
}

}  // namespace

std::string ShmChannel::ranks_text(RankSet ranks) const {
  return ((ranks & (ranks - 1)) == 0 ? "rank " : "ranks ") + numbers(ranks);
}

std::string ShmChannel::behind(const std::vector<RankRecord>& records, int64_t now) const {
  const int n = layout_.nranks;
  const auto key = [&](int r) {
    return std::make_pair(records[size_t(r)].newest(), records[size_t(r)].arrived);
  };
  auto lowest = key(0);
  for (int r = 1; r < n; ++r) lowest = std::min(lowest, key(r));
  RankSet late = 0;
  std::map<uint64_t, RankSet> ahead;  // the other ranks, by the call they are in
  for (int r = 0; r < n; ++r) {
    if (key(r) == lowest) {
      late |= RankSet(1) << r;
    } else {
      ahead[records[size_t(r)].newest()] |= RankSet(1) << r;
    }
  }
  std::ostringstream out;
  if (ahead.empty()) {
    if (lowest.first == 0) return "behind: none, no rank has made a call yet";
    out << "behind: none, every rank is in #" << lowest.first << " at step " << lowest.second;
    return out.str();
  }
  out << "behind: ";
  for (RankSet r = late; r != 0; r &= r - 1) {
    const int rank = __builtin_ctzll(r);
    const RankRecord& rec = records[size_t(rank)];
    out << (r == late ? "" : "; ") << rank_name(rank);
    if (!rec.state.empty()) out << " (" << rec.state << ")";
    if (rec.calls.empty()) {
      out << ", no call yet";
      continue;
    }
    out << ", its last call " << call_text(rec.calls.front(), call_names_, call_name_count_) << ": "
        << state_text(rec.calls.front(), now);
    if (ahead.count(lowest.first)) out << ", at step " << rec.arrived;
  }
  for (const auto& [call, ranks] : ahead) {
    const bool one = (ranks & (ranks - 1)) == 0;
    out << "; " << ranks_text(ranks) << (one ? " is" : " are")
        << (call == lowest.first ? " further" : "") << " in #" << call;
  }
  return out.str();
}

std::string ShmChannel::flight_record() const {
  try {
    const int n = layout_.nranks;
    const int64_t now = Clock::now().time_since_epoch().count();
    std::vector<RankRecord> records;
    for (int r = 0; r < n; ++r) records.push_back(read_record(r));
    std::ostringstream out;
    out << "ddpx flight record, as " << rank_name(me_)
        << " reads it from the node's shared memory (calls newest first):";
    for (int r = 0; r < n; ++r) {
      const RankRecord& rec = records[size_t(r)];
      out << "\n  " << rank_name(r) << " (" << rec.process << "): last published step "
          << rec.arrived;
      if (rec.reduced > 0 && rec.reduced != rec.arrived) {
        out << " (its last reduction, step " << rec.reduced << ")";
      }
      if (rec.waiting != kNotWaiting) {
        out << "; waiting " << duration_text(now - rec.waiting_since_ns) << " ";
        RankSet late = 0;
        for (int p = 0; p < n; ++p) {
          const RankRecord& peer = records[size_t(p)];
          const bool in_block = control_[p].summing.load(std::memory_order_relaxed) > 0;
          const uint64_t published = rec.waiting == kWaitArrive ? peer.arrived : peer.reduced;
          const bool awaited = rec.waiting == kWaitBlocks ? in_block : published < rec.waiting_for;
          if (p != r && awaited) late |= RankSet(1) << p;
        }
        // Whom it waits for, from the counters as they are now: a wait about to end has none.
        const std::string whom = late == 0 ? "its peers (all there by now)" : ranks_text(late);
        if (rec.waiting == kWaitBlocks) {
          out << "for " << whom << " to sum the shared blocks of its call";
        } else {
          out << "for " << whom << (rec.waiting == kWaitArrive ? " to send" : " to reduce")
              << " step " << rec.waiting_for;
        }
      } else {
        out << "; not waiting";
      }
      out << "; " << rec.queued << " job" << (rec.queued == 1 ? "" : "s") << " queued";
      if (rec.calls.empty()) out << "; no call yet";
      for (const RankRecord::Call& c : rec.calls) {
        out << "\n    " << call_text(c, call_names_, call_name_count_) << ": "
            << state_text(c, now);
      }
    }
    if (n > 1) out << "\n  " << behind(records, now);
    return out.str();
  } catch (const std::exception& e) {
    return std::string("ddpx flight record unreadable: ") + e.what();
  }
}

}  // namespace ddpx
