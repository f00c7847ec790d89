// The all-gather, broadcast, reduce-scatter and all-to-all of a group that spans nodes: each rank
// trades with the ranks of its local index on the other nodes (its lane), and the node's shared
// memory does the rest, so every node's link carries each byte once, every lane a share of it.
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "cross_node.h"
#include "shm_allreduce.h"

namespace ddpx {

char* ShmAllreduce::lane_buffer(size_t bytes) {
  if (lane_buffer_.size() < bytes) lane_buffer_.resize(bytes);
  return lane_buffer_.data();
}

// A call checked within the node (a step with no data) and with the other nodes, before any data
// crosses: the nodes' transfers go only where every rank agreed.
CallMeta ShmAllreduce::checked_across_nodes(Collective op, int64_t numel, int32_t dtype,
                                            int32_t wire, double scale, int root,
                                            int32_t torch_dtype, const std::string& what) {
  begin_call();
  const CallMeta mine = call_meta(op, numel, dtype, wire, scale, root, torch_dtype);
  exchange(mine, true, [](char*) {}, what);
  finish_node_check(mine, "", what);
  return mine;
}

// Each rank all-gathers its input over its lane, then the node all-gathers what the lanes brought:
// rank r's part of node n lands at outs[group rank of (n, r)]. In pieces (cross_piece_bytes),
// all started at once: the node hands out each piece as it lands, while the next cross.
void ShmAllreduce::allgather_across_nodes(const void* in, size_t bytes, int32_t torch_dtype,
                                          void* const* outs, const std::string& what) {
  const CallMeta mine = checked_across_nodes(Collective::AllGather, int64_t(bytes), -1, -1, 1.0, 0,
                                             torch_dtype, what);
  if (bytes == 0) return;
  const size_t nodes = size_t(cross_node_->nodes()), ranks = size_t(channel_.size());
  const size_t piece = cross_piece_bytes(bytes);
  // Piece [lo, lo + n) of every node's input lies at nodes x lo, node by node.
  char* lane = lane_buffer(bytes * nodes);
  const char* src = static_cast<const char*>(in);
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    across("transfer", what,
           [&] { cross_node_->start_all_gather(src + lo, n, lane + lo * nodes); });
  }
  const Store store = bytes * node_ranks_.size() >= kStreamBytes ? Store::Streaming : Store::Cached;
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    across("transfer", what, [&] { cross_node_->finish_trade(); });
    allgather_in_node(
        mine, false, lane + lo * nodes, n * nodes,
        [&](int r, size_t at, const char* from, size_t count) {
          while (count > 0) {
            const size_t node = at / n, offset = at % n, part = std::min(count, n - offset);
            char* to =
                static_cast<char*>(outs[node_ranks_[node * ranks + size_t(r)]]) + lo + offset;
            if (to != from) kernels().copy(to, from, part, store);
            at += part;
            from += part;
            count -= part;
          }
        },
        what);
  }
}

// The root's lane broadcasts from the root's node, then every node broadcasts from that lane.
void ShmAllreduce::broadcast_across_nodes(void* data, size_t bytes, int32_t torch_dtype, int root,
                                          const std::string& what) {
  const CallMeta mine = checked_across_nodes(Collective::Broadcast, int64_t(bytes), -1, -1, 1.0,
                                             root, torch_dtype, what);
  const int ranks = channel_.size();
  const auto at = std::find(node_ranks_.begin(), node_ranks_.end(), root) - node_ranks_.begin();
  const int root_node = int(at / ranks), root_local = int(at % ranks);
  if (bytes == 0) return;
  if (channel_.me() == root_local) {
    across("transfer", what, [&] { cross_node_->broadcast(data, bytes, root_node); });
  }
  broadcast_in_node(mine, false, data, bytes, root_local, what);
}

