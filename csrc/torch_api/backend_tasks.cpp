// The tasks of the ddpx backend's collectives, and the tensor handling they share
// (backend_tasks.h).
#include "backend_tasks.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <sstream>
#include <utility>

#include "../collectives/collectives.h"
#include "../engine/engine.h"
#include "../engine/request.h"
#include "reduce_ops.h"

namespace ddpx {
namespace {

using c10d::ReduceOp;

// The MIN, MAX, PRODUCT and bitwise reductions, and every reduction of integer and bool tensors,
// all-gather the ranks' data this much at a time (per rank) and reduce it here, in rank order.
constexpr int64_t kGatherChunkBytes = int64_t(1) << 20;

// Where the engine reads or writes each rank's part.
template <class Pointer>
std::vector<Pointer> pointers(const std::vector<at::Tensor>& parts) {
  std::vector<Pointer> out;
  for (const auto& t : parts) out.push_back(t.data_ptr());
  return out;
}

// The world parts of the contiguous flat, count elements each.
std::vector<at::Tensor> parts_of(const at::Tensor& flat, int world, int64_t count) {
  std::vector<at::Tensor> parts;
  for (int r = 0; r < world; ++r) parts.push_back(flat.view(-1).narrow(0, r * count, count));
  return parts;
}

// t itself when the engine can write it in place, else a contiguous copy to write back.
at::Tensor dense(const at::Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

void write_back(const at::Tensor& into, const at::Tensor& from) {
  if (!from.is_same(into)) into.copy_(from);
}

// A tensor that does not share memory with other, or a copy of it; `allowed` is the one part of
// other that t may be (an in-place call's own part).
at::Tensor apart_from(const at::Tensor& t, const at::Tensor& other, const at::Tensor& allowed) {
  if (allowed.defined() && t.data_ptr() == allowed.data_ptr() && t.numel() == allowed.numel()) {
    return t;
  }
  return overlaps(t, other) ? t.clone() : t;
}

// The bytes a tensor's elements may lie in: from its lowest element to past its highest.
std::pair<const char*, const char*> span(const at::Tensor& t) {
  const char* lo = static_cast<const char*>(t.data_ptr());
  const char* hi = lo;
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t reach = (t.size(d) - 1) * t.stride(d) * int64_t(t.element_size());
    (reach < 0 ? lo : hi) += reach;
  }
  return {lo, hi + t.element_size()};
}

}  // namespace

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.layout() != at::kStrided ||
      b.layout() != at::kStrided) {
    return false;
  }
  const auto [a_lo, a_hi] = span(a);
  const auto [b_lo, b_hi] = span(b);
  return a_lo < b_hi && b_lo < a_hi;
}

std::string list_error(const std::vector<at::Tensor>& list, const at::Tensor& like, int world,
                       const std::string& what, const char* role) {
  std::ostringstream why;
  if (int(list.size()) != world) {
    why << "ddpx: " << what << " needs a list of " << world << " " << role << ", got "
        << list.size();
    return why.str();
  }
  for (const auto& t : list) {
    if (t.scalar_type() != like.scalar_type()) {
      why << "ddpx: " << what << ": invalid tensor type: its " << role << " must all be "
          << like.scalar_type() << ", got " << t.scalar_type();
      return why.str();
    }
    if (t.numel() != like.numel()) {
      why << "ddpx: " << what << ": invalid tensor size: its " << role << " must all have "
          << like.numel() << " elements, got " << t.numel();
      return why.str();
    }
  }
  return {};
}

std::string whole_error(const at::Tensor& whole, const at::Tensor& part, int world,
                        const std::string& what, const char* whole_role, const char* part_role) {
  if (whole.numel() == world * part.numel() && whole.scalar_type() == part.scalar_type()) return {};
  std::ostringstream why;
  why << "ddpx: " << what << " needs an " << whole_role << " of " << world << " x " << part.numel()
      << " " << part.scalar_type() << " elements (world size x " << part_role << "), got "
      << whole.numel() << " " << whole.scalar_type();
  return why.str();
}

