// The cross-node link over process groups (cross_node.h): the lanes, the chunks in flight, and the
// link thread that sums compressed chunks as they arrive.
#include "cross_node.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>

#include "../common/errors.h"
#include "../common/thread_name.h"
#include "../common/torch_compat.h"
#include "../kernels/quantize.h"
#include "abort_watch.h"

namespace ddpx {
namespace {

// Block-scaled chunks are rounded and summed a tile at a time, whole blocks that stay in the core's
// L1 cache.
constexpr int64_t kTile = 64 * kBlock;

// The node-to-node step of the hierarchical all-reduce, for one chunk of one rank's slices.
// Uncompressed, the chunk is all-reduced as it is. Compressed, it crosses in the wire dtype both
// ways and is still summed in float32: an all-to-all deals each node one piece of every node's
// chunk, each rank sums its piece over the nodes in node order and rounds the sum once, and an
// all-gather hands the pieces back. Between two nodes each node sends its whole chunk to the
// other, the same bytes in one round instead of two, and each sums both chunks in node order and
// rounds once (faster than dealing and gathering; uncompressed, gloo's all-reduce stays faster
// than trading the chunks: docs/design.md, "Across nodes"). Every rank holding the chunk ends with
// the same bits, and the bytes on the network are those of the wire dtype. int8 and int4 cross
// the same way, block-scaled (quantize.h): each rank rounds its chunk (and, among more than two
// nodes, the summed piece it owns) with error feedback, and every sum is of dequantized float32 in
// node order.
//
// Nothing here waits for a transfer it could overlap: the caller's thread deals a chunk (or
// starts its all-reduce) as soon as it is summed within the node, a link thread sums the dealt
// pieces of each chunk as they arrive and starts gathering them back, and the caller finishes
// the chunks in order. A lane is two process groups, one that deals and one that gathers, so
// each sees its transfers in chunk order on every rank whatever the threads' timing; chunks take
// turns on the lanes, and every transfer fails after the engine's timeout.
class ProcessGroupCrossNode final : public CrossNode {
 public:
  // groups: the dealing and the gathering group of each lane, in turn.
  ProcessGroupCrossNode(std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups,
                        std::chrono::milliseconds timeout, std::shared_ptr<AbortWatch> watch)
      : groups_(std::move(groups)), timeout_(timeout), link_(std::make_shared<Link>()) {
    TORCH_INTERNAL_ASSERT(!groups_.empty() && groups_.size() % 2 == 0,
                          "ddpx: a lane across nodes is two process groups");
    nodes_ = groups_[0]->getSize();
    TORCH_CHECK_VALUE(nodes_ <= kMaxSources, "ddpx: the hierarchical all-reduce sums at most ",
                      kMaxSources, " nodes, this job has ", nodes_);
    // The threads start once nothing here can throw: a thread left running by a constructor
    // that throws would end the process.
    link_->timeout = timeout;
    link_->watch = std::move(watch);
    AbortWatch::start(link_->watch);
    link_->thread = std::thread(link_loop, link_);
  }

  ~ProcessGroupCrossNode() override {
    {
      std::lock_guard<std::mutex> lock(link_->mu);
      link_->stopping = true;
    }
    link_->cv.notify_all();
    // A link thread still waiting on a transfer that a failure abandoned gets its error at the
    // timeout; the process need not wait for that. It owns all it touches.
    if (link_->busy) {
      link_->thread.detach();
    } else {
      link_->thread.join();
    }
    link_->watch->stop();
  }

  int nodes() const override { return nodes_; }
  int node() const override { return groups_[0]->getRank(); }
  uint64_t bytes_sent() const override { return bytes_sent_.load(std::memory_order_relaxed); }

  void start_gather(const std::vector<int64_t>& mine) override {
    const int64_t n = int64_t(mine.size());
    words_in_ = at::tensor(at::IntArrayRef(mine), at::kLong);
    words_out_ = at::empty({n * nodes_}, at::kLong);
    gathering_ = ddpx::all_gather(*groups_[0], words_out_, words_in_, timeout_);
  }

