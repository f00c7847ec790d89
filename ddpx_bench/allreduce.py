"""`ddpx-bench allreduce`: each engine (ddpx's, the peers', the copy floor) checked against a
float64 sum, then timed in turns, cell by cell; on a shaped link, the link's bound and ddpx's cost
model beside each time.

On 2 cores, about 1.75 minutes at the defaults, more with the peers. The peers it compares with,
OpenMPI (through mpi4py) and DeepSpeed, are optional: `pip install -e ".[peers]"`. --quick
answers in well under a minute with what every install has: 2 ranks, DDP's bucket sizes, gloo,
ddpx and the copy floor, fewer samples, one launch (its options: `ddpx-bench allreduce --help`);
options given beside it win (`--quick --engines gloo,ddpx,ddpx-bf16,copy`), and the table's
header says that it was quick and what the full run is.

    ddpx-bench allreduce --quick
    ddpx-bench allreduce --json bench_out/allreduce.json --plot bench_out/allreduce.png
    ddpx-bench allreduce --world_sizes 2 --sizes 4K,1M --iters 5 --min_time 0.1
    ddpx-bench allreduce --world_sizes 4 --nodes 2    # as if on two machines
    ddpx-bench allreduce --sizes 4K,1M --engines gloo,ddpx,mpi,deepspeed,copy

In detail: one in-place sum of a float32 tensor of each of --sizes (bytes; K, M, G are powers of
1024) on each of --world_sizes, by each engine: `gloo` (torch.distributed.all_reduce), `ddpx`
(ddpx.all_reduce), `ddpx-arena` (ddpx.all_reduce of a tensor that lies in ddpx's arena on every
rank, made once per size with ddpx._ext.extension().arena_empty: the ranks read each other's
tensors where they lie, copying nothing in or out; the check copies its random inputs in and the
sum out, and a call that the engine does not count as zero-copy, in the check or the timing, stops
the run), `ddpx-fp16` and `ddpx-bf16` (ddpx.all_reduce with that compression), `ddpx-int8` and
`ddpx-int4` (the fused hook's compression="int8" and "int4" all-reduce, as on a bucket's first step,
with no residual yet: block-scaled integers between nodes, float32 within one; of an arena tensor,
as the hook's buckets lie, where the arena works), the peers
`mpi` (OpenMPI's MPI_Allreduce through mpi4py, in place on the tensor's own memory) and
`deepspeed` (DeepSpeed's CPU shared-memory all-reduce, the op deepspeed.comm calls for
inference_all_reduce, called directly; its first use compiles it, about a minute, into
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, before any timing), and `copy`, which is
not an all-reduce: every rank at once copies its tensor into a buffer of the same size, the least
memory traffic (read the tensor, write a result) any in-place all-reduce needs, a floor to read
the others against (it is timed, not checked). Five more, not run unless named, ddpx with
another schedule than its default (one-shot up to 32 KiB; above it, while a rank waits for its
CPU, blocks that any rank sums for all straight from and into the ranks' tensors, else slices
in 256 KiB steps through shared memory; docs/under-load.md): `ddpx-shared`, the blocks on any
machine; `ddpx-narrow`, the slices on any machine; `ddpx-oneshot`, every rank sums whole blocks
up to 4 MiB; `ddpx-wide`, slices in 4 MiB steps; `ddpx-timed`, local rank 0 timing narrow, wide
and one-shot per size as it runs. Engines
that do not work here are left out with a note (the peers when not installed;
`deepspeed` with --nodes, as its op spans one node only, while `gloo` and `mpi` reduce the
simulated nodes as one machine; the fixed schedules with --nodes, which always split).
MPI needs ranks that mpirun starts: when `mpi` runs, ddpx-bench starts each world size with
`mpirun --oversubscribe --bind-to none -np W python -m ddpx_bench <the same arguments>` instead of
torch.multiprocessing, and every engine runs in those ranks (so under a launcher `mpi` is left
out). In each cell (world size, size):
  - each engine reduces random inputs once and is compared with a float64 sum; a wrong sum stops
    the run with exit status 1;
  - then it reduces a zero-filled tensor (repeated in-place sums of zeros stay finite) in batches
    of calls; each batch starts right after a barrier, and a sample is the slowest rank's mean time
    per call in the batch;
  - every engine gets --iters samples, the batches sized so they last --min_time seconds together,
    and the engines take turns sample by sample so that they share the machine's conditions.
Reported: median and p10-p90 of the samples in ms, GB/s = bytes / median time / 1e9,
x vs gloo = gloo's median / the engine's median (bigger is faster), and x vs best peer = the
fastest peer's median (of gloo, mpi and deepspeed, those that ran; no such column when gloo is the
only one) / the engine's, and / floor = the engine's median / copy's (where copy ran; below 1
moves less memory than a copy; copy's own row, the floor, has no ratios). With --nodes N
the spawned ranks are split into N nodes (GROUP_RANK, as a launcher sets it), so ddpx reduces
hierarchically as on N machines, and the table adds the bytes ddpx's engines sent across nodes per
call, summed over the ranks (as bandwidth-optimal collectives send them: 2(N-1)/N of the data for
an all-reduce, (N-1)/N for an all-to-all or an all-gather). Under a launcher its nodes count.
"""

