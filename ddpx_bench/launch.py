"""Starting the ranks of each world size: by torch.multiprocessing, or by mpirun when the `mpi`
engine runs; by one torchrun per node of a testbed (--link); or by a launcher. The ranks that
mpirun and torchrun start run `python -m ddpx_bench` with the command's arguments; rank 0 hands
back the result. And the --load processes."""

import contextlib
import datetime
import functools
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpx_bench.common import MPI_WORKDIR, mpirun_path, say
from ddpx_bench.mode import MODES
from ddpx_bench.processes import die_with_parent

PG_TIMEOUT = datetime.timedelta(minutes=5)
# How the ranks are placed on the cores: mpirun's --bind-to for the ranks it starts.
BINDINGS = ("none", "core")
# Set by ddpx-bench for the ranks it starts on its testbed (--link): where rank 0 writes its result.
TESTBED_RESULT = "DDPX_BENCH_TESTBED_RESULT"


def spawned(args, argv: list[str]) -> dict:
    """Run each world size in freshly started ranks, under the load; merge what their rank 0 wrote.

    The ranks are started by mpirun where the mode needs it (MPI joins only ranks it started:
    allreduce's `mpi` engine), else by torch.multiprocessing.
    """
    mode = MODES[args.mode]
    start = functools.partial(_mpirun, argv) if mode.uses_mpirun(args) else _spawn
    mode.prepare(args)
    runs = []
    with cpu_load(args.load) as load_pids:
        args.load_pids = load_pids  # for the JSON's settings
        for run in range(args.runs):
            results = []
            for world_size in args.world_sizes:
                if args.runs > 1:
                    say(f"run {run + 1}/{args.runs}, world size {world_size}: fresh ranks")
                with tempfile.TemporaryDirectory(prefix="ddpx-bench-") as workdir:
                    start(world_size, args, workdir)
                    results.append(json.loads(Path(workdir, "result.json").read_text()))
            runs.append(_merged(results))
    return runs[0] if len(runs) == 1 else _over_runs(runs, mode)


def _over_runs(runs: list[dict], mode) -> dict:
    """One result of several fresh launches: a row per cell (the mode's cell_keys) whose figures
    are the median over the runs, with each figure's worst run beside it as worst_<figure> (the
    largest time, the smallest ratio); every run's own result stays under "runs"."""
    keys = mode.cell_keys
    cells = {}
    for run in runs:
        for row in run["rows"]:
            cells.setdefault(tuple(row[key] for key in keys), []).append(row)
    rows = []
    for same_cell in cells.values():
        row = dict(same_cell[0], runs=len(same_cell))
        for figure, value in same_cell[0].items():
            if figure in keys or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            values = [other[figure] for other in same_cell if other.get(figure) is not None]
            if len(values) < len(same_cell):
                continue
            row[figure] = statistics.median(values)
            if figure.endswith("_ms") or figure in mode.bigger_is_better:
                worst = min if figure in mode.bigger_is_better else max
                row[f"worst_{figure}"] = worst(values)
        rows.append(row)
    return {**_merged(runs), "rows": rows, "runs": runs}


