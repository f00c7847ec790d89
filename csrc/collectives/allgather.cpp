// The all-gather: on one node every rank's input goes through its input slot in blocks, one step
// each, and every rank copies every peer's block to its place; across nodes each rank first
// all-gathers its input with the ranks of its local index on the other nodes (its lane), and the
// node then all-gathers what the lanes brought, so every node's link carries each byte once.
#include <algorithm>
#include <atomic>
#include <functional>

#include "../cross_node/cross_node.h"
#include "collectives.h"
#include "opening.h"

namespace ddpx {
namespace {

// Puts bytes [lo, lo + count) of rank r's input, at from, where they belong.
using Place = std::function<void(int r, size_t lo, const char* from, size_t count)>;

// Through the slots: each block of every rank's input goes through its input slot at a step of its
// own (the first block at step `carried` where the call's opening carried it: Opening::carried),
// and every rank places every peer's block.
void allgather_slots(NodeComm& comm, const CallMeta& mine, uint64_t carried, const void* in,
                     size_t bytes, const Place& place, const std::string& what) {
  const size_t block = comm.layout().block_bytes;
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const char* src = static_cast<const char*>(in);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = comm.block_step(
        mine, b, carried, [&](char* slot) { kernels().copy(slot, src + lo, count, Write::Cached); },
        what);
    if (count == 0) continue;
    for (int r = 0; r < comm.local_ranks(); ++r) {
      place(r, lo, r == comm.local_rank() ? src + lo : comm.input_slot(r, step), count);
    }
  }
}

// Direct: each rank copies every peer's input to its place from where it lies, then waits for the
// peers to finish reading its own. The parts go in block-sized pieces that the rank's threads take
// in turn.
void allgather_direct(NodeComm& comm, const Opening& opening, size_t bytes, void* const* outs,
                      Write write, const std::string& what) {
  const int n = comm.local_ranks();
  const size_t piece = comm.layout().block_bytes;
  const size_t per_part = (bytes + piece - 1) / piece;
  std::atomic<size_t> next{0};
  comm.workers().run(comm.threads_for(bytes * size_t(n)), [&](int) {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < per_part * size_t(n);) {
      const int r = int(i / per_part);
      const size_t lo = i % per_part * piece, count = std::min(piece, bytes - lo);
      char* to = static_cast<char*>(outs[r]) + lo;
      const char* from = opening.peers.view(r, lo, count, to);
      if (from != to) kernels().copy(to, from, count, write);
    }
  });
  comm.finish_reads(opening.step, what);
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
  const size_t nodes = size_t(link.nodes()), ranks = size_t(comm.local_ranks());
  const size_t piece = cross_piece_bytes(bytes);
  // Piece [lo, lo + n) of every node's input lies at nodes x lo, node by node.
  char* lane = comm.buffers().lanes(bytes * nodes);
  const char* src = static_cast<const char*>(in);
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    comm.across("transfer", what, [&] { link.start_all_gather(src + lo, n, lane + lo * nodes); });
  }
  const Write write = bytes * node_ranks.size() >= kStreamBytes ? Write::Streaming : Write::Cached;
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    comm.across("transfer", what, [&] { link.finish_trade(); });
    allgather_slots(
        comm, mine, 0, lane + lo * nodes, n * nodes,
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
      bytes * size_t(comm.local_ranks()) >= kStreamBytes ? Write::Streaming : Write::Cached;
  const size_t first_block = std::min(bytes, comm.layout().block_bytes);
  const Opening opening = open_call(
      comm, mine, in, bytes, OpenRule{},
      [&](char* slot) { kernels().copy(slot, in, first_block, Write::Cached); }, what);
  if (opening.method == CopyMethod::Direct) {
    allgather_direct(comm, opening, bytes, outs, write, what);
    return;
  }
  const Place place = [&](int r, size_t lo, const char* from, size_t count) {
    char* part = static_cast<char*>(outs[r]) + lo;
    if (part != from) kernels().copy(part, from, count, write);
  };
  allgather_slots(comm, mine, opening.carried, in, bytes, place, what);
}

}  // namespace ddpx
