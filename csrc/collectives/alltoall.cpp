// The all-to-all: on one node each step's input slot holds this rank's part for every other rank,
// and each rank copies out the parts meant for it; across nodes each piece of the parts goes
// through the node once per destination node, and the lanes trade what the node collected.
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "../cross_node/cross_node.h"
#include "collectives.h"

namespace ddpx {
namespace {

void alltoall_in_node(NodeComm& comm, const CallMeta& mine, bool first, const void* const* ins,
                      const size_t* sends, void* const* outs, const size_t* receives,
                      size_t longest, const std::string& what) {
  const int me = comm.local_rank();
  const Kernels& k = kernels();
  const int n = comm.local_ranks();
  // Each step's slot holds one part per destination rank, whole cache lines each.
  const size_t part = comm.layout().block_bytes / size_t(n) / 64 * 64;
  const size_t steps = longest == 0 ? 1 : (longest + part - 1) / part;
  size_t total = 0;
  for (int r = 0; r < n; ++r) total += receives[r];
  const Write write = total >= kStreamBytes ? Write::Streaming : Write::Cached;
  const auto piece = [&](size_t bytes, size_t lo) {
    return lo < bytes ? std::min(part, bytes - lo) : size_t(0);
  };
  for (size_t s = 0; s < steps; ++s) {
    const size_t lo = s * part;
    const uint64_t step = comm.exchange(
        mine, first && s == 0,
        [&](char* slot) {
          for (int r = 0; r < n; ++r) {
            const size_t count = r == me ? 0 : piece(sends[r], lo);
            if (count > 0) {
              k.copy(slot + size_t(r) * part, static_cast<const char*>(ins[r]) + lo, count,
                     Write::Cached);
            }
          }
        },
        what);
    for (int r = 0; r < n; ++r) {
      const size_t count = piece(receives[r], lo);
      if (count == 0) continue;
      const char* from = r == me ? static_cast<const char*>(ins[me]) + lo
                                 : comm.input_slot(r, step) + size_t(me) * part;
      char* to = static_cast<char*>(outs[r]) + lo;
      if (to != from) k.copy(to, from, count, write);
    }
  }
}

// Local rank r collects from every local rank its part for rank r of node m, and those parts,
// side by side, are its lane's message to node m; for its own node, they are its outputs. The
// lanes trade each piece (cross_piece_bytes) as soon as the node has collected it.
void alltoall_across_nodes(NodeComm& comm, const void* const* ins, void* const* outs, size_t bytes,
                           int32_t torch_dtype, const std::string& what) {
  const CallMeta mine =
      comm.begin(Collective::AllToAll, int64_t(bytes), -1, -1, 1.0, 0, torch_dtype);
  CrossNode& link = comm.cross_node();
  const std::vector<int>& node_ranks = comm.node_ranks();
  const size_t nodes = size_t(link.nodes()), ranks = size_t(comm.local_ranks());
  const size_t piece = cross_piece_bytes(bytes);
  // Piece [lo, lo + n) of what crosses lies at nodes x ranks x lo, node by node, rank by rank;
  // so does what comes back.
  char* dealt = comm.buffers().lanes(2 * nodes * ranks * bytes);
  char* received = dealt + nodes * ranks * bytes;
  const size_t here = size_t(link.node());
  std::vector<const void*> node_ins(ranks);
  std::vector<void*> node_outs(ranks);
  for (size_t lo = 0; lo == 0 || lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    const std::vector<size_t> sizes(ranks, n);
    char* piece_dealt = dealt + lo * nodes * ranks;
    for (size_t node = 0; node < nodes; ++node) {
      for (size_t r = 0; r < ranks; ++r) {
        node_ins[r] = static_cast<const char*>(ins[node_ranks[node * ranks + r]]) + lo;
        node_outs[r] = node == here ? static_cast<char*>(outs[node_ranks[here * ranks + r]]) + lo
                                    : piece_dealt + (node * ranks + r) * n;
      }
      alltoall_in_node(comm, mine, lo == 0 && node == 0, node_ins.data(), sizes.data(),
                       node_outs.data(), sizes.data(), n, what);
    }
    if (lo == 0) comm.finish_node_check(mine, "", what);
    if (n == 0) return;
    comm.across("transfer", what, [&] {
      link.start_all_to_all(piece_dealt, ranks * n, received + lo * nodes * ranks);
    });
  }
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    comm.across("transfer", what, [&] { link.finish_trade(); });
    const char* piece_received = received + lo * nodes * ranks;
    for (size_t node = 0; node < nodes; ++node) {
      if (node == here) continue;
      for (size_t r = 0; r < ranks; ++r) {
        kernels().copy(static_cast<char*>(outs[node_ranks[node * ranks + r]]) + lo,
                       piece_received + (node * ranks + r) * n, n, Write::Cached);
      }
    }
  }
}

}  // namespace

void alltoall(NodeComm& comm, const void* const* ins, const size_t* sends, void* const* outs,
              const size_t* receives, size_t longest, int32_t torch_dtype,
              const std::string& what) {
  if (comm.spans_nodes()) {
    const int n = comm.group_size();
    TORCH_CHECK_VALUE(
        std::all_of(sends, sends + n, [&](size_t b) { return b == longest; }) &&
            std::all_of(receives, receives + n, [&](size_t b) { return b == longest; }),
        "ddpx: ", what, " across nodes takes parts of one size");
    alltoall_across_nodes(comm, ins, outs, longest, torch_dtype, what);
    return;
  }
  const CallMeta mine =
      comm.begin_local(Collective::AllToAll, int64_t(longest), -1, 1.0, 0, what, torch_dtype);
  alltoall_in_node(comm, mine, true, ins, sends, outs, receives, longest, what);
}

}  // namespace ddpx
