#include "shm_allreduce.h"

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

#include "cross_node.h"

namespace ddpx {

ShmAllreduce::ShmAllreduce(std::shared_ptr<ShmSegment> segment, ShmLayout layout, int local_rank,
                           std::vector<int> ranks, size_t one_shot_bytes,
                           std::chrono::milliseconds timeout, bool initialize)
    : channel_(std::move(segment), layout, local_rank, std::move(ranks), timeout, initialize),
      one_shot_bytes_(one_shot_bytes) {
  // A rank that gives up ends its peers' waits across nodes too, not only within the node.
  channel_.set_on_fail([this](const std::string& why) {
    if (cross_node_) cross_node_->abort(why);
  });
}

void ShmAllreduce::begin_call() {
  channel_.begin_call();
  schedules_.store(agreed_, std::memory_order_relaxed);
  shared_now_.store(agreed_shared_, std::memory_order_relaxed);
}

void ShmAllreduce::reject(const std::string& reason, const std::string& what) {
  begin_call();
  const uint64_t step = ++step_;
  const CallMeta rejected = call_meta(Collective::AllReduce, -1, 0, 0, 0.0, 0);
  channel_.post(step, rejected);
  channel_.set_message(reason);
  channel_.publish(Phase::Arrive, step);
  channel_.wait_all(Phase::Arrive, step, what);
  agree_on_schedules(step);
  if (cross_node_) {
    start_node_check(rejected, false, what);
    try {
      finish_node_check(rejected, reason, what);
    } catch (const c10::Error&) {
      // This rank's own reason is the one to raise.
    }
  }
  C10_THROW_ERROR(ValueError, reason);
}

// The call number counts every collective on the group's engine, torch's own (DDP's broadcasts
// at construction, for one) with the user's, so that a rank that skipped one shows.
std::string ShmAllreduce::describe_call(const CallMeta& m) {
  static const char* const names[] = {"", "an all-gather of ", "a broadcast of ",
                                      "a reduce-scatter of ", "an all-to-all of parts up to "};
  std::ostringstream out;
  out << names[m.op] << m.numel;
  if (m.dtype < 0) {
    out << " bytes ";
    if (m.torch_dtype >= 0) out << "of " << c10::ScalarType(m.torch_dtype) << " ";
    out << "(";
  } else {
    out << " " << dtype_name(DType(m.dtype)) << " elements (wire " << dtype_name(DType(m.wire))
        << ", scale " << m.scale << ", ";
  }
  if (Collective(m.op) == Collective::Broadcast) out << "from local rank " << m.root << ", ";
  out << "the group's collective #" << m.call << ")";
  return out.str();
}

void ShmAllreduce::check_peers_agree(const CallMeta& mine, const std::string& what) {
  for (int r = 0; r < channel_.size(); ++r) {
    if (r == channel_.me()) continue;
    const CallMeta& m = channel_.posted(r, step_);
    if (m.numel < 0) {
      TORCH_CHECK(false, "ddpx: ", channel_.rank_name(r), " rejected its input to ", what, ": ",
                  channel_.message(r));
    }
    if (m.numel != mine.numel || m.dtype != mine.dtype || m.wire != mine.wire ||
        m.scale != mine.scale || m.call != mine.call || m.op != mine.op || m.root != mine.root ||
        m.torch_dtype != mine.torch_dtype) {
      C10_THROW_ERROR(
          Error,
          "ddpx: ranks disagree on " + what + ": " + channel_.rank_name(channel_.me()) + " has " +
              describe_call(mine) + ", " + channel_.rank_name(r) + " has " + describe_call(m) +
              ". Every rank must reduce the same sizes and dtypes in the same order: check that "
              "the model and its trainable parameters are the same on every rank");
    }
  }
}

void ShmAllreduce::check_call(const CallMeta& mine, const std::string& what) {
  if (!cross_node_) {
    check_peers_agree(mine, what);
    return;
  }
  std::string local_error;
  try {
    check_peers_agree(mine, what);
  } catch (const c10::Error& e) {
    local_error = e.what_without_backtrace();
  }
  start_node_check(mine, local_error.empty(), what);
  if (!local_error.empty()) finish_node_check(mine, local_error, what);
}

std::pair<int64_t, int64_t> ShmAllreduce::Blocks::slice(int64_t count) const {
  const int64_t line = int64_t(64 / wire_size);
  const int64_t size = (count + ranks * line - 1) / (ranks * line) * line;
  const int64_t lo = std::min<int64_t>(count, me * size);
  return {lo, std::min<int64_t>(count, lo + size)};
}

void ShmAllreduce::allreduce(void* data, DType dtype, int64_t numel, DType wire, double scale,
                             const std::string& what) {
  begin_call();
  TORCH_CHECK_VALUE(numel >= 0, "ddpx: negative element count");
  const size_t wire_size = dtype_size(wire);
  const size_t bytes = size_t(numel) * wire_size;
  const int timed = steps() == Steps::Timed ? timed_class(bytes) : -1;
  const Schedule schedule = schedule_for(bytes, timed);
  // A call's time, as local rank 0 times the schedules, leaves out its wait for the ranks to
  // arrive at the first step: that is the skew the calls before left, which one-shot calls,
  // ending without a synchronisation, pass on to whichever call comes next.
  const auto started = Clock::now();
  const bool wide = schedule == kWide;
  const ShmLayout& layout = channel_.layout();
  const int64_t per_block = int64_t((wide                  ? layout.wide_bytes
                                     : schedule == kShared ? shared_block_bytes(bytes)
                                                           : layout.block_bytes) /
                                    wire_size);
  // Two-phase sums stay in the accumulation dtype in shared memory, so a result is rounded into
  // the tensor's dtype once, and is the same bits whichever schedule reduced it.
  const DType acc = dtype == DType::Float64 ? DType::Float64 : DType::Float32;
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
                      channel_.size(),
                      channel_.me()};
  const Store out_store =
      size_t(numel) * blocks.data_size >= kStreamBytes ? Store::Streaming : Store::Cached;
  const bool one_shot = schedule == kOneShot;
  // The two-phase schedule sums this rank's slice of its own block straight from the tensor
  // when the wire holds the tensor's values unchanged, so that slice is never copied in: the
  // same bits as packed, a sixth less memory traffic at 2 ranks. Only for a tensor that fits
  // in the cache: from memory, reading it in the sum is slower than copying it in first.
  const bool own_slice_direct =
      !one_shot && wire == dtype && scale == 1.0 && out_store == Store::Cached;
  AllreduceCall call{
      blocks,
      call_meta(Collective::AllReduce, numel, int32_t(dtype), int32_t(wire), scale, 0),
      scale,
      wide,
      own_slice_direct,
      out_store,
      what};
  if (cross_node_) {
    allreduce_across_nodes(call);
    return;
  }
  if (schedule == kShared) {
    allreduce_shared(call);
  } else {
    allreduce_in_node(call, one_shot);
  }
  if (channel_.me() == 0 && timed >= 0 && schedule != kShared) {
    time_schedule(timed, schedule, bytes, Clock::now() - started - call.skew);
  }
}

