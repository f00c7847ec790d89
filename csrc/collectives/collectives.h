// ddpx's collectives over the node communicator (node_comm.h), one file each, each holding its
// within-node steps and, for a group that spans nodes, its across-node half: allreduce.cpp,
// allgather.cpp, broadcast.cpp, reduce_scatter.cpp, alltoall.cpp, barrier.cpp.
//
// Every collective is checked against the other ranks' call (and the other nodes') before any
// data moves, and raises on every rank where they disagree. Ranks are the group's: outs and ins
// hold group_size() pointers, root is a group rank. torch_dtype: the c10::ScalarType of the
// tensors whose bytes a collective moves, which the ranks check as they do the sizes. what names
// the call in errors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "../kernels/kernels.h"
#include "node_comm.h"

namespace ddpx {

// How a sum of dtype data carried in wire (request.h's wire_dtype) is scaled and rounded, the
// rule of every reduction. A compressed call (wire narrower than the data) rounds each input into
// the wire, scaled first (so a float16 wire does not overflow on data that fits once scaled), and
// a node's partial sums cross nodes in the wire. An uncompressed call's inputs travel as they are,
// its partial sums cross in the accumulation dtype, and the scale is applied once, to the float32
// (float64) sum as it is rounded into the result: one rounding in all.
struct SumRule {
  SumRule(DType dtype, DType wire, double scale)
      : input_scale(wire != dtype ? scale : 1.0),
        sum_scale(wire != dtype ? 1.0 : scale),
        across(wire != dtype ? wire : accumulation(dtype)) {}
  // float32, or float64 for float64.
  static DType accumulation(DType dtype) {
    return dtype == DType::Float64 ? DType::Float64 : DType::Float32;
  }
  double input_scale, sum_scale;
  DType across;  // what a node's partial sums cross nodes in
};

// What compression="int8" lost of one gradient bucket so far, carried into the bucket's next
// all-reduce (error feedback): float32, laid out as the cross-node sums of this rank's slices
// (allreduce.cpp), then, among more than two nodes, as many again for the second rounding. The
// hook keeps one per bucket (error_feedback.h); one call uses it at a time.
struct Residual {
  at::Tensor values;
  // Its n values: zeros where it held another number, which a bucket whose layout changed (its
  // own, or the engine's slices) needs.
  float* sized(int64_t n);
};

// compression="int8" or "int4" of an all-reduce (request.h): where the call spans nodes, each
// node's float32 sums cross nodes as block-scaled integers of `bits` (quantize.h), with residual's
// error feedback if one is given; within a node nothing changes, the data is summed as it is,
// uncompressed.
struct BlocksAcross {
  int bits;  // 8 or 4
  std::shared_ptr<Residual> residual;
  DType wire() const { return bits == 8 ? DType::Int8 : DType::Int4; }
};

// data[i] = the sum over ranks of data_r[i], scaled and carried as SumRule says,
// accumulated in float (double for float64) in rank order and written back in data's dtype: the
// same bits on every rank, whichever schedule ran. Across nodes the node's two phases frame a
// cross-node sum of each rank's slices.
// With `end`, a call across nodes may return with its last chunks still crossing: it then takes
// end (leaving it empty) and runs it once they are handed out, which a later all-reduce given an
// end, or any other call, does as it goes (NodeComm's in-flight chunks). Every rank of the group
// must pass an end to the same calls.
void allreduce(NodeComm& comm, void* data, DType dtype, int64_t numel, DType wire, double scale,
               const std::string& what, const BlocksAcross* quantized = nullptr,
               CallEnd* end = nullptr);

// Every rank's `bytes` bytes of in land at outs[rank] on every rank (in may be outs[me]).
void allgather(NodeComm& comm, const void* in, size_t bytes, int32_t torch_dtype, void* const* outs,
               const std::string& what);

// Rank root's data lands in every rank's.
void broadcast(NodeComm& comm, void* data, size_t bytes, int32_t torch_dtype, int root,
               const std::string& what);

// out (count elements) = the sum over ranks of their ins[me], scaled and carried in wire as SumRule
// says, summed in float (double for float64) and rounded into dtype, in rank order on one node,
// within each node then over the nodes in node order across nodes.
void reduce_scatter(NodeComm& comm, const void* const* ins, void* out, DType dtype, DType wire,
                    int64_t count, double scale, const std::string& what);

// This rank's ins[r] (sends[r] bytes) goes to rank r, and outs[r] (receives[r] bytes) receives
// rank r's part for this rank. longest, the largest part any rank sends, must be the same on every
// rank (the ranks check it): it sets the steps. Across nodes every part must be `longest` bytes.
void alltoall(NodeComm& comm, const void* const* ins, const size_t* sends, void* const* outs,
              const size_t* receives, size_t longest, int32_t torch_dtype, const std::string& what);

// Returns once every rank has called it.
void barrier(NodeComm& comm, const std::string& what);

}  // namespace ddpx
