"""Runs test bodies on several ranks at once: one spawned process per rank, a gloo process group
(or NCCL, one GPU per rank) over a FileStore in a temporary folder, results (or the first error)
back to the test. A RankPool keeps its ranks for many bodies (conftest.py's rank_pool fixture
shares them between tests); run_ranks starts fresh ones for one body. Also the launch helpers
the test modules share: torchrun, two nodes side by side, killing a launched job."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

# What the test modules import from here too.
from ddpx_bench.processes import (  # noqa: F401
    JOB_MARK,
    alive,
    die_with_parent,
    free_port,
    job_processes,
    kill_job,
    left_in_shm,
    segment_creator,
    shm_segments,
)

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
# How many times longer than here the harness waits for ranks and jobs to start and finish:
# tools/arm_run.sh runs tests under qemu-aarch64, where each process takes about a minute to
# import torch. What the tests assert of ddpx itself (how soon it raises, group timeouts) stays.
TIME_SCALE = float(os.environ.get("DDPX_TEST_TIME_SCALE", "1"))


def _serve(rank, world_size, store_path, tasks, results, env, backend, group_timeout):
    """A rank of a RankPool: joins the group, then runs each (fn, args) from ``tasks`` and puts
    (rank, "ok", pickled result) or (rank, "error", traceback) in ``results``, until None."""
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.set_debug_level_from_env()  # torch read it at import, before env was applied
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        if "ddpx" in backend:
            import ddpx  # noqa: F401 - registers the "ddpx" backend
        timeout = {} if group_timeout is None else {"timeout": timedelta(seconds=group_timeout)}
        dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank,
                                world_size=world_size, **timeout)
    except BaseException:  # noqa: BLE001 - the first run reports it
        results.put((rank, "error", traceback.format_exc()))
        return
    try:
        while (task := _next_task(tasks)) is not None:
            fn, args = task
            try:
                # Plain pickle copies tensors into the message; the queue's own pickler would
                # share their memory with the parent, which breaks once this process exits.
                results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
            except BaseException:  # noqa: BLE001 - report everything to the test
                results.put((rank, "error", traceback.format_exc()))
    finally:
        _end_group()


def _end_group() -> None:
    """Destroys this rank's process group unless a body already did, after the objects that
    hold it (see ddpx_bench/launch.py's _run_rank: the group must end before exit)."""
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _next_task(tasks):
    """The next task, or None when the pool closes or the test process is gone: a pytest killed
    by a CI timeout must not leave its ranks waiting for ever."""
    while True:
        try:
            return tasks.get(timeout=1)
        except queue.Empty:
            if not multiprocessing.parent_process().is_alive():
                return None


def train_small_ddp(rank: int, register=None, group=None) -> tuple[list, object]:
    """Job scripts take this function's source: DDP of a small MLP from seed 0 on ``group``
    (default: the world), 4 KB buckets, 5 SGD steps on data seeded by ``rank``.
    ``register(model)`` (a hook's registration) runs before the first step; returns the final
    parameters, as lists, and what it returned."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = DDP(net, process_group=group, bucket_cap_mb=0.004)
    registered = register(model) if register else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().flatten().tolist() for p in net.parameters()], registered


def _run_forked_rank(script: str, argv: list, env: dict, log_path: str) -> None:
    """A rank of fork_job: torchrun's environment for it, the script's folder its working
    directory, its output in log_path, the script run as __main__, then what an interpreter's
    exit runs (the process ends in os._exit), after the process group is destroyed as
    ddpx_bench/launch.py's _run_rank does."""
    import atexit
    import runpy

    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    die_with_parent()  # the fork server, which ends with the test process
    os.environ.update(env)
    os.chdir(os.path.dirname(script))
    torch.set_num_threads(1)
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        _end_group()
        atexit._run_exitfuncs()


def fork_job(source: str, folder: Path, world: int, nodes: int = 1, argv: tuple = (),
             env: dict | None = None, timeout: float = 180,
             wait_for_all: bool = False) -> tuple[list[int], str]:
    """Writes the job ``source`` to ``folder``/job.py and runs it (with ``argv``) as torchrun
    would start it on ``nodes`` nodes of world // nodes ranks each, but with every rank forked as
    RankPool's are: torchrun's environment for each (GROUP_RANK telling the nodes apart) and
    ``env``, ``folder`` as its working directory, its output in rank<N>.log there. The same job
    without a process per rank importing torch and torch._dynamo (about 6 s of a core each
    here).

    A rank that fails ends the job, the others killed, unless ``wait_for_all``; so does the
    timeout (times TIME_SCALE). Returns the ranks' exit codes (a killed rank's negative) and
    their output, which says which ranks were killed and why."""
    script = folder / "job.py"
    script.write_text(source)
    ctx = _rank_context()
    per_node = world // nodes
    port = free_port()
    ranks = []
    for rank in range(world):
        rank_env = {"RANK": str(rank), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node),
                    "GROUP_RANK": str(rank // per_node), "GROUP_WORLD_SIZE": str(nodes),
                    "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1", **(env or {})}
        process = ctx.Process(target=_run_forked_rank, args=(
            str(script), [str(arg) for arg in argv], rank_env,
            str(folder / f"rank{rank}.log")))
        process.start()
        ranks.append(process)
    deadline = time.monotonic() + timeout * TIME_SCALE
    while (any(p.is_alive() for p in ranks) and time.monotonic() < deadline
           and (wait_for_all or not any(p.exitcode for p in ranks))):
        time.sleep(0.1)
    running = [r for r, p in enumerate(ranks) if p.is_alive()]
    for process in ranks:
        if process.is_alive():
            process.kill()
        process.join()
    logs = ""
    if running and time.monotonic() >= deadline:
        logs = f"ranks {running} did not finish in {timeout * TIME_SCALE:g} s\n"
    elif running:
        logs = f"ranks {running} were killed: another rank failed\n"
    for r, process in enumerate(ranks):
        log = folder / f"rank{r}.log"
        output = log.read_text() if log.exists() else "(no output: it did not start)"
        logs += f"rank {r} (exit code {process.exitcode}):\n{output}\n"
    return [p.exitcode for p in ranks], logs


def run_nodes(source: str, tmp_path, nodes: int = 2) -> list[dict]:
    """Runs the job ``source`` as ``nodes`` nodes of 2 ranks on this machine (fork_job; its
    argument: tmp_path, where each rank writes rank<N>.json); returns those, in rank order,
    after checking that every rank succeeded."""
    codes, logs = fork_job(source, tmp_path, 2 * nodes, nodes, argv=(tmp_path,))
    assert codes == [0] * (2 * nodes), logs
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2 * nodes)]


