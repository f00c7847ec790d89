// Reaching a peer's memory through the kernel (process_vm_readv and process_vm_writev): whether
// this rank can, found once by a probe of every peer, each rank's verdict in the segment for its
// peers to read, and the copies themselves. The all-reduce's shared schedule and every Direct call
// whose data lies in no mapped arena (collectives/opening.h) move their bytes through it.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace ddpx {

class ShmChannel;

// What a rank publishes in the segment for its peers' probes and verdicts (ShmChannel's control
// block holds one per rank).
struct PeerMemoryWords {
  uint64_t probe_address;      // where this rank's probe word lies in its process
  std::atomic<int32_t> reach;  // a PeerMemory::Reach: whether this rank reaches its peers'
};

class PeerMemory {
 public:
  enum class Reach { Unknown, Yes, No };

  // Publishes this rank's probe word in its words; channel: the node's, for its ranks' pids,
  // names and words, and to fail on a refused copy.
  explicit PeerMemory(ShmChannel& channel);

  // Tries to read and write a word in every peer's process, once: every rank does at its first
  // call, once all have attached. Then reachable() says whether every rank could.
  void probe();
  bool probed() const { return probed_; }
  Reach reachable() const;
  // Whether this rank found it reaches every peer's memory (its own probe: no peer's verdict).
  bool reaches_peers() const;
  // Why this rank cannot reach a peer's memory, empty when it can (or has not tried).
  const std::string& unreachable_because() const { return unreachable_because_; }

  // Copies bytes from local rank `rank`'s address space, or into it; raises (and fails the
  // channel) if the kernel refuses.
  void read(int rank, void* to, uint64_t from, size_t bytes, const std::string& what) const;
  void write(int rank, uint64_t to, const void* from, size_t bytes, const std::string& what) const;

 private:
  using PeerCopy = ssize_t (*)(pid_t, const iovec*, unsigned long, const iovec*, unsigned long,
                               unsigned long);
  void transfer(PeerCopy copy, const char* verb, int rank, void* local_bytes,
                uint64_t remote_address, size_t bytes, const std::string& what) const;

  ShmChannel& channel_;
  // The word peers probe: this process's pid, at the address its words publish.
  uint64_t probe_word_;
  bool probed_ = false;
  std::string unreachable_because_;
};

}  // namespace ddpx
