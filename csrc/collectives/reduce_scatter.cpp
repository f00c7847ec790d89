// The reduce-scatter: on one node each step's input slot holds one part per destination rank, and
// each rank sums its part over the ranks in rank order; across nodes the node first reduce-scatters
// what each lane's ranks receive, the lanes trade those sums, and each rank adds its part over the
// nodes in node order, rounding once.
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../cross_node/cross_node.h"
#include "collectives.h"
#include "opening.h"

namespace ddpx {
namespace {

// How many elements of each destination rank's part a slot holds: whole cache lines each.
int64_t slot_part(const NodeComm& comm, DType wire) {
  const size_t wire_size = dtype_size(wire);
  const int64_t line = int64_t(64 / wire_size);
  return int64_t(comm.layout().block_bytes / (wire_size * size_t(comm.local_ranks()))) / line *
         line;
}

// Writes elements [lo, lo + todo) of each destination rank's part into slot, one part of
// slot_part elements after another, each scaled by input_scale into wire.
void fill_parts(char* slot, const void* const* ins, int n, DType dtype, DType wire, int64_t part,
                int64_t lo, int64_t todo, double input_scale) {
  if (todo <= 0) return;
  const size_t size = dtype_size(dtype), wire_size = dtype_size(wire);
  for (int r = 0; r < n; ++r) {
    kernels().convert(slot + size_t(r * part) * wire_size, wire,
                      static_cast<const char*>(ins[r]) + size_t(lo) * size, dtype, todo,
                      input_scale, Write::Cached);
  }
}

// Through the slots: out = the ranks' parts for this rank, each scaled by input_scale into wire,
// the sum scaled by sum_scale into out_dtype. Each step's slot holds one part per destination
// rank (the first at step `carried` where the call's opening carried it: Opening::carried).
void reduce_scatter_slots(NodeComm& comm, const CallMeta& mine, uint64_t carried,
                          const void* const* ins, DType dtype, void* out, DType out_dtype,
                          DType wire, int64_t count, double input_scale, double sum_scale,
                          const std::string& what) {
  const int me = comm.local_rank();
  const int n = comm.local_ranks();
  const size_t wire_size = dtype_size(wire);
  const int64_t part = slot_part(comm, wire);
  const int64_t steps = count == 0 ? 1 : (count + part - 1) / part;
  const size_t out_size = dtype_size(out_dtype);
  const Write write = size_t(count) * out_size >= kStreamBytes ? Write::Streaming : Write::Cached;
  char* dst = static_cast<char*>(out);
  const void* srcs[kMaxLocalRanks];
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t lo = s * part, todo = std::min(part, count - lo);
    const uint64_t step = comm.block_step(
        mine, s, carried,
        [&](char* slot) { fill_parts(slot, ins, n, dtype, wire, part, lo, todo, input_scale); },
        what);
    if (todo <= 0) continue;
    for (int r = 0; r < n; ++r) {
      srcs[r] = comm.input_slot(r, step) + size_t(me * part) * wire_size;
    }
    kernels().reduce(dst + size_t(lo) * out_size, out_dtype, srcs, n, wire, todo, sum_scale, write);
  }
}

// Direct: every rank's input lies one part after another; each rank sums its part of every peer's
// input from where it lies (converted into the wire first where the call compresses, as the slots
// would hold it), in block-sized pieces that the rank's threads take in turn, then waits for the
// peers to finish reading its own.
void reduce_scatter_direct(NodeComm& comm, const Opening& opening, DType dtype, void* out,
                           DType wire, int64_t count, const SumRule& rule,
                           const std::string& what) {
  const int n = comm.local_ranks(), me = comm.local_rank();
  const Kernels& k = kernels();
  const size_t size = dtype_size(dtype), wire_size = dtype_size(wire);
  const size_t mine_at = size_t(me) * size_t(count) * size;  // this rank's part in every input
  const bool converted = wire != dtype;
  const int64_t per = std::max<int64_t>(1, int64_t(comm.layout().block_bytes / size));
  const Write write = size_t(count) * size >= kStreamBytes ? Write::Streaming : Write::Cached;
  std::atomic<int64_t> next{0};
  comm.workers().run(comm.threads_for(size_t(count) * size * size_t(n)), [&](int thread) {
    std::vector<char>& scratch = comm.workers().scratch(thread);
    scratch.resize(size_t(n) * size_t(per) * (size + (converted ? wire_size : 0)));
    const void* srcs[kMaxLocalRanks];
    for (int64_t lo; (lo = next.fetch_add(per, std::memory_order_relaxed)) < count;) {
      const int64_t todo = std::min(per, count - lo);
      for (int r = 0; r < n; ++r) {
        const char* raw = opening.peers.view(r, mine_at + size_t(lo) * size, size_t(todo) * size,
                                             scratch.data() + size_t(r) * size_t(per) * size);
        srcs[r] = raw;
        if (converted) {
          char* wired =
              scratch.data() + size_t(n) * size_t(per) * size + size_t(r) * size_t(per) * wire_size;
          k.convert(wired, wire, raw, dtype, todo, rule.input_scale, Write::Cached);
          srcs[r] = wired;
        }
      }
      k.reduce(static_cast<char*>(out) + size_t(lo) * size, dtype, srcs, n, wire, todo,
               rule.sum_scale, write);
    }
  });
  comm.finish_reads(opening.step, what);
}

// Whether parts ins[0..n) lie one after another, count elements each.
bool one_after_another(const void* const* ins, int n, size_t part_bytes) {
  for (int r = 1; r < n; ++r) {
    if (static_cast<const char*>(ins[r]) != static_cast<const char*>(ins[0]) + r * part_bytes) {
      return false;
    }
  }
  return true;
}

// Local rank r gets the node's sums of the parts of rank r of every node, in the accumulation
// dtype. In pieces (cross_piece_bytes), each trade started as soon as the node has summed it.
void reduce_scatter_across_nodes(NodeComm& comm, const void* const* ins, void* out, DType dtype,
                                 DType wire, int64_t count, double scale, const std::string& what) {
  CallMeta mine =
      comm.begin(Collective::ReduceScatter, count, int32_t(dtype), int32_t(wire), scale, 0);
  const SumRule rule(dtype, wire, scale);
  CrossNode& link = comm.cross_node();
  const std::vector<int>& node_ranks = comm.node_ranks();
  const int nodes = link.nodes(), ranks = comm.local_ranks();
  const DType acc = SumRule::accumulation(dtype);
  const size_t size = dtype_size(dtype), acc_size = dtype_size(acc);
  const int64_t piece =
      std::max<int64_t>(1, int64_t(cross_piece_bytes(size_t(count) * acc_size) / acc_size));
  // Piece [lo, lo + n) of every node's sums lies at nodes x lo, node by node; so do the sums
  // the other nodes send back.
  char* sums = comm.buffers().lanes(2 * size_t(count) * acc_size * size_t(nodes));
  char* received = sums + size_t(count) * acc_size * size_t(nodes);
  std::vector<const void*> node_ins(static_cast<size_t>(ranks));
  for (int64_t lo = 0; lo == 0 || lo < count; lo += piece) {
    const int64_t n = std::min(piece, count - lo);
    char* piece_sums = sums + size_t(lo) * acc_size * size_t(nodes);
    for (int node = 0; node < nodes; ++node) {
      for (int r = 0; r < ranks; ++r) {
        node_ins[size_t(r)] =
            static_cast<const char*>(ins[node_ranks[size_t(node * ranks + r)]]) + size_t(lo) * size;
      }
      // The call's first step carries the first slot of node 0's parts and checks the call.
      uint64_t carried = 0;
      if (lo == 0 && node == 0) {
        const int64_t part = slot_part(comm, wire);
        carried = open_call(
                      comm, mine, nullptr, 0, OpenRule{},
                      [&](char* slot) {
                        fill_parts(slot, node_ins.data(), ranks, dtype, wire, part, 0,
                                   std::min(part, n), rule.input_scale);
                      },
                      what)
                      .carried;
      }
      reduce_scatter_slots(comm, mine, carried, node_ins.data(), dtype,
                           piece_sums + size_t(node) * size_t(n) * acc_size, acc, wire, n,
                           rule.input_scale, 1.0, what);
    }
    if (lo == 0) comm.finish_node_check(mine, "", what);
    if (n == 0) return;
    comm.across("transfer", what, [&] {
      link.start_all_to_all(piece_sums, size_t(n) * acc_size,
                            received + size_t(lo) * acc_size * size_t(nodes));
    });
  }
  const void* from_nodes[kMaxSources];
  const int here = link.node();
  for (int64_t lo = 0; lo < count; lo += piece) {
    const int64_t n = std::min(piece, count - lo);
    comm.across("transfer", what, [&] { link.finish_trade(); });
    const size_t at = size_t(lo) * acc_size * size_t(nodes);
    for (int node = 0; node < nodes; ++node) {
      from_nodes[node] =
          (node == here ? sums : received) + at + size_t(node) * size_t(n) * acc_size;
    }
    kernels().reduce(static_cast<char*>(out) + size_t(lo) * size, dtype, from_nodes, nodes, acc, n,
                     rule.sum_scale, Write::Cached);
  }
}

}  // namespace

