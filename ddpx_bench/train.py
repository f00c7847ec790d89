"""`ddpx-bench train`: DDP training steps of one MLP per comm hook, taking turns step by step,
timed on the slowest rank; the final parameters checked across ranks and against DDP's default.

About 6 minutes on 2 cores at the defaults, half of them torch's bf16 and PowerSGD hooks.

    ddpx-bench train --json bench_out/train.json --plot bench_out/train.png
    ddpx-bench train --world_sizes 2 --params 2M --steps 5 --load 1   # busy machine
    ddpx-bench train --world_sizes 2 --comm_hooks default,ddpx --params 2M --steps 5
    ddpx-bench train --world_sizes 2 --comm_hooks default,backend,backend-mem --params 2M
    ddpx-bench train --world_sizes 2 --model gpt --batch_size 2 --comm_hooks backend-mem,none
    ddpx-bench train --link 1gbit --world_sizes 4 --comm_hooks default,bf16,powersgd,ddpx,none

In detail: DDP steps (forward, backward, SGD step) of ddpx_bench.models.MLP with --params parameters
on --batch_size rows of random data per rank (or, with --model gpt, of ddpx_bench.models.GPT on
--batch_size sequences of random token ids, with its next-token loss), one model per --comm_hooks
entry: `default` (DDP's own all-reduce), `fp16` and `bf16` (torch's fp16_compress_hook and
bf16_compress_hook; DDP registers a hook of the latter's name only with NCCL, so it is registered
through a wrapper, and left out where the backend does not sum bfloat16), `powersgd-r1` and
`powersgd-r4` (`powersgd`: both; torch's powerSGD_hook of matrix_approximation_rank 1 and 4, with
its error feedback and warm start, compressing from the third step on, which the default --warmup
leaves untimed), `ddpx`, `ddpx-fp16`, `ddpx-bf16`, `ddpx-int8`, `ddpx-int4`
(ddpx.register_fused_hook; left out where this ddpx lacks the compression), `ddpx+step`,
`ddpx-bf16+step`, `ddpx-int8+step`, `ddpx-int4+step` (the same, with
register_fused_hook(optimizer=...): across nodes the SGD step of each bucket's parameters taken in
flight, once that bucket is reduced; `steps` for the four), `backend` and `backend-mem` (DDP's own
all-reduce, no hook, on a group of every rank made with ddpx's backend, each with its own;
gradient_as_bucket_view, so each .grad is a view of its bucket: `backend` with
DDP_DISABLE_COMM_MEM=1, the buckets in ordinary memory, which ddpx copies in and out of its buffers;
`backend-mem` with DDP_DISABLE_COMM_MEM=0, the buckets in ddpx's arena, which it reduces where they
lie, zero-copy; the variable is set while DDP makes its buckets, at construction and at their
rebuild in the second step's forward, and put back after; a step after which a gradient lies
elsewhere than its bucket should stops the run, and the table says how many all-reduces the engine
ran zero-copy: some with the arena and none without, else exit status 1; `backend-mem` is left out
where the backend allocates no tensors: without an arena), and `none`, which is not a way to train:
a hook that communicates nothing (each rank keeps its own gradients), the step's floor that any
hook's time is read against (it is timed, not checked). The models start from the same seed, see the
same data and take turns step by step; a sample is one step on the slowest rank, started right after
a barrier. Reported: median and p10-p90 step time in ms, x vs default, and max |diff| of each
model's final parameters from the default model's with its tolerance: 64 roundings of the gradients
to the wire dtype (64 u_wire x the largest parameter change of the default model) and of the
parameters to float32 (64 u_fp32 x the largest parameter); PowerSGD's |diff| has no tolerance, as it
is not a rounding of the gradients. Parameters that differ across ranks, or from default's beyond
the tolerance, make the run exit with status 1 after the table. On the testbed (--link), each node's
local rank 0 reads its interface's byte counters around each step (from the barrier before it to one
after it): link MB/step is what a node sent per timed step, the mean over the steps and the nodes,
and bytes vs fp32 that over the `ddpx` hook's; S/R those bytes at the link's rate (tbf counts the
same bytes), the least time the link takes to carry them. No hook has anything to send before DDP
hands it the step's first bucket, which comes F ms into none's step (on the slowest rank, after
the forward and the last layers' backward): F + S/R is the least a hook's step can take on that
link, said under the table beside the step measured. Across nodes each ddpx hook's line says where
its step went beyond `none`'s: its engine's thread on node work (sums, hand-outs), waiting for the
link, and (the `+step` hooks) on the optimizer's steps it took up before those waits. CPU ms/step is
the CPU time a timed step took on every rank's threads (from each thread's schedstat, read after the
barrier that starts the step and after one that ends it), summed over the ranks, the mean over the
steps, and split by whose threads they are: the ranks' own (the main thread, torch's), ddpx's (named
"ddpx ..."), gloo's. Where none's steps already keep the cores busy, a hook's step over none's is at
least about its CPU over none's; beyond that, its ranks waited.
"""

