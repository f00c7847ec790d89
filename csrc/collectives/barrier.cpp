// The barrier: a step with no data, which every rank of the node (and, through the call's check
// with the other nodes, of every node) reaches before any leaves it.
#include "collectives.h"

namespace ddpx {

void barrier(NodeComm& comm, const std::string& what) {
  const CallMeta mine = comm.begin(Collective::Barrier, 0, -1, -1, 1.0, 0);
  comm.exchange(mine, true, [](char*) {}, what);
  // Each rank's trade with the other nodes ends once every node's ranks have all arrived.
  if (comm.spans_nodes()) comm.finish_node_check(mine, "", what);
}

}  // namespace ddpx
