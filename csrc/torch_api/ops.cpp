// ddpx's collectives as torch operators (torch.ops.ddpx.*), so that torch.compile traces them
// into its graph instead of breaking it at a Python extension call. An operator names its
// group by the group's name; engine_for (ddpx/engine.py) publishes each engine it makes here.
#include <torch/library.h>

#include <map>
#include <mutex>
#include <utility>

#include "../engine/engine.h"

namespace ddpx {
namespace {

std::mutex published_mu;
std::map<std::pair<std::string, c10::DeviceType>, std::weak_ptr<Engine>> published;

void all_reduce_(at::Tensor& tensor, const std::string& group, double scale,
                 std::optional<at::ScalarType> wire) {
  std::shared_ptr<Engine> engine;
  {
    std::lock_guard<std::mutex> lock(published_mu);
    auto it = published.find({group, tensor.device().type()});
    if (it != published.end()) engine = it->second.lock();
  }
  TORCH_CHECK_VALUE(engine, "ddpx: no engine for ", tensor.device().type(),
                    " tensors on process group '", group,
                    "'; call ddpx.all_reduce (or ddpx.engine_for) on it before this operator");
  engine->run(tensor, Request{scale, wire, "torch.ops.ddpx.all_reduce_"});
}

// What a traced graph needs of the operator: it writes its input in place, nothing else.
void all_reduce_meta(at::Tensor& /*tensor*/, const std::string& /*group*/, double /*scale*/,
                     std::optional<at::ScalarType> /*wire*/) {}

}  // namespace

void publish_engine(const std::string& group, c10::DeviceType device,
                    const std::shared_ptr<Engine>& engine) {
  std::lock_guard<std::mutex> lock(published_mu);
  published[{group, device}] = engine;
}

TORCH_LIBRARY(ddpx, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str group, float scale, ScalarType? wire) -> ()");
}

TORCH_LIBRARY_IMPL(ddpx, CPU, m) { m.impl("all_reduce_", all_reduce_); }
TORCH_LIBRARY_IMPL(ddpx, CUDA, m) { m.impl("all_reduce_", all_reduce_); }
TORCH_LIBRARY_IMPL(ddpx, Meta, m) { m.impl("all_reduce_", all_reduce_meta); }

}  // namespace ddpx
