// Point-to-point between the ranks of one node: the rings in the segment, the movers that fill
// and empty them, and the works that callers wait on.
#include "shm_p2p.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <mutex>

#include "../common/thread_name.h"
#include "../node/shm_channel.h"
#include "../node/waiter.h"

namespace ddpx {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kFrame = 64;  // a message's frame, and what its bytes are padded to
// The rings of all pairs together take about this much, each between the bounds below.
constexpr size_t kRingsBudget = size_t(16) << 20;
constexpr size_t kMinRing = size_t(4) << 10;
constexpr size_t kMaxRing = size_t(2) << 20;
// So that the segment of a full node fits a container's 64 MiB /dev/shm (docs/design.md, "Many
// ranks per node"), the rings stay within the budget at every rank count.
static_assert(kMinRing * kMaxLocalRanks * (kMaxLocalRanks - 1) <= kRingsBudget,
              "the smallest rings of a full node exceed the rings' budget");
constexpr size_t kPiecesPerRing = 8;
// How long the thread leaves a new send or receive to its caller before it moves it itself.
constexpr auto kGrace = std::chrono::microseconds(100);

// A rank's doorbell: whoever moves its sends and receives sleeps on it when there is nothing to
// move, and a peer that publishes to it, or a local thread that posts, rings it.
struct alignas(64) Doorbell {
  WakeWord word;
};

// One ring's counters, in bytes since the start: the sender's and the receiver's apart.
struct RingControl {
  alignas(64) std::atomic<uint64_t> head;
  alignas(64) std::atomic<uint64_t> tail;
};

struct Frame {
  int64_t tag;
  uint64_t bytes;
  char pad[kFrame - 16];
};
static_assert(sizeof(Frame) == kFrame, "a frame fills its 64 bytes");

size_t controls_bytes(int n) {
  return round_up(size_t(n) * sizeof(Doorbell) + size_t(n) * size_t(n) * sizeof(RingControl),
                  kPage);
}

std::exception_ptr dist_error(const std::string& message) {
  try {
    C10_THROW_ERROR(DistBackendError, message);
  } catch (...) {
    return std::current_exception();
  }
}

// A send or a receive, from its post to its completion.
struct Op {
  bool is_send;
  int peer;  // local rank; -1: a receive from any
  int64_t tag;
  at::Tensor buffer;  // contiguous: what crosses
  at::Tensor user;    // the caller's tensor; a receive copies buffer into it when they differ
  size_t bytes;
  Clock::time_point deadline;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  std::atomic<int> source{-1};  // the rank a receive took its message from
  // A send's progress: whether its frame is in, and how much of its padded bytes.
  bool framed = false;
  size_t moved = 0;
  char* data() const { return static_cast<char*>(buffer.data_ptr()); }
};

// A message taken from a ring before any receive wanted it.
struct Held {
  int source;
  int64_t tag;
  std::vector<char> data;
  bool complete = false;
};

// The message at the tail of a ring from one source, once its frame is read.
struct Inbound {
  bool framed = false;
  size_t bytes = 0;
  size_t moved = 0;                // of its padded bytes
  std::shared_ptr<Op> op;          // the receive it goes to, or (null)
  std::list<Held>::iterator held;  // where it is set aside
};

}  // namespace

size_t P2PLayout::ring_bytes() const {
  if (nranks < 2) return 0;
  const size_t pairs = size_t(nranks) * size_t(nranks - 1);
  size_t ring = kMaxRing;
  while (ring > kMinRing && ring * pairs > kRingsBudget) ring /= 2;
  return ring;
}

size_t P2PLayout::bytes() const {
  return controls_bytes(nranks) + size_t(nranks) * size_t(nranks - 1) * ring_bytes();
}

struct ShmPointToPoint::State {
  const ShmChannel& channel;
  int n, me;
  size_t ring, piece;
  Doorbell* bells;
  RingControl* controls;  // [src * n + dst]
  char* rings;

  // What callers post; the movers adopt it at their next pass.
  std::mutex post_mu;
  std::vector<std::shared_ptr<Op>> posted;
  std::string stopped_because;  // once stopped: what every op posted after fails with

