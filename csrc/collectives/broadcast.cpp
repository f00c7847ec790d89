// The broadcast: on one node the root's data goes through its input slot in blocks, one step
// each, and every other rank copies it out; across nodes the root's lane first broadcasts it from
// the root's node to the same local rank of every node, and then every node broadcasts from there.
#include <c10/util/Exception.h>

#include <algorithm>

#include "../cross_node/cross_node.h"
#include "collectives.h"

namespace ddpx {
namespace {

// Where the root's data lies in its arena (its first step says so), no block goes through the
// slots: every other rank copies it from there, and the root waits for them to finish reading.
// Returns false, having copied nothing, where some rank cannot reach the root's memory: the ranks
// then run it again through the slots from the next step.
bool broadcast_in_node(NodeComm& comm, const CallMeta& mine, bool first, void* data, size_t bytes,
                       int root, const std::string& what) {
  ShmChannel& channel = comm.channel();
  const int me = channel.me();
  const size_t block = channel.layout().block_bytes;
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const Write write = bytes >= kStreamBytes ? Write::Streaming : Write::Cached;
  char* bytes_at = static_cast<char*>(data);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = comm.exchange(
        mine, first && b == 0,
        [&](char* slot) {
          if (me == root && !mine.arena.valid()) k.copy(slot, bytes_at + lo, count, Write::Cached);
        },
        what);
    if (first && b == 0 && channel.posted(root, step).arena.valid()) {
      if (!comm.all_reach(step)) return false;
      const char* from = me == root ? bytes_at : comm.peer_arena(root, step);
      if (me != root) {
        if (from == nullptr) {
          channel.read_peer(root, data, channel.posted(root, step).address, bytes, what);
        } else if (bytes > 0) {
          k.copy(bytes_at, from, bytes, write);
        }
      }
      comm.finish_reads(step, what);
      if (from != nullptr) comm.count_zero_copy();
      return true;
    }
    if (me != root) k.copy(bytes_at + lo, channel.input_slot(root, step), count, write);
  }
  return true;
}

void broadcast_across_nodes(NodeComm& comm, void* data, size_t bytes, int32_t torch_dtype, int root,
                            const std::string& what) {
  const CallMeta mine = comm.begin_checked_across_nodes(Collective::Broadcast, int64_t(bytes), -1,
                                                        -1, 1.0, root, torch_dtype, what);
  const int ranks = comm.channel().size();
  const std::vector<int>& node_ranks = comm.node_ranks();
  const auto at = std::find(node_ranks.begin(), node_ranks.end(), root) - node_ranks.begin();
  const int root_node = int(at / ranks), root_local = int(at % ranks);
  if (bytes == 0) return;
  if (comm.channel().me() == root_local) {
    comm.across("transfer", what, [&] { comm.cross_node().broadcast(data, bytes, root_node); });
  }
  broadcast_in_node(comm, mine, false, data, bytes, root_local, what);
}

}  // namespace

void broadcast(NodeComm& comm, void* data, size_t bytes, int32_t torch_dtype, int root,
               const std::string& what) {
  TORCH_CHECK_VALUE(root >= 0 && root < comm.group_size(), "ddpx: broadcast from rank ", root,
                    " of ", comm.group_size());
  if (comm.spans_nodes()) {
    broadcast_across_nodes(comm, data, bytes, torch_dtype, root, what);
    return;
  }
  CallMeta mine =
      comm.begin_local(Collective::Broadcast, int64_t(bytes), -1, 1.0, root, what, torch_dtype);
  if (comm.channel().me() == root) {
    mine.address = reinterpret_cast<uint64_t>(data);
    mine.arena = comm.arena_place(data, bytes);
  }
  if (!broadcast_in_node(comm, mine, true, data, bytes, root, what)) {
    mine.arena = {};
    broadcast_in_node(comm, mine, false, data, bytes, root, what);
  }
}

}  // namespace ddpx
