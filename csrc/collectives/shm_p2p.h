// Point-to-point (send, recv, isend/irecv, batch_isend_irecv) between the ranks of one node,
// through rings at the end of the node's shared-memory segment, apart from the collectives'
// steps: a send never waits behind a collective its peer has not reached, nor a collective
// behind a send.
//
// Each ordered pair of local ranks has a ring of its own, which only the sender fills and only
// the receiver empties, each publishing one counter. A message is a 64-byte frame (tag, bytes)
// and its bytes, padded to 64; it crosses in pieces, so that the receiver copies one piece out
// while the sender copies the next one in. Messages between two ranks keep their order, and a
// receive takes the first one from its source with its tag. When a receive waits for a tag and
// its source's next message has another, that message is set aside in this process's memory
// (MPI's unexpected messages), so receives may be posted in any tag order, as on gloo.
//
// A thread per backend moves the bytes of every pending send and receive, started with the
// backend's first one; a caller waiting for a work moves them itself meanwhile, which saves a
// small message the two hand-offs between threads it would otherwise cost.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstddef>
#include <memory>
#include <string>
#include <thread>

namespace ddpx {

class ShmChannel;  // shm_channel.h

// The point-to-point part of a segment for this many local ranks.
struct P2PLayout {
  int nranks;
  size_t ring_bytes() const;  // each ordered pair's ring: smaller as the pairs multiply
  size_t bytes() const;
};

class ShmPointToPoint {
 public:
  // The rings of channel's segment, for a group on one node (local ranks are its ranks).
  // channel must outlive this object; the works it returns may outlive both.
  explicit ShmPointToPoint(const ShmChannel& channel);
  // Fails every send and receive still pending, then stops the thread.
  ~ShmPointToPoint();
  // Fails every send and receive pending, and every one after, with why (ProcessGroup.abort());
  // from any thread.
  void abort(const std::string& why);
  ShmPointToPoint(const ShmPointToPoint&) = delete;
  ShmPointToPoint& operator=(const ShmPointToPoint&) = delete;

  // src -1 receives from any rank. The work's future holds [tensor].
  c10::intrusive_ptr<c10d::Work> send(const at::Tensor& tensor, int dst, int tag);
  c10::intrusive_ptr<c10d::Work> recv(const at::Tensor& tensor, int src, int tag);
  std::string describe() const;

  struct State;  // what the thread and the works share (defined in the .cpp)

 private:
  std::shared_ptr<State> state_;
  std::thread worker_;
};

}  // namespace ddpx