def on_testbed(args, argv: list[str]) -> dict:
    """Run each world size under each --link rate on --nodes network namespaces
    (ddpx_bench.testbed), one torchrun per node running this same command; merge what their rank 0
    wrote, each row with its link: the rate and the TCP payload rate measured on it, and what the
    mode adds (Mode.add_link_figures)."""
    from ddpx_bench import testbed  # root only: not loaded by the runs on this machine

    why_not = testbed.unavailable()
    if why_not:
        sys.exit(f"ddpx-bench: --link needs network namespaces, and {why_not}")
    results = []
    for rate in args.link:
        for world_size in args.world_sizes:
            with tempfile.TemporaryDirectory(prefix="ddpx-bench-") as workdir, \
                    testbed.Testbed(args.nodes, None if rate == "none" else rate,
                                    congestion=args.congestion) as bed:
                tcp = bed.measure_tcp()
                say(f"{args.nodes} nodes, link {rate}: TCP carries {tcp / 1e9:.3f} Gbit/s "
                    f"({args.congestion})")
                result_path = Path(workdir, "result.json")
                jobs = bed.torchrun(["-m", "ddpx_bench", *argv],
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
                row.update(link=rate, tcp_bits_per_s=tcp, tcp_congestion=args.congestion)
            results.append(result)
    merged = _merged(results)
    MODES[args.mode].add_link_figures(merged["rows"])
    return merged


def _merged(results: list[dict]) -> dict:
    """One result of the results of several runs (world sizes, links)."""
    return {
        "rows": [row for result in results for row in result["rows"]],
        "left_out": {name: why for result in results for name, why in result["left_out"].items()},
        "notes": list(dict.fromkeys(note for result in results for note in result["notes"])),
        "failures": [failure for result in results for failure in result["failures"]],
        "rank_threads": max(result["rank_threads"] for result in results),
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


def _mpirun(argv: list[str], world_size: int, args, workdir: str) -> None:
    """Start `world_size` ranks of this command (`argv`: its arguments) with mpirun; they find
    `workdir` in their environment. Raise CalledProcessError if mpirun fails (a rank failed: it
    said why)."""
    command = [mpirun_path(), "--allow-run-as-root", "--oversubscribe"]
    # mpirun binds the ranks itself, by core in rank order, as it does by default for 2 ranks.
    command += ["--bind-to", args.bind, "--map-by", "core", "-np", str(world_size)]
    command += [sys.executable, "-m", "ddpx_bench", *argv]
    # In ddpx-bench's session, as the --load processes are (see cpu_load); it dies with
    # ddpx-bench (its ranks die with it); what the ranks print is progress, so it goes to stderr:
    # stdout is for the table.
    mpirun = subprocess.Popen(
        command,
        env={**os.environ, MPI_WORKDIR: workdir},
        stdin=subprocess.DEVNULL,
        stdout=sys.stderr,
        preexec_fn=die_with_parent,
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


def _spawned_rank(rank: int, world_size: int, args, workdir: str) -> None:
    die_with_parent()
    if MPI_WORKDIR not in os.environ:  # mpirun has bound its ranks
        bind_rank(args.bind, rank)
    os.environ["GROUP_RANK"] = str(rank // (world_size // args.nodes))
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=PG_TIMEOUT
    )
    result = _run_rank(args)
    if rank == 0:
        Path(workdir, "result.json").write_text(json.dumps(result))


def mpirun_rank(args) -> None:
    """Run as one of the ranks that _mpirun started: MPI numbers them; the rest is as spawned."""
    rank, world_size = (int(os.environ[f"OMPI_COMM_WORLD_{key}"]) for key in ("RANK", "SIZE"))
    _spawned_rank(rank, world_size, args, os.environ[MPI_WORKDIR])


def bind_rank(binding: str, local_rank: int) -> None:
    """Bind this process, and the threads it starts from now on, as `binding` says: "core", to
    the local_rank-th core it may run on (modulo their number); "none" leaves it as it is."""
    if binding == "core" and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def _ignore_ctrl_c_and_die_with_parent() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an ignored signal stays ignored across exec
    die_with_parent()


def launched(args) -> dict | None:
    """Run as one rank of a launcher's job (torchrun, accelerate launch): its world size only."""
    if TESTBED_RESULT in os.environ:  # a rank of a testbed's torchrun, which dies with ddpx-bench
        die_with_parent()
    # One load per machine, started before this rank joins the group: no rank of the machine gets
    # past the barrier below before it runs.
    starts_load = os.environ.get("LOCAL_RANK", "0") == "0"
    with cpu_load(args.load if starts_load else 0) as load_pids:
        args.load_pids = load_pids  # for the JSON's settings
        bind_rank(args.bind, int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("gloo", timeout=PG_TIMEOUT)
        dist.barrier()
        world_size = dist.get_world_size()
        result = _run_rank(args)  # ends with a barrier: every rank is done before the load stops
    if int(os.environ["RANK"]) != 0:
        return None
    if TESTBED_RESULT in os.environ:  # a node of ddpx-bench's testbed: the parent reports
        Path(os.environ[TESTBED_RESULT]).write_text(json.dumps(result))
        return None
    if args.world_sizes != [world_size]:
        result["notes"].append(f"launched with WORLD_SIZE={world_size}: only that world size ran")
    return result


@contextlib.contextmanager
def cpu_load(per_core: int):
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
                # In ddpx-bench's session, with the ranks, as a user's `taskset ... &` in the
                # shell that launches the job: Linux's autogroups give each session its own share
                # of a core, and a load in a session of its own would compete only with that
                # share. A Ctrl-C is for ddpx-bench, which stops them.
                process = subprocess.Popen(
                    [sys.executable, "-c", "while True: pass"],
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_ignore_ctrl_c_and_die_with_parent,
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
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = MODES[args.mode].run(args)
        result["rank_threads"] = torch.get_num_threads()
        dist.barrier()  # the load, if any, stops after the last rank is done
        return result
    finally:
        # Free the DDP models (reference cycles) first, so that destroying the group really ends
        # it and joins gloo's threads. A group still alive at interpreter exit can abort there:
        # a gloo thread that drops a finished work's Python tensors then needs the GIL.
        gc.collect()
        dist.destroy_process_group()
