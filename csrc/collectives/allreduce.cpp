// The all-reduce: within the node in one of the schedules ScheduleChoice picks (schedule.h), and
// across nodes as the node's two phases framing a cross-node sum of each rank's slices.
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "../common/idle_work.h"
#include "../cross_node/cross_node.h"
#include "../node/arena.h"
#include "collectives.h"
#include "opening.h"

namespace ddpx {
namespace {

using Phase = ShmChannel::Phase;
using Clock = ShmChannel::Clock;
using Schedule = ScheduleChoice::Schedule;

// Chunks started across nodes and not yet all-gathered, per rank: enough to keep the link busy
// while the node sums the next chunks and hands out the last (docs/design.md, "Across nodes").
constexpr int64_t kCrossChunksInFlight = 6;
// A shared call's blocks: narrow ones, smaller for messages of less than two per rank.
constexpr size_t kMinSharedBlock = size_t(16) << 10;

// One all-reduce's blocks: the tensor's, in the dtype it is reduced in, and this rank's slice
// of each, which it sums for the node in the two-phase schedules.
struct Blocks {
  char* data;
  DType dtype, wire, acc;       // acc: the dtype of the sums, float32 (float64 for float64)
  int64_t numel, per_block, n;  // n: how many blocks
  size_t data_size, wire_size, acc_size;
  int ranks, me;
  int64_t elements(int64_t b) const {  // in block b
    return std::max<int64_t>(0, std::min(per_block, numel - b * per_block));
  }
  char* at(int64_t b) const { return data + size_t(b * per_block) * data_size; }
  // This rank's slice [lo, hi) of a block of count elements. Slices are whole cache lines, so no
  // two ranks write the same line of the output slot.
  std::pair<int64_t, int64_t> slice(int64_t count) const {
    const int64_t line = int64_t(64 / wire_size);
    const int64_t size = (count + ranks * line - 1) / (ranks * line) * line;
    const int64_t lo = std::min<int64_t>(count, me * size);
    return {lo, std::min<int64_t>(count, lo + size)};
  }
};

// What an all-reduce does at every block: the blocks, the call's description, and how.
struct AllreduceCall {
  NodeComm& comm;
  Blocks blocks;
  CallMeta meta;
  SumRule rule;
  bool wide;              // wide steps
  bool own_slice_direct;  // see allreduce
  Write out_write;
  const std::string& what;
  const BlocksAcross* quantized;  // compression="int8" or "int4", or null
  // Across nodes, where the call went Direct: every rank's tensor, read and written where it
  // lies; null where the blocks go through the slots.
  const PeerData* peers = nullptr;
};

// Puts block b into slot, in the wire dtype (less this rank's own slice, where read in place).
void fill_block(const AllreduceCall& call, int64_t b, char* slot) {
  const Blocks& x = call.blocks;
  const Kernels& k = kernels();
  const int64_t count = x.elements(b);
  if (count > 0 && call.own_slice_direct) {
    const auto [lo, hi] = x.slice(count);
    k.convert(slot, x.wire, x.at(b), x.dtype, lo, call.rule.input_scale, Write::Cached);
    k.convert(slot + size_t(hi) * x.wire_size, x.wire, x.at(b) + size_t(hi) * x.data_size, x.dtype,
              count - hi, call.rule.input_scale, Write::Cached);
  } else if (count > 0) {
    k.convert(slot, x.wire, x.at(b), x.dtype, count, call.rule.input_scale, Write::Cached);
  }
}

// Block b's step: `carried` where the call's opening carried block 0, else a new one with block b
// in this rank's input slot and every peer's awaited (NodeComm::block_step).
uint64_t arrive(const AllreduceCall& call, int64_t b, uint64_t carried) {
  return call.comm.block_step(
      call.meta, size_t(b), carried, [&](char* slot) { fill_block(call, b, slot); }, call.what,
      call.wide);
}

// The call's first step (opening.h), with block 0 in this rank's slot where the slots carry it.
// Across nodes a compressed call always goes through the slots: its node sums are of the
// converted values, which no rank's tensor holds.
Opening open_allreduce(AllreduceCall& call, const OpenRule& rule) {
  const Blocks& x = call.blocks;
  const void* data = call.comm.spans_nodes() && x.wire != x.dtype ? nullptr : x.data;
  return open_call(
      call.comm, call.meta, data, size_t(x.numel) * x.data_size, rule,
      [&](char* slot) { fill_block(call, 0, slot); }, call.what);
}

// Sums this rank's slice [lo, hi) of block b over the ranks into out, in the accumulation dtype,
// unscaled: copy_out scales it. From the slots at step, or from every rank's tensor where the
// call reads them where they lie (call.peers; the same values, so the same bits).
void sum_slice(const AllreduceCall& call, uint64_t step, int64_t b, int64_t lo, int64_t hi,
               void* out) {
  const Blocks& x = call.blocks;
  const void* srcs[kMaxLocalRanks];
  if (call.peers) {
    const size_t offset = size_t(b * x.per_block + lo) * x.data_size;
    const size_t bytes = size_t(hi - lo) * x.data_size;
    std::vector<char>& room = call.comm.workers().scratch(0);
    room.resize(size_t(x.ranks) * bytes);
    for (int r = 0; r < x.ranks; ++r) {
      srcs[r] = call.peers->view(r, offset, bytes, room.data() + size_t(r) * bytes);
    }
  } else {
    for (int r = 0; r < x.ranks; ++r) {
      srcs[r] = call.comm.input_slot(r, step) + size_t(lo) * x.wire_size;
    }
    if (call.own_slice_direct) srcs[x.me] = x.at(b) + size_t(lo) * x.data_size;
  }
  kernels().reduce(out, x.acc, srcs, x.ranks, x.wire, hi - lo, 1.0, Write::Cached);
}

// Publishes this rank's slice of the output slot, waits for the others', copies the block out.
void copy_out(const AllreduceCall& call, uint64_t step, int64_t b) {
  const Blocks& x = call.blocks;
  call.comm.publish(Phase::Reduce, step);
  call.comm.wait_all(Phase::Reduce, step, call.what, call.wide);
  kernels().convert(x.at(b), x.dtype, call.comm.output_slot(step), x.acc, x.elements(b),
                    call.rule.sum_scale, call.out_write);
}

// Small messages go in a few blocks per rank, so that ranks that run together share the work.
size_t shared_block_bytes(const ShmLayout& layout, size_t bytes) {
  const size_t share = (bytes / size_t(2 * layout.nranks) + kPage - 1) / kPage * kPage;
  return std::min(layout.block_bytes, std::max(kMinSharedBlock, share));
}

// The claimer reads each rank's block (in the tensor's dtype) where it lies, converts every rank's
// into the wire dtype where the call compresses, sums them in rank order into its own tensor as the
// one-shot schedule does, and writes the result into every peer's.
void sum_block_for_all(const AllreduceCall& call, const Blocks& x, const PeerData& peers, int64_t b,
                       std::vector<char>& scratch) {
  const Kernels& k = kernels();
  const int64_t count = x.elements(b);
  if (count == 0) return;
  const size_t raw_bytes = size_t(count) * x.data_size;
  const size_t offset = size_t(b * x.per_block) * x.data_size;
  const bool converted = x.wire != x.dtype;
  const size_t raw_room = size_t(x.per_block) * x.data_size;
  const size_t wire_room = converted ? size_t(x.per_block) * x.wire_size : 0;
  scratch.resize(size_t(x.ranks) * (raw_room + wire_room));
  const void* srcs[kMaxLocalRanks];
  for (int r = 0; r < x.ranks; ++r) {
    const char* raw = peers.view(r, offset, raw_bytes, scratch.data() + size_t(r) * raw_room);
    srcs[r] = raw;
    if (converted) {
      char* wire = scratch.data() + size_t(x.ranks) * raw_room + size_t(r) * wire_room;
      k.convert(wire, x.wire, raw, x.dtype, count, call.rule.input_scale, Write::Cached);
      srcs[r] = wire;
    }
  }
  k.reduce(x.at(b), x.dtype, srcs, x.ranks, x.wire, count, call.rule.sum_scale, Write::Cached);
  for (int r = 0; r < x.ranks; ++r) {
    if (r != x.me) peers.write(r, offset, x.at(b), raw_bytes);
  }
}

// Blocks claimed by whichever rank gets there first, each summed by its claimer straight from
// every rank's tensor into every rank's tensor, as the call's opening reaches them. The shared
// schedule, and the zero-copy one where the tensors lie in the ranks' arenas: there every block is
// plain loads and stores, so the call copies nothing in or out and synchronises twice whatever its
// size. A large call's blocks are
// claimed by every thread of the rank (workers.h): each sums a block as the rank would, so the bits
// are the same whichever thread of whichever rank summed it.
void allreduce_claimed(AllreduceCall& call, const Opening& opening) {
  NodeComm& comm = call.comm;
  Blocks x = call.blocks;
  x.per_block =
      int64_t(shared_block_bytes(comm.layout(), size_t(x.numel) * x.wire_size) / x.wire_size);
  x.n = x.numel == 0 ? 1 : (x.numel + x.per_block - 1) / x.per_block;
  CallBuffers& buffers = comm.buffers();
  const uint64_t first = buffers.shared_blocks, end = first + uint64_t(x.n);
  buffers.shared_blocks = end;
  const auto claim = [&](int thread) {
    std::vector<char>& scratch = comm.workers().scratch(thread);
    uint64_t block = 0;
    while (comm.claim_block(end, &block)) {
      sum_block_for_all(call, x, opening.peers, int64_t(block - first), scratch);
      comm.block_done(end);
    }
  };
  const int threads = comm.threads_for(size_t(x.numel) * x.wire_size);
  comm.workers().run(int(std::min<int64_t>(x.n, threads)), claim);
  comm.wait_blocks_done(end, call.what);
}

// Through the slots, one block a step (the first at step `carried` where the call's opening carried
// it: Opening::carried): one-shot, every rank sums every block into its tensor, or two-phase.
void allreduce_slots(const AllreduceCall& call, bool one_shot, uint64_t carried) {
  const Blocks& x = call.blocks;
  const void* srcs[kMaxLocalRanks];
  for (int64_t b = 0; b < x.n; ++b) {
    const uint64_t step = arrive(call, b, carried);
    const int64_t count = x.elements(b);
    if (one_shot) {
      for (int r = 0; r < x.ranks; ++r) srcs[r] = call.comm.input_slot(r, step);
      kernels().reduce(x.at(b), x.dtype, srcs, x.ranks, x.wire, count, call.rule.sum_scale,
                       call.out_write);
      continue;
    }
    const auto [lo, hi] = x.slice(count);
    sum_slice(call, step, b, lo, hi, call.comm.output_slot(step) + size_t(lo) * x.acc_size);
    copy_out(call, step, b);
  }
}

// Where block b's slice starts in the node sums of a call, in elements: every block but the last
// is full, its slice full_slice elements.
int64_t slice_offset(const Blocks& x, int64_t full_slice, int64_t b) {
  if (b < x.n) return b * full_slice;
  const auto [lo, hi] = x.slice(x.elements(x.n - 1));
  return (x.n - 1) * full_slice + (hi - lo);
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Calls fn(b, from, to, at) for each block b whose slice holds some of elements [lo, lo + n) of
// the node sums of the blocks from `first` on, slice after slice: the block's elements
// [from, to), at `at` in that range. Every slice but the call's last block's is full_slice long.
template <class Fn>
void for_slices(const Blocks& x, int64_t full_slice, int64_t first, int64_t lo, int64_t n,
                Fn&& fn) {
  int64_t b = first + lo / full_slice, skip = lo % full_slice;
  for (int64_t at = 0; at < n; ++b, skip = 0) {
    const auto [from, to] = x.slice(x.elements(b));
    const int64_t take = std::min(n - at, to - from - skip);
    TORCH_INTERNAL_ASSERT(take > 0, "ddpx: node sums past the call's slices");
    fn(b, from + skip, from + skip + take, at);
    at += take;
  }
}

// Handing out a chunk that crossed nodes: wait for it, then put its sums, as they come, into
// each block's output slot and copy every block out; or, where the call went Direct, write them
// into every rank's tensor where it lies, and at the call's last chunk wait until every rank has
// written its slices. Block-scaled chunks come back a tile at a time, dequantized as they are put;
// the others are summed in place in the node sums. Kept by value, as its call may have returned
// since.
InFlight hand_out(const AllreduceCall& call, std::shared_ptr<std::vector<char>> sums,
                  int64_t full_slice, int64_t first, int64_t end, int64_t elements) {
  std::optional<PeerData> peers;
  if (call.peers) peers = *call.peers;
  auto task = [&comm = call.comm, x = call.blocks, meta = call.meta, rule = call.rule,
               wide = call.wide, out_write = call.out_write, what = call.what,
               quantized = call.quantized != nullptr, peers, sums, full_slice, first, end,
               elements] {
    const Kernels& k = kernels();
    const AllreduceCall done{comm, x, meta, rule, wide, false, out_write, what, nullptr};
    int64_t open = first - 1;  // through the slots: the block whose step is open
    uint64_t step = 0;
    auto advance = [&] {
      if (open >= first) copy_out(done, step, open);
      if (++open < end) step = comm.next_step();
    };
    auto put = [&](int64_t lo, const char* part, int64_t n) {
      for_slices(x, full_slice, first, lo, n, [&](int64_t b, int64_t from, int64_t to, int64_t at) {
        const char* sum = part + size_t(at) * x.acc_size;
        if (peers) {
          char* mine = x.at(b) + size_t(from) * x.data_size;
          const size_t bytes = size_t(to - from) * x.data_size;
          k.convert(mine, x.dtype, sum, x.acc, to - from, rule.sum_scale, Write::Cached);
          for (int r = 0; r < x.ranks; ++r) {
            if (r != x.me) peers->write(r, size_t(mine - x.data), mine, bytes);
          }
          return;
        }
        while (open < b) advance();
        k.convert(comm.output_slot(step) + size_t(from) * x.acc_size, x.acc, sum, x.acc, to - from,
                  1.0, Write::Cached);
      });
    };
    if (elements > 0) {
      CrossNode& link = comm.cross_node();
      {
        // One piece of the engine's idle work (an optimizer's step of a bucket) first: the link
        // has this chunk and the ones after it to carry meanwhile.
        const double idle = link.oldest_crossed() ? 0 : run_idle_work();
        RECORD_FUNCTION("ddpx::waits for the link", std::vector<c10::IValue>());
        const auto waits = Clock::now();
        comm.across("all-reduce", what, [&] { link.await_oldest(); });
        comm.add_across_times(0, seconds_since(waits), false, idle);
      }
      if (quantized) {
        comm.across("all-reduce", what, [&] {
          link.finish_reduce_blocks([&](int64_t lo, const float* part, int64_t n) {
            put(lo, reinterpret_cast<const char*>(part), n);
          });
        });
      } else {
        comm.across("all-reduce", what, [&] { link.finish_reduce(); });
        put(0, sums->data() + size_t(slice_offset(x, full_slice, first)) * x.acc_size, elements);
      }
    }
    if (!peers) {
      while (open < end) advance();
    } else if (end == x.n) {
      comm.finish_reads(comm.next_step(), what);
    }
  };
  return InFlight{std::move(task), nullptr};
}

// Where the chunks of n blocks start, and n: chunks of `size` blocks, but for the first two and
// the last two, a quarter and a half of that, so that the link starts carrying sooner and the
// call's last hand-out waits for less. A function of n and size alone: int8's and int4's blocks of
// 64 values start at each chunk's first value, so its bits depend on where the chunks start.
std::vector<int64_t> chunk_starts(int64_t n, int64_t size) {
  const int64_t quarter = std::max<int64_t>(1, size / 4), half = std::max<int64_t>(1, size / 2);
  std::vector<int64_t> starts{0};
  auto add = [&](int64_t blocks) { starts.push_back(std::min(n, starts.back() + blocks)); };
  if (n <= 2 * (quarter + half)) {
    while (starts.back() < n) add(size);
    return starts;
  }
  add(quarter);
  add(half);
  while (starts.back() < n - half - quarter)
    add(std::min(size, n - half - quarter - starts.back()));
  add(half);
  add(quarter);
  return starts;
}

// This rank's slices of the blocks are summed within the node into the node sums, which cross
// nodes in chunks of whole blocks: a network round trip per block would cost far more than the
// extra pass over the slices. Chunks are started as soon as they are summed and handed out once
// back, a few in flight (NodeComm::put_in_flight), so the link carries one chunk while the node
// sums the next and hands out the last. A call given `end` leaves its last chunks in flight and
// returns: the next call's chunks follow them onto the link while they cross, and end runs once
// they are handed out (the hook's gradient buckets, but for a backward's last). A block's output
// slot is written only after every peer published its previous step, and they do that after
// reading the slot's last contents.
void allreduce_across_nodes(AllreduceCall& call, CallEnd* end) {
  const auto started = Clock::now();
  const NodeComm::AcrossTimes before = call.comm.across_times();
  const Blocks& x = call.blocks;
  NodeComm& comm = call.comm;
  CrossNode& link = comm.cross_node();
  const int64_t full_slice = [&] {
    const auto [lo, hi] = x.slice(std::min(x.per_block, x.numel));
    return hi - lo;
  }();
  const int64_t total = slice_offset(x, full_slice, x.n);
  // int8, int4: the residual of the node sums' rounding, then (more than two nodes) of the pieces'.
  const std::shared_ptr<Residual> residual = call.quantized ? call.quantized->residual : nullptr;
  float* residuals = residual ? residual->sized(link.nodes() > 2 ? 2 * total : total) : nullptr;
  auto residual_at = [&](int64_t b, int64_t part) -> std::shared_ptr<float> {
    if (!residuals) return nullptr;
    return std::shared_ptr<float>(residual,
                                  residuals + part * total + slice_offset(x, full_slice, b));
  };
  // Chunk c is blocks [chunk_start(c), chunk_start(c + 1)).
  const std::vector<int64_t> starts = chunk_starts(
      x.n, std::max<int64_t>(1, int64_t(comm.chunk_bytes() / (size_t(x.per_block) * x.data_size))));
  const int64_t chunks = int64_t(starts.size()) - 1;
  auto chunk_start = [&](int64_t c) { return starts[size_t(c)]; };
  auto chunk_elements = [&](int64_t c) {
    return slice_offset(x, full_slice, chunk_start(c + 1)) -
           slice_offset(x, full_slice, chunk_start(c));
  };
  // The call's first step checks it within the node and starts its check with the other nodes;
  // it carries the first block where the blocks go through the slots.
  const Opening opening = open_allreduce(call, OpenRule{-1, false, call.wide});
  if (opening.method == CopyMethod::Direct) call.peers = &opening.peers;
  // A Direct block-scaled call sums its chunks within the node a tile at a time as they are
  // rounded, but for the first, summed whole while the check across nodes crosses: no chunk crosses
  // before it. The node sums hold what is summed whole.
  const bool tiles = call.quantized && call.peers;
  const std::shared_ptr<std::vector<char>> node_sums =
      comm.buffers().node_sums(size_t(tiles ? chunk_elements(0) : total) * x.acc_size);
  auto sums_at = [&](int64_t b) {
    return node_sums->data() + size_t(slice_offset(x, full_slice, b)) * x.acc_size;
  };
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = chunk_start(c);
    const bool tiled = tiles && c > 0;
    for (int64_t b = first; b < chunk_start(c + 1) && !tiled; ++b) {
      const uint64_t step = call.peers ? 0 : arrive(call, b, opening.carried);
      const auto [lo, hi] = x.slice(x.elements(b));
      sum_slice(call, step, b, lo, hi, sums_at(b));
    }
    // The check across nodes started with the first block and ran while the node summed it.
    if (c == 0) comm.finish_node_check(call.meta, "", call.what);
    if (chunk_elements(c) > 0 && call.quantized) {
      const CrossNode::BlockValues values = [&](int64_t lo, int64_t n,
                                                float* room) -> const float* {
        if (!tiled) return reinterpret_cast<const float*>(sums_at(first)) + lo;
        for_slices(x, full_slice, first, lo, n,
                   [&](int64_t b, int64_t from, int64_t to, int64_t at) {
                     sum_slice(call, 0, b, from, to, room + at);
                   });
        return room;
      };
      comm.across("all-reduce", call.what, [&] {
        link.start_reduce_blocks(chunk_elements(c), call.quantized->bits, values,
                                 residual_at(first, 0),
                                 link.nodes() > 2 ? residual_at(first, 1) : nullptr);
      });
    } else if (chunk_elements(c) > 0) {
      const std::shared_ptr<void> chunk(node_sums, sums_at(first));
      comm.across("all-reduce", call.what,
                  [&] { link.start_reduce(chunk, x.acc, call.rule.across, chunk_elements(c)); });
    }
    comm.put_in_flight(
        hand_out(call, node_sums, full_slice, first, chunk_start(c + 1), chunk_elements(c)));
    comm.hand_out_in_flight(kCrossChunksInFlight - 1);
  }
  const bool left_in_flight = end != nullptr && comm.in_flight() > 0;
  if (left_in_flight) {
    comm.last_in_flight().end = std::move(*end);
    *end = nullptr;
  } else {
    comm.hand_out_in_flight(0);
  }
  const NodeComm::AcrossTimes after = comm.across_times();
  const double waited = after.link_wait_s - before.link_wait_s + after.idle_s - before.idle_s;
  comm.add_across_times(seconds_since(started) - waited, 0, left_in_flight);
}

}  // namespace

float* Residual::sized(int64_t n) {
  if (!values.defined() || values.numel() != n) values = at::zeros({n}, at::kFloat);
  return values.data_ptr<float>();
}

void allreduce(NodeComm& comm, void* data, DType dtype, int64_t numel, DType wire, double scale,
               const std::string& what, const BlocksAcross* quantized, CallEnd* end) {
  TORCH_CHECK_VALUE(numel >= 0, "ddpx: negative element count");
  if (end == nullptr) comm.hand_out_in_flight(0);
  TORCH_INTERNAL_ASSERT(!quantized || (wire == dtype && dtype != DType::Float64),
                        "ddpx: int8 and int4 sum float32, bfloat16 and float16 data, uncompressed "
                        "within the node");
  ScheduleChoice& choice = comm.schedule();
  const CallMeta meta = comm.begin(Collective::AllReduce, numel, int32_t(dtype),
                                   int32_t(quantized ? quantized->wire() : wire), scale, 0);
  const size_t wire_size = dtype_size(wire);
  const size_t bytes = size_t(numel) * wire_size;
  const Schedule schedule = choice.schedule_for(bytes);
  const int timed = comm.local_rank() == 0 ? choice.timed_class(bytes, schedule) : -1;
  // A call's time, as local rank 0 times the schedules, leaves out its wait for the ranks to
  // arrive at the first step: that is the skew the calls before left, which one-shot calls,
  // ending without a synchronisation, pass on to whichever call comes next.
  const auto started = Clock::now();
  const bool wide = schedule == ScheduleChoice::kWide;
  const ShmLayout& layout = comm.layout();
  const int64_t per_block = int64_t((wide ? layout.wide_bytes : layout.block_bytes) / wire_size);
  // Two-phase sums stay in the accumulation dtype in shared memory, so a result is rounded into
  // the tensor's dtype once, and is the same bits whichever schedule reduced it.
  const DType acc = SumRule::accumulation(dtype);
  const Blocks blocks{static_cast<char*>(data),
                      dtype,
                      wire,
                      acc,
                      numel,
                      per_block,
                      numel == 0 ? 1 : (numel + per_block - 1) / per_block,
                      dtype_size(dtype),
                      wire_size,
                      dtype_size(acc),
                      comm.local_ranks(),
                      comm.local_rank()};
  const Write out_write =
      size_t(numel) * blocks.data_size >= kStreamBytes ? Write::Streaming : Write::Cached;
  const bool one_shot = schedule == ScheduleChoice::kOneShot;
  // The two-phase schedule sums this rank's slice of its own block straight from the tensor
  // when the wire holds the tensor's values unchanged (uncompressed: SumRule scales the sum), so
  // that slice is never copied in: the same bits as converted, a sixth less memory traffic at 2
  // ranks. Only for a tensor that fits in the cache: from memory, reading it in the sum is slower
  // than copying it in first.
  const bool own_slice_direct = !one_shot && wire == dtype && out_write == Write::Cached;
  AllreduceCall call{comm,     blocks,           meta,      SumRule(dtype, wire, scale),
                     wide,     own_slice_direct, out_write, what,
                     quantized};
  if (comm.spans_nodes()) {
    try {
      allreduce_across_nodes(call, end);
    } catch (...) {
      // Every rank's call fails here, so every rank forgets the same chunks.
      comm.fail_in_flight(std::current_exception());
      throw;
    }
    return;
  }
  // The shared schedule reads and writes every rank's tensor where it lies; the others go through
  // the slots unless every rank's tensor lies in its arena, where the call goes claimed whatever
  // the schedule, nothing copied in or out.
  const bool shared = schedule == ScheduleChoice::kShared;
  const Opening opening = open_allreduce(call, OpenRule{-1, shared, wide});
  if (opening.method == CopyMethod::Direct) {
    allreduce_claimed(call, opening);
  } else {
    allreduce_slots(call, one_shot, opening.carried);
  }
  // Only a call that ran as its schedule runs on any tensor times it: not one that went claimed
  // for tensors in the arena, or went through the slots after all.
  if (opening.plain && (opening.method == CopyMethod::Direct) == shared && timed >= 0) {
    choice.time(timed, schedule, bytes, Clock::now() - started - opening.skew);
  }
}

}  // namespace ddpx
