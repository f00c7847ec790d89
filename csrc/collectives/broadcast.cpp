// The broadcast: on one node the root's data goes through its input slot in blocks, one step
// each, and every other rank copies it out; across nodes the root's lane first broadcasts it from
// the root's node to the same local rank of every node, and then every node broadcasts from there.
#include <c10/util/Exception.h>

#include <algorithm>

#include "../cross_node/cross_node.h"
#include "collectives.h"
#include "opening.h"

namespace ddpx {
namespace {

// Through the slots: each block of the root's data goes through its input slot at a step of its
// own (the first block at step `carried` where the call's opening carried it: Opening::carried),
// and every other rank copies it out.
void broadcast_slots(NodeComm& comm, const CallMeta& mine, uint64_t carried, void* data,
                     size_t bytes, int root, const std::string& what) {
  const int me = comm.local_rank();
  const size_t block = comm.layout().block_bytes;
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const Write write = bytes >= kStreamBytes ? Write::Streaming : Write::Cached;
  char* bytes_at = static_cast<char*>(data);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = comm.block_step(
        mine, b, carried,
        [&](char* slot) {
          if (me == root) k.copy(slot, bytes_at + lo, count, Write::Cached);
        },
        what);
    if (me != root) k.copy(bytes_at + lo, comm.input_slot(root, step), count, write);
  }
}

// Direct: every other rank copies the root's data from where it lies, and the root waits for them
// to finish reading.
void broadcast_direct(NodeComm& comm, const Opening& opening, void* data, size_t bytes, int root,
                      const std::string& what) {
  char* to = static_cast<char*>(data);
  if (comm.local_rank() != root && bytes > 0) {
    const char* from = opening.peers.view(root, 0, bytes, to);
    if (from != to) {
      kernels().copy(to, from, bytes, bytes >= kStreamBytes ? Write::Streaming : Write::Cached);
    }
  }
  comm.finish_reads(opening.step, what);
}

void broadcast_across_nodes(NodeComm& comm, void* data, size_t bytes, int32_t torch_dtype, int root,
                            const std::string& what) {
  const CallMeta mine = comm.begin_checked_across_nodes(Collective::Broadcast, int64_t(bytes), -1,
                                                        -1, 1.0, root, torch_dtype, what);
  const int ranks = comm.local_ranks();
  const std::vector<int>& node_ranks = comm.node_ranks();
  const auto at = std::find(node_ranks.begin(), node_ranks.end(), root) - node_ranks.begin();
  const int root_node = int(at / ranks), root_local = int(at % ranks);
  if (bytes == 0) return;
  if (comm.local_rank() == root_local) {
    comm.across("transfer", what, [&] { comm.cross_node().broadcast(data, bytes, root_node); });
  }
  broadcast_slots(comm, mine, 0, data, bytes, root_local, what);
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
  const bool mine_is_read = comm.local_rank() == root;
  const size_t first_block = std::min(bytes, comm.layout().block_bytes);
  const Opening opening = open_call(
      comm, mine, mine_is_read ? data : nullptr, bytes, OpenRule{root},
      [&](char* slot) {
        if (mine_is_read) kernels().copy(slot, data, first_block, Write::Cached);
      },
      what);
  if (opening.method == CopyMethod::Direct) {
    broadcast_direct(comm, opening, data, bytes, root, what);
    return;
  }
  broadcast_slots(comm, mine, opening.carried, data, bytes, root, what);
}

}  // namespace ddpx