import functools
import importlib.util
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddpx
from ddpx._cross_node import cross_chunk_bytes
from ddpx._ext import extension
from ddpx.engine import QUANTIZED, engine_for, wire_dtype
from ddpx_bench import costmodel
from ddpx_bench.common import (
    MPI_WORKDIR,
    PEERS,
    UNIT_ROUNDOFF,
    WIRE,
    add_if_it_works,
    engine_rows,
    environment,
    format_size,
    mpirun_path,
    node_count,
    progress,
    random_input,
    say,
    timed_in_turns,
)
from ddpx_bench.mode import Mode, choices_option, node_options, size_list, timing_options
from ddpx_bench.report import (
    PER_CALL,
    cpu_note,
    format_cpu,
    format_ms,
    format_ratio,
    format_spread,
    format_table,
    runs_line,
    save_figure,
    tcp_line,
    world_size_panels,
)

# ddpx with another schedule than its default (one-shot up to 32 KiB; above it shared blocks on
# a busy machine, narrow steps on an idle one): (the engine's settings, why a run across nodes
# leaves it out).
_NO_ONE_SHOT = "across nodes every message is split: there is no one-shot"
_NARROW_ACROSS = "across nodes every step is narrow"
SCHEDULES = {
    "ddpx-oneshot": ({"one_shot_bytes": 4096 * 1024}, _NO_ONE_SHOT),
    "ddpx-wide": ({"schedule": "wide"}, _NARROW_ACROSS),
    "ddpx-timed": ({"schedule": "timed", "one_shot_bytes": 4096 * 1024}, _NARROW_ACROSS),
    "ddpx-narrow": ({"schedule": "narrow"}, _NARROW_ACROSS),
    "ddpx-shared": ({"schedule": "shared"}, _NARROW_ACROSS),
}
# ddpx's all-reduce of a tensor that lies in ddpx's arena on every rank: the zero-copy path.
ARENA = "ddpx-arena"
ENGINES = ("gloo", "ddpx", ARENA, "ddpx-fp16", "ddpx-bf16", "ddpx-int8", "ddpx-int4", "mpi",
           "deepspeed", "copy", *SCHEDULES)
PEERS_INSTALL = 'pip install -e ".[peers]"'
# Set by ddpx-bench for the ranks it starts, once it has built DeepSpeed's op: "" when it built,
# else why not (so that no rank builds it again).
DEEPSPEED_BUILT = "DDPX_BENCH_DEEPSPEED_BUILT"


