"""Benchmark ddpx against gloo and the other CPU all-reduces on one machine: the all-reduce alone,
a DDP training step, accuracy.

Run everything: the script spawns the ranks of each of --world_sizes (default 2,4) itself, gloo
over a FileStore in a temporary folder, one thread per rank, and they end with it (on an error,
Ctrl-C, or even SIGKILL). The table goes to stdout, progress to stderr. On 2 cores, about 1.5
minutes for allreduce (more with the peers) and 2.5 for train; accuracy (default world sizes 4,8)
takes about a minute. The peers that allreduce compares with, OpenMPI (through mpi4py) and
DeepSpeed, are optional: `pip install -e ".[peers]"`.

    python scripts/bench.py allreduce --json bench_out/allreduce.json --plot bench_out/allreduce.png
    python scripts/bench.py train --json bench_out/train.json --plot bench_out/train.png
    python scripts/bench.py accuracy --json bench_out/accuracy.json --plot bench_out/accuracy.png

Smaller runs:

    python scripts/bench.py allreduce --world_sizes 2 --sizes 4K,1M --iters 5 --min_time 0.1
    python scripts/bench.py allreduce --world_sizes 4 --nodes 2    # as if on two machines
    python scripts/bench.py allreduce --sizes 4K,1M --engines gloo,ddpx,mpi,deepspeed,copy
    python scripts/bench.py train --world_sizes 2 --params 2M --steps 5 --load 1   # busy machine
    python scripts/bench.py train --world_sizes 2 --comm_hooks default,ddpx --params 2M --steps 5

Under a launcher, the launcher's processes are the ranks and only its world size runs:

    accelerate launch --config_file scripts/configs/cpu.yaml scripts/bench.py allreduce
    torchrun --nproc_per_node 4 scripts/bench.py allreduce

--load N (every mode; default 0, idle) measures on a busy machine: N CPU-bound processes per core
(the cores this process may run on) run for the whole run, each pinned to its core and
busy-looping in plain Python, as `taskset -c C python3 -c "while True: pass"` would. They start
before the ranks of the first world size and stop after the last, by the process that starts the
ranks (under a launcher: the rank with LOCAL_RANK 0 of each machine, with barriers, so that every
rank runs under the load), and they die with it, even by SIGKILL. The table's header says the
load ("load: 1 CPU-bound process per core (2 in all)"), the JSON's settings hold `load` and
`load_pids`:

    python scripts/bench.py allreduce --world_sizes 2 --sizes 1M --load 1

allreduce: one in-place sum of a float32 tensor of each of --sizes (bytes; K, M, G are powers of
1024) on each of --world_sizes, by each engine: `gloo` (torch.distributed.all_reduce), `ddpx`
(ddpx.all_reduce), `ddpx-fp16` and `ddpx-bf16` (ddpx.all_reduce with that compression), the peers
`mpi` (OpenMPI's MPI_Allreduce through mpi4py, in place on the tensor's own memory) and
`deepspeed` (DeepSpeed's CPU shared-memory all-reduce, the op deepspeed.comm calls for
inference_all_reduce, called directly; its first use compiles it, about a minute, into
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, before any timing), and `copy`, which is
not an all-reduce: every rank at once copies its tensor into a buffer of the same size, the least
memory traffic (read the tensor, write a result) any in-place all-reduce needs, a floor to read
the others against (it is timed, not checked). Engines that do not work here are left out with a
note (the peers when not installed; `deepspeed` with --nodes, as its op spans one node only,
while `gloo` and `mpi` reduce the simulated nodes as one machine).
MPI needs ranks that mpirun starts: when `mpi` runs, bench.py starts each world size with
`mpirun --oversubscribe --bind-to none -np W python bench.py <the same arguments>` instead of
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
fastest peer's median (of gloo, mpi and deepspeed, those that ran) / the engine's. With --nodes N
the spawned ranks are split into N nodes (GROUP_RANK, as a launcher sets it), so ddpx reduces
hierarchically as on N machines, and the table adds the bytes ddpx's engines sent across nodes per
call, summed over the ranks (as bandwidth-optimal collectives send them: 2(N-1)/N of the data for
an all-reduce, (N-1)/N for an all-to-all or an all-gather). Under a launcher its nodes count.

train: DDP steps (forward, backward, SGD step) of ddpx.models.MLP with --params parameters on
--batch_size rows of random data per rank, one model per --comm_hooks entry: `default` (DDP's own
all-reduce), `fp16` and `bf16` (torch's fp16_compress_hook and bf16_compress_hook; the latter needs
NCCL, so it is left out on CPU), `ddpx`, `ddpx-fp16`, `ddpx-bf16` (ddpx.register_fused_hook), and
`none`, which is not a way to train: a hook that communicates nothing (each rank keeps its own
gradients), the step's floor that any hook's time is read against (it is timed, not checked). The
models start from the same seed, see the same data and take turns step by step; a sample is one
step on the slowest rank, started right after a barrier. Reported: median and p10-p90 step time in
ms, x vs default, and max |diff| of each model's final parameters from the default model's with its
tolerance: 64 roundings of the gradients to the wire dtype (64 u_wire x the largest parameter
change of the default model) and of the parameters to float32 (64 u_fp32 x the largest parameter).
Parameters that differ across ranks, or from default's beyond the tolerance, make the run exit
with status 1 after the table.

accuracy: the averaged all-reduce of --size normally distributed float32 elements per rank (seeded
per rank) on each of --world_sizes (default 4,8), by each of --methods: `default`
(torch.distributed.all_reduce of x / world size in float32), `torch-fp16` and `torch-bf16` (torch's
fp16_compress_hook and bf16_compress_hook called on the data as DDP would: cast to the wire dtype,
divide by the world size in it, all-reduce in it with gloo, cast back), `ddpx`, `ddpx-fp16` and
`ddpx-bf16` (ddpx.all_reduce with average=True and that compression). Reported: max and mean abs
error against the float64 reference (the sum of the float64 inputs / world size; the largest over
the ranks), the ratio of each ddpx-<wire> error to torch-<wire>'s (smaller is more accurate), and
whether every rank got the same bits. A ddpx result that differs across ranks, or a non-finite
error, makes the run exit with status 1 after the table.
"""