  std::vector<int64_t> finish_gather() override {
    auto work = std::move(gathering_);
    link_->watch->await(*work);
    const int64_t* words = words_out_.const_data_ptr<int64_t>();
    return std::vector<int64_t>(words, words + words_out_.numel());
  }

  void start_reduce(std::shared_ptr<void> data, DType acc, DType wire, int64_t n) override {
    auto chunk = std::make_shared<Chunk>();
    chunk->data = std::move(data);
    chunk->acc = acc;
    chunk->wire = wire;
    chunk->n = n;
    const size_t lane = next_lane();
    if (wire == acc) {
      const auto dtype = acc == DType::Float64 ? at::kDouble : at::kFloat;
      std::vector<at::Tensor> tensors{over(chunk->data, n, dtype)};
      c10d::AllreduceOptions opts;
      opts.timeout = timeout_;
      chunk->work = groups_[lane]->allreduce(tensors, opts);
      pending_.push_back(std::move(chunk));
      return;
    }
    const int64_t wire_size = int64_t(dtype_size(wire));
    chunk->piece = (n + nodes_ - 1) / nodes_;
    // Between two nodes the chunk crosses whole; among more, in one padded piece per node.
    const int64_t bytes = (nodes_ == 2 ? n : nodes_ * chunk->piece) * wire_size;
    chunk->dealt = at::empty({bytes}, at::kByte);
    char* out = static_cast<char*>(chunk->dealt.data_ptr());
    kernels().convert(out, wire, chunk->data.get(), acc, n, 1.0, Write::Cached);
    std::memset(out + n * wire_size, 0, size_t(bytes - n * wire_size));
    if (nodes_ == 2) {
      trade(std::move(chunk), lane);
      return;
    }
    const size_t piece_bytes = size_t(chunk->piece * wire_size);
    deal(std::move(chunk), lane, piece_bytes);
  }

  // Between two nodes each node's chunk crosses whole and both nodes sum the two in node order;
  // among more, each node's chunk is dealt in one piece per node, each rank sums its piece over
  // the nodes, rounds the sum to the chunk's bits again (keeping what that lost in `pieces`) and
  // gathers the pieces back. Every piece is quantized on its own, its blocks starting at its first
  // element.
  void start_reduce_blocks(int64_t n, int bits, const BlockValues& values,
                           std::shared_ptr<float> residual,
                           std::shared_ptr<float> pieces) override {
    auto chunk = std::make_shared<Chunk>();
    chunk->bits = bits;
    chunk->n = n;
    chunk->node = node();
    chunk->pieces = std::move(pieces);
    const size_t lane = next_lane();
    if (nodes_ == 2) {
      const BlockLayout layout(n, bits);
      chunk->dealt = bytes_like(layout.bytes());
      round_tiles(chunk->dealt.data_ptr(), layout, values, 0, n, residual.get());
      trade(std::move(chunk), lane);
      return;
    }
    chunk->piece = (n + nodes_ - 1) / nodes_;
    const BlockLayout layout(chunk->piece, bits);
    chunk->dealt = bytes_like(size_t(nodes_) * layout.bytes());
    for (int k = 0; k < nodes_; ++k) {
      const int64_t lo = std::min(n, k * chunk->piece);
      round_tiles(static_cast<char*>(chunk->dealt.data_ptr()) + size_t(k) * layout.bytes(), layout,
                  values, lo, std::min(chunk->piece, n - lo),
                  residual ? residual.get() + lo : nullptr);
    }
    deal(std::move(chunk), lane, layout.bytes());
  }

  // Trades go through buffers of their own, which a trade that a failure abandons keeps.
  void start_all_gather(const void* in, size_t bytes, void* out) override {
    at::Tensor mine = bytes_like(bytes), all = bytes_like(bytes * size_t(nodes_));
    std::memcpy(mine.data_ptr(), in, bytes);
    trades_.push_back({ddpx::all_gather(*groups_[0], all, mine, timeout_), all, out});
    count(int64_t(bytes) * (nodes_ - 1));
  }

