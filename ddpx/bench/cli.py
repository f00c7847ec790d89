"""Benchmark ddpx against gloo and the other CPU all-reduces on one machine: the all-reduce alone,
the torch.distributed collectives through ddpx's backend, a DDP training step, an FSDP2 training
step through ddpx's backend, accuracy.

Run everything: ddpx-bench spawns the ranks of each of --world_sizes (default 2,4) itself, gloo
over a FileStore in a temporary folder, one thread per rank, and they end with it (on an error,
Ctrl-C, or even SIGKILL). The table goes to stdout, progress to stderr. On 2 cores, about 1.5
minutes for allreduce (more with the peers) and 2.5 for train; accuracy (default world sizes 4,8)
takes about a minute; collectives at least one (54 engines and cells of --min_time 1 s each); fsdp
about 3 (its bf16 cells, not run by default, about an hour on AVX2 cores: see fsdp).
The peers that allreduce compares with, OpenMPI (through mpi4py) and DeepSpeed, are optional:
`pip install -e ".[peers]"`. `python -m ddpx.bench` is the same command.

    ddpx-bench allreduce --json bench_out/allreduce.json --plot bench_out/allreduce.png
    ddpx-bench collectives --json bench_out/collectives.json --plot bench_out/collectives.png
    ddpx-bench train --json bench_out/train.json --plot bench_out/train.png
    ddpx-bench fsdp --json bench_out/fsdp.json --plot bench_out/fsdp.png
    ddpx-bench accuracy --json bench_out/accuracy.json --plot bench_out/accuracy.png

Smaller runs:

    ddpx-bench allreduce --world_sizes 2 --sizes 4K,1M --iters 5 --min_time 0.1
    ddpx-bench allreduce --world_sizes 4 --nodes 2    # as if on two machines
    ddpx-bench allreduce --sizes 4K,1M --engines gloo,ddpx,mpi,deepspeed,copy
    ddpx-bench collectives --world_sizes 2 --sizes 4K,64K --iters 3 --min_time 0.05
    ddpx-bench collectives --collectives all_reduce,all_gather,reduce_scatter,barrier
    ddpx-bench train --world_sizes 2 --params 2M --steps 5 --load 1   # busy machine
    ddpx-bench train --world_sizes 2 --comm_hooks default,ddpx --params 2M --steps 5
    ddpx-bench fsdp --world_sizes 2 --precisions fp32 --params 2M --steps 5
    ddpx-bench fsdp --world_sizes 2 --params 200K --layers 2 --steps 5 --load 1

Under a launcher, the launcher's processes are the ranks and only its world size runs:

    accelerate launch --config_file scripts/configs/cpu.yaml -m ddpx.bench allreduce
    torchrun --nproc_per_node 4 -m ddpx.bench allreduce

--load N (every mode; default 0, idle) measures on a busy machine: N CPU-bound processes per core
(the cores this process may run on) run for the whole run, each pinned to its core and
busy-looping in plain Python, as `taskset -c C python3 -c "while True: pass"` would. They start
before the ranks of the first world size and stop after the last, by the process that starts the
ranks (under a launcher: the rank with LOCAL_RANK 0 of each machine, with barriers, so that every
rank runs under the load), and they die with it, even by SIGKILL. The table's header says the
load ("load: 1 CPU-bound process per core (2 in all)"), the JSON's settings hold `load` and
`load_pids`:

    ddpx-bench allreduce --world_sizes 2 --sizes 1M --load 1

The load runs in ddpx-bench's session, with the ranks, as processes started from the job's shell
would: Linux's autogroups first share a core between sessions, so a load in a session of its own
would only compete with the job's share of it.

--bind core (every mode; default none) binds rank r, and every thread it starts, to core r modulo
the cores, before it starts any, as mpirun binds 2 ranks by default (the ranks mpirun starts are
bound by mpirun itself: --bind-to core --map-by core); --bind none leaves them to the scheduler.
--runs N (allreduce and train on this machine; default 1) launches the ranks of every world size
N times afresh under the same load: each cell's figures are then the median over the N launches,
with the slowest launch's median (worst ms) and the smallest ratio (worst x) beside them, and the
JSON keeps every launch's own result under "runs". Under load one launch decides nothing:

    ddpx-bench allreduce --world_sizes 2 --sizes 64K,1M,25M --load 1 --bind core --runs 5

allreduce: one in-place sum of a float32 tensor of each of --sizes (bytes; K, M, G are powers of
1024) on each of --world_sizes, by each engine: `gloo` (torch.distributed.all_reduce), `ddpx`
(ddpx.all_reduce), `ddpx-fp16` and `ddpx-bf16` (ddpx.all_reduce with that compression), the peers
`mpi` (OpenMPI's MPI_Allreduce through mpi4py, in place on the tensor's own memory) and
`deepspeed` (DeepSpeed's CPU shared-memory all-reduce, the op deepspeed.comm calls for
inference_all_reduce, called directly; its first use compiles it, about a minute, into
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, before any timing), and `copy`, which is
not an all-reduce: every rank at once copies its tensor into a buffer of the same size, the least
memory traffic (read the tensor, write a result) any in-place all-reduce needs, a floor to read
the others against (it is timed, not checked). Three more, not run unless named, ddpx with
another schedule than its default (one-shot up to 32 KiB, slices in 256 KiB steps above;
docs/under-load.md): `ddpx-oneshot`, every rank sums whole blocks up to 4 MiB; `ddpx-wide`,
slices in 4 MiB steps; `ddpx-timed`, local rank 0 timing the three per size as it runs. Engines
that do not work here are left out with a note (the peers when not installed;
`deepspeed` with --nodes, as its op spans one node only, while `gloo` and `mpi` reduce the
simulated nodes as one machine; the fixed schedules with --nodes, which always split).
MPI needs ranks that mpirun starts: when `mpi` runs, ddpx-bench starts each world size with
`mpirun --oversubscribe --bind-to none -np W python -m ddpx.bench <the same arguments>` instead of
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

collectives: each of --collectives called through torch.distributed, on the gloo world and on a
group of the same ranks with ddpx's backend (`import ddpx` registers it: dist.new_group(ranks,
backend="ddpx")), in the same processes, for float32 inputs of each of --sizes (default
64K,1M,25M) on each of --world_sizes: `all_reduce` (an in-place sum; also by ddpx.all_reduce, the
engine's own API, as a third engine), `all_gather_into_tensor` and `all_gather` (the list form;
every rank's input of `size` bytes, an output of world size x size), `reduce_scatter_tensor` and
`reduce_scatter` (the list form; an input of `size` bytes, an output of size / world size, left
out where the input does not split evenly), `broadcast` (from rank 0) and `barrier` (no data: one
cell per world size). The default is all_reduce,all_gather_into_tensor,reduce_scatter_tensor,
broadcast. all_gather_into_tensor and reduce_scatter_tensor are called as all_gather_single and
reduce_scatter_single where torch has those (the same calls, without a deprecation warning). In
each cell (world size, collective, size), as for allreduce:
  - each engine runs it once on random inputs, and every rank's result is compared with the
    reference: a float64 sum for all_reduce and the reduce_scatters (within allreduce's
    tolerance; ddpx's all-reduces must also give every rank the same bits), the inputs themselves,
    bit for bit, for the gathers and broadcast; for the barrier, the last rank enters it 10 ms
    late and no rank may leave it before. A wrong result stops the run with exit status 1;
  - then the engines take turns timing it on zero-filled inputs, --iters samples each, a sample
    the slowest rank's mean time per call in a batch begun right after a barrier.
Reported per cell: each engine's median in ms; gloo/ddpx = gloo's median / ddpx's (bigger: ddpx
faster); ddpx/ddpx.all_reduce = the ddpx backend's median / ddpx.all_reduce's (bigger: the engine's
own API faster); and which path served the ddpx backend's calls of the cell, from its routes()
(`engine`, `gloo`, or both with their counts); the JSON holds p10-p90 and the counts. A footer
says what the sizes mean, the notes the path (describe()) of the ddpx backend and of
ddpx.all_reduce. Where ddpx registers no backend, the ddpx column is left out with a note.

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

fsdp: FSDP2 training steps (forward, backward, AdamW step of --lr, default 1e-3) of a transformer:
--layers (default 8) post-norm torch.nn.TransformerEncoderLayer of --heads (default 8) heads,
feed-forward 4 x d_model and no dropout, and a linear head, d_model the multiple of 8 x --heads
that comes nearest to --params parameters in all (default 25M: d_model 512, 25.5M), on
--batch_size (default 8) sequences of --seq_len (default 64) random tokens per rank, against random
targets (mean squared error). fully_shard shards each layer and the root once over the gloo world
and once over a group of the same ranks with ddpx's backend (dist.new_group(ranks,
backend="ddpx")), in the same processes, from the same parameters on the same data, for each of
--precisions (default fp32): `fp32`, and `bf16` (MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.bfloat16): bfloat16 gathers of the parameters, compute and reduce-scatters of
the gradients, float32 sharded parameters for AdamW). In each cell (world size, precision):
  - both models take --warmup steps (default 2), then the ddpx model's parameters are compared
    with the gloo model's. fp32: max |diff| at most a tenth of lr x --warmup, the furthest AdamW
    can move a parameter in the warm-up (a wrong reduction moves them about that far apart; gloo's
    and ddpx's roundings, which differ at 3+ ranks, much less; at 2 ranks they give the same
    bits), the attention's key biases left out (their true gradient is 0: Adam turns rounding
    noise into steps). bf16: the updates (parameters after the warm-up minus before, as one
    vector) have cosine at least 0.98. Models that are apart stop the run with exit status 1;
  - then --steps timed steps each (default 10), the models taking turns step by step; a sample is
    one step on the slowest rank, started right after a barrier.
Reported per cell: each group's median ms per step; gloo/ddpx = gloo's median / ddpx's (bigger:
ddpx faster); the comparison after the warm-up (same bits, max |diff| or cosine); which path served
the ddpx backend's calls of the cell, from its routes() (FSDP2's all_gather_into_tensor and
reduce_scatter_tensor, the comparison's all_gather_into_tensor_coalesced). The JSON holds p10-p90,
the counts and the comparison's numbers. A CPU without bfloat16 instructions (AVX512-BF16, AMX)
multiplies bfloat16 matrices far more slowly than float32 ones (AVX2: about 200 times), so there
the bf16 cells time mostly the compute. Where ddpx registers no backend, its column is left out
with a note.

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
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch.multiprocessing as mp

from ddpx.bench import testbed
from ddpx.bench.accuracy import METHODS
from ddpx.bench.allreduce import ENGINES, SCHEDULES
from ddpx.bench.collectives import COLLECTIVES, DEFAULT_COLLECTIVES
from ddpx.bench.common import MPI_WORKDIR
from ddpx.bench.fsdp import PRECISIONS
from ddpx.bench.launch import BINDINGS, CELL_KEYS, launched, mpirun_rank, on_testbed, spawned
from ddpx.bench.report import report
from ddpx.bench.train import COMM_HOOKS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="ddpx-bench",
        description=summary,
        epilog=details,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        default=[engine for engine in ENGINES if engine not in SCHEDULES],
        help=f"comma-separated, from {','.join(ENGINES)} (default all but "
        f"{', '.join(SCHEDULES)})",
    )
    _timing_options(allreduce)
    _node_options(allreduce)

    collectives = modes.add_parser(
        "collectives",
        parents=[common],
        help="time the torch.distributed collectives on gloo and on ddpx's backend",
    )
    collectives.add_argument(
        "--sizes",
        type=_size_list,
        default=_size_list("64K,1M,25M"),
        help="comma-separated sizes of each rank's input in bytes, K/M/G suffixes "
        "(default 64K,1M,25M)",
    )
    collectives.add_argument(
        "--collectives",
        type=_choice_list(COLLECTIVES),
        default=list(DEFAULT_COLLECTIVES),
        help=f"comma-separated, from {','.join(COLLECTIVES)} (default "
        f"{','.join(DEFAULT_COLLECTIVES)})",
    )
    _timing_options(collectives)

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

    fsdp = modes.add_parser(
        "fsdp",
        parents=[common],
        help="time FSDP2 training steps on gloo and on ddpx's backend",
    )
    fsdp.add_argument(
        "--precisions",
        type=_choice_list(PRECISIONS),
        default=["fp32"],
        help=f"comma-separated, from {','.join(PRECISIONS)} (default fp32: see bf16 above)",
    )
    fsdp.add_argument(
        "--params",
        type=_count,
        default=_count("25M"),
        help="parameters of the transformer, with K/M suffixes (powers of 1000): d_model is the "
        "multiple of 8 x --heads that comes nearest (default 25M: d_model 512)",
    )
    fsdp.add_argument("--layers", type=int, default=8, help="encoder layers (default 8)")
    fsdp.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    fsdp.add_argument("--batch_size", type=int, default=8, help="sequences per rank (default 8)")
    fsdp.add_argument("--seq_len", type=int, default=64, help="tokens per sequence (default 64)")
    fsdp.add_argument("--steps", type=int, default=10, help="timed steps per model and precision")
    fsdp.add_argument(
        "--warmup",
        type=_positive,
        default=2,
        help="untimed steps per model and precision, after which the models are compared",
    )
    fsdp.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")

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
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib (or leave out --plot)")
    if args.nodes is None:
        args.nodes = 2 if args.link else 1
    return args


def _timing_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iters", type=int, default=20, help="timed samples per engine and cell")
    parser.add_argument(
        "--min_time",
        type=float,
        default=1.0,
        help="seconds the samples of one engine and cell last at least",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="calls per engine and cell that size its batches"
    )


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
    common.add_argument(
        "--runs",
        type=_positive,
        default=1,
        help="fresh launches of the ranks (allreduce and train; default 1): each cell's figures "
        "are the median over them with the worst beside it, the JSON keeps every run",
    )
    common.add_argument(
        "--bind",
        choices=BINDINGS,
        default="none",
        help="core: bind each rank (and its threads) to one core, rank r to core r mod cores, as "
        "mpirun binds 2 ranks by default; none: let them float (default)",
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a count, 1 or more")
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


def main(argv: list[str] | None = None) -> None:
    """Run `ddpx-bench` with `argv` (default: this command's arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    uneven = [size for size in args.world_sizes if args.nodes < 1 or size % args.nodes]
    if uneven:
        sys.exit(f"ddpx-bench: --nodes {args.nodes} does not divide world size {uneven[0]} evenly")
    if args.runs > 1 and (args.mode not in CELL_KEYS or args.link or "WORLD_SIZE" in os.environ):
        sys.exit("ddpx-bench: --runs launches the ranks afresh, which it does for allreduce and "
                 "train on this machine (not with --link, nor under a launcher): leave --runs out")
    if args.link and args.load:
        sys.exit("ddpx-bench: --load with --link would load every node's cores, which are the same "
                 "cores: leave one of them out")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if MPI_WORKDIR in os.environ:
            result = mpirun_rank(args)
        elif "WORLD_SIZE" in os.environ:
            result = launched(args)
        elif args.link:
            result = on_testbed(args, argv)
        else:
            result = spawned(args, argv)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        sys.exit(f"ddpx-bench: rank {exc.error_index} failed:{exc}")
    except subprocess.CalledProcessError as exc:
        sys.exit(f"ddpx-bench: {exc.cmd} failed with status {exc.returncode} (errors above)")
    except KeyboardInterrupt:
        sys.exit("ddpx-bench: interrupted")
    if result is None:
        return
    if not result["rows"]:
        sys.exit(f"ddpx-bench: nothing to measure; left out: {result['left_out']}")
    report(args, argv, result)
    if result["failures"]:
        sys.exit("ddpx-bench: " + "; ".join(result["failures"]))
