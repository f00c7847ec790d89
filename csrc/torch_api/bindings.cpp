// Python bindings of ddpx._C. Policy (which engine, which group, when to fall back) lives in the
// Python package; this file only exposes the pieces.
#include <pybind11/chrono.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "../engine/engine.h"
#include "backend.h"
#include "fused_hook.h"

#ifndef DDPX_TORCH_VERSION
#error "build ddpx._C through setup.py or ddpx's loader, which define DDPX_TORCH_VERSION"
#endif
// The version comes unquoted on the command line (no shell quoting to survive) and is quoted here.
#define DDPX_STRINGIFY(x) DDPX_STRINGIFY_(x)
#define DDPX_STRINGIFY_(x) #x

namespace py = pybind11;

namespace ddpx {
namespace {

// engine.schedule's names, in ScheduleChoice::Policy's order.
constexpr const char* kPolicyNames[] = {"timed", "narrow", "wide", "shared", "auto"};

DType kernel_dtype(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "ddpx kernels take contiguous CPU tensors");
  const auto dtype = to_dtype(t.scalar_type());
  TORCH_CHECK(dtype, "ddpx kernels take float32/float64/bfloat16/float16, got ", t.scalar_type());
  return *dtype;
}

const Kernels& kernels_named(const std::string& isa) {
  const Kernels* k = kernels_for(isa.c_str());
  TORCH_CHECK(k != nullptr, "ddpx: kernels '", isa, "' are not available on this CPU or build");
  return *k;
}

Request make_request(double scale, std::optional<at::ScalarType> wire, std::string what,
                     bool dense_wire_only) {
  return Request{scale, wire, std::move(what), dense_wire_only};
}

const char* numa_mode_name(NumaRange::Mode mode) {
  return mode == NumaRange::Mode::Preferred ? "preferred" : "interleave";
}

NumaRange numa_range_of(const py::tuple& range) {
  TORCH_CHECK_VALUE(range.size() == 4, "ddpx: a placement range is (offset, bytes, mode, nodes)");
  const auto mode = range[2].cast<std::string>();
  TORCH_CHECK_VALUE(mode == "preferred" || mode == "interleave",
                    "ddpx: a placement's mode is 'preferred' or 'interleave', not '", mode, "'");
  return NumaRange{range[0].cast<size_t>(), range[1].cast<size_t>(),
                   mode == "preferred" ? NumaRange::Mode::Preferred : NumaRange::Mode::Interleaved,
                   range[3].cast<std::vector<int>>()};
}

py::dict numa_where_dict(uintptr_t address) {
  const NumaWhere where = numa_where(reinterpret_cast<const void*>(address));
  py::dict out;
  out["node"] = where.node;
  out["policy"] = where.policy;
  out["nodes"] = where.nodes;
  return out;
}

}  // namespace

#ifdef DDPX_WITH_CUDA
void bind_cuda(py::module& m);  // csrc/cuda/cuda_engine.cpp
#endif

}  // namespace ddpx

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace ddpx;
  m.attr("torch_version") = DDPX_STRINGIFY(DDPX_TORCH_VERSION);
#ifdef DDPX_WITH_CUDA
  m.attr("has_cuda_kernels") = true;
  bind_cuda(m);
#else
  m.attr("has_cuda_kernels") = false;