  // Between two nodes an all-to-all is one part each way, which an all-gather of the part for
  // the other node carries: gloo moved it faster than the same bytes as an all-to-all.
  void start_all_to_all(const void* in, size_t bytes, void* out) override {
    const int here = node();
    at::Tensor received = bytes_like(bytes * size_t(nodes_));
    c10::intrusive_ptr<c10d::Work> work;
    if (nodes_ == 2) {
      at::Tensor theirs = bytes_like(bytes);
      std::memcpy(theirs.data_ptr(), static_cast<const char*>(in) + size_t(1 - here) * bytes,
                  bytes);
      work = ddpx::all_gather(*groups_[0], received, theirs, timeout_);
    } else {
      at::Tensor dealt = bytes_like(bytes * size_t(nodes_));
      std::memcpy(dealt.data_ptr(), in, dealt.nbytes());
      work = ddpx::all_to_all(*groups_[0], received, dealt, timeout_);
    }
    trades_.push_back({std::move(work), received, out, here});
    count(int64_t(bytes) * (nodes_ - 1));
  }

  void finish_trade() override {
    Trade trade = std::move(trades_.front());
    trades_.pop_front();
    link_->watch->await(*trade.work);
    const char* from = static_cast<const char*>(trade.received.data_ptr());
    char* to = static_cast<char*>(trade.out);
    const size_t part = trade.received.nbytes() / size_t(nodes_);
    for (int node = 0; node < nodes_; ++node) {
      if (node == trade.own_part) continue;
      std::memcpy(to + size_t(node) * part, from + size_t(node) * part, part);
    }
  }

  void broadcast(void* data, size_t bytes, int root) override {
    const at::Tensor all = bytes_like(bytes);
    if (root == node()) std::memcpy(all.data_ptr(), data, bytes);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    const size_t piece = cross_piece_bytes(bytes);
    for (size_t lo = 0; lo < bytes; lo += piece) {
      std::vector<at::Tensor> part{
          all.narrow(0, int64_t(lo), int64_t(std::min(piece, bytes - lo)))};
      c10d::BroadcastOptions opts;
      opts.rootRank = root;
      opts.timeout = timeout_;
      works.push_back(groups_[0]->broadcast(part, opts));
    }
    for (const auto& work : works) link_->watch->await(*work);
    if (root != node()) std::memcpy(data, all.data_ptr(), bytes);
    if (root == node()) count(int64_t(bytes) * (nodes_ - 1));
  }

  void finish_reduce() override {
    std::shared_ptr<Chunk> chunk = oldest(false);
    cross(*chunk);
    const int64_t wire_size = int64_t(dtype_size(chunk->wire));
    if (chunk->wire == chunk->acc) {
      count(2 * (nodes_ - 1) * chunk->n * wire_size / nodes_);
      return;
    }
    if (nodes_ == 2) {
      const auto both = in_node_order(*chunk);
      kernels().reduce(chunk->dealt.data_ptr(), chunk->wire, both.data(), 2, chunk->wire, chunk->n,
                       1.0, Write::Cached);
    }
    kernels().convert(chunk->data.get(), chunk->acc, chunk->dealt.data_ptr(), chunk->wire, chunk->n,
                      1.0, Write::Cached);
    count(nodes_ == 2 ? chunk->n * wire_size : 2 * (nodes_ - 1) * chunk->piece * wire_size);
  }

  // Both nodes' chunks summed in node order, or every node's gathered piece, to put.
  void finish_reduce_blocks(const BlockSums& put) override {
    std::shared_ptr<Chunk> chunk = oldest(true);
    cross(*chunk);
    if (nodes_ == 2) {
      const BlockLayout layout(chunk->n, chunk->bits);
      sum_tiles(in_node_order(*chunk).data(), 2, layout, 0, chunk->n, put);
      count(int64_t(layout.bytes()));
      return;
    }
    const BlockLayout layout(chunk->piece, chunk->bits);
    for (int k = 0; k < nodes_; ++k) {
      const int64_t lo = std::min(chunk->n, k * chunk->piece);
      const void* piece =
          static_cast<const char*>(chunk->dealt.data_ptr()) + size_t(k) * layout.bytes();
      sum_tiles(&piece, 1, layout, lo, std::min(chunk->piece, chunk->n - lo), put);
    }
    count(2 * (nodes_ - 1) * int64_t(layout.bytes()));
  }

