// The process group's collectives under the names of the torch built against (torch_compat.h).
#include "torch_compat.h"

#include <vector>

namespace ddpx {

c10::intrusive_ptr<c10d::Work> all_to_all(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in, std::chrono::milliseconds timeout) {
  std::vector<int64_t> equal_splits;
  c10d::AllToAllOptions opts;
  opts.timeout = timeout;
#if DDPX_TORCH_AT_LEAST_2_13
  return group.all_to_all_single(out, in, equal_splits, equal_splits, opts);
#else
  return group.alltoall_base(out, in, equal_splits, equal_splits, opts);
#endif
}

c10::intrusive_ptr<c10d::Work> all_gather(c10d::ProcessGroup& group, at::Tensor& out,
                                          at::Tensor& in, std::chrono::milliseconds timeout) {
  c10d::AllgatherOptions opts;
  opts.timeout = timeout;
#if DDPX_TORCH_AT_LEAST_2_13
  return group.all_gather_single(out, in, opts);
#else
  return group._allgather_base(out, in, opts);
#endif
}

}  // namespace ddpx