namespace {

// The parts of the contiguous t that all_to_all_single sends or receives, one per rank: rows by
// splits, or world equal parts without.
std::vector<at::Tensor> split_parts(const at::Tensor& t, const std::vector<int64_t>& splits,
                                    int world, const char* role, const std::string& what) {
  std::vector<at::Tensor> out;
  const at::Tensor flat = t.view(-1);
  if (splits.empty()) {
    TORCH_CHECK_VALUE(t.numel() % world == 0, "ddpx: ", what, " splits its ", role, " of ",
                      t.numel(), " elements into ", world, " equal parts: pass splits");
    for (int r = 0; r < world; ++r) {
      out.push_back(flat.narrow(0, r * (t.numel() / world), t.numel() / world));
    }
    return out;
  }
  const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  const int64_t row = rows == 0 ? 0 : t.numel() / rows;
  int64_t at_row = 0;
  TORCH_CHECK_VALUE(int(splits.size()) == world, "ddpx: ", what, " takes one split per rank");
  for (int64_t split : splits) {
    TORCH_CHECK_VALUE(split >= 0 && at_row + split <= rows, "ddpx: ", what, "'s ", role,
                      " splits add up to more than its ", rows, " rows");
    out.push_back(flat.narrow(0, at_row * row, split * row));
    at_row += split;
  }
  return out;
}

// Reduces the contiguous `data` in place over the node's ranks with op: all-gathered a chunk at
// a time, combined in rank order, exactly (as gloo does, integer sums wrapping around).
void reduce_gathered(NodeComm& comm, const at::Tensor& data, const ReduceOp& op,
                     const std::string& what) {
  const int n = comm.group_size();
  const int64_t numel = data.numel();
  const int64_t per = std::max<int64_t>(1, kGatherChunkBytes / int64_t(data.element_size()));
  at::Tensor flat = data.view(-1);
  at::Tensor rows_buffer = at::empty({n * std::min(per, numel)}, data.options());
  for (int64_t lo = 0; lo == 0 || lo < numel; lo += per) {
    const int64_t todo = std::min(per, numel - lo);
    at::Tensor piece = flat.narrow(0, lo, todo);
    at::Tensor rows = rows_buffer.narrow(0, 0, n * todo).view({n, todo});
    std::vector<at::Tensor> row_list;
    for (int r = 0; r < n; ++r) row_list.push_back(rows[r]);
    ddpx::allgather(comm, piece.data_ptr(), size_t(todo) * data.element_size(),
                    int32_t(data.scalar_type()), pointers<void*>(row_list).data(), what);
    piece.copy_(rows[0]);
    for (int r = 1; r < n; ++r) combine(piece, rows[r], op);
  }
}

// reduce_scatter on the node: output = the reduction over ranks of their parts[me].
void run_reduce_scatter(NodeComm& comm, const at::Tensor& output,
                        const std::vector<at::Tensor>& parts, const ReduceOp& op, int world,
                        const std::string& what) {
  at::Tensor out = dense(output);
  std::vector<at::Tensor> ins;
  for (const auto& part : parts) ins.push_back(apart_from(dense(part), out, at::Tensor()));
  if (kernel_sum(out, op)) {
    const DType dtype = *to_dtype(out.scalar_type());
    const Request request{sum_scale(op, world), std::nullopt, what};
    const DType wire = *to_dtype(wire_dtype(out.scalar_type(), request));
    ddpx::reduce_scatter(comm, pointers<const void*>(ins).data(), out.data_ptr(), dtype, wire,
                         out.numel(), request.scale, what);
  } else {
    const std::string why = invalid_reduction(out, op, what);
    if (!why.empty()) comm.reject(why, what);
    at::Tensor all = at::cat(ins);
    reduce_gathered(comm, all, op, what);
    out.view(-1).copy_(all.narrow(0, int64_t(comm.group_rank()) * out.numel(), out.numel()));
  }
  write_back(output, out);
}

}  // namespace

Task all_reduce_task(const at::Tensor& tensor, const ReduceOp& op, int world) {
  const std::string what = "torch.distributed.all_reduce (" + std::string(op_name(op)) + ")";
  const bool sum = kernel_sum(tensor, op);
  const double scale = sum ? sum_scale(op, world) : 1.0;
  return [tensor, op, sum, scale, what](NodeComm& comm) {
    at::Tensor data = dense(tensor);
    if (sum) {
      all_reduce(comm, data, Request{scale, std::nullopt, what});
    } else {
      const std::string why = invalid_reduction(data, op, what);
      if (!why.empty()) comm.reject(why, what);
      reduce_gathered(comm, data, op, what);
    }
    write_back(tensor, data);
  };
}