  void await_oldest() override {
    TORCH_INTERNAL_ASSERT(!pending_.empty(), "ddpx: no chunk is crossing nodes");
    cross(*pending_.front());
  }

  bool oldest_crossed() const override {
    TORCH_INTERNAL_ASSERT(!pending_.empty(), "ddpx: no chunk is crossing nodes");
    const Chunk& chunk = *pending_.front();
    if (chunk.crossed) return true;
    if (chunk.gathering.valid() &&
        chunk.gathering.wait_for(std::chrono::seconds(0)) != std::future_status::ready)
      return false;
    return chunk.work->isCompleted() && (!chunk.sending || chunk.sending->isCompleted());
  }

 private:
  struct Chunk {
    std::shared_ptr<void> data;  // start_reduce: n accumulation-dtype elements, summed in place
    DType acc = DType::Float32, wire = DType::Float32;
    int bits = 0;  // block-scaled integers of these bits on the wire (start_reduce_blocks), or 0
    int64_t n = 0, piece = 0;
    int node = 0;                   // this rank's node, whose piece the link thread sums
    std::shared_ptr<float> pieces;  // blocks: what the second rounding lost, n elements, or null
    // Compressed: the wire-dtype pieces dealt, received and summed (between two nodes, this
    // node's chunk and then the sum, and the other node's chunk).
    at::Tensor dealt, received, mine;
    c10::intrusive_ptr<c10d::Work> work;     // the transfer under way (two nodes: the receive)
    c10::intrusive_ptr<c10d::Work> sending;  // two nodes, compressed: the send
    bool crossed = false;                    // work (and sending) waited on
    c10::intrusive_ptr<c10d::ProcessGroup> gathering_group;
    std::promise<void> gathering_started;  // set by the link thread once work gathers
    std::shared_future<void> gathering;
  };
  struct Trade {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor received;
    void* out;
    int own_part = -1;  // the part of out, one per node, that the trade leaves as it is, if any
  };
  struct Link {
    std::thread thread;
    std::mutex mu;
    std::condition_variable cv;
    std::deque<std::shared_ptr<Chunk>> dealt;  // compressed chunks whose pieces are on the way
    bool stopping = false;
    std::atomic<bool> busy{false};
    std::chrono::milliseconds timeout{};
    std::shared_ptr<AbortWatch> watch;
  };

  // Among more than two nodes: deals the chunk's pieces (its `dealt`, one per node) over the
  // lane's first group, and hands it to the link thread, which sums this node's piece of every
  // node's into `mine` (piece_bytes) and gathers them back into `dealt` over the second.
  void deal(std::shared_ptr<Chunk> chunk, size_t lane, size_t piece_bytes) {
    chunk->received = bytes_like(chunk->dealt.nbytes());
    chunk->mine = bytes_like(piece_bytes);
    chunk->gathering_group = groups_[lane + 1];
    chunk->work = ddpx::all_to_all(*groups_[lane], chunk->received, chunk->dealt, timeout_);
    chunk->gathering = chunk->gathering_started.get_future().share();
    {
      std::lock_guard<std::mutex> lock(link_->mu);
      link_->dealt.push_back(chunk);
    }
    link_->cv.notify_all();
    pending_.push_back(std::move(chunk));
  }