uint64_t ShmAllreduce::arrive(AllreduceCall& call, int64_t b) {
  const Blocks& x = call.blocks;
  const Kernels& k = kernels();
  const uint64_t step = ++step_;
  const int64_t count = x.elements(b);
  if (b == 0) channel_.post(step, call.meta);
  char* slot = channel_.input_slot(x.me, step);
  if (count > 0 && call.own_slice_direct) {
    const auto [lo, hi] = x.slice(count);
    k.pack(slot, x.wire, x.at(b), x.dtype, lo, call.scale, Store::Cached);
    k.pack(slot + size_t(hi) * x.wire_size, x.wire, x.at(b) + size_t(hi) * x.data_size, x.dtype,
           count - hi, call.scale, Store::Cached);
  } else if (count > 0) {
    k.pack(slot, x.wire, x.at(b), x.dtype, count, call.scale, Store::Cached);
  }
  channel_.publish(Phase::Arrive, step);
  const auto waits_from = Clock::now();
  channel_.wait_all(Phase::Arrive, step, call.what, call.wide);
  if (b != 0) return step;
  call.skew = Clock::now() - waits_from;
  agree_on_schedules(step);
  check_call(call.meta, call.what);
  return step;
}

void ShmAllreduce::sum_slice(const AllreduceCall& call, uint64_t step, int64_t b, int64_t lo,
                             int64_t hi, void* out) {
  const Blocks& x = call.blocks;
  const void* srcs[kMaxLocalRanks];
  for (int r = 0; r < x.ranks; ++r) {
    srcs[r] = channel_.input_slot(r, step) + size_t(lo) * x.wire_size;
  }
  if (call.own_slice_direct) srcs[x.me] = x.at(b) + size_t(lo) * x.data_size;
  kernels().reduce(out, x.acc, srcs, x.ranks, x.wire, hi - lo, Store::Cached);
}

