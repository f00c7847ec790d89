// The node communicator (node_comm.h): calls, steps, the checks of each call within the node and
// across nodes, rejection, and transfers between nodes turned into errors on every rank.
#include "node_comm.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <sstream>
#include <stdexcept>

#include "../common/errors.h"
#include "../cross_node/cross_node.h"
#include "../node/arena.h"

namespace ddpx {
namespace {

// The collectives as the flight record names them (Collective's order): torch.distributed's.
constexpr const char* kCollectiveNames[] = {"all_reduce",     "all_gather", "broadcast",
                                            "reduce_scatter", "all_to_all", "barrier"};

}  // namespace

NodeComm::NodeComm(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
                   std::vector<int> ranks, size_t one_shot_bytes, std::chrono::milliseconds timeout,
                   bool initialize)
    : channel_(std::move(segment), layout, local_rank, std::move(ranks), timeout, initialize),
      schedule_(layout, one_shot_bytes) {
  channel_.set_call_names(kCollectiveNames, int(std::size(kCollectiveNames)));
  // A rank that gives up ends its peers' waits across nodes too, not only within the node.
  channel_.set_on_fail([this](const std::string& why) {
    if (cross_node_) cross_node_->abort(why);
  });
}

NodeComm::~NodeComm() {
  fail_in_flight(std::make_exception_ptr(
      std::runtime_error("ddpx: the engine was shut down while an all-reduce was crossing nodes")));
}

std::shared_ptr<std::vector<char>> CallBuffers::node_sums(size_t bytes) {
  for (auto& buffer : node_sums_) {
    if (buffer.use_count() == 1) {
      if (buffer->size() < bytes) buffer->resize(bytes);
      return buffer;
    }
  }
  return node_sums_.emplace_back(std::make_shared<std::vector<char>>(bytes));
}

void NodeComm::hand_out_in_flight(size_t keep) {
  while (in_flight_.size() > keep) {
    InFlight chunk = std::move(in_flight_.front());
    in_flight_.pop_front();
    try {
      chunk.hand_out();
    } catch (...) {
      const std::exception_ptr error = std::current_exception();
      if (chunk.end) chunk.end(error);
      fail_in_flight(error);
      throw;
    }
    if (chunk.end) chunk.end(nullptr);
  }
}

void NodeComm::fail_in_flight(std::exception_ptr error) noexcept {
  std::deque<InFlight> failed;
  failed.swap(in_flight_);
  for (InFlight& chunk : failed) {
    if (chunk.end) chunk.end(error);
  }
}

void NodeComm::set_cross_node(std::shared_ptr<CrossNode> cross_node, size_t chunk_bytes,
                              std::vector<int> node_ranks) {
  TORCH_CHECK_VALUE(chunk_bytes > 0, "ddpx: the cross-node chunk must have bytes");
  TORCH_CHECK_VALUE(node_ranks.size() == size_t(cross_node->nodes()) * size_t(channel_.size()),
                    "ddpx: ", node_ranks.size(), " group ranks for ", cross_node->nodes(),
                    " nodes of ", channel_.size());
  cross_node_ = std::move(cross_node);
  schedule_.set_spans_nodes();
  chunk_bytes_ = chunk_bytes;
  node_ranks_ = std::move(node_ranks);
}

void NodeComm::set_threads(int threads) {
  TORCH_CHECK_VALUE(threads >= 1, "ddpx: a rank needs at least one thread, got ", threads);
  workers_.resize(threads);
  schedule_.set_threads(threads);
}

int NodeComm::group_size() const { return cross_node_ ? int(node_ranks_.size()) : channel_.size(); }

int NodeComm::group_rank() const {
  if (!cross_node_) return channel_.me();
  return node_ranks_[size_t(cross_node_->node() * channel_.size() + channel_.me())];
}

CallMeta NodeComm::begin(Collective op, int64_t numel, int32_t dtype, int32_t wire, double scale,
                         int root, int32_t torch_dtype) {
  // The all-reduce hands out the chunks in flight itself (allreduce.cpp); others before they start.
  if (op != Collective::AllReduce) hand_out_in_flight(0);
  const auto began = channel_.begin_call();
  schedule_.begin_call();
  CallMeta mine{++calls_, numel, dtype, wire, scale, int32_t(op), root, 0, torch_dtype};
  mine.reaches = memory_.reaches_peers() ? 1 : 0;
  schedule_.stamp(mine);
  // Its first step is the next one, whichever way the call opens.
  channel_.record_call(mine, step_ + 1, began);
  return mine;
}

CallMeta NodeComm::begin_local(Collective op, int64_t numel, int32_t dtype, double scale, int root,
                               const std::string& what, int32_t torch_dtype) {
  const CallMeta mine = begin(op, numel, dtype, dtype, scale, root, torch_dtype);
  TORCH_CHECK_VALUE(!cross_node_, "ddpx: ", what,
                    " spans nodes; the shared-memory engine all-reduces, all-gathers, "
                    "broadcasts, reduce-scatters and trades equal parts across nodes, the other "
                    "collectives stay on one");
  return mine;
}

uint64_t NodeComm::exchange(const CallMeta& mine, bool first,
                            const std::function<void(char*)>& fill, const std::string& what,
                            bool wide, ShmChannel::Clock::duration* waited) {
  const uint64_t step = ++step_;
  if (first) channel_.post(step, mine);
  if (fill) fill(channel_.input_slot(channel_.me(), step));
  channel_.publish(ShmChannel::Phase::Arrive, step);
  const auto waits_from = ShmChannel::Clock::now();
  channel_.wait_all(ShmChannel::Phase::Arrive, step, what, wide);
  if (waited) *waited = ShmChannel::Clock::now() - waits_from;
  if (first) first_step(step, mine, what);
  return step;
}

void NodeComm::reject(const std::string& reason, const std::string& what, bool keep_in_flight) {
  if (!keep_in_flight) hand_out_in_flight(0);
  try {
    reject_call(reason, what);
  } catch (...) {
    // The peers' calls fail at their check, and so forget the chunks in flight too.
    if (keep_in_flight) fail_in_flight(std::current_exception());
    throw;
  }
}

void NodeComm::reject_call(const std::string& reason, const std::string& what) {
  const CallMeta rejected = begin(Collective::AllReduce, -1, 0, 0, 0.0, 0);
  const uint64_t step = ++step_;
  channel_.post(step, rejected);
  channel_.set_message(reason);
  channel_.publish(ShmChannel::Phase::Arrive, step);
  channel_.wait_all(ShmChannel::Phase::Arrive, step, what);
  schedule_.agree(channel_.posted(0, step), channel_, memory_);
  if (cross_node_) {
    start_node_check(rejected, false, what);
    try {
      finish_node_check(rejected, reason, what);
    } catch (const c10::Error&) {
      // This rank's own reason is the one to raise.
    }
  }
  C10_THROW_ERROR(ValueError, reason);
}

// The call number counts every collective on the group's engine, torch's own (DDP's broadcasts
// at construction, for one) with the user's, so that a rank that skipped one shows.
std::string NodeComm::describe_call(const CallMeta& m) {
  static const char* const names[] = {"",
                                      "an all-gather of ",
                                      "a broadcast of ",
                                      "a reduce-scatter of ",
                                      "an all-to-all of parts up to ",
                                      "a barrier"};
  std::ostringstream out;
  if (Collective(m.op) == Collective::Barrier) {
    out << names[m.op] << " (the group's collective #" << m.call << ")";
    return out.str();
  }
  out << names[m.op] << m.numel;
  if (m.dtype < 0) {
    out << " bytes ";
    if (m.torch_dtype >= 0) out << "of " << c10::ScalarType(m.torch_dtype) << " ";
    out << "(";
  } else {
    out << " " << dtype_name(DType(m.dtype)) << " elements (wire " << dtype_name(DType(m.wire))
        << ", scale " << m.scale << ", ";
  }
  if (Collective(m.op) == Collective::Broadcast) out << "from local rank " << m.root << ", ";
  out << "the group's collective #" << m.call << ")";
  return out.str();
}

void NodeComm::check_peers_agree(const CallMeta& mine, const std::string& what) {
  for (int r = 0; r < channel_.size(); ++r) {
    if (r == channel_.me()) continue;
    const CallMeta& m = channel_.posted(r, step_);
    if (m.numel < 0) {
      TORCH_CHECK(false, "ddpx: ", channel_.rank_name(r), " rejected its input to ", what, ": ",
                  channel_.message(r));
    }
    if (m.numel != mine.numel || m.dtype != mine.dtype || m.wire != mine.wire ||
        m.scale != mine.scale || m.call != mine.call || m.op != mine.op || m.root != mine.root ||
        m.torch_dtype != mine.torch_dtype) {
      C10_THROW_ERROR(
          Error,
          "ddpx: ranks disagree on " + what + ": " + channel_.rank_name(channel_.me()) + " has " +
              describe_call(mine) + ", " + channel_.rank_name(r) + " has " + describe_call(m) +
              ". Every rank must reduce the same sizes and dtypes in the same order: check that "
              "the model and its trainable parameters are the same on every rank");
    }
  }
}

void NodeComm::first_step(uint64_t step, const CallMeta& mine, const std::string& what) {
  // Every rank probes its peers' memory at its first call, once all have attached.
  if (channel_.size() > 1 && !memory_.probed()) memory_.probe();
  schedule_.agree(channel_.posted(0, step), channel_, memory_);
  if (!cross_node_) {
    check_peers_agree(mine, what);
    return;
  }
  std::string local_error;
  try {
    check_peers_agree(mine, what);
  } catch (const c10::Error& e) {
    local_error = e.what_without_backtrace();
  }
  start_node_check(mine, local_error.empty(), what);
  if (!local_error.empty()) finish_node_check(mine, local_error, what);
}

std::vector<int64_t> NodeComm::node_words(const CallMeta& m, bool ok) {
  int64_t scale_bits;
  static_assert(sizeof scale_bits == sizeof m.scale);
  std::memcpy(&scale_bits, &m.scale, sizeof scale_bits);
  return {ok ? 0 : 1, int64_t(m.call), m.numel,      m.dtype, m.wire, scale_bits,
          m.op,       m.root,          m.torch_dtype};
}

void NodeComm::start_node_check(const CallMeta& mine, bool ok, const std::string& what) {
  try {
    cross_node_->start_gather(node_words(mine, ok));
  } catch (const std::exception& e) {
    fail_node_check(what, e);
  }
}

void NodeComm::fail_node_check(const std::string& what, const std::exception& e) {
  channel_.fail("ddpx: " + channel_.rank_name(channel_.me()) + ": checking " + what +
                " with the other nodes failed: " + error_text(e));
}

void NodeComm::finish_node_check(const CallMeta& mine, const std::string& local_error,
                                 const std::string& what) {
  std::vector<int64_t> all;
  try {
    all = cross_node_->finish_gather();
  } catch (const std::exception& e) {
    fail_node_check(what, e);
  }
  TORCH_CHECK(local_error.empty(), local_error);
  const std::vector<int64_t> words = node_words(mine, true);
  for (int node = 0; node < cross_node_->nodes(); ++node) {
    const int64_t* theirs = all.data() + size_t(node) * words.size();
    if (theirs[0] != 0) {
      C10_THROW_ERROR(Error, "ddpx: " + what + " failed on node " + std::to_string(node) +
                                 " (a rank there rejected its input or disagreed with its "
                                 "node; its error says which), so every node stops it");
    }
    if (!std::equal(words.begin() + 1, words.end(), theirs + 1)) {
      double scale;
      std::memcpy(&scale, &theirs[5], sizeof scale);
      const CallMeta other{uint64_t(theirs[1]), theirs[2], int32_t(theirs[3]),
                           int32_t(theirs[4]),  scale,     int32_t(theirs[6]),
                           int32_t(theirs[7]),  0,         int32_t(theirs[8])};
      C10_THROW_ERROR(
          Error, "ddpx: nodes disagree on " + what + ": " + channel_.rank_name(channel_.me()) +
                     " on node " + std::to_string(cross_node_->node()) + " has " +
                     describe_call(mine) + ", its peer on node " + std::to_string(node) + " has " +
                     describe_call(other) +
                     ". Every rank must make the same calls with the same sizes and dtypes, in the "
                     "same order");
    }
  }
}

CallMeta NodeComm::begin_checked_across_nodes(Collective op, int64_t numel, int32_t dtype,
                                              int32_t wire, double scale, int root,
                                              int32_t torch_dtype, const std::string& what) {
  const CallMeta mine = begin(op, numel, dtype, wire, scale, root, torch_dtype);
  exchange(mine, true, [](char*) {}, what);
  finish_node_check(mine, "", what);
  return mine;
}

void NodeComm::across(const char* kind, const std::string& what,
                      const std::function<void()>& transfer) {
  try {
    transfer();
  } catch (const std::exception& e) {
    channel_.fail("ddpx: " + channel_.rank_name(channel_.me()) + ": the " + kind +
                  " across nodes of " + what + " failed: " + error_text(e));
  }
}

char* NodeComm::map_peer(int r, const ArenaPlace& place) {
  if (!place.valid()) return nullptr;
  std::string why;
  char* chunk = Arena::process().peer_chunk(channel_.pid(r), place, &why);
  if (chunk != nullptr) return chunk + place.offset;
  const std::lock_guard<std::mutex> lock(unmapped_mu_);
  if (unmapped_because_.empty()) unmapped_because_ = channel_.rank_name(r) + "'s: " + why;
  return nullptr;
}

std::string NodeComm::unmapped_because() const {
  const std::lock_guard<std::mutex> lock(unmapped_mu_);
  return unmapped_because_;
}

void NodeComm::finish_reads(uint64_t step, const std::string& what) {
  channel_.publish(ShmChannel::Phase::Reduce, step);
  channel_.wait_all(ShmChannel::Phase::Reduce, step, what);
}

}  // namespace ddpx