  // Sums each dealt chunk's pieces as they arrive, in chunk order, and starts gathering them.
  static void link_loop(std::shared_ptr<Link> link) {
    name_this_thread("ddpx link");
    std::string broken;  // an earlier transfer failed: the groups are out of step since
    while (true) {
      std::shared_ptr<Chunk> c;
      {
        std::unique_lock<std::mutex> lock(link->mu);
        link->cv.wait(lock, [&] { return link->stopping || !link->dealt.empty(); });
        if (link->stopping) return;
        c = std::move(link->dealt.front());
        link->dealt.pop_front();
        link->busy = true;
      }
      try {
        if (!broken.empty()) C10_THROW_ERROR(DistBackendError, broken);
        link->watch->await(*c->work);
        const int64_t nodes = c->gathering_group->getSize();
        if (c->bits != 0) {
          sum_piece_blocks(*c, int(nodes));
        } else {
          sum_piece(*c, int(nodes));
        }
        c->work = ddpx::all_gather(*c->gathering_group, c->dealt, c->mine, link->timeout);
        c->gathering_started.set_value();
      } catch (const std::exception& e) {
        broken = "an earlier transfer failed: " + error_text(e);
        c->gathering_started.set_exception(std::current_exception());
      }
      link->busy = false;
    }
  }

  static void sum_piece(Chunk& c, int nodes) {
    const int64_t wire_size = int64_t(dtype_size(c.wire));
    const void* pieces[kMaxSources];
    for (int64_t i = 0; i < nodes; ++i) {
      pieces[i] = static_cast<const char*>(c.received.data_ptr()) + i * c.piece * wire_size;
    }
    kernels().reduce(c.mine.data_ptr(), c.wire, pieces, nodes, c.wire, c.piece, 1.0, Write::Cached);
  }

  // Sums this node's piece of every node's block-scaled chunk in float32, in node order, and
  // rounds the sum to the chunk's bits again, the residual of that rounding kept in the chunk's
  // pieces.
  static void sum_piece_blocks(Chunk& c, int nodes) {
    const BlockLayout layout(c.piece, c.bits);
    const void* pieces[kMaxSources];
    for (int i = 0; i < nodes; ++i) {
      pieces[i] = static_cast<const char*>(c.received.data_ptr()) + size_t(i) * layout.bytes();
    }
    std::vector<float> sum(size_t(c.piece));
    kernels().dequantize_sum_blocks(sum.data(), pieces, nodes, layout, c.piece, 0, layout.blocks);
    const int64_t lo = std::min(c.n, c.node * c.piece);
    kernels().quantize_blocks(c.mine.data_ptr(), layout, sum.data(),
                              c.pieces ? c.pieces.get() + lo : nullptr, std::min(c.piece, c.n - lo),
                              0, layout.blocks);
  }

  // Between two nodes a compressed chunk crosses as a send of this node's and a receive of the
  // other's, which gloo posts at once: all-gathers, run one after another, left the link idle
  // between chunks (docs/benchmarks.md, "Compressing hooks across a network").
  void trade(std::shared_ptr<Chunk> chunk, size_t lane) {
    chunk->received = bytes_like(chunk->dealt.nbytes());
    const int other = 1 - node();
    std::vector<at::Tensor> out{chunk->dealt}, in{chunk->received};
    chunk->work = groups_[lane]->recv(in, other, 0);
    chunk->sending = groups_[lane]->send(out, other, 0);
    pending_.push_back(std::move(chunk));
  }

  // Waits until the chunk has crossed (once: a send or receive is waited on only once), and
  // throws the link thread's failure or the transfer's.
  void cross(Chunk& chunk) {
    if (chunk.crossed) return;
    if (chunk.gathering.valid()) chunk.gathering.get();
    if (chunk.sending) {
      link_->watch->await_blocking(*chunk.work, timeout_);
      link_->watch->await_blocking(*chunk.sending, timeout_);
    } else {
      link_->watch->await(*chunk.work);
    }
    chunk.crossed = true;
  }

  // Between two nodes: both nodes' chunks, node 0's first.
  std::array<const void*, 2> in_node_order(const Chunk& chunk) const {
    const void* mine = chunk.dealt.const_data_ptr();
    const void* theirs = chunk.received.const_data_ptr();
    return node() == 0 ? std::array<const void*, 2>{mine, theirs}
                       : std::array<const void*, 2>{theirs, mine};
  }

  std::shared_ptr<Chunk> oldest(bool blocks) {
    TORCH_INTERNAL_ASSERT(!pending_.empty() && (pending_.front()->bits != 0) == blocks,
                          "ddpx: a chunk across nodes finished as another kind than it started");
    std::shared_ptr<Chunk> chunk = std::move(pending_.front());
    pending_.pop_front();
    return chunk;
  }

