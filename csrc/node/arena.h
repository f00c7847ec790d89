// Memory the engine owns: CPU tensors that every local rank can read and write where they lie,
// so a collective on them copies nothing in or out (allreduce.cpp's zero-copy schedule).
//
// Each process holds one arena. Its chunks are anonymous shared memory (memfd), never a name in
// /dev/shm: when the last process that maps a chunk exits, however it exits, the kernel frees it,
// and no two jobs can share one. A peer maps a chunk the first time a call names it, taking the
// owner's descriptor with pidfd_getfd (the same permission as process_vm_readv, which the engine
// probes), and keeps the mapping. A freed tensor's chunk goes back to the arena's free list and is
// only ever reused by this process: a peer reads a tensor only within a call on it, and a call's
// every rank returns only once no rank reads another's tensor any more.
#pragma once

#include <ATen/core/Tensor.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace ddpx {

// Where bytes lie in their owner's arena, as a call posts them for its peers (CallMeta::arena).
struct ArenaPlace {
  int32_t fd = -1;     // the owner's descriptor of the chunk; -1: not in an arena
  uint64_t inode = 0;  // the chunk's, to tell it from any other file at that descriptor
  uint64_t chunk_bytes = 0;
  uint64_t offset = 0;  // of the bytes in the chunk
  bool valid() const { return fd >= 0; }
};

class Arena {
 public:
  // The process's arena.
  static Arena& process();

  // Whether this process can make chunks (memfd_create may be refused, by a seccomp profile for
  // one); why_not() says why not.
  bool usable();
  const std::string& why_not();
  // A tensor of numel elements in a chunk (uninitialised). Where a chunk cannot be made, or
  // options ask for other than a CPU tensor, ordinary memory, said once (a warning).
  at::Tensor allocate(int64_t numel, const at::TensorOptions& options);
  // Moves t's storage into a chunk, its bytes copied, so that every tensor viewing that storage
  // (DDP's bucket, the gradients viewing it) lies in the arena from now on. False, leaving it as it
  // was, where t is not a whole CPU storage or no chunk can be made.
  bool adopt(const at::Tensor& t);
  // Where [data, data + bytes) lies, if wholly in one chunk of this arena.
  ArenaPlace find(const void* data, size_t bytes);
  // A peer's chunk (owner pid, place) mapped here, or nullptr with why set. Mappings are kept.
  char* peer_chunk(pid_t owner, const ArenaPlace& place, std::string* why);

  // Chunks made, their bytes, and the bytes tensors hold now; for describe().
  struct Usage {
    size_t chunks = 0, bytes = 0, in_use = 0, peer_chunks = 0;
    bool fell_back = false;  // some allocation got ordinary memory
  };
  Usage usage();

 private:
  struct Chunk {
    int fd;
    uint64_t inode;
    char* base;
    size_t bytes;
    bool in_use;
  };
  Arena() = default;
  static void release(void* chunk);
  Chunk* take(size_t bytes);  // a free chunk that fits, or a new one; nullptr on failure
  // A chunk's bytes as a tensor's storage would hold them, returned to the arena with it; empty,
  // with why set, where none can be made.
  at::DataPtr take_data(size_t bytes, std::string* why);
  void probe();

  std::mutex mutex_;
  bool probed_ = false;
  std::string why_not_;
  bool fell_back_ = false;
  std::map<uintptr_t, Chunk> chunks_;                  // by base address
  std::map<std::pair<pid_t, uint64_t>, char*> peers_;  // (owner, inode) -> mapping here
  std::map<pid_t, int> pidfds_;
};

}  // namespace ddpx
