// The cross-node link of the hierarchical collectives: the ranks of one local index on every
// node, and its implementation over process groups.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "../kernels/kernels.h"

namespace ddpx {

class CrossNode {
 public:
  virtual ~CrossNode() = default;
  virtual int nodes() const = 0;
  virtual int node() const = 0;  // this rank's node, 0 .. nodes() - 1
  // Starts trading words with the other nodes (each passes the same number); finish_gather
  // returns every node's, in node order. Both throw on failure.
  virtual void start_gather(const std::vector<int64_t>& mine) = 0;
  virtual std::vector<int64_t> finish_gather() = 0;
  // Starts summing n accumulation-dtype elements in place over the nodes, sending them in the
  // wire dtype; `data` stays owned by the transfer until it ends. finish_reduce waits for the
  // oldest transfer still running (finish_reduce_blocks: of start_reduce_blocks) and throws its
  // failure. Both throw on failure.
  virtual void start_reduce(std::shared_ptr<void> data, DType acc, DType wire, int64_t n) = 0;
  virtual void finish_reduce() = 0;
  // As start_reduce, for n float32 elements sent as block-scaled integers of `bits` (8 or 4:
  // quantize.h), which `values` gives a tile at a time while the call rounds them (so they need
  // lie nowhere whole). residual (n elements, or null) holds what this rank's rounding of them
  // lost, added before rounding and updated after; among more than two nodes, pieces (n
  // elements, or null) holds the same for the second rounding, of the piece of the sum this node
  // owns. finish_reduce_blocks ends it, handing the sums to `put` a tile at a time, in order.
  // values(lo, n, room) returns the values [lo, lo + n): where they lie, or put into room (n
  // floats); put(lo, sums, n) takes the sums [lo, lo + n), which sums holds only during the call.
  using BlockValues = std::function<const float*(int64_t lo, int64_t n, float* room)>;
  using BlockSums = std::function<void(int64_t lo, const float* sums, int64_t n)>;
  virtual void start_reduce_blocks(int64_t n, int bits, const BlockValues& values,
                                   std::shared_ptr<float> residual,
                                   std::shared_ptr<float> pieces) = 0;
  virtual void finish_reduce_blocks(const BlockSums& put) = 0;
  // Waits until the oldest transfer still running has crossed, leaving its finish_reduce (or
  // finish_reduce_blocks) only this node's work. Throws where the transfer failed.
  virtual void await_oldest() = 0;
  // Whether await_oldest would return without waiting for the link; false also where that cannot
  // be known before waiting (gloo's sends and receives).
  virtual bool oldest_crossed() const = 0;
  // Byte moves between the nodes, for the collectives other than the all-reduce; each throws on
  // failure. Trades run while the caller works: start_all_gather puts every node's `bytes` of in
  // into out (nodes() x bytes, node order); start_all_to_all sends part n of in (nodes() parts
  // of `bytes`) to node n, and part n of out comes from it, but for this node's own part, which
  // it neither sends nor writes; finish_trade waits for the oldest trade still running and fills
  // its out. broadcast: node root's data lands in every node's.
  virtual void start_all_gather(const void* in, size_t bytes, void* out) = 0;
  virtual void start_all_to_all(const void* in, size_t bytes, void* out) = 0;
  virtual void finish_trade() = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  // Tells every other rank of the job that this one gave up (why), so that their waits across
  // nodes end now instead of at their timeout. Does not throw.
  virtual void abort(const std::string& why) noexcept = 0;
  // Bytes this rank has sent to other nodes so far, counted as bandwidth-optimal algorithms send
  // them: 2(N-1)/N of an all-reduce's data over N nodes, (N-1) parts of an all-gather or
  // all-to-all, and a broadcast's data once per other node from its root.
  virtual uint64_t bytes_sent() const = 0;
};

// How much of a message crosses per trade: one large gloo transfer fills only about half a shaped
// link, several under way at once keep it full, and the node works on each piece while the link
// carries the others. A quarter of the message (at least 64 KiB) up to 1 MiB, a sixteenth (at
// most 4 MiB) from 4 MiB, 256 KiB between.
size_t cross_piece_bytes(size_t bytes);

// The link over process groups: `groups` holds a dealing and a gathering group per lane, in turn,
// each of the ranks of this local index on every node in node order. Every transfer fails after
// `timeout`, or as soon as a rank of the job puts why it gave up under `abort_key` in `store`
// (which this rank does when it gives up).
std::shared_ptr<CrossNode> make_cross_node(
    std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups, std::chrono::milliseconds timeout,
    c10::intrusive_ptr<c10d::Store> store, std::string abort_key);

}  // namespace ddpx
