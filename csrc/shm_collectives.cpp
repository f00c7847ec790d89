// The node's collectives other than the all-reduce: each moves or sums its data in blocks, one
// synchronisation per block, checked against the peers' call at the first. Across nodes
// (shm_hierarchical_collectives.cpp) the same steps frame a transfer between the nodes.
#include <c10/util/Exception.h>

#include <algorithm>

#include "shm_allreduce.h"

namespace ddpx {

CallMeta ShmAllreduce::local_call(Collective op, int64_t numel, int32_t dtype, double scale,
                                  int root, const std::string& what, int32_t torch_dtype) {
  begin_call();
  TORCH_CHECK_VALUE(!cross_node_, "ddpx: ", what,
                    " spans nodes; the shared-memory engine all-reduces, all-gathers, "
                    "broadcasts, reduce-scatters and trades equal parts across nodes, the other "
                    "collectives stay on one");
  return call_meta(op, numel, dtype, dtype, scale, root, torch_dtype);
}

uint64_t ShmAllreduce::exchange(const CallMeta& mine, bool first,
                                const std::function<void(char*)>& fill, const std::string& what) {
  const uint64_t step = ++step_;
  if (first) channel_.post(step, mine);
  fill(channel_.input_slot(channel_.me(), step));
  channel_.publish(Phase::Arrive, step);
  channel_.wait_all(Phase::Arrive, step, what);
  if (first) {
    agree_on_schedules(step);
    check_call(mine, what);
  }
  return step;
}

void ShmAllreduce::allgather(const void* in, size_t bytes, int32_t torch_dtype, void* const* outs,
                             const std::string& what) {
  if (cross_node_) {
    allgather_across_nodes(in, bytes, torch_dtype, outs, what);
    return;
  }
  const CallMeta mine =
      local_call(Collective::AllGather, int64_t(bytes), -1, 1.0, 0, what, torch_dtype);
  const Store store =
      bytes * size_t(channel_.size()) >= kStreamBytes ? Store::Streaming : Store::Cached;
  allgather_in_node(
      mine, true, in, bytes,
      [&](int r, size_t lo, const char* from, size_t count) {
        char* part = static_cast<char*>(outs[r]) + lo;
        if (part != from) kernels().copy(part, from, count, store);
      },
      what);
}

void ShmAllreduce::allgather_in_node(const CallMeta& mine, bool first, const void* in, size_t bytes,
                                     const Place& place, const std::string& what) {
  const size_t block = block_bytes();
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const char* src = static_cast<const char*>(in);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = exchange(
        mine, first && b == 0, [&](char* slot) { k.copy(slot, src + lo, count, Store::Cached); },
        what);
    if (count == 0) continue;
    for (int r = 0; r < channel_.size(); ++r) {
      place(r, lo, r == channel_.me() ? src + lo : channel_.input_slot(r, step), count);
    }
  }
}

void ShmAllreduce::broadcast(void* data, size_t bytes, int32_t torch_dtype, int root,
                             const std::string& what) {
  TORCH_CHECK_VALUE(root >= 0 && root < group_size(), "ddpx: broadcast from rank ", root, " of ",
                    group_size());
  if (cross_node_) {
    broadcast_across_nodes(data, bytes, torch_dtype, root, what);
    return;
  }
  const CallMeta mine =
      local_call(Collective::Broadcast, int64_t(bytes), -1, 1.0, root, what, torch_dtype);
  broadcast_in_node(mine, true, data, bytes, root, what);
}

void ShmAllreduce::broadcast_in_node(const CallMeta& mine, bool first, void* data, size_t bytes,
                                     int root, const std::string& what) {
  const int me = channel_.me();
  const size_t block = block_bytes();
  const size_t blocks = bytes == 0 ? 1 : (bytes + block - 1) / block;
  const Kernels& k = kernels();
  const Store store = bytes >= kStreamBytes ? Store::Streaming : Store::Cached;
  char* bytes_at = static_cast<char*>(data);
  for (size_t b = 0; b < blocks; ++b) {
    const size_t lo = b * block, count = std::min(block, bytes - lo);
    const uint64_t step = exchange(
        mine, first && b == 0,
        [&](char* slot) {
          if (me == root) k.copy(slot, bytes_at + lo, count, Store::Cached);
        },
        what);
    if (me != root) k.copy(bytes_at + lo, channel_.input_slot(root, step), count, store);
  }
}

void ShmAllreduce::barrier(const std::string& what) {
  begin_call();
  const CallMeta mine = call_meta(Collective::AllGather, 0, -1, -1, 1.0, 0);
  exchange(mine, true, [](char*) {}, what);
  // Each rank's trade with the other nodes ends once every node's ranks have all arrived.
  if (cross_node_) finish_node_check(mine, "", what);
}

