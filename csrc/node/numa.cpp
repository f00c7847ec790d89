// NUMA placement of shared memory (numa.h): mbind and get_mempolicy, by their raw syscalls.
#include "numa.h"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iterator>

namespace ddpx {
namespace {

// Room for 1024 nodes, as many as the kernel itself allows (CONFIG_NODES_SHIFT 10).
constexpr int kMaskWords = 16;
constexpr int kMaxNodes = kMaskWords * 64;
using NodeMask = unsigned long[kMaskWords];

}  // namespace

std::string numa_place(char* base, const std::vector<NumaRange>& ranges) {
  // A placement is whole or none: the ranges placed before one that fails go back to the
  // default, so that what describe() says of the segment is true of every page.
  auto undo = [&](size_t placed) {
    for (size_t i = 0; i < placed; ++i) {
      syscall(SYS_mbind, base + ranges[i].offset, ranges[i].bytes, MPOL_DEFAULT, nullptr, 0, 0);
    }
  };
  for (size_t i = 0; i < ranges.size(); ++i) {
    const NumaRange& range = ranges[i];
    NodeMask mask{};
    for (int node : range.nodes) {
      if (node < 0 || node >= kMaxNodes) {
        undo(i);
        return "node " + std::to_string(node) + " is out of range";
      }
      mask[node / 64] |= 1UL << (node % 64);
    }
    const int mode = range.mode == NumaRange::Mode::Preferred ? MPOL_PREFERRED : MPOL_INTERLEAVE;
    // maxnode counts one past the last bit the kernel reads.
    if (syscall(SYS_mbind, base + range.offset, range.bytes, mode, mask, kMaxNodes + 1, 0) != 0) {
      const int error = errno;
      undo(i);
      std::string nodes;
      for (int node : range.nodes) nodes += (nodes.empty() ? "" : ",") + std::to_string(node);
      return "mbind to node" + std::string(range.nodes.size() == 1 ? " " : "s ") + nodes + ": " +
             std::strerror(error);
    }
  }
  return "";
}

NumaWhere numa_where(const void* address) {
  NumaWhere where;
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0, address, MPOL_F_NODE | MPOL_F_ADDR) == 0) {
    where.node = node;
  }
  int mode = 0;
  NodeMask mask{};
  if (syscall(SYS_get_mempolicy, &mode, mask, kMaxNodes + 1, address, MPOL_F_ADDR) != 0) {
    where.policy = std::string("unknown (") + std::strerror(errno) + ")";
    return where;
  }
  mode &= ~MPOL_MODE_FLAGS;
  static const char* const kNames[] = {
      "default",        "preferred",          "bind", "interleave", "local",
      "preferred_many", "weighted_interleave"};
  where.policy = mode >= 0 && mode < int(std::size(kNames)) ? kNames[mode] : std::to_string(mode);
  for (int n = 0; n < kMaxNodes; ++n) {
    if (mask[n / 64] & (1UL << (n % 64))) where.nodes.push_back(n);
  }
  return where;
}

}  // namespace ddpx