void reduce_scatter(NodeComm& comm, const void* const* ins, void* out, DType dtype, DType wire,
                    int64_t count, double scale, const std::string& what) {
  TORCH_CHECK_VALUE(count >= 0, "ddpx: negative element count");
  if (comm.spans_nodes()) {
    reduce_scatter_across_nodes(comm, ins, out, dtype, wire, count, scale, what);
    return;
  }
  CallMeta mine =
      comm.begin_local(Collective::ReduceScatter, count, int32_t(dtype), scale, 0, what);
  mine.wire = int32_t(wire);
  const SumRule rule(dtype, wire, scale);
  const int n = comm.local_ranks();
  const size_t part_bytes = size_t(count) * dtype_size(dtype);
  // Peers read this rank's input where it lies only where its parts lie one after another.
  const bool contiguous = one_after_another(ins, n, part_bytes);
  const int64_t part = slot_part(comm, wire);
  const Opening opening = open_call(
      comm, mine, contiguous ? ins[0] : nullptr, size_t(n) * part_bytes, OpenRule{},
      [&](char* slot) {
        fill_parts(slot, ins, n, dtype, wire, part, 0, std::min(part, count), rule.input_scale);
      },
      what);
  if (opening.method == CopyMethod::Direct) {
    reduce_scatter_direct(comm, opening, dtype, out, wire, count, rule, what);
    return;
  }
  reduce_scatter_slots(comm, mine, opening.carried, ins, dtype, out, dtype, wire, count,
                       rule.input_scale, rule.sum_scale, what);
}

}  // namespace ddpx