import copy
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx
from ddpx._ext import extension
from ddpx_bench.common import (
    THREAD_KINDS,
    UNIT_ROUNDOFF,
    WIRE,
    cpu_share,
    environment,
    link_traffic,
    node_count,
    same_on_all_ranks,
    slowest_rank_stats,
    steps_in_turns,
    why_no_comm_memory,
)
from ddpx_bench.mode import Mode, choices_option, count, node_options
from ddpx_bench.models import GPT, MLP
from ddpx_bench.report import (
    PER_STEP,
    cpu_note,
    format_cpu,
    format_ratio,
    format_spread,
    format_table,
    pyplot,
    runs_line,
    save_figure,
    step_bars,
    tcp_line,
)

# A ddpx hook's name with this after it: the optimizer steps each bucket in flight.
IN_FLIGHT = "+step"
STEPPED_IN_FLIGHT = tuple(f"{hook}{IN_FLIGHT}"
                          for hook in ("ddpx", "ddpx-bf16", "ddpx-int8", "ddpx-int4"))
COMM_HOOKS = ("default", "fp16", "bf16", "powersgd-r1", "powersgd-r4", "ddpx", "ddpx-fp16",
              "ddpx-bf16", "ddpx-int8", "ddpx-int4", *STEPPED_IN_FLIGHT, "backend", "backend-mem",
              "none")
# What --comm_hooks takes for several hooks.
HOOK_SHORTHANDS = {"powersgd": ("powersgd-r1", "powersgd-r4"), "steps": STEPPED_IN_FLIGHT}
# torch's PowerSGD: hook name -> matrix_approximation_rank.
POWERSGD_RANKS = {"powersgd-r1": 1, "powersgd-r4": 4}
# The first step PowerSGD compresses (0-based): the earliest it takes with error feedback and warm
# start, whose memory needs the buckets DDP rebuilds after the first step.
POWERSGD_START = 2
# DDP's own all-reduce on a group with ddpx's backend, its buckets in ordinary memory or in ddpx's
# arena (comm memory): hook name -> whether comm memory is on.
BACKEND_HOOKS = {"backend": False, "backend-mem": True}
# How many roundings the final parameters of a hook may differ from the default hook's by.
PARAM_TOLERANCE_ROUNDINGS = 64


class Hooked(NamedTuple):
    """A DDP model with a comm hook, what the hook does, and the model's optimizer."""

    model: DDP
    describe: str
    optimizer: torch.optim.Optimizer


def sgd(lr: float):
    """The optimizer `ddpx-bench train` steps each model with: plain SGD of learning rate `lr`."""
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr)


def bench_train(args) -> dict:
    left_out, failures = {}, []
    torch.manual_seed(args.seed)
    initial = (GPT if args.model == "gpt" else MLP).with_params(args.params)
    first_bucket = FirstBucket()
    models = hooked_models(initial, args.comm_hooks, left_out, sgd(args.lr), first_bucket)
    traffic = link_traffic()
    engine_times = EngineTimes(models)
    cpu = {}
    samples = timed_steps(models, _train_batches(initial, args), args.warmup, args.steps, traffic,
                          (engine_times, first_bucket), cpu)
    rows = _train_rows(initial, models, samples, args, failures)
    for row in rows:
        spent = [sum(column) for column in zip(*cpu[row["hook"]][args.warmup:], strict=True)]
        row.update(cpu_share(*spent[:3]))
        row.update(_thread_cpu(spent[3:], args.steps))
    if traffic is not None:
        _add_link_bytes(rows, traffic, args.warmup)
    engine_times.add_to(rows, args.warmup)
    first_bucket.add_to(rows, args.warmup)
    notes = []
    if args.trace:
        trace(models, _train_batches(initial, args), args.trace)
        notes.append(f"trace: one more step of each hook, rank 0's, in {args.trace}")
    return {"rows": rows, "left_out": left_out, "notes": notes, "failures": failures}


