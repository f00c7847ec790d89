// A call's first step on one node, where how its data moves is chosen, once, for every collective
// (docs/design.md, "Zero-copy"). Every rank posts its description there, with where its data lies
// in its process and, if it lies in the rank's arena (arena.h), there too. From what all posted,
// every rank reaches the same choice:
// - Direct: the ranks read (and the all-reduce's claimers write) each other's data where it lies,
//   through the view the opening returns: a peer's arena chunk mapped here (plain loads and
//   stores: zero-copy), or its address read and written through the kernel (process_vm_readv and
//   writev: single copy).
// - Slots: the data goes through the segment's slots in blocks, copied in and out. The first
//   step carried the first block unless some rank's data lay in its arena (that rank filled no
//   slot), in which case the copy starts at the next step.
// The collectives are then one straight function per method, and never ask again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "../node/shm_channel.h"
#include "node_comm.h"

namespace ddpx {

enum class CopyMethod { Slots, Direct };

// Whose data a Direct call reads, and when it goes Direct.
struct OpenRule {
  // The one rank whose data the others read (a broadcast's root), or -1: every rank's.
  int root = -1;
  // Direct even where the data lies in no arena, read and written through the kernel: the
  // all-reduce's shared schedule. Otherwise Direct only where the data read lies in arenas.
  bool unmapped_too = false;
  // The first step's block is a wide one (the all-reduce's wide schedule).
  bool wide = false;
};

// Each rank's data as this rank reaches it, in a Direct call. A copy outlives the call: an
// all-reduce across nodes hands its chunks out after it returns (allreduce.cpp).
class PeerData {
 public:
  PeerData(const PeerMemory& memory, std::string what) : memory_(&memory), what_(std::move(what)) {}
  // Rank r's data mapped here (this rank's own: where it lies), or null where it is reached
  // through the kernel, at address in its process.
  char* mapped(int r) const { return at_[r]; }
  void map(int r, char* at, uint64_t address) {
    at_[r] = at;
    address_[r] = address;
  }
  // Bytes [offset, offset + bytes) of rank r's data: where they lie if mapped, otherwise read
  // into room.
  const char* view(int r, size_t offset, size_t bytes, char* room) const;
  // Writes bytes at from into rank r's data at offset.
  void write(int r, size_t offset, const void* from, size_t bytes) const;

 private:
  const PeerMemory* memory_;
  std::string what_;  // the call's name, for errors
  char* at_[kMaxLocalRanks] = {};
  uint64_t address_[kMaxLocalRanks] = {};
};

struct Opening {
  CopyMethod method;
  uint64_t step;  // the first step
  // Slots: the first step, where its slots hold the call's first block; 0 where they do not (the
  // copy starts at the next step).
  uint64_t carried;
  // No rank's data lay in an arena: the call ran as its schedule runs anywhere.
  bool plain;
  ShmChannel::Clock::duration skew;  // this rank's wait for the others at the first step
  PeerData peers;                    // Direct only
};

// The call's first step: mine gets this rank's address and arena place (data: null where no peer
// reads this rank's data), the slot gets fill's block where this rank's data lies in no arena (fill
// null: the step carries no data), and the call is checked against the peers'. A Direct call whose
// every read lies mapped counts as zero-copy (NodeComm::zero_copy_calls).
Opening open_call(NodeComm& comm, CallMeta& mine, const void* data, size_t bytes,
                  const OpenRule& rule, const std::function<void(char*)>& fill,
                  const std::string& what);

}  // namespace ddpx
