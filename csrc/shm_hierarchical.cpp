// The hierarchical all-reduce: the node's ranks sum their slices of each block, the slices cross
// nodes through the CrossNode link, and the node hands the sums out; and the check of each call
// against the other nodes'.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "cross_node.h"
#include "errors.h"
#include "shm_allreduce.h"

namespace ddpx {
namespace {

// Chunks started across nodes and not yet all-gathered, per rank: enough to keep the link busy
// while the node sums the next chunks and hands out the last (docs/design.md, "Across nodes").
constexpr int64_t kCrossChunksInFlight = 6;

}  // namespace

void ShmAllreduce::set_cross_node(std::shared_ptr<CrossNode> cross_node, size_t chunk_bytes,
                                  std::vector<int> node_ranks) {
  TORCH_CHECK_VALUE(chunk_bytes > 0, "ddpx: the cross-node chunk must have bytes");
  TORCH_CHECK_VALUE(node_ranks.size() == size_t(cross_node->nodes()) * size_t(channel_.size()),
                    "ddpx: ", node_ranks.size(), " group ranks for ", cross_node->nodes(),
                    " nodes of ", channel_.size());
  cross_node_ = std::move(cross_node);
  chunk_bytes_ = chunk_bytes;
  node_ranks_ = std::move(node_ranks);
}

int ShmAllreduce::group_size() const {
  return cross_node_ ? int(node_ranks_.size()) : channel_.size();
}

int ShmAllreduce::group_rank() const {
  if (!cross_node_) return channel_.me();
  return node_ranks_[size_t(cross_node_->node() * channel_.size() + channel_.me())];
}

void ShmAllreduce::across(const char* kind, const std::string& what,
                          const std::function<void()>& transfer) {
  try {
    transfer();
  } catch (const std::exception& e) {
    channel_.fail("ddpx: " + channel_.rank_name(channel_.me()) + ": the " + kind +
                  " across nodes of " + what + " failed: " + error_text(e));
  }
}

// A call as the nodes trade it: the verdict (0: the node's ranks agree), then the CallMeta.
std::vector<int64_t> ShmAllreduce::node_words(const CallMeta& m, bool ok) {
  int64_t scale_bits;
  static_assert(sizeof scale_bits == sizeof m.scale);
  std::memcpy(&scale_bits, &m.scale, sizeof scale_bits);
  return {ok ? 0 : 1, int64_t(m.call), m.numel,      m.dtype, m.wire, scale_bits,
          m.op,       m.root,          m.torch_dtype};
}

void ShmAllreduce::start_node_check(const CallMeta& mine, bool ok, const std::string& what) {
  try {
    cross_node_->start_gather(node_words(mine, ok));
  } catch (const std::exception& e) {
    fail_node_check(what, e);
  }
}

void ShmAllreduce::fail_node_check(const std::string& what, const std::exception& e) {
  channel_.fail("ddpx: " + channel_.rank_name(channel_.me()) + ": checking " + what +
                " with the other nodes failed: " + error_text(e));
}

void ShmAllreduce::finish_node_check(const CallMeta& mine, const std::string& local_error,
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

// This rank's slices of the blocks are summed within the node into node_sums_, which crosses
// nodes in chunks of whole blocks: a network round trip per block would cost far more than the
// extra pass over the slices. Chunks are started as soon as they are summed and handed out once
// back, a few in flight, so the link carries one chunk while the node sums the next and hands out
// the last. A block's output slot is written only after every peer published its previous step,
// and they do that after reading the slot's last contents.
void ShmAllreduce::allreduce_across_nodes(AllreduceCall& call) {
  const Blocks& x = call.blocks;
  const int64_t full_slice = [&] {
    const auto [lo, hi] = x.slice(std::min(x.per_block, x.numel));
    return hi - lo;
  }();
  // Where block b's slice starts in node_sums_, in elements; every block but the last is full.
  auto slice_offset = [&](int64_t b) {
    if (b < x.n) return b * full_slice;
    const auto [lo, hi] = x.slice(x.elements(x.n - 1));
    return (x.n - 1) * full_slice + (hi - lo);
  };
  const int64_t total = slice_offset(x.n);
  if (!node_sums_ || node_sums_->size() < size_t(total) * x.acc_size) {
    node_sums_ = std::make_shared<std::vector<char>>(size_t(total) * x.acc_size);
  }
  char* sums = node_sums_->data();
  auto sums_at = [&](int64_t b) { return sums + size_t(slice_offset(b)) * x.acc_size; };
  // Chunk c is blocks [chunk_start(c), chunk_start(c + 1)).
  const int64_t chunk_blocks =
      std::max<int64_t>(1, int64_t(chunk_bytes_ / (size_t(x.per_block) * x.data_size)));
  const int64_t chunks = (x.n + chunk_blocks - 1) / chunk_blocks;
  auto chunk_start = [&](int64_t c) { return std::min(x.n, c * chunk_blocks); };
  auto chunk_elements = [&](int64_t c) {
    return slice_offset(chunk_start(c + 1)) - slice_offset(chunk_start(c));
  };
  auto hand_out_chunk = [&](int64_t c) {
    if (chunk_elements(c) > 0)
      across("all-reduce", call.what, [&] { cross_node_->finish_reduce(); });
    for (int64_t b = chunk_start(c); b < chunk_start(c + 1); ++b) {
      const uint64_t step = ++step_;
      const auto [lo, hi] = x.slice(x.elements(b));
      kernels().pack(channel_.output_slot(step) + size_t(lo) * x.acc_size, x.acc, sums_at(b), x.acc,
                     hi - lo, 1.0, Store::Cached);
      copy_out(call, step, b);
    }
  };
  int64_t handed_out = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = chunk_start(c);
    for (int64_t b = first; b < chunk_start(c + 1); ++b) {
      const uint64_t step = arrive(call, b);
      const auto [lo, hi] = x.slice(x.elements(b));
      sum_slice(call, step, b, lo, hi, sums_at(b));
    }
    // The check across nodes started with the first block and ran while the node summed it.
    if (c == 0) finish_node_check(call.meta, "", call.what);
    if (chunk_elements(c) > 0) {
      const std::shared_ptr<void> chunk(node_sums_, sums_at(first));
      across("all-reduce", call.what,
             [&] { cross_node_->start_reduce(chunk, x.acc, x.wire, chunk_elements(c)); });
    }
    if (c + 1 - handed_out >= kCrossChunksInFlight) hand_out_chunk(handed_out++);
  }
  while (handed_out < chunks) hand_out_chunk(handed_out++);
}

}  // namespace ddpx