#endif

  py::class_<ShmSegment, std::shared_ptr<ShmSegment>>(m, "ShmSegment", py::module_local())
      .def_static(
          "create",
          [](const std::string& name, size_t nbytes, const std::vector<py::tuple>& placement) {
            std::vector<NumaRange> ranges;
            for (const py::tuple& r : placement) ranges.push_back(numa_range_of(r));
            py::gil_scoped_release release;
            return ShmSegment::create(name, nbytes, ranges);
          },
          py::arg("name"), py::arg("nbytes"), py::arg("placement") = std::vector<py::tuple>())
      .def_static("attach", &ShmSegment::attach, py::arg("name"), py::arg("nbytes"),
                  py::call_guard<py::gil_scoped_release>())
      .def_static("unlink", &ShmSegment::unlink, py::arg("name"))
      .def_property_readonly("nbytes", &ShmSegment::size)
      .def_property_readonly("not_placed", &ShmSegment::not_placed)
      .def_property_readonly(
          "address", [](const ShmSegment& s) { return reinterpret_cast<uintptr_t>(s.data()); });

  // NUMA placement (numa.h): the segment's ranges as (offset, bytes, mode, nodes), mode
  // "preferred" or "interleave"; and where the page at an address lies.
  m.def(
      "shm_numa_ranges",
      [](int nranks, size_t block_bytes, size_t wide_bytes, const std::vector<int>& rank_nodes) {
        std::vector<py::tuple> out;
        for (const NumaRange& r :
             ShmLayout{nranks, block_bytes, wide_bytes}.numa_ranges(rank_nodes)) {
          out.push_back(py::make_tuple(r.offset, r.bytes, numa_mode_name(r.mode), r.nodes));
        }
        return out;
      },
      py::arg("nranks"), py::arg("block_bytes"), py::arg("wide_bytes"), py::arg("rank_nodes"));
  m.def(
      "numa_where", [](uintptr_t address) { return numa_where_dict(address); }, py::arg("address"));

  // How many ranks of one group a node's shared-memory engine serves at most.
  m.attr("max_local_ranks") = kMaxLocalRanks;
  m.def(
      "shm_segment_bytes",
      [](int nranks, size_t block_bytes, size_t wide_bytes) {
        return ShmLayout{nranks, block_bytes, wide_bytes}.segment_bytes();
      },
      py::arg("nranks"), py::arg("block_bytes"), py::arg("wide_bytes"));

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", py::module_local())
      .def(
          "run",
          [](Engine& e, at::Tensor t, double scale, std::optional<at::ScalarType> wire,
             std::string what, bool dense_wire_only) {
            e.run(std::move(t), make_request(scale, wire, std::move(what), dense_wire_only));
          },
          py::arg("tensor"), py::arg("scale"), py::arg("wire"), py::arg("what"),
          py::arg("dense_wire_only") = false, py::call_guard<py::gil_scoped_release>())
      .def(
          "run_async",
          [](Engine& e, at::Tensor t, double scale, std::optional<at::ScalarType> wire,
             std::string what, bool dense_wire_only) {
            c10::intrusive_ptr<c10::ivalue::Future> future;
            {
              py::gil_scoped_release release;
              future = e.run_async(std::move(t),
                                   make_request(scale, wire, std::move(what), dense_wire_only));
            }
            return torch::jit::toPyObject(c10::IValue(std::move(future)));
          },
          py::arg("tensor"), py::arg("scale"), py::arg("wire"), py::arg("what"),
          py::arg("dense_wire_only") = false)
      .def("set_group", &Engine::set_group, py::arg("group_name"))
      .def("describe", &Engine::describe)
      .def("flight_record", &Engine::flight_record, py::call_guard<py::gil_scoped_release>())
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>());

  py::class_<ShmEngine, Engine, std::shared_ptr<ShmEngine>>(m, "ShmEngine", py::module_local())
      .def_property_readonly("cross_node_bytes", &ShmEngine::cross_node_bytes)
      .def_property_readonly("cross_node_times",
                             [](ShmEngine& e) {
                               const NodeComm::AcrossTimes times = e.comm().across_times();
                               return std::map<std::string, double>{
                                   {"node_s", times.node_s},
                                   {"link_wait_s", times.link_wait_s},
                                   {"idle_s", times.idle_s},
                                   {"calls_left_in_flight", double(times.calls_left_in_flight)}};
                             })
      .def_property(
          "one_shot_bytes", [](ShmEngine& e) { return e.comm().schedule().one_shot_bytes(); },
          [](ShmEngine& e, size_t bytes) { e.comm().schedule().set_one_shot_bytes(bytes); })
      .def_property(
          "schedule",
          [](ShmEngine& e) { return std::string(kPolicyNames[int(e.comm().schedule().policy())]); },
          [](ShmEngine& e, const std::string& policy) {
            const auto* const end = std::end(kPolicyNames);
            const auto* const found = std::find(std::begin(kPolicyNames), end, policy);
            TORCH_CHECK_VALUE(
                found != end,
                "ddpx: schedule must be 'auto', 'shared', 'narrow', 'wide' or 'timed', "
                "got '",
                policy, "'");
            e.comm().schedule().set_policy(
                ScheduleChoice::Policy(found - std::begin(kPolicyNames)));
          })
      // What describe() says, as values to check.
      .def_property_readonly("local_ranks", [](ShmEngine& e) { return e.comm().channel().size(); })
      .def_property_readonly(
          "nodes",
          [](ShmEngine& e) { return e.comm().spans_nodes() ? e.comm().cross_node().nodes() : 1; })
      .def_property_readonly("block_bytes",
                             [](ShmEngine& e) { return e.comm().channel().layout().block_bytes; })
      .def_property_readonly("wide_bytes",
                             [](ShmEngine& e) { return e.comm().channel().layout().wide_bytes; })
      .def_property_readonly("wide_sizes",
                             [](ShmEngine& e) { return e.comm().schedule().wide_sizes(); })
      .def_property_readonly("one_shot_sizes",
                             [](ShmEngine& e) { return e.comm().schedule().one_shot_sizes(); })
      .def_property_readonly(
          "always_one_shot_bytes",
          [](ShmEngine& e) { return e.comm().schedule().always_one_shot_bytes(); })
      .def_property_readonly("shared_now",
                             [](ShmEngine& e) { return e.comm().schedule().shared_now(); })
      .def_property_readonly("shared_sizes",
                             [](ShmEngine& e) { return e.comm().schedule().shared_sizes(); })
      .def_property(
          "threads", [](ShmEngine& e) { return e.comm().threads(); },
          [](ShmEngine& e, int threads) {
            py::gil_scoped_release release;
            e.run([threads](NodeComm& comm) { comm.set_threads(threads); });
          })
      .def_property_readonly("threaded_calls",
                             [](ShmEngine& e) { return e.comm().workers().threaded_runs(); })
      .def_property_readonly("zero_copy_calls",
                             [](ShmEngine& e) { return e.comm().zero_copy_calls(); })
      .def_property_readonly("numa", &ShmEngine::numa)
      // Where the first page of each local rank's input slots lies, then the output slots'.
      .def_property_readonly(
          "slot_memory",
          [](ShmEngine& e) {
            const ShmChannel& channel = e.comm().channel();
            py::list out;
            for (int r = 0; r < channel.size(); ++r) {
              out.append(numa_where_dict(reinterpret_cast<uintptr_t>(channel.input_slot(r, 0))));
            }
            out.append(numa_where_dict(reinterpret_cast<uintptr_t>(channel.output_slot(0))));
            return out;
          })
      .def_property_readonly("oversubscribed",
                             [](ShmEngine& e) { return e.comm().channel().oversubscribed(); })
      .def_property_readonly("wait_stats", [](const ShmEngine& e) {
        const ShmChannel::WaitStats w = e.wait_stats();
        py::dict stats;
        stats["waited_ns"] = w.waited_ns;
        stats["waits"] = w.waits;
        stats["sleeps"] = w.sleeps;
        stats["yields"] = w.yields;
        stats["lost_yields"] = w.lost_yields;
        return stats;
      });

  // The process's arena (arena.h): tensors in it, whether one lies there, what it holds.
  m.def(
      "arena_empty",
      [](int64_t numel, at::ScalarType dtype) {
        return Arena::process().allocate(numel, at::TensorOptions().dtype(dtype));
      },
      py::arg("numel"), py::arg("dtype"));
  m.def("arena_holds", [](const at::Tensor& t) {
    return t.device().is_cpu() &&
           Arena::process().find(t.data_ptr(), size_t(t.numel()) * t.element_size()).valid();
  });
  m.def("arena_usage", [] {
    Arena& arena = Arena::process();
    const Arena::Usage use = arena.usage();
    py::dict out;
    out["usable"] = arena.usable();
    out["why_not"] = arena.why_not();
    out["chunks"] = use.chunks;
    out["bytes"] = use.bytes;
    out["in_use"] = use.in_use;
    out["peer_chunks"] = use.peer_chunks;
    out["fell_back"] = use.fell_back;
    return out;
  });

  // Local rank 0's choice of schedule for `calls` all-reduces of `bytes` in a row, the n-th call
  // of a schedule taking ms[schedule][n % len(ms[schedule])], on a node of 256 KiB and 4 MiB steps,
  // a rank having waited for its CPU at call i as busy[i % len(busy)] says: the calls' schedules,
  // each chosen as an engine's call chooses it (NodeComm::begin, allreduce, first_step). The
  // choice, tested without timing a machine.
  m.def(
      "schedule_choices",
      [](const std::string& policy, size_t bytes,
         const std::map<std::string, std::vector<double>>& ms, int calls,
         const std::vector<bool>& busy, bool reachable, int threads) {
        TORCH_CHECK_VALUE(!busy.empty(), "busy needs a value");
        static const char* const names[] = {"narrow", "wide", "one-shot", "shared"};
        ScheduleChoice choice(ShmLayout{2, size_t(256) << 10, size_t(4) << 20}, size_t(32) << 10);
        const auto* const found =
            std::find(std::begin(kPolicyNames), std::end(kPolicyNames), policy);
        TORCH_CHECK_VALUE(found != std::end(kPolicyNames), "no policy ", policy);
        choice.set_policy(ScheduleChoice::Policy(found - std::begin(kPolicyNames)));
        choice.set_threads(threads);
        std::vector<std::string> ran;
        std::map<std::string, size_t> runs;
        for (int call = 0; call < calls; ++call) {
          choice.begin_call();
          CallMeta mine{};
          choice.stamp(mine);
          const ScheduleChoice::Schedule schedule = choice.schedule_for(bytes);
          const int timed = choice.timed_class(bytes, schedule);
          choice.agreed(mine);
          choice.decide(reachable, busy[size_t(call) % busy.size()]);
          ran.emplace_back(names[schedule]);
          if (timed < 0) continue;
          const auto took = ms.find(ran.back());
          TORCH_CHECK_VALUE(took != ms.end() && !took->second.empty(), "no time for ", ran.back());
          const double each = took->second[runs[ran.back()]++ % took->second.size()];
          choice.time(timed, schedule, bytes, std::chrono::nanoseconds(int64_t(each * 1e6)));
        }
        return ran;
      },
      py::arg("policy"), py::arg("bytes"), py::arg("ms"), py::arg("calls"),
      py::arg("busy") = std::vector<bool>{false}, py::arg("reachable") = true,
      py::arg("threads") = 1);

  m.def(
      "make_shm_engine",
      [](std::shared_ptr<ShmSegment> segment, int nranks, size_t block_bytes, size_t wide_bytes,
         int local_rank, std::vector<int> ranks, size_t one_shot_bytes, double timeout_s,
         bool initialize, std::vector<c10::intrusive_ptr<c10d::ProcessGroup>> cross_node_groups,
         size_t cross_chunk_bytes, std::optional<c10::intrusive_ptr<c10d::Store>> store,
         std::string abort_key, std::vector<int> node_ranks, std::string numa) {
        auto timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
        auto comm = std::make_unique<NodeComm>(
            std::move(segment), ShmLayout{nranks, block_bytes, wide_bytes}, local_rank,
            std::move(ranks), one_shot_bytes, timeout, initialize);
        std::shared_ptr<CrossNode> cross_node;
        if (!cross_node_groups.empty()) {
          cross_node = make_cross_node(std::move(cross_node_groups), timeout,
                                       store.value_or(c10::intrusive_ptr<c10d::Store>()),
                                       std::move(abort_key));
        }
        auto engine = std::make_shared<ShmEngine>(std::move(comm), std::move(cross_node),
                                                  cross_chunk_bytes, std::move(node_ranks));
        engine->set_numa(std::move(numa));
        return engine;
      },
      py::arg("segment"), py::arg("nranks"), py::arg("block_bytes"), py::arg("wide_bytes"),
      py::arg("local_rank"), py::arg("ranks"), py::arg("one_shot_bytes"), py::arg("timeout_s"),
      py::arg("initialize"),
      py::arg("cross_node_groups") = std::vector<c10::intrusive_ptr<c10d::ProcessGroup>>(),
      py::arg("cross_chunk_bytes") = size_t(0), py::arg("store") = py::none(),
      py::arg("abort_key") = std::string(), py::arg("node_ranks") = std::vector<int>(),
      py::arg("numa") = std::string());

  py::class_<Backend, c10d::Backend, c10::intrusive_ptr<Backend>>(m, "Backend")
      .def(py::init([](int rank, int size, std::chrono::milliseconds timeout,
                       c10::intrusive_ptr<c10d::Backend> gloo, std::shared_ptr<ShmEngine> engine,
                       std::string why_not) {
             return c10::make_intrusive<Backend>(rank, size, timeout, std::move(gloo),
                                                 std::move(engine), std::move(why_not));
           }),
           py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("gloo"), py::arg("engine"),
           py::arg("why_not") = std::string())
      .def("describe", &Backend::describe)
      .def_property_readonly("options", &Backend::options)
      .def("_set_default_timeout", &Backend::set_timeout, py::arg("timeout"))
      .def_property_readonly("engine", &Backend::engine)
      .def_property_readonly("why_not", &Backend::why_not)
      .def(
          "flight_record",
          [](const Backend& b) {
            if (b.engine()) return b.engine()->flight_record();
            return "ddpx: no flight record: this group's collectives go to gloo (" + b.why_not() +
                   ")";
          },
          py::call_guard<py::gil_scoped_release>())
      .def("routes", [](const Backend& b) {
        py::dict out;
        for (const auto& [name, counts] : b.routes()) {
          py::dict paths;
          paths["engine"] = counts.engine;
          paths["gloo"] = counts.gloo;
          out[py::str(name)] = paths;
        }
        return out;
      });

  m.def(
      "make_process_group_engine",
      [](c10::intrusive_ptr<c10d::ProcessGroup> group, std::string reason) {
        return std::shared_ptr<Engine>(
            std::make_shared<ProcessGroupEngine>(std::move(group), std::move(reason)));
      },
      py::arg("group"), py::arg("reason"));

  m.def(
      "publish_engine",
      [](const std::string& group, const std::string& device, std::shared_ptr<Engine> engine) {
        publish_engine(group, c10::Device(device).type(), engine);
      },
      py::arg("group"), py::arg("device"), py::arg("engine"));

  m.def(
      "register_fused_hook",
      [](c10d::Reducer& reducer, std::shared_ptr<Engine> engine, double scale,
         std::optional<at::ScalarType> wire, bool into_arena,
         std::shared_ptr<ErrorFeedback> feedback, std::optional<py::function> step) {
        const bool adopt = into_arena && engine->serves_arena();
        std::shared_ptr<BucketSteps> steps;
        if (step) {
          // The steps run, and the function may be dropped, on threads that do not hold the GIL.
          std::shared_ptr<py::function> held(new py::function(std::move(*step)),
                                             [](py::function* f) {
                                               py::gil_scoped_acquire gil;
                                               delete f;
                                             });
          auto step_bucket = [held](const std::vector<at::Tensor>& gradients,
                                    const std::vector<at::Tensor>& parameters) {
            py::gil_scoped_acquire gil;
            try {
              (*held)(gradients, parameters);
            } catch (py::error_already_set& e) {
              throw std::runtime_error(std::string("ddpx: the optimizer's step of a bucket: ") +
                                       e.what());
            }
          };
          auto shm = std::dynamic_pointer_cast<ShmEngine>(engine);
          TORCH_INTERNAL_ASSERT(shm, "ddpx: optimizer= steps across nodes, on ddpx's engine");
          steps = std::make_shared<BucketSteps>(step_bucket, std::move(shm));
        }
        reducer.register_comm_hook(std::make_unique<FusedHook>(FusedHookConfig{
            std::move(engine), scale, wire, adopt, std::move(feedback), std::move(steps)}));
      },
      py::arg("reducer"), py::arg("engine"), py::arg("scale"), py::arg("wire"),
      py::arg("into_arena"), py::arg("feedback") = nullptr, py::arg("step") = py::none());
  py::class_<ErrorFeedback, std::shared_ptr<ErrorFeedback>>(m, "ErrorFeedback", py::module_local())
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("parameters"))
      .def("state", &ErrorFeedback::state)
      .def("load", &ErrorFeedback::load, py::arg("state"));
  m.def(
      "invalid_input",
      [](const at::Tensor& tensor, std::optional<at::ScalarType> wire, std::string what,
         const std::string& device) {
        return invalid_input(tensor, Request{1.0, wire, std::move(what)},
                             c10::Device(device).type());
      },
      py::arg("tensor"), py::arg("wire"), py::arg("what"), py::arg("device"));

  m.def("kernel_isa", [] { return std::string(kernels().isa); });
  m.def(
      "kernel_convert",
      [](at::Tensor dst, const at::Tensor& src, double scale, const std::string& isa, bool stream) {
        TORCH_CHECK(dst.numel() == src.numel(), "ddpx: kernel_convert needs equal sizes");
        kernels_named(isa).convert(dst.data_ptr(), kernel_dtype(dst), src.data_ptr(),
                                   kernel_dtype(src), src.numel(), scale,
                                   stream ? Write::Streaming : Write::Cached);
      },
      py::arg("dst"), py::arg("src"), py::arg("scale"), py::arg("isa"), py::arg("stream") = false);
  m.def(
      "kernel_copy",
      [](at::Tensor dst, const at::Tensor& src, const std::string& isa, bool stream) {
        TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes(),
                    "ddpx: kernel_copy needs contiguous tensors of equal bytes");
        kernels_named(isa).copy(dst.data_ptr(), src.data_ptr(), src.nbytes(),
                                stream ? Write::Streaming : Write::Cached);
      },
      py::arg("dst"), py::arg("src"), py::arg("isa"), py::arg("stream") = false);
  m.def(
      "kernel_reduce",
      [](at::Tensor dst, const std::vector<at::Tensor>& srcs, const std::string& isa, bool stream,
         double scale) {
        TORCH_CHECK(!srcs.empty() && srcs.size() <= size_t(kMaxLocalRanks), "ddpx: 1 to ",
                    kMaxLocalRanks, " sources");
        std::vector<const void*> ptrs;
        for (const auto& s : srcs) {
          TORCH_CHECK(s.numel() == dst.numel() && s.scalar_type() == srcs[0].scalar_type(),
                      "ddpx: kernel_reduce sources must match in size and dtype");
          kernel_dtype(s);
          ptrs.push_back(s.data_ptr());
        }
        kernels_named(isa).reduce(dst.data_ptr(), kernel_dtype(dst), ptrs.data(), int(ptrs.size()),
                                  kernel_dtype(srcs[0]), dst.numel(), scale,
                                  stream ? Write::Streaming : Write::Cached);
      },
      py::arg("dst"), py::arg("srcs"), py::arg("isa"), py::arg("stream") = false,
      py::arg("scale") = 1.0);
}