  // The movers' state, one mover at a time.
  std::mutex mu;
  std::vector<std::deque<std::shared_ptr<Op>>> sends;  // per destination, in post order
  std::list<std::shared_ptr<Op>> recvs;                // not yet matched, in post order
  std::vector<Inbound> inbound;                        // per source
  std::list<Held> held;                                // in arrival order
  std::vector<std::string> broken;                     // per peer: why its rings are unusable
  bool stopped = false;
  Clock::time_point checked = Clock::now();  // when check_stalled last ran

  // The thread's: it moves while something is pending and no caller is moving.
  std::mutex thread_mu;
  std::condition_variable thread_cv;
  int pending = 0;
  int waiters = 0;
  std::atomic<bool> stopping{false};  // written under thread_mu; read outside it by Idle

  explicit State(const ShmChannel& ch) : channel(ch), n(ch.size()), me(ch.me()) {
    const P2PLayout layout{n};
    ring = layout.ring_bytes();
    piece = ring / kPiecesPerRing;
    char* region = ch.p2p_region();
    bells = reinterpret_cast<Doorbell*>(region);
    controls = reinterpret_cast<RingControl*>(region + size_t(n) * sizeof(Doorbell));
    rings = region + controls_bytes(n);
    sends.resize(size_t(n));
    inbound.resize(size_t(n));
    broken.resize(size_t(n));
  }

  RingControl& control(int src, int dst) const { return controls[size_t(src * n + dst)]; }
  char* ring_of(int src, int dst) const {
    const int pair = src * (n - 1) + (dst < src ? dst : dst - 1);
    return rings + size_t(pair) * ring;
  }
  std::string name(int local) const { return channel.rank_name(local); }

  void ring_bell(int rank) {
    // Orders what the caller published (a counter, a future's completion) before the ring.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    bells[rank].word.ring();
  }

  // Copies between a ring and memory, across the ring's end where the span wraps.
  void to_ring(char* base, uint64_t at, const char* from, size_t count) const {
    const size_t offset = at % ring, first = std::min(count, ring - offset);
    std::memcpy(base + offset, from, first);
    std::memcpy(base, from + first, count - first);
  }
  void from_ring(const char* base, uint64_t at, char* to, size_t count) const {
    const size_t offset = at % ring, first = std::min(count, ring - offset);
    std::memcpy(to, base + offset, first);
    std::memcpy(to + first, base, count - first);
  }

  // Moves a message's bytes, padded, between memory and a ring as far as `room` allows, in
  // pieces: copy(at, offset, count) moves count bytes at the message's offset to or from ring
  // position at. Each piece is published on counter (the ring's head or tail, at `at`) and rings
  // peer. Returns whether the whole message is through.
  bool stream(std::atomic<uint64_t>& counter, uint64_t& at, size_t& room, size_t& moved,
              size_t bytes, int peer, bool& any,
              const std::function<void(uint64_t, size_t, size_t)>& copy) {
    const size_t padded = round_up(bytes, kFrame);
    while (moved < padded && room > 0) {
      const size_t count = std::min({room, padded - moved, piece});
      if (moved < bytes) copy(at, moved, std::min(count, bytes - moved));
      at += count;
      room -= count;
      moved += count;
      counter.store(at, std::memory_order_seq_cst);
      ring_bell(peer);
      any = true;
    }
    return moved == padded;
  }

  void post(const std::shared_ptr<Op>& op) {
    std::string refused;
    {
      std::lock_guard<std::mutex> lock(post_mu);
      refused = stopped_because;
      if (refused.empty()) posted.push_back(op);
    }
    if (!refused.empty()) {
      op->future->setError(dist_error(refused));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(thread_mu);
      ++pending;
    }
    thread_cv.notify_one();
    ring_bell(me);
  }

  // Ends an op: done holds what this pass finished, completed once the lock is released.
  struct Finished {
    std::shared_ptr<Op> op;
    std::string error;
  };
  using Done = std::vector<Finished>;

  static bool wants(const Op& recv, int source, int64_t tag) {
    return (recv.peer < 0 || recv.peer == source) && recv.tag == tag;
  }

  void deliver(const std::shared_ptr<Op>& recv, const Held& message, Done& done) const {
    recv->source.store(message.source);
    if (message.data.size() != recv->bytes) {
      done.push_back({recv, size_mismatch(*recv, message.source, message.data.size())});
      return;
    }
    if (recv->bytes > 0) std::memcpy(recv->data(), message.data.data(), recv->bytes);
    done.push_back({recv, ""});
  }