def _thread_cpu(seconds: list[float], steps: int) -> dict:
    """cpu_<kind>_ms for each kind of THREAD_KINDS, and cpu_ms, their sum: the CPU time a timed
    step took on every rank's threads of that kind, summed over the ranks, the mean over the
    steps."""
    per_step = torch.tensor(seconds, dtype=torch.float64) * (1e3 / steps)
    dist.all_reduce(per_step)
    ms = dict(zip(THREAD_KINDS, per_step.tolist(), strict=True))
    return {**{f"cpu_{kind}_ms": ms[kind] for kind in THREAD_KINDS}, "cpu_ms": sum(ms.values())}


def trace(models: dict, batches: list[torch.Tensor], path: str) -> None:
    """One more step of each model (after the checks: learning rate 0, nothing moves) under
    torch.profiler on every rank, each rank's written as a Chrome trace (rank_trace_path): ddpx's
    ranges (ddpx::fused_hook on the autograd thread, ddpx::all_reduce (engine) and ddpx::waits
    for the link on its engine's) beside the backward's ops, each step under
    'ddpx-bench step: <hook>'. The ranks' traces side by side show which rank the others wait
    for, and why."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for name, (model, _, optimizer) in models.items():
            for group in optimizer.param_groups:
                group["lr"] = 0.0
            if dist.get_world_size() > 1:
                dist.barrier()
            with record_function(f"ddpx-bench step: {name}"):
                _step(model, optimizer, batches, 0)
    profiler.export_chrome_trace(rank_trace_path(path, dist.get_rank()))


def rank_trace_path(path: str, rank: int) -> str:
    """Where `--trace path` writes rank `rank`'s trace: rank 0's at `path`, rank r's beside it
    with .rank<r> before the suffix (trace.json, trace.rank1.json)."""
    if rank == 0:
        return path
    where = Path(path)
    return str(where.with_name(f"{where.stem}.rank{rank}{where.suffix}"))


class EngineTimes:
    """Where each step of a ddpx hook across nodes went on its engine's thread (the engine's
    cross_node_times, read around the step): its node work (sums, hand-outs, checks) and its waits
    for a chunk to come back over the link, beside the backward on the other threads."""

    def __init__(self, models: dict):
        self.engines = {}
        for name, (model, _, _) in models.items():
            if not name.startswith("ddpx"):
                continue
            engine = ddpx.engine.engine_for(model.process_group)
            if isinstance(engine, extension().ShmEngine) and engine.nodes > 1:
                self.engines[name] = engine
        self.seconds = {name: [] for name in self.engines}

    def timing(self, name: str, step):
        """`step` (of hook `name`), its engine's times read around each call where it has one."""
        if name not in self.engines:
            return step

        def timed(index: int) -> None:
            before = self.engines[name].cross_node_times
            step(index)
            after = self.engines[name].cross_node_times
            self.seconds[name].append(
                [after[k] - before[k] for k in ("node_s", "link_wait_s", "idle_s")])
        return timed

    def add_to(self, rows: list[dict], warmup: int) -> None:
        """engine_node_ms, engine_link_wait_ms, engine_idle_ms (the optimizer's steps it took up
        in its waits for the link): the median over the timed steps of the slowest rank's."""
        for row in rows:
            if row["hook"] not in self.engines:
                continue
            mine = torch.tensor(self.seconds[row["hook"]][warmup:]).median(0).values * 1e3
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
            row["engine_node_ms"], row["engine_link_wait_ms"], row["engine_idle_ms"] = mine.tolist()


class FirstBucket:
    """When in each step DDP handed the floor's hook (`none`) its first bucket, from the step's
    start: the forward and the backward of the last layers, before which no hook has anything to
    send. The `none` hook's state."""

    def __init__(self):
        self.start: float | None = None
        self.seconds: list[float] = []

    def timing(self, name: str, step):
        """`step` (of hook `name`), its start noted where the hook is `none`."""
        if name != "none":
            return step

        def timed(index: int) -> None:
            self.start = time.perf_counter()
            step(index)
        return timed

    def handed(self) -> None:
        """DDP handed the hook a bucket: the step's first, unless one came since its start."""
        if self.start is not None:
            self.seconds.append(time.perf_counter() - self.start)
            self.start = None

    def add_to(self, rows: list[dict], warmup: int) -> None:
        """first_bucket_ms on none's row: the median over the timed steps of the slowest rank's."""
        for row in rows:
            if row["hook"] == "none":
                seconds = torch.tensor(self.seconds[warmup:], dtype=torch.float64)
                dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
                row["first_bucket_ms"] = seconds.median().item() * 1e3