Task broadcast_task(const at::Tensor& tensor, int root) {
  return [tensor, root](NodeComm& comm) {
    at::Tensor data = dense(tensor);
    ddpx::broadcast(comm, data.data_ptr(), size_t(data.numel()) * data.element_size(),
                    int32_t(data.scalar_type()), root, "torch.distributed.broadcast");
    write_back(tensor, data);
  };
}

Task all_gather_task(std::vector<at::Tensor> outs, const at::Tensor& input, int world) {
  return [outs = std::move(outs), input, world](NodeComm& comm) {
    const std::string what = "torch.distributed.all_gather";
    std::vector<at::Tensor> dense_outs;
    for (const auto& out : outs) dense_outs.push_back(dense(out));
    at::Tensor in = dense(input);
    for (int r = 0; r < world; ++r) {
      in = apart_from(in, dense_outs[size_t(r)],
                      r == comm.group_rank() ? dense_outs[size_t(r)] : at::Tensor());
    }
    ddpx::allgather(comm, in.data_ptr(), size_t(in.numel()) * in.element_size(),
                    int32_t(in.scalar_type()), pointers<void*>(dense_outs).data(), what);
    for (size_t r = 0; r < outs.size(); ++r) write_back(outs[r], dense_outs[r]);
  };
}

Task all_gather_into_tensor_task(const at::Tensor& output, const at::Tensor& input, int world) {
  return [output, input, world](NodeComm& comm) {
    const std::string what = "torch.distributed.all_gather_into_tensor";
    at::Tensor out = dense(output);
    const at::Tensor own =
        out.view(-1).narrow(0, int64_t(comm.group_rank()) * input.numel(), input.numel());
    const at::Tensor in = apart_from(dense(input), out, own);
    ddpx::allgather(comm, in.data_ptr(), size_t(in.numel()) * in.element_size(),
                    int32_t(in.scalar_type()),
                    pointers<void*>(parts_of(out, world, input.numel())).data(), what);
    write_back(output, out);
  };
}

Task reduce_scatter_task(const at::Tensor& output, std::vector<at::Tensor> ins, const ReduceOp& op,
                         int world) {
  return [output, ins = std::move(ins), op, world](NodeComm& comm) {
    const std::string what = "torch.distributed.reduce_scatter (" + std::string(op_name(op)) + ")";
    run_reduce_scatter(comm, output, ins, op, world, what);
  };
}

Task reduce_scatter_tensor_task(const at::Tensor& output, const at::Tensor& input,
                                const ReduceOp& op, int world) {
  return [output, input, op, world](NodeComm& comm) {
    const std::string what =
        "torch.distributed.reduce_scatter_tensor (" + std::string(op_name(op)) + ")";
    run_reduce_scatter(comm, output, parts_of(dense(input), world, output.numel()), op, world,
                       what);
  };
}

Task barrier_task() {
  return [](NodeComm& comm) { ddpx::barrier(comm, "torch.distributed.barrier"); };
}