  std::string size_mismatch(const Op& recv, int source, size_t sent) const {
    return "ddpx: " + name(me) + " received " + std::to_string(sent) + " bytes from " +
           name(source) + " (tag " + std::to_string(recv.tag) + ") into a tensor of " +
           std::to_string(recv.bytes) + " bytes: a send and its recv must have tensors of the " +
           "same size";
  }

  void adopt(Done& done) {
    std::vector<std::shared_ptr<Op>> ops;
    {
      std::lock_guard<std::mutex> lock(post_mu);
      ops.swap(posted);
    }
    for (auto& op : ops) {
      if (op->peer >= 0 && !broken[size_t(op->peer)].empty()) {
        done.push_back({op, broken[size_t(op->peer)]});
      } else if (op->is_send) {
        sends[size_t(op->peer)].push_back(std::move(op));
      } else {
        auto it = std::find_if(held.begin(), held.end(), [&](const Held& h) {
          return h.complete && wants(*op, h.source, h.tag);
        });
        if (it != held.end()) {
          deliver(op, *it, done);
          held.erase(it);
        } else {
          recvs.push_back(std::move(op));
        }
      }
    }
  }

  // Moves what fits of the sends to dst into its ring.
  bool push(int dst, Done& done) {
    auto& queue = sends[size_t(dst)];
    RingControl& ctl = control(me, dst);
    char* base = ring_of(me, dst);
    bool moved = false;
    while (!queue.empty()) {
      Op& op = *queue.front();
      uint64_t head = ctl.head.load(std::memory_order_relaxed);
      size_t room = ring - size_t(head - ctl.tail.load(std::memory_order_acquire));
      if (!op.framed) {
        if (room < kFrame) return moved;
        Frame frame{};
        frame.tag = op.tag;
        frame.bytes = op.bytes;
        to_ring(base, head, reinterpret_cast<const char*>(&frame), kFrame);
        head += kFrame;
        room -= kFrame;
        op.framed = true;
        ctl.head.store(head, std::memory_order_seq_cst);
        ring_bell(dst);
        moved = true;
      }
      const bool through = stream(ctl.head, head, room, op.moved, op.bytes, dst, moved,
                                  [&](uint64_t at, size_t offset, size_t count) {
                                    to_ring(base, at, op.data() + offset, count);
                                  });
      if (!through) return moved;
      done.push_back({queue.front(), ""});
      queue.pop_front();
    }
    return moved;
  }

  // Reads what has arrived from src into the receives that take it, or sets it aside.
  bool pull(int src, Done& done) {
    if (!broken[size_t(src)].empty()) return false;
    RingControl& ctl = control(src, me);
    const char* base = ring_of(src, me);
    Inbound& in = inbound[size_t(src)];
    bool moved = false;
    while (true) {
      uint64_t tail = ctl.tail.load(std::memory_order_relaxed);
      size_t ready = size_t(ctl.head.load(std::memory_order_acquire) - tail);
      if (!in.framed) {
        if (ready < kFrame) return moved;
        Frame frame;
        from_ring(base, tail, reinterpret_cast<char*>(&frame), kFrame);
        auto it = std::find_if(recvs.begin(), recvs.end(),
                               [&](const auto& r) { return wants(*r, src, frame.tag); });
        if (it != recvs.end()) {
          in.op = *it;
          recvs.erase(it);
          in.op->source.store(src);
        } else if (std::any_of(recvs.begin(), recvs.end(),
                               [&](const auto& r) { return r->peer < 0 || r->peer == src; })) {
          in.held = held.insert(held.end(), Held{src, frame.tag, {}, false});
          in.held->data.resize(frame.bytes);
        } else {
          return moved;  // no receive waits for this source: the message stays in the ring
        }
        in.framed = true;
        in.bytes = frame.bytes;
        in.moved = 0;
        tail += kFrame;
        ready -= kFrame;
        ctl.tail.store(tail, std::memory_order_seq_cst);
        ring_bell(src);
        moved = true;
      }
      const bool fits = !in.op || in.op->bytes == in.bytes;
      char* to = in.op ? in.op->data() : in.held->data.data();
      const bool through = stream(ctl.tail, tail, ready, in.moved, in.bytes, src, moved,
                                  [&](uint64_t at, size_t offset, size_t count) {
                                    if (fits) from_ring(base, at, to + offset, count);
                                  });
      if (!through) return moved;
      if (in.op) {
        done.push_back({in.op, fits ? "" : size_mismatch(*in.op, src, in.bytes)});
      } else {
        in.held->complete = true;
        auto it = std::find_if(recvs.begin(), recvs.end(),
                               [&](const auto& r) { return wants(*r, src, in.held->tag); });
        if (it != recvs.end()) {
          deliver(*it, *in.held, done);
          recvs.erase(it);
          held.erase(in.held);
        }
      }
      in = Inbound{};
    }
  }