void ShmAllreduce::reduce_scatter(const void* const* ins, void* out, DType dtype, DType wire,
                                  int64_t count, double scale, const std::string& what) {
  TORCH_CHECK_VALUE(count >= 0, "ddpx: negative element count");
  if (cross_node_) {
    reduce_scatter_across_nodes(ins, out, dtype, wire, count, scale, what);
    return;
  }
  CallMeta mine = local_call(Collective::ReduceScatter, count, int32_t(dtype), scale, 0, what);
  mine.wire = int32_t(wire);
  reduce_scatter_in_node(mine, true, ins, dtype, out, dtype, wire, count, scale, what);
}

void ShmAllreduce::reduce_scatter_in_node(const CallMeta& mine, bool first, const void* const* ins,
                                          DType dtype, void* out, DType out_dtype, DType wire,
                                          int64_t count, double scale, const std::string& what) {
  const int me = channel_.me();
  const Kernels& k = kernels();
  const int n = channel_.size();
  const size_t size = dtype_size(dtype), wire_size = dtype_size(wire);
  // Each step's slot holds one part per destination rank, whole cache lines each.
  const int64_t line = int64_t(64 / wire_size);
  const int64_t part = int64_t(block_bytes() / (wire_size * size_t(n))) / line * line;
  const int64_t steps = count == 0 ? 1 : (count + part - 1) / part;
  const size_t out_size = dtype_size(out_dtype);
  const Store store = size_t(count) * out_size >= kStreamBytes ? Store::Streaming : Store::Cached;
  char* dst = static_cast<char*>(out);
  const void* srcs[kMaxLocalRanks];
  for (int64_t s = 0; s < steps; ++s) {
    const int64_t lo = s * part, todo = std::min(part, count - lo);
    const uint64_t step = exchange(
        mine, first && s == 0,
        [&](char* slot) {
          if (todo <= 0) return;
          for (int r = 0; r < n; ++r) {
            k.pack(slot + size_t(r * part) * wire_size, wire,
                   static_cast<const char*>(ins[r]) + size_t(lo) * size, dtype, todo, scale,
                   Store::Cached);
          }
        },
        what);
    if (todo <= 0) continue;
    for (int r = 0; r < n; ++r) {
      srcs[r] = channel_.input_slot(r, step) + size_t(me * part) * wire_size;
    }
    k.reduce(dst + size_t(lo) * out_size, out_dtype, srcs, n, wire, todo, store);
  }
}

void ShmAllreduce::alltoall(const void* const* ins, const size_t* sends, void* const* outs,
                            const size_t* receives, size_t longest, int32_t torch_dtype,
                            const std::string& what) {
  if (cross_node_) {
    const int n = group_size();
    TORCH_CHECK_VALUE(
        std::all_of(sends, sends + n, [&](size_t b) { return b == longest; }) &&
            std::all_of(receives, receives + n, [&](size_t b) { return b == longest; }),
        "ddpx: ", what, " across nodes takes parts of one size");
    alltoall_across_nodes(ins, outs, longest, torch_dtype, what);
    return;
  }
  const CallMeta mine =
      local_call(Collective::AllToAll, int64_t(longest), -1, 1.0, 0, what, torch_dtype);
  alltoall_in_node(mine, true, ins, sends, outs, receives, longest, what);
}

void ShmAllreduce::alltoall_in_node(const CallMeta& mine, bool first, const void* const* ins,
                                    const size_t* sends, void* const* outs, const size_t* receives,
                                    size_t longest, const std::string& what) {
  const int me = channel_.me();
  const Kernels& k = kernels();
  const int n = channel_.size();
  // Each step's slot holds one part per destination rank, whole cache lines each.
  const size_t part = block_bytes() / size_t(n) / 64 * 64;
  const size_t steps = longest == 0 ? 1 : (longest + part - 1) / part;
  size_t total = 0;
  for (int r = 0; r < n; ++r) total += receives[r];
  const Store store = total >= kStreamBytes ? Store::Streaming : Store::Cached;
  const auto piece = [&](size_t bytes, size_t lo) {
    return lo < bytes ? std::min(part, bytes - lo) : size_t(0);
  };
  for (size_t s = 0; s < steps; ++s) {
    const size_t lo = s * part;
    const uint64_t step = exchange(
        mine, first && s == 0,
        [&](char* slot) {
          for (int r = 0; r < n; ++r) {
            const size_t count = r == me ? 0 : piece(sends[r], lo);
            if (count > 0) {
              k.copy(slot + size_t(r) * part, static_cast<const char*>(ins[r]) + lo, count,
                     Store::Cached);
            }
          }
        },
        what);
    for (int r = 0; r < n; ++r) {
      const size_t count = piece(receives[r], lo);
      if (count == 0) continue;
      const char* from = r == me ? static_cast<const char*>(ins[me]) + lo
                                 : channel_.input_slot(r, step) + size_t(me) * part;
      char* to = static_cast<char*>(outs[r]) + lo;
      if (to != from) k.copy(to, from, count, store);
    }
  }
}

}  // namespace ddpx