import argparse
import contextlib
import copy
import ctypes
import datetime
import functools
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

ENGINES = ("gloo", "ddpx", "ddpx-fp16", "ddpx-bf16", "mpi", "deepspeed", "copy")
# The other projects' CPU all-reduces, which "x vs best peer" reads every engine against.
PEERS = ("gloo", "mpi", "deepspeed")
PEERS_INSTALL = 'pip install -e ".[peers]"'
COMM_HOOKS = ("default", "fp16", "bf16", "ddpx", "ddpx-fp16", "ddpx-bf16", "none")
METHODS = ("default", "torch-fp16", "torch-bf16", "ddpx", "ddpx-fp16", "ddpx-bf16")
WIRE = {
    "gloo": None,
    "mpi": None,
    "deepspeed": None,
    "copy": None,
    "ddpx": None,
    "ddpx-fp16": "fp16",
    "ddpx-bf16": "bf16",
    "default": None,
    "none": None,
    "fp16": "fp16",
    "bf16": "bf16",
    "torch-fp16": "fp16",
    "torch-bf16": "bf16",
}
UNIT_ROUNDOFF = {None: 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
# How many roundings the final parameters of a hook may differ from the default hook's by.
PARAM_TOLERANCE_ROUNDINGS = 64
THREADS_PER_RANK = 1
PG_TIMEOUT = datetime.timedelta(minutes=5)
TIMING = {
    "allreduce": "a sample: the slowest rank's mean time per call in a batch begun after a barrier",
    "train": "a sample: the slowest rank's time for one step begun after a barrier",
}
# Set by bench.py for the ranks it starts with mpirun: their temporary folder (the FileStore's).
MPI_WORKDIR = "DDPX_BENCH_MPI_WORKDIR"
# Set by bench.py for the ranks it starts on its testbed (--link): where rank 0 writes its result.
TESTBED_RESULT = "DDPX_BENCH_TESTBED_RESULT"
# Set by bench.py for the ranks it starts, once it has built DeepSpeed's op: "" when it built, else
# why not (so that no rank builds it again).
DEEPSPEED_BUILT = "DDPX_BENCH_DEEPSPEED_BUILT"
ERRORS = (
    "max and mean |result - float64 reference| (the largest over the ranks), reference = sum of "
    "the float64 inputs / world size; vs torch: ddpx-<wire>'s error / torch-<wire>'s"
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.set_defaults(nodes=None, link=[], load_pids=[])
    modes = parser.add_subparsers(dest="mode", required=True)
    common = _common_options([2, 4])
    allreduce = modes.add_parser("allreduce", parents=[common], help="time the all-reduce alone")
    allreduce.add_argument(
        "--sizes",
        type=_size_list,
        default=_size_list("4K,64K,1M,4M,25M,100M"),
        help="comma-separated message sizes in bytes, K/M/G suffixes (default 4K,...,100M)",
    )
    allreduce.add_argument(
        "--engines",
        type=_choice_list(ENGINES),
        default=list(ENGINES),
        help=f"comma-separated, from {','.join(ENGINES)} (default all)",
    )
    allreduce.add_argument(
        "--iters", type=int, default=20, help="timed samples per engine and cell"
    )
    _node_options(allreduce)
    allreduce.add_argument(
        "--min_time",
        type=float,
        default=1.0,
        help="seconds the samples of one engine and cell last at least",
    )
    allreduce.add_argument(
        "--warmup", type=int, default=3, help="calls per engine and cell that size its batches"
    )

    train = modes.add_parser("train", parents=[common], help="time DDP training steps")
    train.add_argument(
        "--comm_hooks",
        type=_choice_list(COMM_HOOKS),
        default=list(COMM_HOOKS),
        help=f"comma-separated, from {','.join(COMM_HOOKS)} (default all)",
    )
    train.add_argument(
        "--params",
        type=_count,
        default=_count("25M"),
        help="parameters of the MLP, with K/M suffixes (powers of 1000)",
    )
    train.add_argument("--batch_size", type=int, default=16)
    train.add_argument("--steps", type=int, default=12, help="timed steps per hook")
    train.add_argument("--warmup", type=int, default=2, help="untimed steps per hook")
    train.add_argument("--lr", type=float, default=0.01)
    _node_options(train)

    accuracy = modes.add_parser(
        "accuracy",
        parents=[_common_options([4, 8])],
        help="compare the averaged all-reduce's errors against a float64 reference",
    )
    accuracy.add_argument(
        "--methods",
        type=_choice_list(METHODS),
        default=list(METHODS),
        help=f"comma-separated, from {','.join(METHODS)} (default all)",
    )
    accuracy.add_argument(
        "--size",
        type=_count,
        default=_count("1M"),
        help="float32 elements per rank, with K/M suffixes (powers of 1000; default 1M)",
    )
    args = parser.parse_args(argv)
    if args.nodes is None:
        args.nodes = 2 if args.link else 1
    return args


def _node_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="split each world size into this many equal nodes (default 1; 2 with --link)",
    )
    parser.add_argument(
        "--link",
        type=_rate_list,
        default=[],
        help="comma-separated link rates in tc's notation (1gbit,10gbit), or none (unshaped): run "
        "each on --nodes network namespaces joined by a link of that rate (needs root)",
    )


def _rate_list(text: str) -> list[str]:
    from ddpx import testbed

    rates = text.split(",")
    for rate in rates:
        try:
            if rate != "none":
                testbed.bits_per_second(rate)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return rates


def _common_options(world_sizes: list[int]) -> argparse.ArgumentParser:
    """The options every mode takes; a parser of its own per mode, so each has its own defaults."""
    common = argparse.ArgumentParser(add_help=False)
    default = ",".join(map(str, world_sizes))
    common.add_argument(
        "--world_sizes",
        type=_int_list,
        default=world_sizes,
        help=f"comma-separated world sizes to spawn (default {default}; a launcher's WORLD_SIZE "
        "wins)",
    )
    common.add_argument("--json", type=Path, help="write the results and the machine to this file")
    common.add_argument("--plot", type=Path, help="draw the results into this PNG")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument(
        "--load",
        type=_non_negative,
        default=0,
        metavar="N",
        help="run N CPU-bound processes per core for the whole run (default 0: idle)",
    )
    return common


def _suffixed(text: str, base: int) -> int:
    text = text.strip().upper()
    exponent = "KMG".find(text[-1:]) + 1
    return round(float(text[:-1] if exponent else text) * base**exponent)


def _size_list(text: str) -> list[int]:
    sizes = [_suffixed(item, 1024) for item in text.split(",")]
    if any(size <= 0 or size % 4 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"{text}: sizes are positive multiples of 4 bytes (float32)"
        )
    return sizes


def _count(text: str) -> int:
    return _suffixed(text, 1000)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: a count, 0 or more")
    return value


def _int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        items = text.split(",")
        unknown = sorted(set(items) - set(choices))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
        return items

    return parse


def main() -> None:
    args = parse_args()
    uneven = [size for size in args.world_sizes if args.nodes < 1 or size % args.nodes]
    if uneven:
        sys.exit(f"bench.py: --nodes {args.nodes} does not divide world size {uneven[0]} evenly")
    if args.link and args.load:
        sys.exit("bench.py: --load with --link would load every node's cores, which are the same "
                 "cores: leave one of them out")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if MPI_WORKDIR in os.environ:
            result = _mpirun_rank(args)
        elif "WORLD_SIZE" in os.environ:
            result = _launched(args)
        elif args.link:
            result = _on_testbed(args)
        else:
            result = _spawned(args)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        sys.exit(f"bench.py: rank {exc.error_index} failed:{exc}")
    except subprocess.CalledProcessError as exc:
        sys.exit(f"bench.py: {exc.cmd} failed with status {exc.returncode} (errors above)")
    except KeyboardInterrupt:
        sys.exit("bench.py: interrupted")
    if result is None:
        return
    if not result["rows"]:
        sys.exit(f"bench.py: nothing to measure; left out: {result['left_out']}")
    report(args, result)
    if result["failures"]:
        sys.exit("bench.py: " + "; ".join(result["failures"]))


# --- launching the ranks -------------------------------------------------------------------------


def _spawned(args) -> dict:
    """Run each world size in freshly started ranks, under the load; merge what their rank 0 wrote.

    The ranks are started by mpirun when the `mpi` engine runs (MPI joins only ranks it started),
    else by torch.multiprocessing.
    """
    start = _mpirun if _runs_mpi(args) else _spawn
    _prebuild_deepspeed_op(args)
    results = []
    with _cpu_load(args.load) as load_pids:
        args.load_pids = load_pids  # for the JSON's settings
        for world_size in args.world_sizes:
            with tempfile.TemporaryDirectory(prefix="ddpx-bench-") as workdir:
                start(world_size, args, workdir)
                results.append(json.loads(Path(workdir, "result.json").read_text()))
    return _merged(results)


def _on_testbed(args) -> dict:
    """Run each world size under each --link rate on --nodes network namespaces (ddpx.testbed),
    one torchrun per node running this same command; merge what their rank 0 wrote, each row with
    its link: the rate, the TCP payload rate measured on it, and the engine's bound there."""
    from ddpx import testbed

    why_not = testbed.unavailable()
    if why_not:
        sys.exit(f"bench.py: --link needs network namespaces, and {why_not}")
    results = []
    for rate in args.link:
        for world_size in args.world_sizes:
            with tempfile.TemporaryDirectory(prefix="ddpx-bench-") as workdir, \
                    testbed.Testbed(args.nodes, None if rate == "none" else rate) as bed:
                tcp = bed.measure_tcp()
                _say(f"{args.nodes} nodes, link {rate}: TCP carries {tcp / 1e9:.3f} Gbit/s")
                result_path = Path(workdir, "result.json")
                jobs = bed.torchrun([os.path.abspath(__file__), *sys.argv[1:]],
                                    world_size // args.nodes,
                                    env={TESTBED_RESULT: str(result_path)})
                outputs = bed.communicate(jobs, timeout=PG_TIMEOUT.total_seconds() * 4)
                failed = [node for node, job in enumerate(jobs) if job.returncode]
                if failed:
                    for node in failed:
                        print(outputs[node], file=sys.stderr)
                    raise subprocess.CalledProcessError(jobs[failed[0]].returncode,
                                                        f"torchrun of node {failed[0]}")
                result = json.loads(result_path.read_text())
            for row in result["rows"]:
                row.update(link=rate, tcp_bits_per_s=tcp)
                if args.mode == "allreduce" and rate != "none":
                    row["bound_ms"] = link_bound_ms(row, testbed.bits_per_second(rate))
                    row["x_bound"] = row["median_ms"] / row["bound_ms"]
            results.append(result)
    merged = _merged(results)
    if args.mode == "allreduce":
        _add_model(merged["rows"])
    return merged


def _add_model(rows: list[dict]) -> None:
    """ddpx.costmodel's time for each ddpx row on a shaped link, from the same engine's time on
    the unshaped one (--link none) and the link's measured TCP rate."""
    from ddpx import costmodel, engine

    unshaped = {(row["world_size"], row["engine"], row["size_bytes"]): row["median_ms"]
                for row in rows if row["link"] == "none"}
    for row in rows:
        node_ms = unshaped.get((row["world_size"], row["engine"], row["size_bytes"]))
        if row["link"] == "none" or node_ms is None or not row["engine"].startswith("ddpx"):
            continue
        row["model_ms"] = costmodel.hierarchical_ms(
            row["size_bytes"], row["nodes"], row["tcp_bits_per_s"], node_ms,
            chunks=math.ceil(row["size_bytes"] / engine.cross_chunk_bytes()),
            wire_bytes=_wire_bytes(row["engine"]))
        row["x_model"] = row["median_ms"] / row["model_ms"]


def link_bound_ms(row: dict, bits_per_s: float) -> float:
    """The least time an all-reduce of the row's message over its nodes takes on a link of
    `bits_per_s` per node and direction: each node must send 2(N-1)/N of the message, in the
    engine's wire dtype (the bound of a bandwidth-optimal all-reduce between N nodes)."""
    from ddpx import costmodel

    sent = costmodel.bytes_per_node(row["size_bytes"], row["nodes"], _wire_bytes(row["engine"]))
    return sent * 8 / bits_per_s * 1e3


def _wire_bytes(engine: str) -> int:
    """Bytes per element an engine sends: 2 with compression, else float32's 4."""
    return 2 if WIRE.get(engine) else 4


def _merged(results: list[dict]) -> dict:
    """One result of the results of several runs (world sizes, links)."""
    return {
        "rows": [row for result in results for row in result["rows"]],
        "left_out": {name: why for result in results for name, why in result["left_out"].items()},
        "notes": list(dict.fromkeys(note for result in results for note in result["notes"])),
        "failures": [failure for result in results for failure in result["failures"]],
    }


def _spawn(world_size: int, args, workdir: str) -> None:
    # The ranks inherit an ignored SIGINT: Ctrl-C is the parent's to handle, and it terminates them.
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ranks = mp.start_processes(
            _spawned_rank, args=(world_size, args, workdir), nprocs=world_size, join=False
        )
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        while not ranks.join():
            pass
    finally:
        for process in ranks.processes:
            if process.is_alive():
                process.terminate()
            process.join()
        for traceback_file in ranks.error_files:  # torch leaves a failed rank's in /tmp
            Path(traceback_file).unlink(missing_ok=True)


def _mpirun(world_size: int, args, workdir: str) -> None:
    """Start `world_size` ranks of this same command with mpirun; they find `workdir` in their
    environment. Raise CalledProcessError if mpirun fails (a rank failed: it said why)."""
    command = [_mpirun_path(), "--allow-run-as-root", "--oversubscribe"]
    # Unbound, as the spawned ranks are: a bound rank's gloo and ddpx threads would share its core.
    command += ["--bind-to", "none", "-np", str(world_size)]
    command += [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    # Its own session keeps Ctrl-C ours to handle; it dies with bench.py (its ranks die with it);
    # what the ranks print is progress, so it goes to stderr: stdout is for the table.
    mpirun = subprocess.Popen(
        command,
        env={**os.environ, MPI_WORKDIR: workdir},
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        status = mpirun.wait()
    finally:
        if mpirun.poll() is None:
            mpirun.terminate()  # mpirun passes it on to the ranks
            try:
                mpirun.wait(timeout=10)
            except subprocess.TimeoutExpired:
                mpirun.kill()
                mpirun.wait()
    if status:
        raise subprocess.CalledProcessError(status, f"mpirun of {world_size} ranks")


def _runs_mpi(args) -> bool:
    return args.mode == "allreduce" and "mpi" in args.engines and not _why_no_mpi()


def _why_no_mpi() -> str:
    """Why the `mpi` engine cannot run here, or "" if it can."""
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed ({PEERS_INSTALL})"
    if _mpirun_path() is None:
        return f"no mpirun found ({PEERS_INSTALL} installs OpenMPI's)"
    return ""


def _mpirun_path() -> str | None:
    # This Python's own bin first: a virtual environment's is on PATH only when activated.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("mpirun", path=path)


def _spawned_rank(rank: int, world_size: int, args, workdir: str) -> None:
    _die_with_parent()
    os.environ["GROUP_RANK"] = str(rank // (world_size // args.nodes))
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=PG_TIMEOUT
    )
    result = _run_rank(args)
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps(result))


def _mpirun_rank(args) -> None:
    """Run as one of the ranks that _mpirun started: MPI numbers them; the rest is as spawned."""
    rank, world_size = (int(os.environ[f"OMPI_COMM_WORLD_{key}"]) for key in ("RANK", "SIZE"))
    _spawned_rank(rank, world_size, args, os.environ[MPI_WORKDIR])


def _die_with_parent() -> None:
    """Have Linux kill this rank when the parent dies, even by SIGKILL: no rank outlives a run."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(1)


def _launched(args) -> dict | None:
    """Run as one rank of a launcher's job (torchrun, accelerate launch): its world size only."""
    # One load per machine, started before this rank joins the group: no rank of the machine gets
    # past the barrier below before it runs.
    starts_load = os.environ.get("LOCAL_RANK", "0") == "0"
    with _cpu_load(args.load if starts_load else 0) as load_pids:
        args.load_pids = load_pids  # for the JSON's settings
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
        dist.barrier()
        world_size = dist.get_world_size()
        result = _run_rank(args)  # ends with a barrier: every rank is done before the load stops
    if int(os.environ["RANK"]) != 0:
        return None
    if TESTBED_RESULT in os.environ:  # a node of bench.py's testbed: the parent reports
        Path(os.environ[TESTBED_RESULT]).write_text(json.dumps(result))
        return None
    if args.world_sizes != [world_size]:
        result["notes"].append(f"launched with WORLD_SIZE={world_size}: only that world size ran")
    return result


@contextlib.contextmanager
def _cpu_load(per_core: int):
    """Run `per_core` CPU-bound processes on each core this process may use, each pinned to its
    core and busy-looping in plain Python, for the `with` block; yield their pids. They are killed
    at its end however it ends, and by Linux if this process dies first (even by SIGKILL)."""
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
    else:
        cores = list(range(os.cpu_count() or 1))
    processes = []
    try:
        for core in cores:
            for _ in range(per_core):
                # Their own session: a Ctrl-C is for bench.py, which stops them.
                process = subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
                processes.append(process)
                if hasattr(os, "sched_setaffinity"):
                    os.sched_setaffinity(process.pid, {core})
        yield [process.pid for process in processes]
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def _run_rank(args) -> dict:
    torch.set_num_threads(THREADS_PER_RANK)
    try:
        modes = {"allreduce": bench_allreduce, "train": bench_train, "accuracy": bench_accuracy}
        result = modes[args.mode](args)
        dist.barrier()  # the load, if any, stops after the last rank is done
        return result
    finally:
        # Free the DDP models (reference cycles) first, so that destroying the group really ends
        # it and joins gloo's threads. A group still alive at interpreter exit can abort there:
        # a gloo thread that drops a finished work's Python tensors then needs the GIL.
        gc.collect()
        dist.destroy_process_group()


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _progress(message: str) -> None:
    if dist.get_rank() == 0:
        _say(message)


def _import_ddpx():
    """The ddpx module, or None and why it cannot be used."""
    try:
        import ddpx
    except ImportError as exc:
        return None, f"ddpx does not import ({exc})"
    if not hasattr(ddpx, "all_reduce"):
        return None, "ddpx is not built (no ddpx.all_reduce)"
    return ddpx, ""


# --- allreduce mode ------------------------------------------------------------------------------


def bench_allreduce(args) -> dict:
    left_out = {}
    nodes = _node_count()
    engines = _allreduce_engines(args.engines, left_out, nodes)
    world_size, rows, started = dist.get_world_size(), [], time.perf_counter()
    for index, size in enumerate(args.sizes):
        cell = f"world {world_size}, {format_size(size)} (cell {index + 1}/{len(args.sizes)})"
        _progress(
            f"{cell}: checking {', '.join(engines)}; {time.perf_counter() - started:.0f} s elapsed"
        )
        rows += _bench_cell(size, engines, args, cell, nodes)
    return {"rows": rows, "left_out": left_out, "notes": [], "failures": []}


def _node_count() -> int:
    """How many nodes the ranks are on, by the launcher's GROUP_RANK as ddpx finds them."""
    group_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(group_ranks, os.environ.get("GROUP_RANK", "0"))
    return len(set(group_ranks))


def _bytes_across_nodes() -> int | None:
    """What ddpx's engine of the world has sent to other nodes so far, summed over the ranks;
    None for the process-group fallback, which does not count them."""
    from ddpx.engine import engine_for

    sent = engine_for().bytes_across_nodes
    if sent is None:
        return None
    total = torch.tensor([sent], dtype=torch.float64)
    dist.all_reduce(total)
    return int(total.item())


def _allreduce_engines(requested: list[str], left_out: dict, nodes: int) -> dict:
    """The requested engines that work here, by name; why the others do not goes in `left_out`."""
    ddpx, why_not = _import_ddpx()
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
                _add_if_it_works(engines, name, engine, left_out)
        elif ddpx is None:
            left_out[name] = why_not
        else:
            _add_if_it_works(
                engines, name, functools.partial(ddpx.all_reduce, compression=WIRE[name]), left_out
            )
    return engines


def _mpi_engine():
    """The `mpi` engine: OpenMPI's in-place sum through mpi4py; or None and why it cannot run."""
    if MPI_WORKDIR not in os.environ:
        why_not = _why_no_mpi() or "needs ranks started by bench.py's mpirun, not a launcher's"
        return None, why_not
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if (world.Get_rank(), world.Get_size()) != (dist.get_rank(), dist.get_world_size()):
        raise RuntimeError("internal: MPI's ranks are not torch.distributed's")

    def mpi(tensor: torch.Tensor) -> None:
        world.Allreduce(MPI.IN_PLACE, tensor.numpy(), op=MPI.SUM)  # a view: the tensor's memory

    return mpi, ""


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
    _say(
        "loading DeepSpeed's shared-memory all-reduce op; its first load builds it (about a "
        "minute) into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)"
    )
    started = time.perf_counter()
    op, why_not = _deepspeed_op()
    outcome = "loaded" if op else f"left out ({why_not})"
    _say(f"DeepSpeed's op {outcome} after {time.perf_counter() - started:.0f} s")
    return op, why_not


def _prebuild_deepspeed_op(args) -> None:
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


def _add_if_it_works(
    engines: dict, name: str, engine, left_out: dict, fails=(NotImplementedError,)
) -> None:
    """Add `engine` to `engines` if it reduces a small tensor here; else say why in `left_out`.

    `fails`: what it raises where it cannot work (NotImplementedError: a ddpx compression not built
    yet). Every rank probes alike, so they agree on what is left out.
    """
    try:
        engine(torch.ones(8))
    except fails as exc:
        left_out[name] = str(exc).splitlines()[0]
        return
    engines[name] = engine


def _bench_cell(size: int, engines: dict, args, cell: str, nodes: int) -> list[dict]:
    errors = _check_engines(size, engines, args.seed, count_bytes=nodes > 1)
    zeros = torch.zeros(size // 4)
    per_call = {
        name: _seconds_per_call(engine, zeros, args.warmup) for name, engine in engines.items()
    }
    calls = {name: max(1, round(args.min_time / args.iters / per_call[name])) for name in engines}
    expected = sum(max(args.min_time, args.iters * seconds) for seconds in per_call.values())
    _progress(f"{cell}: timing, about {expected:.1f} s")
    samples = {name: [] for name in engines}
    for _ in range(args.iters):
        for name, engine in engines.items():
            samples[name].append(_timed_batch(engine, zeros, calls[name]))
    rows = []
    for name in engines:
        stats = _slowest_rank_stats(samples[name])
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
        reference += _random_input(seed, rank, numel)
    mine = _random_input(seed, dist.get_rank(), numel)
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


def _random_input(seed: int, rank: int, numel: int, normal: bool = False) -> torch.Tensor:
    """Rank `rank`'s input: uniform in [-1, 1), or standard normal."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    if normal:
        return torch.randn(numel, generator=generator)
    return torch.rand(numel, generator=generator) * 2 - 1


def _seconds_per_call(engine, tensor: torch.Tensor, calls: int) -> float:
    """The slowest rank's mean over `calls` calls: the same on every rank, so they plan alike."""
    seconds = torch.tensor([_timed_batch(engine, tensor, calls)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _timed_batch(engine, tensor: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        engine(tensor)
    return (time.perf_counter() - start) / calls


def _slowest_rank_stats(seconds: list[float]) -> dict:
    samples = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    p10, median, p90 = torch.quantile(
        samples * 1e3, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    )
    return {"median_ms": median.item(), "p10_ms": p10.item(), "p90_ms": p90.item()}


# --- train mode ----------------------------------------------------------------------------------


def bench_train(args) -> dict:
    from ddpx.models import MLP

    left_out, failures = {}, []
    torch.manual_seed(args.seed)
    initial = MLP.with_params(args.params)
    models = _hooked_models(initial, args.comm_hooks, left_out)
    optimizers = {
        name: torch.optim.SGD(model.parameters(), lr=args.lr) for name, (model, _) in models.items()
    }
    batches = _train_batches(initial.width, args)
    samples = {name: [] for name in models}
    world_size, started = dist.get_world_size(), time.perf_counter()
    for step in range(args.warmup + args.steps):
        if step % 5 == 0:
            elapsed = time.perf_counter() - started
            _progress(
                f"world {world_size}: step {step + 1}/{args.warmup + args.steps} of each of "
                f"{', '.join(models)}; {elapsed:.0f} s elapsed"
            )
        for name, (model, _) in models.items():
            seconds = _timed_step(model, optimizers[name], batches[step % len(batches)])
            if step >= args.warmup:
                samples[name].append(seconds)
    rows = _train_rows(initial, models, samples, args, failures)
    return {"rows": rows, "left_out": left_out, "notes": [], "failures": failures}


def _hooked_models(initial: torch.nn.Module, hooks: list[str], left_out: dict) -> dict:
    """A DDP copy of `initial` per hook that works here: name -> (model, what its hook does)."""
    ddpx, why_not = _import_ddpx()
    models = {}
    for name in hooks:
        if name.startswith("ddpx") and ddpx is None:
            left_out[name] = why_not
            continue
        model = DDP(copy.deepcopy(initial))
        try:
            models[name] = model, _register_hook(name, model, ddpx)
        # NotImplementedError: a ddpx compression not built yet; TypeError: DDP refuses torch's
        # bf16_compress_hook without NCCL 2.10+ or XCCL.
        except (NotImplementedError, TypeError) as exc:
            left_out[name] = str(exc)
    return models


def _register_hook(name: str, model: DDP, ddpx) -> str:
    """Register the comm hook `name` on `model`; say what it does."""
    if name == "default":
        return "DDP's built-in all-reduce"
    if name == "none":
        model.register_comm_hook(None, _no_communication_hook)
        return "no communication (the floor; timed, not checked)"
    if name.startswith("ddpx"):
        return ddpx.register_fused_hook(model, compression=WIRE[name]).describe()
    hook = getattr(default_hooks, f"{name}_compress_hook")
    model.register_comm_hook(dist.group.WORLD, hook)
    return f"torch {hook.__name__}"


def _no_communication_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hands DDP the bucket as it is: each rank steps with its own gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _train_batches(width: int, args, count: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank())
    return [torch.randn(args.batch_size, width, generator=generator) for _ in range(count)]


def _timed_step(model: DDP, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    optimizer.zero_grad()
    model(batch).square().mean().backward()
    optimizer.step()
    return time.perf_counter() - start


def _train_rows(initial, models: dict, samples: dict, args, failures: list[str]) -> list[dict]:
    checked = {name: entry for name, entry in models.items() if name != "none"}
    diffs = _diffs_from_default(initial, checked)
    nodes = _node_count()
    rows = []
    for name, (model, describe) in models.items():
        row = {
            "world_size": dist.get_world_size(),
            "nodes": nodes,
            "hook": name,
            "describe": describe,
            "params": sum(p.numel() for p in initial.parameters()),
            "batch_size": args.batch_size,
            "steps": args.warmup + args.steps,
            **_slowest_rank_stats(samples[name]),
        }
        rows.append(row)
        if name not in checked:
            continue
        row["ranks_identical"] = _same_on_all_ranks(model.module.parameters())
        row.update(diffs.get(name, {}))
        if not row["ranks_identical"]:
            failures.append(f"{name}: parameters differ across ranks")
        if diffs and not row["max_abs_diff"] <= row["tolerance"]:
            failures.append(
                f"{name}: parameters {row['max_abs_diff']:.3g} from default's, "
                f"tolerance {row['tolerance']:.3g}"
            )
    default_ms = next((row["median_ms"] for row in rows if row["hook"] == "default"), None)
    for row in rows:
        row["x_vs_default"] = default_ms / row["median_ms"] if default_ms else None
    return rows


def _diffs_from_default(initial: torch.nn.Module, models: dict) -> dict:
    """Per hook, max |diff| of its final parameters from the default model's, and a tolerance."""
    if "default" not in models:
        return {}
    default = models["default"][0].module
    moved = _max_abs_diff(default, initial)
    largest = max(p.abs().max().item() for p in default.parameters())
    diffs = {}
    for name, (model, _) in models.items():
        # Gradients are rounded to the wire dtype, and updated parameters to float32.
        rounding = UNIT_ROUNDOFF[WIRE[name]] * moved + UNIT_ROUNDOFF[None] * largest
        diffs[name] = {
            "max_abs_diff": _max_abs_diff(model.module, default),
            "tolerance": PARAM_TOLERANCE_ROUNDINGS * rounding,
        }
    return diffs


def _max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)


def _same_on_all_ranks(tensors) -> bool:
    digest = hashlib.sha256()
    for p in tensors:
        digest.update(p.detach().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    return len(set(digests)) == 1


# --- accuracy mode -------------------------------------------------------------------------------


def bench_accuracy(args) -> dict:
    left_out, failures = {}, []
    methods = _accuracy_methods(args.methods, left_out)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    _progress(f"world {world_size}, {args.size} elements: {', '.join(methods)}")
    reference = torch.zeros(args.size, dtype=torch.float64)
    for other in range(world_size):
        reference += _random_input(args.seed, other, args.size, normal=True)
    reference /= world_size
    mine = _random_input(args.seed, rank, args.size, normal=True)
    rows = []
    for name, method in methods.items():
        result = method(mine.clone())
        error = (result.double() - reference).abs()
        # The largest over the ranks: rank 0's alone could hide a rank that got other bits.
        errors = torch.tensor([error.max().item(), error.mean().item()], dtype=torch.float64)
        dist.all_reduce(errors.nan_to_num_(nan=math.inf), op=dist.ReduceOp.MAX)
        row = {
            "world_size": world_size,
            "elements": args.size,
            "method": name,
            "wire": WIRE[name] or "fp32",
            "max_abs_error": errors[0].item(),
            "mean_abs_error": errors[1].item(),
            "ranks_identical": _same_on_all_ranks([result]),
        }
        if not math.isfinite(row["max_abs_error"]):
            failures.append(f"{name} on {world_size} ranks: non-finite error")
        if name.startswith("ddpx") and not row["ranks_identical"]:
            failures.append(f"{name} on {world_size} ranks: results differ across ranks")
        rows.append(row)
    by_name = {row["method"]: row for row in rows}
    for row in rows:
        compressed = row["method"].startswith("ddpx-")
        torch_row = by_name.get(f"torch-{row['wire']}") if compressed else None
        for stat in ("max", "mean"):
            row[f"{stat}_vs_torch"] = (
                row[f"{stat}_abs_error"] / torch_row[f"{stat}_abs_error"] if torch_row else None
            )
    return {"rows": rows, "left_out": left_out, "notes": [], "failures": failures}


def _accuracy_methods(requested: list[str], left_out: dict) -> dict:
    """The requested methods that work here, by name: each averages its float32 argument."""
    ddpx, why_not = _import_ddpx()
    world_size, methods = dist.get_world_size(), {}
    for name in requested:
        if name == "default":
            methods[name] = lambda t: _summed(t.div_(world_size))
        elif name.startswith("torch-"):
            hook = getattr(default_hooks, f"{WIRE[name]}_compress_hook")
            engine = functools.partial(_hooked, hook)
            # RuntimeError: gloo cannot sum the wire dtype here.
            _add_if_it_works(methods, name, engine, left_out, fails=RuntimeError)
        elif ddpx is None:
            left_out[name] = why_not
        else:
            engine = functools.partial(ddpx.all_reduce, average=True, compression=WIRE[name])
            _add_if_it_works(methods, name, engine, left_out)
    return methods


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _hooked(hook, tensor: torch.Tensor) -> torch.Tensor:
    """Average `tensor` in place with DDP comm hook `hook`, as DDP runs it on a bucket."""
    bucket = SimpleNamespace(buffer=lambda: tensor)  # what the hook reads of a GradBucket
    return hook(None, bucket).wait()


# --- reporting -----------------------------------------------------------------------------------


def report(args, result: dict) -> None:
    document = {
        "mode": args.mode,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": machine(),
        "settings": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
        **({"timing": TIMING[args.mode]} if args.mode in TIMING else {"errors": ERRORS}),
        **result,
    }
    print(format_report(document))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plots = {"allreduce": plot_allreduce, "train": plot_train, "accuracy": plot_accuracy}
        plots[args.mode](document["rows"], args.plot)


def machine() -> dict:
    ddpx, why_not = _import_ddpx()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads_per_rank": THREADS_PER_RANK,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddpx": ddpx.build_info() if ddpx else {"unavailable": why_not},
        "peers": {name: _version(name) for name in ("openmpi", "mpi4py", "deepspeed")},
    }


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        platform.processor(),
    )


def format_report(document: dict) -> str:
    machine = document["machine"]
    lines = [
        f"ddpx bench {document['mode']}: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['threads_per_rank']} thread per rank, torch {machine['torch']}",
        f"timing: {document['timing']}; median and p10-p90 over the samples"
        if "timing" in document
        else f"errors: {document['errors']}",
        _load_line(document["settings"]),
    ]
    left_out = {}
    for name, why in document["left_out"].items():
        left_out.setdefault(why, []).append(name)
    lines += [f"note: {', '.join(names)} left out: {why}" for why, names in left_out.items()]
    lines += [f"note: {note}" for note in document["notes"]]
    lines.append("")
    tables = {"allreduce": _allreduce_table, "train": _train_table, "accuracy": _accuracy_table}
    table = tables[document["mode"]]
    lines += table(document["rows"])
    return "\n".join(lines)


def _load_line(settings: dict) -> str:
    per_core, processes = settings.get("load", 0), len(settings.get("load_pids", []))
    if not per_core:
        return "load: none (idle)"
    plural = "process" if per_core == 1 else "processes"
    return f"load: {per_core} CPU-bound {plural} per core ({processes} in all)"


def _allreduce_table(rows: list[dict]) -> list[str]:
    inter_node = any(row.get("inter_node_bytes") is not None for row in rows)
    linked = any("link" in row for row in rows)
    header = (
        (f"{'link':>7}  " if linked else "")
        + f"{'world':>5}  {'size':>6}  {'engine':<10}  {'median ms':>10}  {'p10-p90 ms':>17}  "
        f"{'GB/s':>7}  {'x vs gloo':>9}  {'x vs best peer':>14}"
        + (f"  {'bound ms':>9}  {'x bound':>7}  {'model ms':>9}  {'x model':>7}" if linked else "")
        + (f"  {'inter-node MB/call':>18}" if inter_node else "")
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            (f"{row['link']:>7}  " if linked else "")
            + f"{row['world_size']:>5}  {format_size(row['size_bytes']):>6}  {row['engine']:<10}  "
            f"{row['median_ms']:>10.3f}  {_spread(row, 3):>17}  {row['gb_per_s']:>7.3g}  "
            f"{_ratio(row['x_vs_gloo']):>9}  {_ratio(row.get('x_vs_best_peer')):>14}"
            + (f"  {_ms(row.get('bound_ms')):>9}  {_ratio(row.get('x_bound')):>7}  "
               f"{_ms(row.get('model_ms')):>9}  {_ratio(row.get('x_model')):>7}" if linked else "")
            + (f"  {_megabytes(row):>18}" if inter_node else "")
        )
    if linked:
        lines.append(
            "bound: each node sends 2(N-1)/N of the message in the engine's wire dtype at the "
            "link's rate; x bound = median / bound (1.00 is the link's limit); model: "
            "ddpx.costmodel from the unshaped (none) row and the TCP rate, x model = median / model"
        )
        lines.append(_tcp_line(rows))
    peers = [peer for peer in PEERS if any(row["engine"] == peer for row in rows)]
    if peers:
        lines.append(f"x vs best peer: the fastest of {', '.join(peers)} in the cell / the engine")
    nodes = {row["world_size"]: row["nodes"] for row in rows if row.get("nodes", 1) > 1}
    if nodes:
        split = ", ".join(f"{size} ranks on {count}" for size, count in nodes.items())
        lines.append(f"nodes: {split}; inter-node MB/call: sent across nodes, all ranks")
    return lines


def _megabytes(row: dict) -> str:
    sent = row.get("inter_node_bytes")
    return "-" if sent is None else f"{sent / 1e6:.3f}"


def _train_table(rows: list[dict]) -> list[str]:
    header = (
        f"{'world':>5}  {'hook':<10}  {'median ms':>10}  {'p10-p90 ms':>13}  {'x vs default':>12}  "
        f"{'max |diff|':>10}  {'tolerance':>9}  path"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        diff = (
            f"{row['max_abs_diff']:>10.2e}  {row['tolerance']:>9.2e}"
            if "max_abs_diff" in row
            else f"{'':>21}"
        )
        lines.append(
            f"{row['world_size']:>5}  {row['hook']:<10}  {row['median_ms']:>10.1f}  "
            f"{_spread(row, 1):>13}  {_ratio(row['x_vs_default']):>12}  {diff}  {row['describe']}"
        )
    lines.append(
        f"MLP of {rows[0]['params']} parameters, batch {rows[0]['batch_size']} per rank, "
        f"{rows[0]['steps']} steps; max |diff|: final parameters vs default's"
    )
    nodes = rows[0].get("nodes", 1)
    if nodes > 1:
        lines.append(f"{rows[0]['world_size']} ranks on {nodes} nodes")
    if any("link" in row for row in rows):
        lines.append(_tcp_line(rows))
    return lines


def _tcp_line(rows: list[dict]) -> str:
    links = {row["link"]: row["tcp_bits_per_s"] for row in rows}
    measured = ", ".join(f"{rate} {bits / 1e9:.3f} Gbit/s" for rate, bits in links.items())
    return f"link: network namespaces, tbf-shaped both ways; one TCP stream carried {measured}"


def _accuracy_table(rows: list[dict]) -> list[str]:
    header = (
        f"{'world':>5}  {'method':<10}  {'wire':<4}  {'max |error|':>11}  {'mean |error|':>12}  "
        f"{'max vs torch':>12}  {'mean vs torch':>13}  identical on ranks"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['world_size']:>5}  {row['method']:<10}  {row['wire']:<4}  "
            f"{row['max_abs_error']:>11.3e}  {row['mean_abs_error']:>12.3e}  "
            f"{_ratio(row['max_vs_torch']):>12}  {_ratio(row['mean_vs_torch']):>13}  "
            f"{'yes' if row['ranks_identical'] else 'no'}"
        )
    lines.append(
        f"{rows[0]['elements']} standard normal float32 elements per rank, averaged; "
        "vs torch: smaller is more accurate"
    )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _spread(row: dict, digits: int) -> str:
    return f"{row['p10_ms']:.{digits}f}-{row['p90_ms']:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_size(size: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size}B"


def plot_allreduce(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    sizes = sorted({row["size_bytes"] for row in rows})
    figure, axes = plt.subplots(
        1, len(world_sizes), figsize=(6 * len(world_sizes), 4.5), squeeze=False, sharey=True
    )
    for ax, world_size in zip(axes[0], world_sizes, strict=True):
        for engine in dict.fromkeys(row["engine"] for row in rows):
            cells = [
                row for row in rows if (row["world_size"], row["engine"]) == (world_size, engine)
            ]
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
    axes[0][0].set_ylabel("ms per all-reduce (median, p10-p90)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_train(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    hooks = list(dict.fromkeys(row["hook"] for row in rows))
    width = 0.8 / len(hooks)
    figure, ax = plt.subplots(figsize=(2 + 1.2 * len(hooks) * len(world_sizes), 4.5))
    for index, hook in enumerate(hooks):
        cells = [row for row in rows if row["hook"] == hook]
        x = [
            world_sizes.index(row["world_size"]) + (index - (len(hooks) - 1) / 2) * width
            for row in cells
        ]
        medians = [row["median_ms"] for row in cells]
        below = [row["median_ms"] - row["p10_ms"] for row in cells]
        above = [row["p90_ms"] - row["median_ms"] for row in cells]
        ax.bar(x, medians, width, yerr=[below, above], capsize=3, label=hook)
    ax.set_xticks(range(len(world_sizes)), [f"{ws} ranks" for ws in world_sizes])
    ax.set(ylabel="ms per training step (median, p10-p90)", title="DDP step time by comm hook")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_accuracy(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    figure, axes = plt.subplots(
        1, len(world_sizes), figsize=(6 * len(world_sizes), 4.5), squeeze=False, sharey=True
    )
    for ax, world_size in zip(axes[0], world_sizes, strict=True):
        cells = [row for row in rows if row["world_size"] == world_size]
        x = range(len(cells))
        for offset, stat in ((-0.2, "max"), (0.2, "mean")):
            errors = [row[f"{stat}_abs_error"] for row in cells]
            ax.bar([i + offset for i in x], errors, 0.4, label=f"{stat} |error|")
        ax.set_xticks(x, [row["method"] for row in cells], rotation=30)
        ax.set(yscale="log", title=f"{world_size} ranks")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("|error| vs float64 reference")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


if __name__ == "__main__":
    main()