  // One pass over everything pending; returns whether any byte moved or any op ended.
  bool pass() {
    Done done;
    bool moved = false;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopped) return false;
      adopt(done);
      for (int peer = 0; peer < n; ++peer) {
        if (peer == me) continue;
        if (!sends[size_t(peer)].empty()) moved |= push(peer, done);
        if (inbound[size_t(peer)].framed || !recvs.empty()) moved |= pull(peer, done);
      }
    }
    finish(done);
    return moved || !done.empty();
  }

  void finish(Done& done) {
    for (auto& [op, error] : done) {
      if (error.empty()) {
        if (!op->is_send && !op->user.is_same(op->buffer)) op->user.copy_(op->buffer);
        op->future->markCompleted(c10::IValue(c10::List<at::Tensor>({op->user})));
      } else {
        op->future->setError(dist_error(error));
      }
    }
    if (done.empty()) return;
    {
      std::lock_guard<std::mutex> lock(thread_mu);
      pending -= int(done.size());
    }
    ring_bell(me);  // a caller waiting for one of these may be asleep
  }

  // What the errors that end an op say of it (Waiter::stalled words them).
  struct OpStall final : Waiter::Stall {
    const State& state;
    const Op& op;
    OpStall(const State& s, const Op& o) : state(s), op(o) {}

    std::string me() const override { return state.name(state.me); }
    std::string exited() const override {
      return op.peer >= 0 && state.channel.exited(op.peer) ? state.name(op.peer) : "";
    }
    std::string waited_for(bool gone) const override {
      const std::string whom = gone ? "it" : op.peer < 0 ? "any rank" : state.name(op.peer);
      return (op.is_send ? "to send " : "to receive ") + std::to_string(op.bytes) + " bytes (tag " +
             std::to_string(op.tag) + ")" + (op.is_send ? " to " : " from ") + whom;
    }
    std::string fix() const override {
      return ": post the matching " + std::string(op.is_send ? "recv" : "send") +
             " on the peer, or raise the process group's timeout if it can be this slow";
    }
  };

  // Fails what waits on a peer that has exited, or beyond its deadline. An op cut off halfway
  // leaves its ring mid-message: the pair's later sends and receives fail too.
  void check_stalled() {
    Done done;
    {
      std::lock_guard<std::mutex> lock(mu);
      const auto now = Clock::now();
      if (now - checked < kPoll) return;
      checked = now;
      const auto why = [&](const Op& op) {
        return Waiter::stalled(OpStall(*this, op), op.deadline, channel.timeout());
      };
      for (int peer = 0; peer < n; ++peer) {
        auto& queue = sends[size_t(peer)];
        for (auto it = queue.begin(); it != queue.end();) {
          std::string error = why(**it);
          if (error.empty()) {
            ++it;
            continue;
          }
          if ((*it)->framed) broken[size_t(peer)] = error;
          done.push_back({*it, error});
          it = queue.erase(it);
        }
        Inbound& in = inbound[size_t(peer)];
        if (in.op) {
          std::string error = why(*in.op);
          if (!error.empty()) {
            broken[size_t(peer)] = error;
            done.push_back({in.op, error});
            in = Inbound{};
          }
        }
      }
      for (auto it = recvs.begin(); it != recvs.end();) {
        std::string error = why(**it);
        if (error.empty()) {
          ++it;
          continue;
        }
        done.push_back({*it, error});
        it = recvs.erase(it);
      }
      // A broken pair's queued sends fail now rather than at their deadline.
      for (int peer = 0; peer < n; ++peer) {
        if (broken[size_t(peer)].empty()) continue;
        for (auto& op : sends[size_t(peer)]) done.push_back({op, broken[size_t(peer)]});
        sends[size_t(peer)].clear();
      }
    }
    finish(done);
  }

  // The movers' wait for something to move (Waiter::wait_for). Its word is this rank's doorbell,
  // which peers ring as they publish and callers as they post; each look at it is a pass, as a
  // mover's spin has nothing cheaper to watch than the rings themselves. A caller waiting for an
  // op passes its future: another mover may end it meanwhile, and rings the bell after completing
  // it; the thread, passing none, also stops waiting when it is asked to stop.
  class Idle final : public Waiter::Waitable {
   public:
    Idle(State& state, const c10::ivalue::Future* awaited, bool crowded)
        : state_(state), awaited_(awaited), crowded_(crowded) {}

    WakeWord* word() const override {
      // Latched: a move ends the wait even if the next look finds nothing, so that the mover
      // starts a new wait, spinning first, after each move.
      over_ = over_ || state_.pass() || (awaited_ ? awaited_->completed() : state_.stopping.load());
      return over_ ? nullptr : &state_.bells[state_.me].word;
    }
    // Which peers the pending ops wait for is not tracked: spin no longer than for peers that
    // may share this CPU. Their rings say nothing of when they last ran; but with more ranks
    // than CPUs (crowded), where the waiter spins only because yields lose the CPU to other
    // processes, the peer most likely waits for a CPU, maybe this one: sleep instead.
    bool may_run_on(int) const override { return true; }
    bool descheduled(int, int64_t) const override { return crowded_; }
    // With more ranks than CPUs the peer this rank waits for most likely waits for its CPU.
    bool yields() const override { return true; }

   private:
    State& state_;
    const c10::ivalue::Future* awaited_;
    bool crowded_;
    mutable bool over_ = false;
  };

  // Moves what it can; with nothing to move, waits through a waiter for a peer or a caller to
  // ring this rank's doorbell, then fails what has stalled if kPoll passed first.
  void step(const c10::ivalue::Future* awaited = nullptr) {
    if (pass()) return;
    // A waiter per thread, as the thread and the callers move at once; what it learns of the
    // machine (yields that lose the CPU) carries over to the thread's next waits.
    static thread_local Waiter waiter;
    const bool crowded = channel.oversubscribed();
    waiter.set_oversubscribed(crowded);
    if (!waiter.wait_for(Idle(*this, awaited, crowded), kPoll)) check_stalled();
  }

  // Fails every pending send and receive, and every one posted after, with why.
  void stop(const std::string& why) {
    Done done;
    {
      std::lock_guard<std::mutex> lock(mu);
      stopped = true;
      std::vector<std::shared_ptr<Op>> ops;
      {
        std::lock_guard<std::mutex> post_lock(post_mu);
        stopped_because = why;
        ops.swap(posted);
      }
      for (auto& queue : sends) ops.insert(ops.end(), queue.begin(), queue.end());
      ops.insert(ops.end(), recvs.begin(), recvs.end());
      for (auto& in : inbound) {
        if (in.op) ops.push_back(in.op);
      }
      for (auto& op : ops) {
        done.push_back({op, why + " while this " + std::string(op->is_send ? "send" : "receive") +
                                " was pending"});
      }
    }
    finish(done);
  }
};

