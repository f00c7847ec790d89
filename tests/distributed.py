"""Runs a test body on several ranks at once: one spawned process per rank, a gloo process group
(or NCCL, one GPU per rank) over a FileStore in a temporary folder, results (or the first error)
back to the test. Also the launch helpers the test modules share: torchrun, two nodes side by
side, killing a launched job."""

from __future__ import annotations

import gc
import json
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def _rank_main(rank, world_size, store_path, fn, args, results, env, backend, group_timeout=None):
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
        # Plain pickle copies tensors into the message; the queue's own pickler would share
        # their memory with the parent, which breaks once this process exits.
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - report everything to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            gc.collect()  # see ddpx/bench/launch.py's _run_rank: the group must end before exit
            dist.destroy_process_group()


def train_small_ddp(rank: int, register=None) -> tuple[list, object]:
    """Job scripts take this function's source: DDP of a small MLP from seed 0, 4 KB buckets,
    5 SGD steps on data seeded by ``rank``. ``register(model)`` (a hook's registration) runs
    before the first step; returns the final parameters, as lists, and what it returned."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model = DDP(net, bucket_cap_mb=0.004)
    registered = register(model) if register else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().flatten().tolist() for p in net.parameters()], registered


def job_processes(marker: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose command line contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry))
    return found


def kill_job(launcher: subprocess.Popen, marker: str) -> None:
    """SIGKILLs a launched job: the launcher's session (started with start_new_session), and the
    workers, which torch's launcher starts in sessions of their own and leaves running when it
    is killed; they are found by ``marker``, a string in their command lines. Returns once they
    are gone (or after 10 s)."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        launcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in job_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("ddpx-")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(source: str, tmp_path) -> list[dict]:
    """Runs the job ``source`` as two nodes of 2 ranks, one torchrun each on this machine (its
    argument: tmp_path, where each rank writes rank<N>.json); returns those, in rank order."""
    script = tmp_path / "job.py"
    script.write_text(source)
    port = free_port()
    nodes = [subprocess.Popen(
        [TORCHRUN, "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(port), str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
        for node in (0, 1)]
    try:
        logs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            kill_job(node, str(tmp_path))
    assert all(node.returncode == 0 for node in nodes), "\n".join(logs)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


def run_ranks(fn, world_size: int, *args, timeout: float = 120, env: dict | None = None,
              backend: str = "gloo", group_timeout: float | None = None):
    """Runs fn(rank, world_size, *args) on world_size ranks; returns the results by rank.
    ``backend`` may be any init_process_group string ("ddpx" and "cpu:ddpx,..." import ddpx
    first, which registers it); ``group_timeout`` (seconds) is the group's timeout.

    Raises AssertionError with a rank's traceback when any rank fails, when the ranks leave a
    ddpx segment in /dev/shm, and kills every rank still running when the timeout passes (a hang
    is a failure, never a stuck suite).
    """
    segments_before = shm_segments()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main,
                             args=(r, world_size, store_path, fn, args, results, env or {},
                                   backend, group_timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcome = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                missing = [r for r in range(world_size) if r not in outcome]
                exited = not any(procs[r].is_alive() for r in missing)
                try:
                    # Once every missing rank has exited, whatever it sent is already queued.
                    rank, status, value = results.get(timeout=1.0 if exited else 0.2)
                except queue.Empty:
                    if exited:
                        break  # they exited without a word: reported below
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"ranks {missing} did not finish in {timeout} s") from None
                    continue
                outcome[rank] = (status, value)
                if status == "error":
                    break
            for p in procs:
                p.join(timeout=30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    errors = {r: v for r, (s, v) in outcome.items() if s == "error"}
    if errors:
        rank, text = min(errors.items())
        raise AssertionError(f"rank {rank} failed:\n{text}")
    if len(outcome) < world_size:
        raise AssertionError(f"only ranks {sorted(outcome)} of {world_size} reported")
    leaked = shm_segments() - segments_before
    assert not leaked, f"the ranks left {sorted(leaked)} in /dev/shm"
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
