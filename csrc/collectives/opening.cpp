// A call's first step, where how its data moves is chosen (opening.h).
#include "opening.h"

#include <cstring>

#include "../node/arena.h"

namespace ddpx {

const char* PeerData::view(int r, size_t offset, size_t bytes, char* room) const {
  if (at_[r] != nullptr) return at_[r] + offset;
  memory_->read(r, room, address_[r] + offset, bytes, what_);
  return room;
}

void PeerData::write(int r, size_t offset, const void* from, size_t bytes) const {
  if (at_[r] != nullptr) {
    std::memcpy(at_[r] + offset, from, bytes);
  } else {
    memory_->write(r, address_[r] + offset, from, bytes, what_);
  }
}

Opening open_call(NodeComm& comm, CallMeta& mine, const void* data, size_t bytes,
                  const OpenRule& rule, const std::function<void(char*)>& fill,
                  const std::string& what) {
  ShmChannel& channel = comm.channel();
  // Valid only once this rank has found that it reaches every peer's memory (its probe, at its
  // first call), so that what the ranks post decides alike on all.
  if (data != nullptr) {
    mine.address = reinterpret_cast<uint64_t>(data);
    if (comm.peer_memory().reaches_peers() && bytes > 0) {
      mine.arena = Arena::process().find(data, bytes);
    }
  }
  const bool fills = fill && !mine.arena.valid() && !rule.unmapped_too;
  ShmChannel::Clock::duration skew{};
  const uint64_t step = comm.exchange(mine, true, fills ? fill : nullptr, what, rule.wide, &skew);

  bool reach = true, any_arena = false, reads_mapped = true;
  for (int r = 0; r < channel.size(); ++r) {
    const CallMeta& posted = channel.posted(r, step);
    reach = reach && posted.reaches != 0;
    any_arena = any_arena || posted.arena.valid();
    if (rule.root < 0 || r == rule.root) reads_mapped = reads_mapped && posted.arena.valid();
  }
  Opening opening{
      reach && (reads_mapped || rule.unmapped_too) ? CopyMethod::Direct : CopyMethod::Slots,
      step,
      fill && !any_arena && !rule.unmapped_too ? step : 0,
      !any_arena,
      skew,
      PeerData(comm.peer_memory(), what)};
  if (opening.method == CopyMethod::Slots) return opening;
  bool zero_copy = true;
  for (int r = 0; r < channel.size(); ++r) {
    const ArenaPlace& place = channel.posted(r, step).arena;
    char* at =
        r == channel.me() ? static_cast<char*>(const_cast<void*>(data)) : comm.map_peer(r, place);
    opening.peers.map(r, at, channel.posted(r, step).address);
    if (rule.root < 0 || r == rule.root) zero_copy = zero_copy && place.valid() && at != nullptr;
  }
  if (zero_copy) comm.count_zero_copy();
  return opening;
}

}  // namespace ddpx
