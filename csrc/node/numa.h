// Where the node's shared memory lies on a machine of several NUMA nodes: parts of a mapping
// given a memory policy before their pages exist, and which node a page lies on.
//
// A policy set with mbind on a shared mapping of a tmpfs file is the file's own (the kernel's
// shared policy), so it decides where every page of that range is allocated, by whichever
// process allocates it: local rank 0's fallocate of the whole segment puts each rank's slots
// on that rank's node. The raw syscalls, not libnuma: nothing else of it is needed.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace ddpx {

// A range of a mapping and where its pages go: on `nodes[0]` before any other (preferred), or
// spread page by page over `nodes` (interleaved).
struct NumaRange {
  enum class Mode { Preferred, Interleaved };
  size_t offset;  // from the mapping's start, a whole number of pages
  size_t bytes;
  Mode mode;
  std::vector<int> nodes;
};

// Gives each range of the mapping at base its policy; empty where all took, else why one did
// not (the kernel lacks the node, or refuses mbind), and then none has one: the pages go where
// they would have.
std::string numa_place(char* base, const std::vector<NumaRange>& ranges);

// Where the page at address lies (-1 where the kernel will not say), and the policy there
// ("default", "preferred", "bind", "interleave", ...) with its nodes.
struct NumaWhere {
  int node = -1;
  std::string policy;
  std::vector<int> nodes;
};
NumaWhere numa_where(const void* address);

}  // namespace ddpx
