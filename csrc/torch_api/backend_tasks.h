// The tasks of the ddpx backend's collectives: for each torch.distributed call the engine serves,
// a closure that the engine's thread runs with the node's collectives, which checks the call's
// tensors (raising on every rank where one rank's are wrong), moves them through the engine and
// writes the results back. The builders take what they need and run no collective themselves.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "../collectives/node_comm.h"

namespace ddpx {

using Task = std::function<void(NodeComm&)>;

// What the backend checks on the caller's thread before it queues a task, so that a bad call
// raises at the call (and its rejection reaches the peers): why a list form's tensors cannot
// pair with `like` (one per rank, each of its dtype and size), why the tensor form's `whole`
// cannot hold world x `part`, or "".
std::string list_error(const std::vector<at::Tensor>& list, const at::Tensor& like, int world,
                       const std::string& what, const char* role);
std::string whole_error(const at::Tensor& whole, const at::Tensor& part, int world,
                        const std::string& what, const char* whole_role, const char* part_role);
// Whether two strided tensors may touch the same bytes (their spans in memory meet).
bool overlaps(const at::Tensor& a, const at::Tensor& b);

// all_reduce of tensor with op (also what reduce runs, the non-root ranks passing a copy).
Task all_reduce_task(const at::Tensor& tensor, const c10d::ReduceOp& op, int world);
Task broadcast_task(const at::Tensor& tensor, int root);
// all_gather: rank r's input lands in outs[r].
Task all_gather_task(std::vector<at::Tensor> outs, const at::Tensor& input, int world);
Task all_gather_into_tensor_task(const at::Tensor& output, const at::Tensor& input, int world);
// reduce_scatter: output = the reduction over ranks of their ins[this rank].
Task reduce_scatter_task(const at::Tensor& output, std::vector<at::Tensor> ins,
                         const c10d::ReduceOp& op, int world);
Task reduce_scatter_tensor_task(const at::Tensor& output, const at::Tensor& input,
                                const c10d::ReduceOp& op, int world);
Task barrier_task();
// all_to_all of the parts: ins[r] goes to rank r, outs[r] comes from it. equal_parts: every
// rank's parts are all the same size, which the ranks need not trade first.
Task all_to_all_task(std::vector<at::Tensor> outs, std::vector<at::Tensor> ins, bool equal_parts,
                     std::string what);
// all_to_all_single: rows of input by input_splits to each rank, rows of output by output_splits
// from each (equal parts without splits). Raises ValueError here for splits that do not fit.
Task all_to_all_single_task(const at::Tensor& output, const at::Tensor& input,
                            const std::vector<int64_t>& output_splits,
                            const std::vector<int64_t>& input_splits, bool equal_parts, int world);

// gather and scatter: whether rank `rank` has one tensor (mine) and, at the root, a list of one
// part per rank (elsewhere none); and the all-to-all where this rank's tensor goes to the root
// (to_root) or comes from it, and the root's list holds every rank's part.
bool rooted_shape(const std::vector<at::Tensor>& mine,
                  const std::vector<std::vector<at::Tensor>>& lists, int root, int rank, int world);
Task rooted_task(const at::Tensor& mine, const std::vector<at::Tensor>& list, int root,
                 bool to_root, std::string what, int world);

}  // namespace ddpx