void ShmAllreduce::copy_out(const AllreduceCall& call, uint64_t step, int64_t b) {
  const Blocks& x = call.blocks;
  channel_.publish(Phase::Reduce, step);
  channel_.wait_all(Phase::Reduce, step, call.what, call.wide);
  kernels().pack(x.at(b), x.dtype, channel_.output_slot(step), x.acc, x.elements(b), 1.0,
                 call.out_store);
}

void ShmAllreduce::allreduce_in_node(AllreduceCall& call, bool one_shot) {
  const Blocks& x = call.blocks;
  const void* srcs[kMaxLocalRanks];
  for (int64_t b = 0; b < x.n; ++b) {
    const uint64_t step = arrive(call, b);
    const int64_t count = x.elements(b);
    if (one_shot) {
      for (int r = 0; r < x.ranks; ++r) srcs[r] = channel_.input_slot(r, step);
      kernels().reduce(x.at(b), x.dtype, srcs, x.ranks, x.wire, count, call.out_store);
      continue;
    }
    const auto [lo, hi] = x.slice(count);
    sum_slice(call, step, b, lo, hi, channel_.output_slot(step) + size_t(lo) * x.acc_size);
    copy_out(call, step, b);
  }
}

// Small messages go in a few blocks per rank, so that ranks that run together share the work.
size_t ShmAllreduce::shared_block_bytes(size_t bytes) const {
  const size_t share = (bytes / size_t(2 * channel_.size()) + kPage - 1) / kPage * kPage;
  return std::min(block_bytes(), std::max(kMinSharedBlock, share));
}

void ShmAllreduce::allreduce_shared(AllreduceCall& call) {
  const Blocks& x = call.blocks;
  const uint64_t step = ++step_;
  call.meta.address = reinterpret_cast<uint64_t>(x.data);
  channel_.post(step, call.meta);
  channel_.publish(Phase::Arrive, step);
  const auto waits_from = Clock::now();
  channel_.wait_all(Phase::Arrive, step, call.what);
  call.skew = Clock::now() - waits_from;
  agree_on_schedules(step);
  // Past the check every rank's tensor has this call's size, which the claimers rely on.
  check_call(call.meta, call.what);
  const uint64_t first = shared_blocks_, end = first + uint64_t(x.n);
  shared_blocks_ = end;
  uint64_t block = 0;
  while (channel_.claim_block(end, &block)) {
    sum_block_for_all(call, step, int64_t(block - first));
    channel_.block_done(end);
  }
  channel_.wait_blocks_done(end, call.what);
}

// The claimer reads each peer's block (in the tensor's dtype), packs every rank's into the wire
// dtype where the call scales or compresses, sums them in rank order into its own tensor as the
// one-shot schedule does, and writes the result into every peer's.
void ShmAllreduce::sum_block_for_all(const AllreduceCall& call, uint64_t step, int64_t b) {
  const Blocks& x = call.blocks;
  const Kernels& k = kernels();
  const int64_t count = x.elements(b);
  if (count == 0) return;
  const size_t raw_bytes = size_t(count) * x.data_size;
  const size_t offset = size_t(b * x.per_block) * x.data_size;
  const bool packed = x.wire != x.dtype || call.scale != 1.0;
  const size_t raw_room = size_t(x.per_block) * x.data_size;
  const size_t wire_room = packed ? size_t(x.per_block) * x.wire_size : 0;
  shared_scratch_.resize(size_t(x.ranks) * (raw_room + wire_room));
  const void* srcs[kMaxLocalRanks];
  for (int r = 0; r < x.ranks; ++r) {
    char* raw = x.at(b);
    if (r != x.me) {
      raw = shared_scratch_.data() + size_t(r) * raw_room;
      channel_.read_peer(r, raw, channel_.posted(r, step).address + offset, raw_bytes, call.what);
    }
    srcs[r] = raw;
    if (packed) {
      char* wire = shared_scratch_.data() + size_t(x.ranks) * raw_room + size_t(r) * wire_room;
      k.pack(wire, x.wire, raw, x.dtype, count, call.scale, Store::Cached);
      srcs[r] = wire;
    }
  }
  k.reduce(x.at(b), x.dtype, srcs, x.ranks, x.wire, count, Store::Cached);
  for (int r = 0; r < x.ranks; ++r) {
    if (r == x.me) continue;
    channel_.write_peer(r, channel_.posted(r, step).address + offset, x.at(b), raw_bytes,
                        call.what);
  }
}

}  // namespace ddpx