def bench_allreduce(args) -> dict:
    left_out = {}
    nodes = node_count()
    engines = _allreduce_engines(args.engines, left_out, nodes)
    world_size, rows, started = dist.get_world_size(), [], time.perf_counter()
    for index, size in enumerate(args.sizes):
        cell = f"world {world_size}, {format_size(size)} (cell {index + 1}/{len(args.sizes)})"
        progress(
            f"{cell}: checking {', '.join(engines)}; {time.perf_counter() - started:.0f} s elapsed"
        )
        rows += _bench_cell(size, engines, args, cell, nodes)
    # The path, and the schedule the engine chose when it was made (ddpx.engine), of this run.
    notes = [f"ddpx on {world_size} ranks: {engine_for().describe()}"] if "ddpx" in engines else []
    return {"rows": rows, "left_out": left_out, "notes": notes, "failures": []}


def _cross_node_bytes() -> int | None:
    """What ddpx's engine of the world has sent to other nodes so far, summed over the ranks;
    None for the process-group fallback, which does not count them."""
    engine = engine_for()
    if not isinstance(engine, extension().ShmEngine):
        return None
    total = torch.tensor([engine.cross_node_bytes], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total.item())


def _allreduce_engines(requested: list[str], left_out: dict, nodes: int) -> dict:
    """The requested engines that work here, by name; why the others do not goes in `left_out`."""
    peers = {"mpi": _mpi_engine, "deepspeed": functools.partial(_deepspeed_engine, nodes)}
    engines = {}
    for name in requested:
        if name == "gloo":
            engines[name] = dist.all_reduce
        elif name == "copy":
            engines[name] = _CopyFloor()
        elif name == ARENA:
            engine, why_not = _arena_engine(ddpx.all_reduce)
            if engine is None:
                left_out[name] = why_not
            else:
                engines[name] = engine
        elif name in peers:
            engine, why_peer_not = peers[name]()
            if engine is None:
                left_out[name] = why_peer_not
            else:
                add_if_it_works(engines, name, engine, left_out)
        elif name in SCHEDULES:
            settings, across = SCHEDULES[name]
            if nodes > 1:
                left_out[name] = across
                continue
            group = dist.new_group(list(range(dist.get_world_size())))
            for attribute, value in settings.items():
                setattr(engine_for(group), attribute, value)
            add_if_it_works(engines, name, functools.partial(ddpx.all_reduce, group=group),
                            left_out)
        elif wire_dtype(WIRE[name]) in QUANTIZED:
            # The hook's buckets lie in the arena: so does this engine's tensor, where it can.
            quantized = functools.partial(_quantized_all_reduce, wire=WIRE[name])
            engine, _ = _arena_engine(quantized)
            add_if_it_works(engines, name, engine or quantized, left_out)
        else:
            add_if_it_works(
                engines, name, functools.partial(ddpx.all_reduce, compression=WIRE[name]), left_out
            )
    return engines


def _quantized_all_reduce(tensor: torch.Tensor, wire: str) -> None:
    """The hook's int8 (int4) all-reduce on the world's engine, as on a bucket's first step (no
    residual yet): ddpx.all_reduce has neither, which need the hook's error feedback."""
    engine_for().run(tensor, 1.0, wire_dtype(wire), f"ddpx-bench {wire} all-reduce")


def _mpi_engine():
    """The `mpi` engine: OpenMPI's in-place sum through mpi4py; or None and why it cannot run."""
    if MPI_WORKDIR not in os.environ:
        why_not = why_no_mpi() or "needs ranks started by ddpx-bench's mpirun, not a launcher's"
        return None, why_not
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (dist.get_rank(), dist.get_world_size()):
        raise RuntimeError("internal: MPI's ranks are not torch.distributed's")

    def mpi(tensor: torch.Tensor) -> None:
        world.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM)  # a view: the tensor's memory

    return mpi, ""


def why_no_mpi() -> str:
    """Why the `mpi` engine cannot run here, or "" if it can."""
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed ({PEERS_INSTALL})"
    if mpirun_path() is None:
        return f"no mpirun found ({PEERS_INSTALL} installs OpenMPI's)"
    return ""