// The node reduce-scatters what each lane's ranks receive: local rank r gets the node's sums of
// the parts of rank r of every node, in the accumulation dtype. The lanes trade those sums, and
// each rank adds its part over the nodes in node order, rounding once. In pieces
// (cross_piece_bytes), each trade started as soon as the node has summed it.
void ShmAllreduce::reduce_scatter_across_nodes(const void* const* ins, void* out, DType dtype,
                                               DType wire, int64_t count, double scale,
                                               const std::string& what) {
  begin_call();
  const CallMeta mine =
      call_meta(Collective::ReduceScatter, count, int32_t(dtype), int32_t(wire), scale, 0);
  const int nodes = cross_node_->nodes(), ranks = channel_.size();
  const DType acc = dtype == DType::Float64 ? DType::Float64 : DType::Float32;
  const size_t size = dtype_size(dtype), acc_size = dtype_size(acc);
  const int64_t piece =
      std::max<int64_t>(1, int64_t(cross_piece_bytes(size_t(count) * acc_size) / acc_size));
  // Piece [lo, lo + n) of every node's sums lies at nodes x lo, node by node; so do the sums
  // the other nodes send back.
  char* sums = lane_buffer(2 * size_t(count) * acc_size * size_t(nodes));
  char* received = sums + size_t(count) * acc_size * size_t(nodes);
  std::vector<const void*> node_ins(static_cast<size_t>(ranks));
  for (int64_t lo = 0; lo == 0 || lo < count; lo += piece) {
    const int64_t n = std::min(piece, count - lo);
    char* piece_sums = sums + size_t(lo) * acc_size * size_t(nodes);
    for (int node = 0; node < nodes; ++node) {
      for (int r = 0; r < ranks; ++r) {
        node_ins[size_t(r)] = static_cast<const char*>(ins[node_ranks_[size_t(node * ranks + r)]]) +
                              size_t(lo) * size;
      }
      reduce_scatter_in_node(mine, lo == 0 && node == 0, node_ins.data(), dtype,
                             piece_sums + size_t(node) * size_t(n) * acc_size, acc, wire, n, scale,
                             what);
    }
    if (lo == 0) finish_node_check(mine, "", what);
    if (n == 0) return;
    across("transfer", what, [&] {
      cross_node_->start_all_to_all(piece_sums, size_t(n) * acc_size,
                                    received + size_t(lo) * acc_size * size_t(nodes));
    });
  }
  const void* from_nodes[kMaxSources];
  const int here = cross_node_->node();
  for (int64_t lo = 0; lo < count; lo += piece) {
    const int64_t n = std::min(piece, count - lo);
    across("transfer", what, [&] { cross_node_->finish_trade(); });
    const size_t at = size_t(lo) * acc_size * size_t(nodes);
    for (int node = 0; node < nodes; ++node) {
      from_nodes[node] =
          (node == here ? sums : received) + at + size_t(node) * size_t(n) * acc_size;
    }
    kernels().reduce(static_cast<char*>(out) + size_t(lo) * size, dtype, from_nodes, nodes, acc, n,
                     Store::Cached);
  }
}

// Each piece of the parts (cross_piece_bytes) goes through the node once per destination node:
// local rank r collects from every local rank its part for rank r of node m, and those parts,
// side by side, are its lane's message to node m; for its own node, they are its outputs. The
// lanes trade each piece as soon as the node has collected it.
void ShmAllreduce::alltoall_across_nodes(const void* const* ins, void* const* outs, size_t bytes,
                                         int32_t torch_dtype, const std::string& what) {
  begin_call();
  const CallMeta mine =
      call_meta(Collective::AllToAll, int64_t(bytes), -1, -1, 1.0, 0, torch_dtype);
  const size_t nodes = size_t(cross_node_->nodes()), ranks = size_t(channel_.size());
  const size_t piece = cross_piece_bytes(bytes);
  // Piece [lo, lo + n) of what crosses lies at nodes x ranks x lo, node by node, rank by rank;
  // so does what comes back.
  char* dealt = lane_buffer(2 * nodes * ranks * bytes);
  char* received = dealt + nodes * ranks * bytes;
  const size_t here = size_t(cross_node_->node());
  std::vector<const void*> node_ins(ranks);
  std::vector<void*> node_outs(ranks);
  for (size_t lo = 0; lo == 0 || lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    const std::vector<size_t> sizes(ranks, n);
    char* piece_dealt = dealt + lo * nodes * ranks;
    for (size_t node = 0; node < nodes; ++node) {
      for (size_t r = 0; r < ranks; ++r) {
        node_ins[r] = static_cast<const char*>(ins[node_ranks_[node * ranks + r]]) + lo;
        node_outs[r] = node == here ? static_cast<char*>(outs[node_ranks_[here * ranks + r]]) + lo
                                    : piece_dealt + (node * ranks + r) * n;
      }
      alltoall_in_node(mine, lo == 0 && node == 0, node_ins.data(), sizes.data(), node_outs.data(),
                       sizes.data(), n, what);
    }
    if (lo == 0) finish_node_check(mine, "", what);
    if (n == 0) return;
    across("transfer", what, [&] {
      cross_node_->start_all_to_all(piece_dealt, ranks * n, received + lo * nodes * ranks);
    });
  }
  for (size_t lo = 0; lo < bytes; lo += piece) {
    const size_t n = std::min(piece, bytes - lo);
    across("transfer", what, [&] { cross_node_->finish_trade(); });
    const char* piece_received = received + lo * nodes * ranks;
    for (size_t node = 0; node < nodes; ++node) {
      if (node == here) continue;
      for (size_t r = 0; r < ranks; ++r) {
        kernels().copy(static_cast<char*>(outs[node_ranks_[node * ranks + r]]) + lo,
                       piece_received + (node * ranks + r) * n, n, Store::Cached);
      }
    }
  }
}

}  // namespace ddpx