namespace {

using State = ShmPointToPoint::State;

class P2PWork final : public c10d::Work {
 public:
  P2PWork(std::shared_ptr<State> state, std::shared_ptr<Op> op)
      : Work(-1, op->is_send ? c10d::OpType::SEND
                             : (op->peer < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV)),
        state_(std::move(state)),
        op_(std::move(op)) {}

  bool isCompleted() override { return op_->future->completed(); }
  bool isSuccess() const override { return op_->future->completed() && !op_->future->hasError(); }
  std::exception_ptr exception() const override {
    return op_->future->hasError() ? op_->future->exception_ptr() : nullptr;
  }
  std::vector<at::Tensor> result() override { return {op_->user}; }
  int sourceRank() const override {
    if (op_->is_send) return Work::sourceRank();
    return op_->source.load();
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return op_->future; }

  // Moves this and every other pending op on the calling thread until this one ends.
  bool wait(std::chrono::milliseconds timeout) override {
    const auto start = Clock::now();
    {
      std::lock_guard<std::mutex> lock(state_->thread_mu);
      ++state_->waiters;
    }
    struct Leave {
      State& state;
      ~Leave() {
        {
          std::lock_guard<std::mutex> lock(state.thread_mu);
          --state.waiters;
        }
        state.thread_cv.notify_one();
      }
    } leave{*state_};
    while (!op_->future->completed()) {
      if (timeout != kNoTimeout && Clock::now() - start > timeout) {
        C10_THROW_ERROR(DistBackendError,
                        "ddpx: " + state_->name(state_->me) + "'s wait for a " +
                            (op_->is_send ? "send" : "receive") + " timed out after " +
                            std::to_string(timeout.count()) + " ms; it stays pending");
      }
      state_->step(op_->future.get());
    }
    op_->future->waitAndThrow();
    return true;
  }

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<Op> op_;
};

void worker_loop(const std::shared_ptr<State>& state) {
  name_this_thread("ddpx p2p");
  while (true) {
    {
      std::unique_lock<std::mutex> lock(state->thread_mu);
      if (state->stopping || state->pending == 0 || state->waiters > 0) {
        state->thread_cv.wait(
            lock, [&] { return state->stopping || (state->pending > 0 && state->waiters == 0); });
        // Most posts are waited for at once (send and recv are isend and irecv, then wait):
        // the caller then moves the bytes itself, and this thread keeps off the CPUs.
        const bool taken = state->thread_cv.wait_for(lock, kGrace, [&] {
          return state->stopping || state->pending == 0 || state->waiters > 0;
        });
        if (taken && !state->stopping) continue;
      }
      if (state->stopping) return;
    }
    state->step();
  }
}

}  // namespace