def _deepspeed_engine(nodes: int):
    """The `deepspeed` engine: DeepSpeed's CPU shared-memory all-reduce, the op that
    deepspeed.comm calls for inference_all_reduce, called directly; or None and why it cannot run.
    """
    if nodes > 1:
        return None, f"DeepSpeed's shared-memory all-reduce spans one node, not {nodes}"
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # One rank per machine loads it first: the first load builds it, the others find it built.
    loads_first = os.environ.get("LOCAL_RANK", str(rank)) == "0"
    if loads_first:
        # Under a launcher no parent has built it before.
        op, why_not = _deepspeed_op() if DEEPSPEED_BUILT in os.environ else _build_deepspeed_op()
    dist.barrier()
    if not loads_first:
        op, why_not = _deepspeed_op()
    if op is not None and op.vector_kernel_level() < 1:
        why_not = "DeepSpeed's float32 shared-memory kernels need AVX2"
    # A rank that initialises waits for every other rank's segment: all of them, or none.
    reasons = [""] * world_size
    dist.all_gather_object(reasons, why_not)
    why_not = next((why for why in reasons if why), "")
    if why_not:
        return None, why_not
    # The op names its segments after MASTER_ADDR and MASTER_PORT: a name of this run's own.
    run = [f"ddpx-bench-{os.getpid()}"]
    dist.broadcast_object_list(run, src=0)
    with environment(LOCAL_SIZE=str(world_size), MASTER_ADDR=run[0], MASTER_PORT="0"):
        op.initialize(world_size, rank)  # creates this rank's segment, maps every rank's
    dist.barrier()
    # Every rank has mapped every segment: unlink them now, so that no run leaves any behind.
    for segment in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{run[0]}_0_{rank}"):
        segment.unlink()
    return torch.ops.deepspeed.inference_all_reduce_, ""


@functools.cache
def _deepspeed_op():
    """DeepSpeed's CPU shared-memory all-reduce op module (its first load builds it, about a
    minute, into TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); or None and why not."""
    if os.environ.get(DEEPSPEED_BUILT):
        return None, os.environ[DEEPSPEED_BUILT]
    if importlib.util.find_spec("deepspeed") is None:
        return None, f"deepspeed is not installed ({PEERS_INSTALL})"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else it looks for GPUs first, and warns
    try:
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None:
            return None, "this DeepSpeed has no ShareMemCommBuilder for the CPU"
        return builder.load(verbose=False), ""
    # A build fails in many ways: no compiler or ninja, a compile error, an unsupported CPU.
    except Exception as exc:
        return None, f"DeepSpeed's shared-memory op does not build: {str(exc).splitlines()[0]}"


def _build_deepspeed_op():
    """_deepspeed_op(), saying on stderr that it may build the op, and how long it took."""
    if importlib.util.find_spec("deepspeed") is None:
        return _deepspeed_op()
    say(
        "loading DeepSpeed's shared-memory all-reduce op; its first load builds it (about a "
        "minute) into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)"
    )
    started = time.perf_counter()
    op, why_not = _deepspeed_op()
    outcome = "loaded" if op else f"left out ({why_not})"
    say(f"DeepSpeed's op {outcome} after {time.perf_counter() - started:.0f} s")
    return op, why_not


def _arena_engine(reduce):
    """An engine that reduces arena tensors with `reduce` (as `ddpx-arena` does with
    ddpx.all_reduce), once it has reduced a small one zero-copy on every rank; or None and why
    it cannot run here (the same on every rank)."""
    world = engine_for()
    why_not = ""
    if not isinstance(world, extension().ShmEngine):
        why_not = f"ddpx has no shared-memory engine here, so no arena ({world.describe()})"
    elif not extension().arena_usage()["usable"]:
        why_not = f"ddpx's arena cannot be made here: {extension().arena_usage()['why_not']}"
    reasons = [""] * dist.get_world_size()
    dist.all_gather_object(reasons, why_not)
    why_not = next((why for why in reasons if why), "")
    if why_not:
        return None, why_not
    engine = _ArenaAllreduce(reduce)
    try:
        # Where the ranks cannot reach each other's memory (ptrace rules), arena tensors are
        # reduced the copy way: the engine says why in its description.
        engine.check(torch.zeros(8), "probing")
    except _NotZeroCopy as exc:
        return None, f"ddpx's all-reduce of arena tensors copies here ({exc}; {world.describe()})"
    return engine, ""


