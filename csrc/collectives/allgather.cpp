// The all-gather: on one node every rank's input goes through its input slot in blocks, one step
// each, and every rank copies every peer's block to its place; across nodes each rank first
// all-gathers its input with the ranks of its local index on the other nodes (its lane), and the
// node then all-gathers what the lanes brought, so every node's link carries each byte once.
#include <algorithm>
#include <atomic>
#include <functional>

#include "../cross_node/cross_node.h"
#include "collectives.h"

namespace ddpx {
namespace {

// Puts bytes [lo, lo + count) of rank r's input, at from, where they belong.
using Place = std::function<void(int r, size_t lo, const char* from, size_t count)>;

// Returns false, having placed nothing, where a call's first step finds that some ranks' inputs lie
// in their arenas: the ranks then run it again from the next step.
bool allgather_in_node(NodeComm& comm, const CallMeta& mine, bool first, const void* in,
                       size_t bytes, const Place& place, const std::string& what) {
  ShmChannel& channel = comm.channel();
  const size_t block = channel.layout().block_bytes;
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const char* src = static_cast<const char*>(in);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = comm.exchange(
        mine, first && b == 0, [&](char* slot) { k.copy(slot, src + lo, count, Write::Cached); },
        what);
    if (first && b == 0 && comm.any_in_arena(step)) return false;
    if (count == 0) continue;
    for (int r = 0; r < channel.size(); ++r) {
      place(r, lo, r == channel.me() ? src + lo : channel.input_slot(r, step), count);
    }
  }
  return true;
}

// Every rank's input lies in its arena: each rank copies every peer's straight to its place, after
// one step with no data, then waits for the peers to finish reading its own. The parts go in
// block-sized pieces that the rank's threads take in turn.
void allgather_in_arenas(NodeComm& comm, uint64_t step, const void* in, size_t bytes,
                         void* const* outs, Write write, const std::string& what) {
  ShmChannel& channel = comm.channel();
  const int n = channel.size();
  const char* froms[kMaxLocalRanks];
  for (int r = 0; r < n; ++r) {
    froms[r] = r == channel.me() ? static_cast<const char*>(in) : comm.peer_arena(r, step);
  }
  const size_t piece = channel.layout().block_bytes;
  const size_t per_part = (bytes + piece - 1) / piece;
  std::atomic<size_t> next{0};
  comm.run_threads(comm.threads_for(bytes * size_t(n)), [&](int) {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < per_part * size_t(n);) {
      const int r = int(i / per_part);
      const size_t lo = i % per_part * piece, count = std::min(piece, bytes - lo);
      char* to = static_cast<char*>(outs[r]) + lo;
      if (froms[r] == nullptr) {
        channel.read_peer(r, to, channel.posted(r, step).address + lo, count, what);
      } else if (to != froms[r] + lo) {
        kernels().copy(to, froms[r] + lo, count, write);
      }
    }
  });
  comm.finish_reads(step, what);
  if (std::find(froms, froms + n, nullptr) == froms + n) comm.count_zero_copy();
}

// Rank r's part of node n lands at outs[group rank of (n, r)]. In pieces (cross_piece_bytes), all
// started at once: the node hands out each piece as it lands, while the next cross.
void allgather_across_nodes(NodeComm& comm, const void* in, size_t bytes, int32_t torch_dtype,
                            void* const* outs, const std::string& what) {
  const CallMeta mine = comm.begin_checked_across_nodes(Collective::AllGather, int64_t(bytes), -1,
                                                        -1, 1.0, 0, torch_dtype, what);
  if (bytes == 0) return;
  CrossNode& link = comm.cross_node();
  const std::vector<int>& node_ranks = comm.node_ranks();
  const size_t nodes = size_t(link.nodes()), ranks = size_t(comm.channel().size());
  const size_t piece = cross_piece_bytes(bytes);
  // Piece [lo, lo + n) of every node's input lies at nodes x lo, node by node.
  char* lane = comm.lane_buffer(bytes * nodes);
  const char* src = static_cast<const char*>(in);
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    comm.across("transfer", what, [&] { link.start_all_gather(src + lo, n, lane + lo * nodes); });
  }
  const Write write = bytes * node_ranks.size() >= kStreamBytes ? Write::Streaming : Write::Cached;
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    comm.across("transfer", what, [&] { link.finish_trade(); });
    allgather_in_node(
        comm, mine, false, lane + lo * nodes, n * nodes,
        [&](int r, size_t at, const char* from, size_t count) {
          while (count > 0) {
            const size_t node = at / n, offset = at % n, part = std::min(count, n - offset);
            char* to = static_cast<char*>(outs[node_ranks[node * ranks + size_t(r)]]) + lo + offset;
            if (to != from) kernels().copy(to, from, part, write);
            at += part;
            from += part;
            count -= part;
          }
        },
        what);
  }
}

}  // namespace

void allgather(NodeComm& comm, const void* in, size_t bytes, int32_t torch_dtype, void* const* outs,
               const std::string& what) {
  if (comm.spans_nodes()) {
    allgather_across_nodes(comm, in, bytes, torch_dtype, outs, what);
    return;
  }
  CallMeta mine =
      comm.begin_local(Collective::AllGather, int64_t(bytes), -1, 1.0, 0, what, torch_dtype);
  const Write write =
      bytes * size_t(comm.channel().size()) >= kStreamBytes ? Write::Streaming : Write::Cached;
  const Place place = [&](int r, size_t lo, const char* from, size_t count) {
    char* part = static_cast<char*>(outs[r]) + lo;
    if (part != from) kernels().copy(part, from, count, write);
  };
  mine.address = reinterpret_cast<uint64_t>(in);
  mine.arena = comm.arena_place(in, bytes);
  bool first = true;
  if (mine.arena.valid()) {
    const uint64_t step = comm.exchange(mine, true, [](char*) {}, what);
    if (comm.all_in_arena(step)) {
      allgather_in_arenas(comm, step, in, bytes, outs, write, what);
      return;
    }
    first = false;
  }
  if (!allgather_in_node(comm, mine, first, in, bytes, place, what)) {
    allgather_in_node(comm, mine, false, in, bytes, place, what);
  }
}

}  // namespace ddpx