ShmPointToPoint::ShmPointToPoint(const ShmChannel& channel)
    : state_(std::make_shared<State>(channel)) {
  worker_ = std::thread(worker_loop, state_);
}

ShmPointToPoint::~ShmPointToPoint() {
  {
    std::lock_guard<std::mutex> lock(state_->thread_mu);
    state_->stopping = true;
  }
  state_->thread_cv.notify_one();
  state_->ring_bell(state_->me);
  worker_.join();
  state_->stop("ddpx: the process group was destroyed");
}

void ShmPointToPoint::abort(const std::string& why) { state_->stop(why); }

namespace {

std::shared_ptr<Op> make_op(bool is_send, const at::Tensor& tensor, int peer, int tag,
                            std::chrono::milliseconds timeout) {
  TORCH_CHECK_VALUE(tensor.device().is_cpu() && tensor.layout() == at::kStrided,
                    "ddpx: ", is_send ? "send" : "recv", " takes a dense CPU tensor; this one is ",
                    tensor.toString());
  auto op = std::make_shared<Op>();
  op->is_send = is_send;
  op->peer = peer;
  op->tag = tag;
  op->user = tensor;
  op->buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  op->bytes = op->buffer.nbytes();
  op->deadline = Clock::now() + timeout;
  op->future =
      c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  return op;
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ShmPointToPoint::send(const at::Tensor& tensor, int dst, int tag) {
  TORCH_CHECK_VALUE(dst >= 0 && dst < state_->n && dst != state_->me, "ddpx: cannot send to ",
                    "local rank ", dst, " from local rank ", state_->me);
  auto op = make_op(true, tensor, dst, tag, state_->channel.timeout());
  state_->post(op);
  return c10::make_intrusive<P2PWork>(state_, std::move(op));
}

c10::intrusive_ptr<c10d::Work> ShmPointToPoint::recv(const at::Tensor& tensor, int src, int tag) {
  TORCH_CHECK_VALUE(src >= -1 && src < state_->n && src != state_->me, "ddpx: cannot receive ",
                    "from local rank ", src, " at local rank ", state_->me);
  auto op = make_op(false, tensor, src, tag, state_->channel.timeout());
  state_->post(op);
  return c10::make_intrusive<P2PWork>(state_, std::move(op));
}

std::string ShmPointToPoint::describe() const {
  return "point-to-point through shared memory (a " + std::to_string(state_->ring >> 10) +
         " KiB ring per pair of ranks)";
}

}  // namespace ddpx