class _NotZeroCopy(RuntimeError):
    """A ddpx-arena call that ddpx's engine did not count as zero-copy, raised on every rank."""


class _ArenaAllreduce:
    """The `ddpx-arena` engine: ddpx.all_reduce (or another `reduce` on the world's engine) of a
    tensor in ddpx's arena on every rank, which the ranks sum reading each other's tensors where
    they lie, copying nothing in or out.

    It reduces a tensor of its own, made with arena_empty once per size (and dtype) of the tensor
    it is called with, which it leaves untouched: the timed calls never copy. A new tensor is
    zeroed (repeated in-place sums of zeros stay finite) and reduced once, so that every peer has
    mapped its chunk (a peer maps a chunk in the first call that names it) before a call counts.
    `check` reduces given data through it; `require_zero_copy` raises unless the engine counted
    every call of every such engine since as zero-copy.
    """

    calls = 0  # of every instance's __call__, for require_zero_copy: they share one engine

    def __init__(self, reduce):
        self.engine = engine_for()
        self.reduce = reduce
        self.tensor = torch.empty(0)

    def __call__(self, tensor: torch.Tensor) -> None:
        self.ready(tensor)
        self.reduce(self.tensor)
        _ArenaAllreduce.calls += 1

    def ready(self, like: torch.Tensor) -> None:
        """Makes the arena tensor for `like`'s size and dtype, and reduces it once, if it has
        none yet."""
        if self.tensor.numel() == like.numel() and self.tensor.dtype == like.dtype:
            return
        self.tensor = torch.empty(0)  # the previous size's back to the arena first
        tensor = extension().arena_empty(like.numel(), like.dtype).zero_()
        self.reduce(tensor)
        self.tensor = tensor

    def counts(self) -> tuple[int, int]:
        """(the engine's zero-copy calls, every such engine's calls) so far, for
        require_zero_copy."""
        return self.engine.zero_copy_calls, _ArenaAllreduce.calls

    def check(self, tensor: torch.Tensor, what: str) -> None:
        """Sum `tensor` in place over the ranks through the arena tensor of its size (copied into
        it and back out: checked, not timed), which is zeroed again after; raise on every rank
        unless the call went zero-copy."""
        self.ready(tensor)
        self.tensor.copy_(tensor)
        counts = self.counts()
        self(self.tensor)
        self.require_zero_copy(counts, what)
        tensor.copy_(self.tensor)
        self.tensor.zero_()

    def require_zero_copy(self, counts: tuple[int, int], what: str) -> None:
        """Raise on every rank unless the engine counted each of this engine's calls since
        `counts` (of counts()) as zero-copy on every rank: a row labelled ddpx-arena never times
        the copy path."""
        zero_copy, calls = (now - then for now, then in zip(self.counts(), counts, strict=True))
        fewest = torch.tensor([zero_copy - calls], dtype=torch.float64)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN)
        if fewest.item() < 0:
            holds = extension().arena_holds(self.tensor)
            raise _NotZeroCopy(
                f"{ARENA}: {what}: an all-reduce of arena tensors went the copy path on some rank "
                f"(this rank: {zero_copy} zero-copy of {calls} calls; its tensor "
                f"{'lies' if holds else 'does not lie'} in its arena; arena "
                f"{extension().arena_usage()})"
            )


class _CopyFloor:
    """The `copy` engine: reads the tensor and writes a buffer of its size, nothing else."""

    def __init__(self):
        self.buffer = torch.empty(0)

    def __call__(self, tensor: torch.Tensor) -> None:
        if self.buffer.shape != tensor.shape:
            self.buffer = torch.empty_like(tensor)
        self.buffer.copy_(tensor)


