"""Faults injected for real: a rank SIGKILLed in the middle of training (2 and 4 ranks, on one
node or two; forked ranks with torchrun's environment) and while its peer waits to receive from
it, every rank SIGKILLed mid-all-reduce under torchrun, two jobs on the node at once, ranks whose
DDP models disagree, a /dev/shm too small for the segment (a private 1 MiB tmpfs mount), empty
tensors and foreign groups, and NaN/Inf gradients against DDP's default all-reduce."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import time

import pytest
import torch
from torch import nn

from distributed import (
    TIME_SCALE,
    TORCHRUN,
    fork_job,
    job_processes,
    kill_job,
    left_in_shm,
    run_ranks,
    shm_segments,
)


def launch(script: str, nproc: int, directory, *extra: str, env: dict | None = None,
           prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """Starts ``script`` (written into ``directory``) under torchrun, in its own session."""
    path = directory / "job.py"
    path.write_text(textwrap.dedent(script))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    command = [*prefix, TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
               "--monitor-interval=1", str(path), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=directory, start_new_session=True)
    proc.marker = str(directory)  # in every worker's command line: how reap() finds them
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    """Waits for a launched job; returns (exit status, output, seconds). Kills its whole session
    on timeout; the caller's ``finally: reap(proc)`` kills it on any other failure."""
    start = time.monotonic()
    timeout *= TIME_SCALE
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        reap(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"the job did not finish in {timeout:g} s:\n{out}") from None
    return proc.returncode, out, time.monotonic() - start


def run_job(script: str, nproc: int, directory, *extra: str, timeout: float,
            env: dict | None = None, prefix: tuple[str, ...] = ()) -> tuple[int, str, float]:
    """launch, then finish: the job's (exit status, output, seconds); nothing of it outlives
    this, however it ends."""
    proc = launch(script, nproc, directory, *extra, env=env, prefix=prefix)
    try:
        return finish(proc, timeout)
    finally:
        reap(proc)


def fork_to_fail(script: str, world: int, directory, *argv: str, nodes: int = 1,
                 env: dict | None = None) -> tuple[list[int], str, float]:
    """``script`` as a job of forked ranks in ``directory`` (distributed.fork_job), every rank
    left to end on its own however the others end: their exit codes, their output and the
    job's seconds."""
    start = time.monotonic()
    codes, out = fork_job(textwrap.dedent(script), directory, world, nodes, argv, env,
                          timeout=90, wait_for_all=True)
    return codes, out, time.monotonic() - start


def reap(proc: subprocess.Popen) -> None:
    kill_job(proc, proc.marker)