def torchrun(tmp_path: Path, name: str, source: str, *args: str, timeout: float = 180) -> str:
    """Writes ``source`` to ``tmp_path / name`` and runs it on 2 ranks of one node with
    torchrun (one thread each), from tmp_path, with ``args``; asserts that it succeeded and that
    no rank aborted at exit (gloo's "terminate called without an active exception"), and
    returns what the ranks printed."""
    (tmp_path / name).write_text(source)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", name, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "terminate called" not in done.stderr, done.stderr
    return done.stdout


def folder_with_scripts(tmp_path: Path) -> Path:
    """``tmp_path``, seeing the repository's scripts/ through a link: a command written for the
    repository's root runs there, and what it writes, and the ranks' command lines, name
    tmp_path."""
    (tmp_path / "scripts").symlink_to(Path(__file__).resolve().parents[1] / "scripts")
    return tmp_path


def run_on_two_hosts(commands: list[str], tmp_path: Path) -> list[str]:
    """Runs commands[k] in a shell on host k of a two-host testbed whose addresses are 10.0.0.1
    and 10.0.0.2 (what the launch commands of the docs name), from folder_with_scripts(tmp_path);
    returns their outputs once both succeeded."""
    # Imported here: ddpx reads its settings when first imported, and the ranks this module
    # spawns set theirs (a test's env) before they import it.
    from ddpx_bench import testbed

    folder = folder_with_scripts(tmp_path)
    with testbed.Testbed(2, rate=None, subnet="10.0.0") as bed:
        assert bed.master_addr == "10.0.0.1"
        env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        jobs = [bed.popen(node, ["bash", "-c", command], env=env, cwd=folder,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for node, command in enumerate(commands)]
        outputs = bed.communicate(jobs, timeout=300)
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(outputs)
    return outputs


def _segments_of(pids) -> set[str]:
    """The ddpx segments in /dev/shm whose creator (the pid in their name) is one of ``pids``."""
    return {name for name in shm_segments() if segment_creator(name) in set(pids)}


def _rank_context():
    """Where ranks start: forked from a server process that imported torch once (about 3 s of a
    core per process here), so a rank starts in tens of milliseconds instead, yet as clean as a
    spawned one: the server runs no torch op and holds no thread, and ddpx, whose settings are
    read at its import, is imported by each rank after its environment is set. The server
    imports torch._dynamo too, which DDP's constructor and torch.compile import at their first
    call: another 2.5 s of a core in each rank that makes a DDP model."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


class RankPool:
    """``world_size`` rank processes (started as ``_rank_context`` says), each in one process
    group for its whole life (gloo, or NCCL with one GPU per rank; ``backend`` may be any
    init_process_group string, and "ddpx" and "cpu:ddpx,..." import ddpx first, which registers
    it; ``group_timeout`` in seconds),
    that run function after function: ``run(fn, *args)`` runs fn(rank, world_size, *args) on
    every rank and returns the results by rank. The ranks start at the first run.

    A run that fails (a rank raises, a rank dies, the ranks leave a ddpx segment in /dev/shm, or
    the timeout passes) raises AssertionError with the first failing rank's traceback and kills
    the ranks, since a collective left half done would poison the next run: that one starts
    fresh ranks, as does a run that finds a rank dead. ``close()`` (or the end of a ``with``
    block) ends them; no rank and no segment one of them created outlives it.
    """

    def __init__(self, world_size: int, backend: str = "gloo", env: dict | None = None,
                 group_timeout: float | None = None):
        self.world_size = world_size
        self._options = (dict(env or {}), backend, group_timeout)
        self._procs = []
        self._tasks = []
        self._results = None
        self._store_dir = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, by rank; empty before the first run and after close()."""
        return [p.pid for p in self._procs]

    def _start(self):
        ctx = _rank_context()
        self._store_dir = tempfile.TemporaryDirectory()
        store_path = os.path.join(self._store_dir.name, "store")
        self._results = ctx.Queue()
        # A queue per rank: from one shared queue a rank could take another rank's task.
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        for r in range(self.world_size):
            p = ctx.Process(target=_serve, args=(r, self.world_size, store_path, self._tasks[r],
                                                 self._results, *self._options))
            p.start()
            self._procs.append(p)

    def run(self, fn, *args, timeout: float = 120) -> list:
        """fn(rank, world_size, *args) on every rank; the results by rank. A hang is a failure,
        never a stuck suite: after ``timeout`` seconds (the ranks' start included) the ranks
        still running are killed."""
        __tracebackhide__ = True  # pytest shows the test's line and the rank's traceback
        if not all(p.is_alive() and alive(p.pid) for p in self._procs):
            self._end(grace=0)  # a dead rank broke the group: the others cannot leave it cleanly
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        try:
            outcome, failure = self._collect(timeout)
        except BaseException:  # an interrupt (Ctrl-C): the ranks are mid-body, kill them now
            self._end(grace=0)
            raise
        errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
        if errors:
            rank, text = min(errors.items())
            failure = f"rank {rank} failed:\n{text}"
        elif failure is None and len(outcome) < self.world_size:
            failure = f"only ranks {sorted(outcome)} of {self.world_size} reported"
        elif failure is None and _segments_of(self.pids):
            failure = f"the ranks left {sorted(_segments_of(self.pids))} in /dev/shm"
        if failure is not None:
            exits = [f"rank {r} exited with code {p.exitcode}"
                     for r, p in enumerate(self._procs) if not p.is_alive()]
            self._end(grace=0)
            raise AssertionError("\n".join([failure, *exits]))
        return [pickle.loads(outcome[r][1]) for r in range(self.world_size)]

    def _collect(self, timeout: float) -> tuple[dict, str | None]:
        """{rank: (status, value)} as the ranks report, until all have, one reports an error,
        every silent rank has exited, or the timeout passes (then also a failure message)."""
        outcome = {}
        timeout *= TIME_SCALE
        deadline = time.monotonic() + timeout
        while len(outcome) < self.world_size:
            missing = [r for r in range(self.world_size) if r not in outcome]
            exited = not any(self._procs[r].is_alive() for r in missing)
            try:
                # Once every missing rank has exited, whatever it sent is already queued.
                rank, status, value = self._results.get(timeout=1.0 if exited else 0.2)
            except queue.Empty:
                if exited:
                    break  # they exited without a word: reported by run
                if time.monotonic() > deadline:
                    return outcome, f"ranks {missing} did not finish in {timeout:g} s"
                continue
            outcome[rank] = (status, value)
            if status == "error":
                break
        return outcome, None

    def close(self) -> None:
        """Ends the ranks: each destroys its process group and exits (those still running after
        30 s are killed)."""
        for tasks in self._tasks:
            tasks.put(None)
        self._end(grace=30 * TIME_SCALE)

    def _end(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join()
        # A rank killed between creating its segment and unlinking it leaves it behind.
        for name in _segments_of(self.pids):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))
        for q in [*self._tasks, *([self._results] if self._results else [])]:
            q.cancel_join_thread()  # what no rank will read must not block this process's exit
            q.close()
        if self._store_dir is not None:
            self._store_dir.cleanup()
        self._procs, self._tasks, self._results, self._store_dir = [], [], None, None


def payload(src: int, dst: int, n: int, dtype=torch.float32, tag: int = 0) -> torch.Tensor:
    """What rank src sends rank dst: n values that name both ends, the tag and the position
    (bools: a pattern of them; complex: each value and its negation)."""
    values = torch.arange(n, dtype=torch.float64) + 1000 * src + 100 * dst + 10 * tag
    if dtype == torch.bool:
        return values.remainder(3) == 1
    if dtype.is_complex:
        return torch.complex(values, -values).to(dtype)
    return values.to(dtype)


def run_ranks(fn, world_size: int, *args, timeout: float = 120, env: dict | None = None,
              backend: str = "gloo", group_timeout: float | None = None):
    """Runs fn(rank, world_size, *args) on world_size fresh ranks, once: a RankPool for one run,
    closed after it. Returns the results by rank; raises as RankPool.run does."""
    with RankPool(world_size, backend, env, group_timeout) as pool:
        return pool.run(fn, *args, timeout=timeout)