def _bench_cell(size: int, engines: dict, args, cell: str, nodes: int) -> list[dict]:
    errors = _check_engines(size, engines, args.seed, count_bytes=nodes > 1)
    arena = next((e for e in engines.values() if isinstance(e, _ArenaAllreduce)), None)
    counts = arena.counts() if arena else None
    samples, calls, cpu = timed_in_turns(engines, torch.zeros(size // 4), args, cell)
    if arena:
        arena.require_zero_copy(counts, f"timing {cell}")
    rows = engine_rows(
        {"world_size": dist.get_world_size(), "nodes": nodes, "size_bytes": size}, samples,
        lambda name: {"calls_per_sample": calls[name], "samples": args.iters, **cpu[name],
                      **errors[name]})
    gloo = next((row["median_ms"] for row in rows if row["engine"] == "gloo"), None)
    peers = {row["engine"]: row["median_ms"] for row in rows if row["engine"] in PEERS}
    best_peer = min(peers, key=peers.get, default=None)
    floor = next((row["median_ms"] for row in rows if row["engine"] == "copy"), None)
    for row in rows:
        row["gb_per_s"] = size / row["median_ms"] / 1e6
        # copy is the floor the engines are read against, not an all-reduce to rank with them.
        engine = row["engine"] != "copy"
        row["x_vs_gloo"] = gloo / row["median_ms"] if gloo and engine else None
        row["best_peer"] = best_peer
        row["x_vs_best_peer"] = (peers[best_peer] / row["median_ms"]
                                 if best_peer and engine else None)
        row["x_floor"] = row["median_ms"] / floor if floor and engine else None
    return rows


def _check_engines(size: int, engines: dict, seed: int, count_bytes: bool) -> dict:
    """Reduce random data once with each engine; raise on every rank if any sum is off. With
    `count_bytes`, also what each ddpx engine sent across nodes for it."""
    world_size, numel = dist.get_world_size(), size // 4
    reference = torch.zeros(numel, dtype=torch.float64)
    for rank in range(world_size):
        reference += random_input(seed, rank, numel)
    mine = random_input(seed, dist.get_rank(), numel)
    errors = {}
    for name, engine in engines.items():
        if name == "copy":
            errors[name] = {"max_abs_error": None, "tolerance": None, "inter_node_bytes": None}
            continue
        result = mine.clone()
        if isinstance(engine, _ArenaAllreduce):
            engine.ready(result)  # its first call, which maps the peers' tensors, goes uncounted
        sent = _cross_node_bytes() if count_bytes and name.startswith("ddpx") else None
        if isinstance(engine, _ArenaAllreduce):
            engine.check(result, f"checking {format_size(size)} on {world_size} ranks")
        else:
            engine(result)
        if sent is not None:
            sent = _cross_node_bytes() - sent
        error = torch.tensor([(result.double() - reference).abs().max().item()])
        error = error.nan_to_num(nan=math.inf)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        # Inputs lie in [-1, 1), so every partial sum does too times world_size: each of the
        # world_size + 1 roundings (to the wire, while summing, back to float32) errs by at most
        # u * world_size.
        tolerance = (world_size + 1) * UNIT_ROUNDOFF[WIRE[name]] * world_size
        if not error.item() <= tolerance:
            raise RuntimeError(
                f"{name} returned a wrong sum for {format_size(size)} on {world_size} ranks: "
                f"max abs error {error.item():.3g} > tolerance {tolerance:.3g}"
            )
        errors[name] = {
            "max_abs_error": error.item(),
            "tolerance": tolerance,
            "inter_node_bytes": sent,
        }
    return errors


def link_bound_ms(row: dict, bits_per_s: float) -> float:
    """The least time an all-reduce of the row's message over its nodes takes on a link of
    `bits_per_s` per node and direction: each node must send 2(N-1)/N of the message, in the
    engine's wire dtype (the bound of a bandwidth-optimal all-reduce between N nodes)."""
    sent = costmodel.bytes_per_node(row["size_bytes"], row["nodes"], _wire_bytes(row["engine"]))
    return sent * 8 / bits_per_s * 1e3


def add_model(rows: list[dict]) -> None:
    """ddpx_bench.costmodel's time for each ddpx row on a shaped link, from the same engine's time
    on the unshaped one (--link none) and the link's measured TCP rate."""
    unshaped = {(row["world_size"], row["engine"], row["size_bytes"]): row["median_ms"]
                for row in rows if row["link"] == "none"}
    for row in rows:
        node_ms = unshaped.get((row["world_size"], row["engine"], row["size_bytes"]))
        if row["link"] == "none" or node_ms is None or not row["engine"].startswith("ddpx"):
            continue
        row["model_ms"] = costmodel.hierarchical_ms(
            row["size_bytes"], row["nodes"], row["tcp_bits_per_s"], node_ms,
            chunks=math.ceil(row["size_bytes"] / cross_chunk_bytes()),
            wire_bytes=_wire_bytes(row["engine"]))
        row["x_model"] = row["median_ms"] / row["model_ms"]


def _wire_bytes(engine: str) -> float:
    """Bytes per element an engine sends: int8's byte (int4's half) and a float32 scale per 64
    values, 2 with the 16-bit compressions, else float32's 4."""
    wire = WIRE.get(engine)
    return {"int8": 1 + 4 / 64, "int4": 0.5 + 4 / 64}.get(wire, 2 if wire else 4)


def _megabytes(row: dict) -> str:
    sent = row.get("inter_node_bytes")
    return "-" if sent is None else f"{sent / 1e6:.3f}"


class Allreduce(Mode):
    name = "allreduce"
    help = "time the all-reduce alone"
    measured = {"timing": PER_CALL}
    cell_keys = ("world_size", "size_bytes", "engine")
    bigger_is_better = ("gb_per_s", "x_vs_gloo", "x_vs_best_peer")
    # What every install has, on the sizes DDP sends most (25M, its default bucket; 1M, its first
    # bucket; 64K, a small model's only one), on 2 ranks (as many as the smallest machine has
    # cores), with samples enough for a median: a first answer while a user waits.
    quick = {"world_sizes": "2", "sizes": "64K,1M,25M", "engines": "gloo,ddpx,copy",
             "iters": "10", "min_time": "0.3"}

    def add_arguments(self, parser):
        parser.add_argument(
            "--sizes",
            type=size_list,
            default="4K,64K,1M,4M,25M,100M",
            help="comma-separated message sizes in bytes, K/M/G suffixes (default 4K,...,100M)",
        )
        choices_option(parser, "--engines", ENGINES,
                       default=tuple(engine for engine in ENGINES if engine not in SCHEDULES),
                       said=f"all but {', '.join(SCHEDULES)}")
        timing_options(parser)
        node_options(parser)

    def prepare(self, args):
        """Build DeepSpeed's op here, once, before any rank starts: the ranks load what it built."""
        if "deepspeed" in args.engines and args.nodes == 1:
            _, why_not = _build_deepspeed_op()
            os.environ[DEEPSPEED_BUILT] = why_not  # for the ranks this process starts

    def uses_mpirun(self, args):
        return "mpi" in args.engines and not why_no_mpi()

    def run(self, args):
        return bench_allreduce(args)

    def add_link_figures(self, rows):
        """Each row's bound on its shaped link (link_bound_ms), and ddpx_bench.costmodel's time
        (add_model)."""
        from ddpx_bench.testbed import bits_per_second  # only where --link ran

        for row in rows:
            if row["link"] != "none":
                row["bound_ms"] = link_bound_ms(row, bits_per_second(row["link"]))
                row["x_bound"] = row["median_ms"] / row["bound_ms"]
        add_model(rows)

    def table(self, rows: list[dict]) -> list[str]:
        runs = rows[0].get("runs")
        inter_node = any(row.get("inter_node_bytes") is not None for row in rows)
        linked = any("link" in row for row in rows)
        floored = any(row.get("x_floor") is not None for row in rows)
        peers = [peer for peer in PEERS if any(row["engine"] == peer for row in rows)]
        # With gloo the only peer, "x vs best peer" would repeat "x vs gloo" under another name.
        best_peer = peers not in ([], ["gloo"])
        ranked, ranked_by = ("x_vs_best_peer", "peer") if best_peer else ("x_vs_gloo", "gloo")
        link = [
            ("bound ms", ">9", lambda row: format_ms(row.get("bound_ms"))),
            ("x bound", ">7", lambda row: format_ratio(row.get("x_bound"))),
            ("model ms", ">9", lambda row: format_ms(row.get("model_ms"))),
            ("x model", ">7", lambda row: format_ratio(row.get("x_model"))),
        ]
        worst = [
            ("worst ms", ">9", lambda row: f"{row['worst_median_ms']:.3f}"),
            ("worst x " + ranked_by, ">12", lambda row: format_ratio(row.get(f"worst_{ranked}"))),
        ]
        lines = format_table([
            *([("link", ">7", lambda row: row["link"])] if linked else []),
            ("world", ">5", lambda row: row["world_size"]),
            ("size", ">6", lambda row: format_size(row["size_bytes"])),
            ("engine", "<10",
             lambda row: "copy floor" if row["engine"] == "copy" else row["engine"]),
            ("median ms", ">10", lambda row: f"{row['median_ms']:.3f}"),
            ("p10-p90 ms", ">17", lambda row: format_spread(row, 3)),
            ("GB/s", ">7", lambda row: f"{row['gb_per_s']:.3g}"),
            ("x vs gloo", ">9", lambda row: format_ratio(row["x_vs_gloo"])),
            *([("x vs best peer", ">14", lambda row: format_ratio(row.get("x_vs_best_peer")))]
              if best_peer else []),
            *([("/ floor", ">7", lambda row: format_ratio(row.get("x_floor")))] if floored else []),
            *(link if linked else []),
            *([("inter-node MB/call", ">18", _megabytes)] if inter_node else []),
            ("CPU busy/si %", ">13", format_cpu),
            *(worst if runs else []),
        ], rows)
        if linked:
            lines.append(
                "bound: each node sends 2(N-1)/N of the message in the engine's wire dtype at the "
                "link's rate; x bound = median / bound (1.00 is the link's limit); model: "
                "ddpx_bench.costmodel from the unshaped (none) row and the TCP rate, "
                "x model = median / model"
            )
            lines.append(tcp_line(rows))
        lines.append(cpu_note("the engine's samples"))
        if runs:
            lines.append(runs_line(runs, ranked.replace("_", " ")))
        if best_peer:
            lines.append(f"x vs best peer: the fastest of {', '.join(peers)} in the cell / the "
                         "engine")
        if any(row["engine"] == "copy" for row in rows):
            lines.append("copy floor: not an all-reduce; every rank copying its tensor once at the "
                         "same time, the least memory traffic an in-place all-reduce needs")
        if floored:
            lines.append("/ floor: the engine / the copy floor in the cell (below 1.00: less "
                         "memory traffic, as where nothing is copied)")
        nodes = {row["world_size"]: row["nodes"] for row in rows if row.get("nodes", 1) > 1}
        if nodes:
            split = ", ".join(f"{size} ranks on {count}" for size, count in nodes.items())
            lines.append(f"nodes: {split}; inter-node MB/call: sent across nodes, all ranks")
        return lines

    def plot(self, rows: list[dict], path: Path) -> None:
        sizes = sorted({row["size_bytes"] for row in rows})
        figure, panels = world_size_panels(rows, "ms per all-reduce (median, p10-p90)")
        for ax, world_size in panels:
            for engine in dict.fromkeys(row["engine"] for row in rows):
                cells = [row for row in rows
                         if (row["world_size"], row["engine"]) == (world_size, engine)]
                x = [row["size_bytes"] for row in cells]
                style = "--" if engine == "copy" else "-"
                marker = "s" if engine in PEERS else "o"  # the peers squares, ddpx's engines dots
                ax.plot(x, [row["median_ms"] for row in cells], style, marker=marker, label=engine)
                low, high = [row["p10_ms"] for row in cells], [row["p90_ms"] for row in cells]
                ax.fill_between(x, low, high, alpha=0.2)
            nodes = next(row.get("nodes", 1) for row in rows if row["world_size"] == world_size)
            title = f"{world_size} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
            ax.set(xscale="log", yscale="log", title=title, xlabel="message size")
            ax.set_xticks(sizes, [format_size(size) for size in sizes])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.legend()
        save_figure(figure, path)


MODE = Allreduce()
