"""Benchmark ddpx against gloo and the other CPU all-reduces on one machine, one mode at a time.

The modes are ddpx_bench.mode.MODES: what each measures and reports is in its file's docstring
(`python -m pydoc ddpx_bench.allreduce`), its options in `ddpx-bench MODE --help`.

Run a mode: ddpx-bench spawns the ranks of each of --world_sizes itself, gloo over a FileStore in
a temporary folder, one thread per rank, and they end with it (on an error, Ctrl-C, or even
SIGKILL). The table goes to stdout, progress to stderr. `python -m ddpx_bench` is the same
command.

    ddpx-bench allreduce --json bench_out/allreduce.json --plot bench_out/allreduce.png

Under a launcher, the launcher's processes are the ranks and only its world size runs:

    accelerate launch --config_file scripts/configs/cpu.yaml -m ddpx_bench allreduce
    torchrun --nproc_per_node 4 -m ddpx_bench allreduce

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
--runs N (the modes whose rows name their cells, allreduce, collectives and train, on this
machine; default 1) launches the ranks of every world size N times afresh under the same load:
each cell's figures are then the median over the N launches, with the slowest launch's median
(worst ms) and the smallest ratio (worst x) beside them, and the JSON keeps every launch's own
result under "runs".
Under load one launch decides nothing:

    ddpx-bench allreduce --world_sizes 2 --sizes 64K,1M,25M --load 1 --bind core --runs 5
"""

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch.multiprocessing as mp

from ddpx_bench.common import MPI_WORKDIR, use_threads
from ddpx_bench.launch import BINDINGS, launched, mpirun_rank, on_testbed, spawned
from ddpx_bench.mode import MODES, int_list, non_negative, positive, threads
from ddpx_bench.report import report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    summary = __doc__.partition("\n\n")[0]
    examples = "".join(
        f"  ddpx-bench {name} --quick    # a first answer, in under a minute\n"
        for name, mode in MODES.items() if mode.quick
    ) + "".join(
        f"  ddpx-bench {name} --json bench_out/{name}.json --plot bench_out/{name}.png\n"
        for name in MODES
    )
    parser = argparse.ArgumentParser(
        prog="ddpx-bench",
        description=summary,
        epilog=f"examples:\n{examples}\nddpx-bench MODE --help: the mode's options. The options "
        "every mode takes (--load, --bind, --runs)\nand the launchers: python -m pydoc "
        "ddpx_bench.cli.\nThe table is printed; nothing is saved without --json (every run) or "
        "--plot.\nResults and how they were measured: docs/benchmarks.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(nodes=None, link=[], load_pids=[])
    subparsers = parser.add_subparsers(dest="mode", required=True)
    mode_parsers = {}
    for mode in MODES.values():
        subparser = subparsers.add_parser(
            mode.name,
            parents=[_common_options(list(mode.world_sizes))],
            help=mode.help,
            description=mode.description,
            epilog=f"What it measures and reports: python -m pydoc {type(mode).__module__}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if mode.quick:
            subparser.add_argument(
                "--quick",
                action="store_true",
                help=f"a first answer, in under a minute on 2 cores: {mode.quick_options}; an "
                f"option given beside --quick wins (the full run: ddpx-bench {mode.name})",
            )
        mode.add_arguments(subparser)
        mode_parsers[mode.name] = subparser
    args = parser.parse_args(argv)
    if getattr(args, "quick", False):
        # Parsed again with --quick's values as the defaults, so that only the options the command
        # line does not give take them, wherever --quick stands in it.
        mode_parsers[args.mode].set_defaults(**MODES[args.mode].quick)
        args = parser.parse_args(argv)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install matplotlib (or leave out --plot)")
    if importlib.util.find_spec("numpy") is None:
        parser.error("numpy is not installed, which the ranks need to agree (torch.distributed's "
                     'object collectives use it): pip install "ddpx[bench]"')
    if args.nodes is None:
        args.nodes = 2 if args.link else 1
    uneven = [size for size in args.world_sizes if args.nodes < 1 or size % args.nodes]
    if uneven:
        parser.exit(2, f"ddpx-bench: --nodes {args.nodes} does not divide world size {uneven[0]} "
                       "evenly\n")
    if args.runs > 1 and (MODES[args.mode].cell_keys is None or args.link
                          or "WORLD_SIZE" in os.environ):
        parser.exit(2, f"ddpx-bench: --runs launches the ranks afresh, which it does for "
                       f"{_modes_with_runs()} on this machine (not with --link, nor under a "
                       "launcher): leave --runs out\n")
    if "WORLD_SIZE" in os.environ and args.threads != 1:
        parser.exit(2, "ddpx-bench: under a launcher the ranks' threads are the launcher's "
                       "environment's: set OMP_NUM_THREADS and DDPX_THREADS there and leave "
                       "--threads out\n")
    if args.link and args.load:
        parser.exit(2, "ddpx-bench: --load with --link would load every node's cores, which are "
                       "the same cores: leave one of them out\n")
    return args


def _common_options(world_sizes: list[int]) -> argparse.ArgumentParser:
    """The options every mode takes; a parser of its own per mode, so each has its own defaults."""
    common = argparse.ArgumentParser(add_help=False)
    default = ",".join(map(str, world_sizes))
    common.add_argument(
        "--world_sizes",
        type=int_list,
        default=world_sizes,
        help=f"comma-separated world sizes to spawn (default {default}; a launcher's WORLD_SIZE "
        "wins)",
    )
    common.add_argument("--json", type=Path,
                        help="write the results and the machine here (else nothing is saved)")
    common.add_argument("--plot", type=Path, help="draw the results into this PNG")
    common.add_argument("--seed", type=int, default=0)
    common.add_argument(
        "--load",
        type=non_negative,
        default=0,
        metavar="N",
        help="run N CPU-bound processes per core for the whole run (default 0: idle)",
    )
    common.add_argument(
        "--runs",
        type=positive,
        default=1,
        help=f"fresh launches of the ranks ({_modes_with_runs()}; default 1): each cell's figures "
        "are the median over them with the worst beside it, the JSON keeps every run",
    )
    common.add_argument(
        "--threads",
        type=threads,
        default=1,
        metavar="T",
        help="threads per rank for torch, OpenMP (DeepSpeed's op) and ddpx (DDPX_THREADS), the "
        "same for every engine (default 1); 'default': leave OMP_NUM_THREADS and DDPX_THREADS "
        "unset, as mp.spawn does: torch's default, which ddpx lowers to each rank's share of the "
        "CPUs",
    )
    common.add_argument(
        "--bind",
        choices=BINDINGS,
        default="none",
        help="core: bind each rank (and its threads) to one core, rank r to core r mod cores, as "
        "mpirun binds 2 ranks by default; none: let them float (default)",
    )
    return common


def _modes_with_runs() -> str:
    names = [name for name, mode in MODES.items() if mode.cell_keys is not None]
    return ", ".join(names[:-1]) + " and " + names[-1]


def main(argv: list[str] | None = None) -> None:
    """Run `ddpx-bench` with `argv` (default: this command's arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if MPI_WORKDIR not in os.environ and "WORLD_SIZE" not in os.environ:
        use_threads(args.threads)
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
    report(MODES[args.mode], args, argv, result)
    if result["failures"]:
        sys.exit("ddpx-bench: " + "; ".join(result["failures"]))