def hooked_models(initial: torch.nn.Module, hooks: list[str], left_out: dict,
                  optimizer: Callable[[DDP], torch.optim.Optimizer],
                  first_bucket: FirstBucket | None = None) -> dict:
    """A DDP copy of `initial` (on its device) per hook that works here, with its `optimizer`
    (and `none`'s hook telling `first_bucket` when its buckets come): name -> Hooked.
    tools/gpu_report.py uses it too."""
    device = next(initial.parameters()).device
    models = {}
    for name in hooks:
        if name in BACKEND_HOOKS:
            entry, why_not = _backend_model(initial, BACKEND_HOOKS[name])
            if entry is None:
                left_out[name] = why_not
            else:
                models[name] = Hooked(*entry, optimizer(entry[0]))
            continue
        model = DDP(copy.deepcopy(initial),
                    device_ids=[device.index] if device.type == "cuda" else None)
        stepper = optimizer(model)
        try:
            models[name] = Hooked(model, _register_hook(name, model, stepper, first_bucket),
                                  stepper)
        # NotImplementedError: a ddpx compression not built yet, or a backend that cannot
        # all-reduce bfloat16; TypeError: DDP refuses a hook.
        except (NotImplementedError, TypeError) as exc:
            left_out[name] = str(exc)
        except ValueError as exc:  # a compression this ddpx does not know yet
            if not (name.startswith("ddpx") and f"compression={_wire(name)!r}" in str(exc)):
                raise
            left_out[name] = str(exc).splitlines()[0]
    return models