def assert_no_job_left(directory, pids=()) -> None:
    deadline = time.monotonic() + 10
    while job_processes(str(directory)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_processes(str(directory)), "processes of the job are still running"
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        # A pid that still exists must at least not be a live process of ours.
        assert pid not in job_processes(str(directory)), f"rank pid {pid} still running"


def read_pids(directory) -> list[int]:
    return [int(p.read_text()) for p in sorted(directory.glob("pid.*"))]


def wait_for_pids(proc: subprocess.Popen, directory, nproc: int) -> list[int]:
    """The pids of a launched job's ranks, once each has written its pid.N (within 60 s,
    times TIME_SCALE)."""
    deadline = time.monotonic() + 60 * TIME_SCALE
    while len(list(directory.glob("pid.*"))) < nproc:
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    return read_pids(directory)


def kill_every_rank(proc: subprocess.Popen, pids: list[int]) -> None:
    """SIGKILLs each rank of a launched job; its launcher must then fail."""
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    rc, out, _ = finish(proc, timeout=60)
    assert rc != 0, out


# ---------------------------------------------------------------------------------------------
# 1. A rank SIGKILLed in the middle of training

TRAIN_AND_DIE = """
    import os, signal
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ddpx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    # sparse: every gradient bucket sparse, which the process group sums.
    sparse = os.environ["HOOK"] == "sparse"
    net = (nn.EmbeddingBag(1000, 64, sparse=True) if sparse
           else nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    # int8+step: int8 across the nodes, each bucket's chunks in flight through backward and the
    # optimizer stepping each bucket on the engine's thread once reduced; and at step 5, when rank
    # 1 dies, a resumed model's first step, whose one bucket is reduced as the saved ones.
    # "process group": the hook's fallback where shared memory is too small (DDPX_SHM_MB).
    in_flight = os.environ["HOOK"] == "int8+step"

    def hooked(saved=None):
        model = DDP(net, bucket_cap_mb=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        state = ddpx.register_fused_hook(model, timeout=timedelta(seconds=10),
                                         compression="int8" if in_flight else None,
                                         optimizer=opt if in_flight else None)
        if saved is not None:
            state.load_state_dict(saved)
        return model, opt, state

    model, opt, state = hooked()
    open(f"path.{rank}", "w").write(state.describe())
    try:
        for step in range(1000):
            if rank == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            x = torch.randint(0, 1000, (32, 8)) if sparse else torch.randn(32, 64)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if in_flight and step == 4:
                model, opt, state = hooked(state.state_dict())
    except Exception as error:
        open(f"error.{rank}", "w").write(f"AT STEP {step}: {error}")
        raise
    print("UNREACHABLE: training finished", flush=True)
"""


@pytest.mark.parametrize("world, nodes, hook", [(2, 1, ""), (2, 1, "process group"),
                                                (2, 1, "sparse"), (4, 1, ""), (4, 2, ""),
                                                (4, 2, "int8+step")])
def test_a_rank_killed_mid_training_fails_the_job_everywhere(world, nodes, hook, tmp_path):
    before = shm_segments()
    env = {"HOOK": hook}
    if hook == "process group":
        env["DDPX_SHM_MB"] = "1"
    codes, out, elapsed = fork_to_fail(TRAIN_AND_DIE, world, tmp_path, nodes=nodes, env=env)
    assert codes == [-signal.SIGKILL if r == 1 else 1 for r in range(world)], out
    assert elapsed < 60 * TIME_SCALE, f"the job took {elapsed:.0f} s to fail"
    assert "UNREACHABLE" not in out
    # Every surviving rank raises at the step rank 1 died in, naming ddpx, the dead rank and the
    # bucket (directly, or as the message of the rank that aborted the all-reduce); through the
    # process group, the bucket, the path and why, and gloo's error; sparse buckets, which the
    # process group sums, the bucket and gloo's error.
    # (Each rank writes its error to its own file: the ranks' output lines interleave.)
    raised = {p.name: p.read_text() for p in tmp_path.glob("error.*")}
    assert sorted(raised) == [f"error.{r}" for r in range(world) if r != 1], out
    for name, line in raised.items():
        assert "AT STEP 5: ddpx:" in line, line
        assert "gradient bucket" in line, line
        if hook == "process group":
            assert "failed on the process-group path (" in line and "DDPX_SHM_MB" in line, line
            assert "gloo" in line, line
            continue
        if hook == "sparse":
            assert "(sparse) failed in the process group's all-reduce: " in line, line
            assert "gloo" in line, line
            continue
        if nodes == 1 or name == "error.0":  # rank 0 shares rank 1's node
            assert "rank 1 (pid" in line and "exited while" in line, line
    # Every hook took the path asked for, and spanned the nodes asked for: the other node learns
    # of the death from the cross-node link, which the dead rank's exit closed.
    for r in range(world):
        path = (tmp_path / f"path.{r}").read_text()
        if hook == "process group":
            assert "process group" in path and "zero-copy: no" in path, path
        else:
            assert path.startswith("ddpx shared memory"), path
            assert (f"and {nodes} nodes" in path) == (nodes > 1), path
    assert not left_in_shm(before)


RECEIVE_FROM_THE_DEAD = """
    import os, signal, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ddpx

    dist.init_process_group("ddpx", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    if rank == 0:
        dist.send(torch.ones(10), 1)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.empty(10), 0)
    start = time.monotonic()
    try:
        dist.recv(torch.empty(1000), 0)
    except Exception as error:
        open("error.1", "w").write(f"{time.monotonic() - start:.1f} s: {error}")
        raise
    print("UNREACHABLE: received from a dead rank", flush=True)
"""


def test_a_rank_killed_while_its_peer_waits_in_recv_fails_the_recv(tmp_path):
    """The ddpx backend's point-to-point: a receive from a rank that dies raises well within
    the group's timeout (300 s), naming the dead rank."""
    before = shm_segments()
    codes, out, _ = fork_to_fail(RECEIVE_FROM_THE_DEAD, 2, tmp_path)
    assert codes == [-signal.SIGKILL, 1] and "UNREACHABLE" not in out, out
    took, error = (tmp_path / "error.1").read_text().split(" s: ", 1)
    assert "ddpx: rank 0 exited while rank 1 waited to receive 4000 bytes (tag 0) from it" \
        in error, error
    assert float(took) < 30, took
    assert not left_in_shm(before)


# ---------------------------------------------------------------------------------------------
# 2. Every rank SIGKILLed mid-all-reduce; two jobs at once

REDUCE_FOREVER = """
    import os, sys, time
    import torch, torch.distributed as dist
    import ddpx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(3_000_000)
    ddpx.all_reduce(t)
    open(f"pid.{rank}", "w").write(str(os.getpid()))
    while True:
        ddpx.all_reduce(t, average=True)
"""


def test_every_rank_killed_mid_all_reduce_leaves_nothing_in_dev_shm(tmp_path):
    before = shm_segments()
    proc = launch(REDUCE_FOREVER, 3, tmp_path)
    try:
        pids = wait_for_pids(proc, tmp_path, 3)
        time.sleep(0.5)  # well inside the loop of 12 MB all-reduces
        kill_every_rank(proc, pids)
    finally:
        reap(proc)
    assert_no_job_left(tmp_path, pids)
    assert not left_in_shm(before), "a SIGKILLed job left its segment in /dev/shm"


REDUCE_MINE = """
    import sys
    import torch, torch.distributed as dist
    import ddpx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    base = float(sys.argv[1])
    for i in range(40):
        for n in (1000, 3_000_000):          # one-shot and two-phase schedules
            t = torch.full((n,), base * (rank + 1) + i)
            ddpx.all_reduce(t)
            expected = base * world * (world + 1) / 2 + world * i
            assert bool((t == expected).all()), (base, i, n, t[:3], expected)
    print(f"JOB {base} OK", flush=True)
"""


def test_two_jobs_at_once_each_get_their_own_sums(tmp_path):
    before = shm_segments()
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = []
    try:
        for d, base in zip(dirs, ("1", "1000"), strict=True):
            d.mkdir()
            procs.append(launch(REDUCE_MINE, 2, d, base))
        results = [finish(p, timeout=120) for p in procs]
    finally:
        for p in procs:
            reap(p)
    for (rc, out, _), base in zip(results, ("1", "1000"), strict=True):
        assert rc == 0, out
        assert f"JOB {float(base)} OK" in out
    for d in dirs:
        assert_no_job_left(d)
    assert not left_in_shm(before)


# ---------------------------------------------------------------------------------------------
# 3. Ranks whose DDP models disagree


def extra_parameter(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = nn.Sequential(nn.Linear(8, 8), *([nn.Linear(8, 8)] if rank == 1 else []))
    with pytest.raises(RuntimeError) as info:
        DDP(net)
    return str(info.value)


def test_an_extra_parameter_is_caught_by_ddp_at_construction_on_every_rank():
    # DDP's own shape check runs before any hook can be registered: ddpx never sees this model.
    messages = run_ranks(extra_parameter, 2, timeout=60)
    for m in messages:
        assert "DDP expects same model across all ranks" in m, m


def different_compression(rank, world):
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    # The same model, so DDP's checks pass (DDP also broadcasts rank 0's bucket layout after the
    # first step, so per-rank bucket_cap_mb cannot split buckets differently). A per-rank hook
    # setting is invisible to DDP: only the all-reduce can see it.
    model = DDP(net)
    ddpx.register_fused_hook(model, compression="bf16" if rank == 1 else None,
                             timeout=timedelta(seconds=10))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(4, 64)).sum().backward()
    return str(info.value), time.monotonic() - start


def test_ranks_with_different_hook_settings_raise_ranks_disagree_on_every_rank():
    results = run_ranks(different_compression, 2, timeout=60)
    for rank, (message, elapsed) in enumerate(results):
        assert "ddpx: ranks disagree on gradient bucket 0" in message, message
        assert f"rank {rank} has 4680 float32 elements (wire {'bfloat16' if rank else 'float32'}" \
            in message, message
        assert f"rank {1 - rank} has 4680 float32 elements" in message, message
        assert elapsed < 8, f"raised after {elapsed:.1f} s"


# ---------------------------------------------------------------------------------------------
# 4. /dev/shm too small, for real

SMALL_SHM = """
    import gc
    import os
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ddpx

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Each rank reports in its own file: the ranks' output lines interleave.
    report = open(f"report.{rank}", "w", buffering=1)
    shm = os.statvfs("/dev/shm")
    report.write(f"SHM {shm.f_blocks * shm.f_frsize}\\n")

    def train(hook):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
        if hook:
            state = ddpx.register_fused_hook(model)
            report.write(f"ENGINE {type(state.engine).__name__}\\n")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(10 + rank)
        for _ in range(5):
            model(torch.randn(8, 16, generator=data)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ours, default = train(True), train(False)
    for a, b in zip(ours, default, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    report.write("SAME PARAMETERS\\n")
    gc.collect()  # the models' reducers go before the group: see tests/test_trainers.py
    dist.destroy_process_group()
"""

UNSHARE = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh")


def unshare_works() -> str | None:
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    return None if done.returncode == 0 else done.stderr.strip() or f"rc {done.returncode}"


# A /dev/shm too small, for real (a private 1 MiB tmpfs) or as DDPX_SHM_MB caps it, and what
# each says to do.
SMALL = {"mount": ("/dev/shm has {} MiB free", ("--shm-size", "DDPX_BLOCK_KB")),
         "cap": ("DDPX_SHM_MB=1 lets a segment take 1 MiB of /dev/shm", ("unset DDPX_SHM_MB",))}


# Each way of being small and each outcome once by default; the other two pairs -m slow.
@pytest.mark.parametrize("small, strict", [("cap", False), ("mount", True),
                                           pytest.param("cap", True, marks=pytest.mark.slow),
                                           pytest.param("mount", False, marks=pytest.mark.slow)])
def test_a_dev_shm_too_small_falls_back_or_fails_strictly(small, strict, tmp_path):
    env = {"DDPX_STRICT": "1"} if strict else {}
    if small == "mount":
        why = unshare_works()
        if why is not None:
            pytest.skip(f"cannot mount a private 1 MiB /dev/shm here: {why}")
    else:
        env["DDPX_SHM_MB"] = "1"
    rc, out, _ = run_job(SMALL_SHM, 2, tmp_path, env=env,
                         prefix=UNSHARE if small == "mount" else (), timeout=90)
    said, fixes = SMALL[small]
    messages = {said.format(mib) for mib in (0, 1)}
    if small == "mount":  # the job really saw the 1 MiB /dev/shm
        assert (tmp_path / "report.0").read_text().startswith("SHM 1048576\n"), out
    if strict:
        assert rc != 0, out
        assert "DDPX_STRICT=1 forbids the process-group fallback" in out, out
        assert any(message in out for message in messages), out
        return
    assert rc == 0, out
    assert out.count("using the process group's all-reduce instead") == 1, out  # rank 0 only
    assert sum(out.count(message) for message in messages) == 1, out
    assert all(fix in out for fix in fixes), out
    for rank in (0, 1):
        report = (tmp_path / f"report.{rank}").read_text().splitlines()
        engines = [line for line in report if line.startswith("ENGINE")]
        assert engines == ["ENGINE Engine"], report  # the process-group path's, not ShmEngine
        assert report[-1] == "SAME PARAMETERS", report
    assert_no_job_left(tmp_path)


# ---------------------------------------------------------------------------------------------
# 5. Empty tensors, and a group that does not contain the caller


def empty_and_foreign(rank, world):
    import torch.distributed as dist

    import ddpx
    from ddpx.engine import engine_for

    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for shape in ((0,), (3, 0)):
            t = torch.empty(shape, dtype=dtype)
            assert ddpx.all_reduce(t, average=True) is t and t.shape == shape
    engine = engine_for(None)
    empty = torch.empty(0)
    assert engine.run_async(empty, 0.5, None, "gradient bucket 0").wait().numel() == 0
    # Empty on one rank only is a disagreement like any other, raised on every rank.
    with pytest.raises(RuntimeError, match="ranks disagree on ddpx.all_reduce: .*has 0 float32"):
        ddpx.all_reduce(torch.empty(0) if rank == 0 else torch.ones(10))
    # float64 after the empty calls: the engine is still in step.
    t = torch.arange(5, dtype=torch.float64) * (rank + 1)
    ddpx.all_reduce(t)
    assert torch.equal(t, torch.arange(5, dtype=torch.float64) * sum(range(1, world + 1)))
    # A hook state for a group the caller is not in.
    mine, other = dist.new_group([0, 1]), dist.new_group([2, 3])
    if rank >= 2:
        mine, other = other, mine
    with pytest.raises(ValueError, match=f"rank {rank} is not a member"):
        ddpx.FusedHookState(process_group=other)
    state = ddpx.FusedHookState(process_group=mine)
    t = torch.full((100,), float(rank))
    state.engine.run(t, state.scale, state.wire, "gradient bucket 0")
    expected = (0 + 1) / 2 if rank < 2 else (2 + 3) / 2
    assert torch.equal(t, torch.full((100,), expected))


def test_empty_tensors_and_a_foreign_group():
    run_ranks(empty_and_foreign, 4, timeout=90)


# ---------------------------------------------------------------------------------------------
# 6. NaN and Inf come out as DDP's default all-reduce gives them


def assert_same_specials(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a.isnan(), b.isnan()), "NaN in different places"
    keep = ~a.isnan()
    assert torch.equal(a[keep], b[keep]), "finite or infinite entries differ"


def non_finite(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    inf, nan = float("inf"), float("nan")
    for n in (64, 100_000):  # one-shot and two-phase schedules
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            t = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dtype)
            # 0: inf + inf, 1: inf + -inf, 2: nan + x, 3: -inf + x, 4: x + nan, 5: -inf + -inf
            specials = [(inf, inf), (inf, -inf), (nan, 1.0), (-inf, 2.0), (3.0, nan),
                        (-inf, -inf)]
            for i, pair in enumerate(specials):
                t[i * 7] = pair[rank]
                t[n - 1 - i] = pair[1 - rank]
            ours, theirs = t.clone(), t.clone()
            ddpx.all_reduce(ours, average=True)
            dist.all_reduce(theirs)
            theirs.div_(world)
            assert_same_specials(ours, theirs)
            assert ours[0] == inf and ours[5 * 7] == -inf and ours[7].isnan()
    # Through DDP: inputs with inf on rank 0 and NaN on rank 1 give inf and NaN (inf * 0)
    # gradient entries in the first layer's weight.
    grads = {}
    for hook in ("default", "cpp"):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2)), bucket_cap_mb=0.0001)
        if hook == "cpp":
            ddpx.register_fused_hook(model)
        x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
        x[rank, 1 + 2 * rank] = inf if rank == 0 else nan
        x[2, 4] = -inf if rank == 0 else 5.0
        model(x).sum().backward()
        grads[hook] = [p.grad.clone() for p in model.parameters()]
    weight = grads["default"][0]
    assert weight.isinf().any() and weight.isnan().any(), "the test must produce inf and NaN"
    for a, b in zip(grads["cpp"], grads["default"], strict=True):
        assert_same_specials(a, b)


def test_nan_and_inf_match_the_default_all_reduce():
    # Two ranks: x/2 is exact, so x*(1/2)+y*(1/2) and (x+y)/2 are the same bits for these values.
    run_ranks(non_finite, 2, timeout=90)