Task all_to_all_task(std::vector<at::Tensor> outs, std::vector<at::Tensor> ins, bool equal_parts,
                     std::string what) {
  return [outs = std::move(outs), ins = std::move(ins), equal_parts,
          what = std::move(what)](NodeComm& comm) {
    const int n = comm.group_size(), me = comm.group_rank();
    const auto bytes = [](const at::Tensor& t) { return t.defined() ? t.nbytes() : size_t(0); };
    const auto where = [](const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; };
    std::vector<at::Tensor> dense_outs, dense_ins;
    for (const auto& out : outs) dense_outs.push_back(out.defined() ? dense(out) : out);
    for (const auto& in : ins) {
      at::Tensor part = in.defined() ? dense(in) : in;
      for (const auto& out : dense_outs) {
        if (part.defined() && out.defined()) part = apart_from(part, out, at::Tensor());
      }
      dense_ins.push_back(part);
    }
    std::vector<size_t> sends, receives;
    std::vector<const void*> from;
    std::vector<void*> to;
    for (int r = 0; r < n; ++r) {
      sends.push_back(bytes(dense_ins[size_t(r)]));
      receives.push_back(bytes(dense_outs[size_t(r)]));
      from.push_back(where(dense_ins[size_t(r)]));
      to.push_back(where(dense_outs[size_t(r)]));
    }
    size_t longest = std::max(*std::max_element(sends.begin(), sends.end()),
                              *std::max_element(receives.begin(), receives.end()));
    std::ostringstream why;
    if (equal_parts) {
      // Every part sent or received is as long as the longest: the other ranks' are too.
      for (int r = 0; r < n && why.tellp() == 0; ++r) {
        for (const at::Tensor* t : {&dense_ins[size_t(r)], &dense_outs[size_t(r)]}) {
          if (t->defined() && bytes(*t) != longest && why.tellp() == 0) {
            why << "ddpx: " << what << " needs parts of one size, got " << bytes(*t) << " and "
                << longest << " bytes";
          }
        }
      }
    } else {
      // Every rank's part sizes, so that all agree on the steps and check what they receive.
      std::vector<int64_t> mine(sends.begin(), sends.end()), all(size_t(n * n));
      std::vector<void*> rows;
      for (int r = 0; r < n; ++r) rows.push_back(all.data() + r * n);
      ddpx::allgather(comm, mine.data(), mine.size() * sizeof(int64_t), int32_t(at::kLong),
                      rows.data(), what);
      longest = size_t(*std::max_element(all.begin(), all.end()));
      for (int r = 0; r < n && why.tellp() == 0; ++r) {
        if (size_t(all[size_t(r * n + me)]) != receives[size_t(r)]) {
          why << "ddpx: " << what << ": local rank " << r << " sends " << all[size_t(r * n + me)]
              << " bytes to local rank " << me << ", which expects " << receives[size_t(r)]
              << ": the ranks' splits must match";
        }
      }
    }
    if (why.tellp() > 0) comm.reject(why.str(), what);
    int32_t torch_dtype = -1;
    for (const auto* parts : {&dense_ins, &dense_outs}) {
      for (const auto& t : *parts) {
        if (t.defined()) torch_dtype = int32_t(t.scalar_type());
      }
    }
    ddpx::alltoall(comm, from.data(), sends.data(), to.data(), receives.data(), longest,
                   torch_dtype, what);
    for (size_t r = 0; r < outs.size(); ++r) {
      if (outs[r].defined()) write_back(outs[r], dense_outs[r]);
    }
  };
}

Task all_to_all_single_task(const at::Tensor& output, const at::Tensor& input,
                            const std::vector<int64_t>& output_splits,
                            const std::vector<int64_t>& input_splits, bool equal_parts, int world) {
  const std::string what = "torch.distributed.all_to_all_single";
  TORCH_CHECK_VALUE(input.is_contiguous() && output.is_contiguous(), "ddpx: ", what,
                    ": Tensors must be contiguous (call .contiguous() on them first)");
  return all_to_all_task(split_parts(output, output_splits, world, "output", what),
                         split_parts(input, input_splits, world, "input", what), equal_parts, what);
}

bool rooted_shape(const std::vector<at::Tensor>& mine,
                  const std::vector<std::vector<at::Tensor>>& lists, int root, int rank,
                  int world) {
  if (mine.size() != 1 || root < 0 || root >= world) return false;
  if (rank == root) return lists.size() == 1 && int(lists[0].size()) == world;
  return lists.empty() || lists[0].empty();
}

Task rooted_task(const at::Tensor& mine, const std::vector<at::Tensor>& list, int root,
                 bool to_root, std::string what, int world) {
  // mine goes to or comes from the root only; the root's list has a part for every rank.
  const size_t n = size_t(world);
  std::vector<at::Tensor> with_root(n), with_all = list;
  with_root[size_t(root)] = mine;
  with_all.resize(n);
  return to_root ? all_to_all_task(with_all, with_root, true, std::move(what))
                 : all_to_all_task(with_root, with_all, true, std::move(what));
}

}  // namespace ddpx