class _BackendDDP(DDP):
    """DDP with its own all-reduce, over a group of every rank with ddpx's backend, each .grad a
    view of its bucket (gradient_as_bucket_view); the buckets in ddpx's arena (`comm_memory`,
    DDP_DISABLE_COMM_MEM=0: ddpx's all-reduce reads the peers' buckets where they lie) or in
    ordinary memory (DDP_DISABLE_COMM_MEM=1: it copies them through its buffers).

    DDP reads DDP_DISABLE_COMM_MEM whenever it allocates its buckets: when it is made, and when it
    rebuilds them in the order the gradients came, in the second step's forward. So the variable
    is set around both, as around every forward, and put back after; `check_buckets` raises
    unless every gradient lies where the buckets should."""

    def __init__(self, module: torch.nn.Module, group, comm_memory: bool):
        with environment(DDP_DISABLE_COMM_MEM="0" if comm_memory else "1"):
            super().__init__(module, process_group=group, gradient_as_bucket_view=True)
        self.comm_memory = comm_memory

    def forward(self, *inputs, **kwargs):
        with environment(DDP_DISABLE_COMM_MEM="0" if self.comm_memory else "1"):
            return super().forward(*inputs, **kwargs)

    def check_buckets(self, step: int) -> None:
        """Raise unless every gradient lies in ddpx's arena with comm memory, none without."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        held = sum(extension().arena_holds(grad) for grad in grads)
        if held != (len(grads) if self.comm_memory else 0):
            where = "in ddpx's arena" if self.comm_memory else "in ordinary memory"
            raise RuntimeError(
                f"rank {dist.get_rank()}: after step {step + 1}, {held} of {len(grads)} gradients "
                f"lie in ddpx's arena, but DDP's buckets should lie {where} (arena "
                f"{extension().arena_usage()})"
            )


def _backend_model(initial: torch.nn.Module, comm_memory: bool):
    """(a _BackendDDP copy of `initial` on a new group of every rank with ddpx's backend, what it
    does); or None and why it cannot run here. Each has a group, so its engine counts its own
    calls."""
    if next(initial.parameters()).device.type != "cpu":
        return None, "ddpx's backend serves CPU tensors"
    if "ddpx" not in dist.Backend.backend_list:
        return None, "this build of ddpx registers no torch.distributed backend 'ddpx'"
    group = dist.new_group(list(range(dist.get_world_size())), backend="ddpx")
    why_not = why_no_comm_memory(ddpx.backend_of(group)) if comm_memory else ""
    if why_not:
        return None, why_not
    model = _BackendDDP(copy.deepcopy(initial), group, comm_memory)
    where = "ddpx's arena" if comm_memory else "ordinary memory"
    flag = "0" if comm_memory else "1"
    return (model, f"DDP's all-reduce on a ddpx group, buckets in {where} "
                   f"(DDP_DISABLE_COMM_MEM={flag}), gradient_as_bucket_view"), ""


def timed_steps(models: dict, batches: list[torch.Tensor], warmup: int, steps: int,
                traffic=None, timings: tuple = (), cpu: dict | None = None) -> dict:
    """`warmup` + `steps` steps of every model (hooked_models') with its optimizer in turn, on
    `batches` in rotation: name -> this rank's seconds for each step after the warm-up
    (slowest_rank_stats makes them the slowest rank's); `traffic` (common.link_traffic's) counts
    each step's bytes on the link, `timings` (EngineTimes, FirstBucket) time each step's parts,
    `cpu` the machine's CPU time in each step, warm-up included (steps_in_turns).
    tools/gpu_report.py uses it too."""
    steps_of = {name: functools.partial(_step, model, optimizer, batches)
                for name, (model, _, optimizer) in models.items()}
    for timing in timings:
        steps_of = {name: timing.timing(name, step) for name, step in steps_of.items()}
    samples = steps_in_turns(steps_of, range(warmup + steps), f"world {dist.get_world_size()}",
                             batches[0].device, traffic, cpu)
    return {name: seconds[warmup:] for name, seconds in samples.items()}


def _register_hook(name: str, model: DDP, optimizer: torch.optim.Optimizer,
                   first_bucket: FirstBucket | None) -> str:
    """Register the comm hook `name` on `model` (stepping `optimizer` per bucket where the name
    says so; `none`'s state `first_bucket`); say what it does."""
    if name == "default":
        return "DDP's built-in all-reduce"
    if name == "none":
        model.register_comm_hook(first_bucket, _no_communication_hook)
        return "no communication (the floor; timed, not checked)"
    if name.startswith("ddpx"):
        in_flight = name.endswith(IN_FLIGHT)
        return ddpx.register_fused_hook(model, compression=_wire(name),
                                        optimizer=optimizer if in_flight else None).describe()
    if name in POWERSGD_RANKS:
        state = _InOrderState(powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=POWERSGD_RANKS[name],
            start_powerSGD_iter=POWERSGD_START, use_error_feedback=True, warm_start=True,
            random_seed=0))
        model.register_comm_hook(state, _powersgd_in_order_hook)
        return (f"torch powerSGD_hook, rank {POWERSGD_RANKS[name]}, error feedback, warm start, "
                f"from step {POWERSGD_START + 1}; a bucket at a time")
    if name == "bf16":
        _check_bfloat16_all_reduce(next(model.parameters()).device)
        model.register_comm_hook(dist.group.WORLD, _bf16_compress_any_backend_hook)
        return "torch bf16_compress_hook, through a wrapper (DDP refuses it by name off NCCL)"
    hook = getattr(default_hooks, f"{name}_compress_hook")
    model.register_comm_hook(dist.group.WORLD, hook)
    return f"torch {hook.__name__}"


class _InOrderState:
    """A hook's state (`hooked`), and the future of the last bucket it was given."""

    __slots__ = ("hooked", "last")

    def __init__(self, hooked):
        self.hooked = hooked
        self.last: torch.futures.Future | None = None


def _powersgd_in_order_hook(
    state: _InOrderState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's powerSGD_hook on `bucket` once the previous bucket's is done. The hook starts its
    P and Q all-reduces in callbacks, on the backend's threads, while DDP hands it the next bucket
    on the autograd thread: on gloo, whose ranks must start their collectives in the same order,
    the two race and the ranks' collectives mismatch. Waiting costs the overlap of one bucket's
    communication with the backward of the next."""
    if state.last is not None:
        state.last.wait()
    state.last = powerSGD_hook.powerSGD_hook(state.hooked, bucket)
    return state.last


def _bf16_compress_any_backend_hook(
    process_group, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook under another name: DDP refuses a hook named so unless NCCL
    2.10+ (or XCCL) is there, though gloo all-reduces bfloat16 tensors too (the `bf16` row's
    tolerance checks the result)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _check_bfloat16_all_reduce(device: torch.device) -> None:
    """Raise NotImplementedError unless the world's backend sums bfloat16 tensors on `device`:
    every rank probes alike, so they agree on what is left out."""
    probe = torch.ones(8, dtype=torch.bfloat16, device=device)
    try:
        dist.all_reduce(probe)
    except RuntimeError as exc:
        raise NotImplementedError(
            f"{dist.get_backend()} cannot all-reduce bfloat16 tensors here: "
            f"{str(exc).splitlines()[0]}") from None
    if not (probe == dist.get_world_size()).all():
        raise NotImplementedError(
            f"{dist.get_backend()} all-reduced 8 bfloat16 ones on {dist.get_world_size()} ranks "
            f"into {probe.tolist()}")


def _no_communication_hook(state: FirstBucket | None,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hands DDP the bucket as it is: each rank steps with its own gradients."""
    if state is not None:
        state.handed()
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _train_batches(initial: torch.nn.Module, args, count: int = 4) -> list[torch.Tensor]:
    """Random rows of the MLP's width, or random token ids of the GPT's context."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank())
    if isinstance(initial, GPT):
        shape = (args.batch_size, initial.context)
        return [torch.randint(initial.vocab, shape, generator=generator) for _ in range(count)]
    return [torch.randn(args.batch_size, initial.width, generator=generator) for _ in range(count)]


def _step(model: DDP, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
          index: int) -> None:
    optimizer.zero_grad()
    batch = batches[index % len(batches)]
    out = model(batch)
    loss = GPT.next_token_loss(out, batch) if batch.dtype == torch.long else out.square().mean()
    loss.backward()
    optimizer.step()
    check_step(model, index)


def check_step(model: DDP, index: int) -> None:
    """Raise where step `index` left a gradient of a `backend` or `backend-mem` model elsewhere
    than its bucket should lie; nothing for the other hooks."""
    if isinstance(model, _BackendDDP):
        model.check_buckets(index)  # a few lookups in the arena's map: microseconds


def _train_rows(initial, models: dict, samples: dict, args, failures: list[str]) -> list[dict]:
    checked = {name: entry for name, entry in models.items() if name != "none"}
    diffs = diffs_from_default(initial, checked)
    nodes = node_count()
    rows = []
    for name, (model, describe, _) in models.items():
        row = {
            "world_size": dist.get_world_size(),
            "nodes": nodes,
            "hook": name,
            "describe": describe,
            "params": sum(p.numel() for p in initial.parameters()),
            "model": type(initial).__name__,
            "batch_size": args.batch_size,
            "steps": args.warmup + args.steps,
            **slowest_rank_stats(samples[name]),
        }
        if isinstance(model, _BackendDDP):
            row.update(_zero_copy(model, failures, name))
        rows.append(row)
        if name not in checked:
            continue
        row["ranks_identical"] = same_on_all_ranks(model.module.parameters())
        row.update(diffs.get(name, {}))
        if not row["ranks_identical"]:
            failures.append(f"{name}: parameters differ across ranks")
        if diffs and row["tolerance"] is not None and not row["max_abs_diff"] <= row["tolerance"]:
            failures.append(
                f"{name}: parameters {row['max_abs_diff']:.3g} from default's, "
                f"tolerance {row['tolerance']:.3g}"
            )
    default_ms = next((row["median_ms"] for row in rows if row["hook"] == "default"), None)
    for row in rows:
        row["x_vs_default"] = default_ms / row["median_ms"] if default_ms else None
    return rows


def _add_link_bytes(rows: list[dict], traffic, warmup: int) -> None:
    """Each row's bytes on the link per timed step (LinkTraffic.per_step: a node's, the mean over
    the steps and the nodes), and their ratio to the `ddpx` (float32) hook's."""
    for row in rows:
        row.update(traffic.per_step(row["hook"], first=warmup))
    fp32 = next((row["link_bytes_per_step"] for row in rows if row["hook"] == "ddpx"), None)
    for row in rows:
        sent = row["link_bytes_per_step"]
        row["bytes_vs_fp32"] = sent / fp32 if fp32 and sent is not None else None


def _zero_copy(model: "_BackendDDP", failures: list[str], name: str) -> dict:
    """This rank's all-reduces on the model's group over the run, and how many of them ddpx's
    engine ran zero-copy: some with comm memory (not the first on a new bucket, which the peers map
    during it), none without; else a failure."""
    backend = ddpx.backend_of(model.process_group)
    calls = backend.routes().get("all_reduce", {}).get("engine", 0)
    zero_copy = backend.engine.zero_copy_calls if backend.engine is not None else 0
    if (zero_copy > 0) != model.comm_memory:
        failures.append(f"{name}: {zero_copy} of {calls} all-reduces zero-copy")
    return {"all_reduces": calls, "zero_copy_calls": zero_copy}


def diffs_from_default(initial: torch.nn.Module, models: dict) -> dict:
    """Per hook, max |diff| of its final parameters from the default model's, and a tolerance
    (None for PowerSGD, which is not a rounding of the gradients). `models`: hook name -> (DDP
    model, description); `initial` is on the models' device. tools/gpu_report.py uses it too."""
    if "default" not in models:
        return {}
    default = models["default"].model.module
    moved = _max_abs_diff(default, initial)
    largest = max(p.abs().max().item() for p in default.parameters())
    diffs = {}
    for name, (model, _, _) in models.items():
        # Gradients are rounded to the wire dtype, and updated parameters to float32.
        rounding = UNIT_ROUNDOFF[_wire(name)] * moved + UNIT_ROUNDOFF[None] * largest
        diffs[name] = {
            "max_abs_diff": _max_abs_diff(model.module, default),
            "tolerance": None if name in POWERSGD_RANKS else PARAM_TOLERANCE_ROUNDINGS * rounding,
        }
    return diffs


def _wire(name: str) -> str | None:
    """The wire dtype of hook `name`, stepping in flight or not."""
    return WIRE[name.removesuffix(IN_FLIGHT)]


def _max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


def _floors(rows: list[dict]) -> dict:
    """(link, world size) -> none's row of that cell."""
    return {(row["link"], row["world_size"]): row for row in rows if row["hook"] == "none"}


def least_step_lines(rows: list[dict]) -> list[str]:
    """Each hook's least step on its link beside its measured step, both against none's."""
    if not any("least_step_ms" in row for row in rows):
        return []
    floors = _floors(rows)
    lines = ["least step: none's first bucket comes F ms into its step (the forward and the "
             "last layers' backward), before which no hook has anything to send, and then a "
             "hook's bytes take S/R on the link:"]
    for row in rows:
        floor = floors.get((row["link"], row["world_size"]))
        if "least_step_ms" not in row or row is floor:
            continue
        lines.append(
            f"  {row['hook']} at {row['link']}: {floor['first_bucket_ms']:.0f} + "
            f"{row['link_floor_ms']:.0f} = {row['least_step_ms']:.0f} ms = "
            f"{row['least_step_ms'] / floor['median_ms']:.2f}x none's step; measured "
            f"{row['median_ms'] / floor['median_ms']:.2f}x")
    return lines


class Train(Mode):
    name = "train"
    help = "time DDP training steps"
    measured = {"timing": PER_STEP}
    cell_keys = ("world_size", "hook")
    bigger_is_better = ("x_vs_default",)

    def add_arguments(self, parser):
        choices_option(parser, "--comm_hooks", COMM_HOOKS, shorthands=HOOK_SHORTHANDS)
        parser.add_argument("--params", type=count, default="25M",
                            help="parameters of the MLP, with K/M suffixes (powers of 1000)")
        parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                            help="mlp: ddpx_bench.models.MLP; gpt: ddpx_bench.models.GPT, "
                                 "GPT-2's blocks (width 512, --batch_size sequences of 128 "
                                 "random tokens)")
        parser.add_argument("--batch_size", type=int, default=16)
        parser.add_argument("--steps", type=int, default=12, help="timed steps per hook")
        parser.add_argument("--warmup", type=int, default=2,
                            help="untimed steps per hook (PowerSGD compresses from the third)")
        parser.add_argument("--lr", type=float, default=0.01)
        parser.add_argument("--trace", metavar="PATH",
                            help="after the run, profile one more step of each hook and write "
                                 "rank 0's Chrome trace (chrome://tracing, Perfetto) here, rank "
                                 "r's beside it as NAME.rank<r>.json")
        node_options(parser)

    def run(self, args):
        return bench_train(args)

    def add_link_figures(self, rows):
        """Each row's link floor (link_floor_ms: its bytes on the link at the link's rate, S/R)
        and the least its step can take (least_step_ms): none's first bucket, then those bytes."""
        from ddpx_bench.testbed import bits_per_second  # only where --link ran

        floors = _floors(rows)
        for row in rows:
            sent = row.get("link_bytes_per_step")
            if row["link"] == "none" or sent is None:
                continue
            row["link_floor_ms"] = sent * 8 / bits_per_second(row["link"]) * 1e3
            floor = floors.get((row["link"], row["world_size"]))
            if floor is not None:
                row["least_step_ms"] = floor["first_bucket_ms"] + row["link_floor_ms"]

    def table(self, rows: list[dict]) -> list[str]:
        runs = rows[0].get("runs")
        worst = [
            ("worst ms", ">9", lambda row: f"{row['worst_median_ms']:.1f}"),
            ("worst x", ">7", lambda row: format_ratio(row.get("worst_x_vs_default"))),
        ]
        # Three digits however small: PowerSGD's bytes are a small fraction of float32's.
        link = [
            ("link MB/step", ">12", lambda row: "-" if row.get("link_bytes_per_step") is None
             else f"{row['link_bytes_per_step'] / 1e6:#.3g}"),
            ("bytes vs fp32", ">13", lambda row: "-" if row.get("bytes_vs_fp32") is None
             else f"{row['bytes_vs_fp32']:#.3g}"),
            ("S/R ms", ">6", lambda row: "-" if row.get("link_floor_ms") is None
             else f"{row['link_floor_ms']:.0f}"),
        ]
        lines = format_table([
            ("world", ">5", lambda row: row["world_size"]),
            ("hook", "<14", lambda row: row["hook"]),
            ("median ms", ">10", lambda row: f"{row['median_ms']:.1f}"),
            ("p10-p90 ms", ">13", lambda row: format_spread(row, 1)),
            ("x vs default", ">12", lambda row: format_ratio(row["x_vs_default"])),
            *(worst if runs else []),
            # The floor, none, is not checked: no |diff| and no tolerance.
            ("max |diff|", ">10",
             lambda row: f"{row['max_abs_diff']:.2e}" if "max_abs_diff" in row else ""),
            # PowerSGD's |diff| has no tolerance: it is not a rounding of the gradients.
            ("tolerance", ">9", lambda row: "" if "max_abs_diff" not in row else
             "-" if row["tolerance"] is None else f"{row['tolerance']:.2e}"),
            *(link if any("link_bytes_per_step" in row for row in rows) else []),
            ("CPU busy/si %", ">13", format_cpu),
            ("CPU ms/step", ">11", lambda row: f"{row['cpu_ms']:.0f}"),
            ("path", "", lambda row: row["describe"] + (
                f"; {row['zero_copy_calls']} of {row['all_reduces']} all-reduces zero-copy"
                if "zero_copy_calls" in row else "")),
        ], rows)
        lines.append(
            f"{rows[0].get('model', 'MLP')} of {rows[0]['params']} parameters, batch "
            f"{rows[0]['batch_size']} per rank, "
            f"{rows[0]['steps']} steps; max |diff|: final parameters vs default's"
        )
        if runs:
            lines.append(runs_line(runs, "x vs default"))
        nodes = rows[0].get("nodes", 1)
        if nodes > 1:
            lines.append(f"{rows[0]['world_size']} ranks on {nodes} nodes")
        if any("link" in row for row in rows):
            lines.append(tcp_line(rows))
        floor = next((row["median_ms"] for row in rows if row["hook"] == "none"), None)
        for row in rows:
            if "engine_node_ms" in row:
                over = f"{row['median_ms'] - floor:.0f} ms over none's, " if floor else ""
                steps = (f", {row['engine_idle_ms']:.0f} ms on optimizer steps before those waits"
                         if row["hook"].endswith(IN_FLIGHT) else "")
                lines.append(
                    f"{row['hook']}: {over}its engine's thread {row['engine_node_ms']:.0f} ms "
                    f"on node work, {row['engine_link_wait_ms']:.0f} ms waiting for the link"
                    f"{steps} (median step, slowest rank)")
        lines.append(cpu_note("the hook's timed steps"))
        lines.append("CPU ms/step: what a timed step took on a core, every rank's threads summed "
                     "(/proc/self/task/*/schedstat), the mean over the steps; by whose threads:")
        floor_cpu = next((row["cpu_ms"] for row in rows if row["hook"] == "none"), None)
        for row in rows:
            versus = f" = {row['cpu_ms'] / floor_cpu:.2f}x none's" if floor_cpu else ""
            lines.append(
                f"  {row['hook']}: {row['cpu_ms']:.0f} ms{versus}: the ranks' own threads "
                f"{row['cpu_rank_ms']:.0f}, ddpx's {row['cpu_ddpx_ms']:.0f}, gloo's "
                f"{row['cpu_gloo_ms']:.0f}")
        if any("link_bytes_per_step" in row for row in rows):
            lines.append("link MB/step: what a node sent per timed step (its interface's tx "
                         "counter, headers and ACKs included), mean over the steps and the "
                         "nodes; bytes vs fp32: / the ddpx hook's; S/R: those bytes at the "
                         "link's rate")
        lines += least_step_lines(rows)
        return lines

    def plot(self, rows: list[dict], path: Path) -> None:
        plt = pyplot()
        world_sizes = sorted({row["world_size"] for row in rows})
        hooks = list(dict.fromkeys(row["hook"] for row in rows))
        figure, ax = plt.subplots(figsize=(2 + 1.2 * len(hooks) * len(world_sizes), 4.5))
        step_bars(ax, rows, "hook")
        ax.set(ylabel="ms per training step (median, p10-p90)", title="DDP step time by comm hook")
        ax.legend()
        save_figure(figure, path)


MODE = Train()