  // Rounds values [from, from + count) (count <= layout.n) into out, a tile at a time, and zeroes
  // the rest of the layout.
  void round_tiles(void* out, const BlockLayout& layout, const BlockValues& values, int64_t from,
                   int64_t count, float* residual) {
    for (int64_t lo = 0; lo < layout.n; lo += kTile) {
      const int64_t len = std::clamp<int64_t>(count - lo, 0, kTile);
      const float* v = len > 0 ? values(from + lo, len, tile_.data()) : tile_.data();
      kernels().quantize_blocks(out, layout, v, residual ? residual + lo : nullptr, count,
                                lo / kBlock, std::min(layout.blocks, (lo + kTile) / kBlock));
    }
  }

  // The first count values of nsrc buffers of layout, summed a tile at a time, to put as values
  // [from, from + count).
  void sum_tiles(const void* const* srcs, int nsrc, const BlockLayout& layout, int64_t from,
                 int64_t count, const BlockSums& put) {
    for (int64_t lo = 0; lo < count; lo += kTile) {
      const int64_t len = std::min(kTile, count - lo);
      kernels().dequantize_sum_blocks(tile_.data(), srcs, nsrc, layout, count, lo / kBlock,
                                      (lo + len + kBlock - 1) / kBlock);
      put(from + lo, tile_.data(), len);
    }
  }

  size_t next_lane() { return 2 * (next_lane_++ % (groups_.size() / 2)); }

  static at::Tensor bytes_like(size_t bytes) { return at::empty({int64_t(bytes)}, at::kByte); }

  // A tensor over data that keeps it alive: a transfer that a failure abandons may still read it
  // from gloo's thread after the call has thrown and the engine that owns it is gone (ranks
  // exiting on test_network's cut link died of SIGSEGV in 2 launches of 5 while an all-gather
  // read a chunk so, unowned; the all-reduce reads it the same way).
  static at::Tensor over(const std::shared_ptr<void>& data, int64_t n, at::ScalarType dtype) {
    return at::from_blob(
        data.get(), {n}, [keep = data](void*) {}, at::TensorOptions().dtype(dtype));
  }

  void abort(const std::string& why) noexcept override { link_->watch->give_up(why); }

  void count(int64_t bytes) { bytes_sent_.fetch_add(uint64_t(bytes), std::memory_order_relaxed); }

  std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups_;
  int nodes_ = 0;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Link> link_;
  size_t next_lane_ = 0;
  std::vector<float> tile_ = std::vector<float>(kTile);  // the caller's thread's, for blocks
  std::deque<std::shared_ptr<Chunk>> pending_;           // started chunks, oldest first
  std::deque<Trade> trades_;                             // started trades, oldest first
  at::Tensor words_in_, words_out_;
  c10::intrusive_ptr<c10d::Work> gathering_;
  std::atomic<uint64_t> bytes_sent_{0};
};

}  // namespace

// One large gloo transfer fills only part of a shaped link and several under way at once fill it;
// sixteenths bring large messages nearer their link bound than quarters, and below 4 MiB the
// node's CPU cost per piece outweighs that (docs/benchmarks.md, "The backend's other collectives
// across a network", has the measurements).
size_t cross_piece_bytes(size_t bytes) {
  const size_t quarter = std::clamp(bytes / 4, size_t(64) << 10, size_t(256) << 10);
  return std::min(std::max(bytes / 16, quarter), size_t(4) << 20);
}

std::shared_ptr<CrossNode> make_cross_node(
    std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> groups, std::chrono::milliseconds timeout,
    c10::intrusive_ptr<c10d::Store> store, std::string abort_key) {
  TORCH_INTERNAL_ASSERT(store, "ddpx: across nodes, an engine needs the job's store");
  return std::make_shared<ProcessGroupCrossNode>(
      std::move(groups), timeout,
      std::make_shared<AbortWatch>(std::move(store), std::move(abort_key)));
}

}  // namespace ddpx
