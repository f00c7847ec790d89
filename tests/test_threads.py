"""A rank's threads (csrc/node/workers.h, ddpx/_cpu_share.py): a large all-reduce's
blocks claimed by several threads of every rank give the bits one thread gives, whatever each
rank's count; the engine counts the calls its helpers took part in; the policy gives each rank
its share of the CPUs it may run on, and lowers torch's intra-op threads to it where
OMP_NUM_THREADS is unset (mp.spawn's case), saying so once.

The thread counts here oversubscribe two cores, as users do: what is checked is the bits and the
counts, never a time (docs/benchmarks.md has the times, and the model of a larger machine).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from ddpx import _cpu_share, _process_wide, backend_of
from ddpx._ext import extension

from collective_checks import check, collecting, digest, expect_equal, make, quiet, rank_order_sum
from distributed import run_ranks

# Elements: under the threaded size (1 MiB), just over it, and several blocks per thread.
SIZES = [4097, 300_001, 3_000_001]
DTYPES = [torch.float32, torch.bfloat16]


def threaded_bits(rank, world, threads_by_rank):
    """Every rank sets its threads, then all-reduces arena and ordinary tensors on the shared and
    auto schedules; returns the results' digests, the large calls and the calls counted
    threaded. Rank 0 checks each result against the rank-order float32 sum, bit for bit."""
    quiet()
    engine = backend_of().engine
    engine.threads = threads_by_rank[rank]
    check(f"{threads_by_rank[rank]} thread" in engine.describe(), engine.describe())
    prints, large, threaded = {}, 0, engine.threaded_calls
    with collecting() as failures:
        for schedule in ("shared", "auto"):
            engine.schedule = schedule
            for _ in range(3):  # the ranks' reach and rank 0's choice are agreed a call late
                dist.all_reduce(torch.ones(4))
            for dtype in DTYPES:
                for n in SIZES:
                    inputs = [make(r, (n,), dtype, "threads") for r in range(world)]
                    for where in ("ordinary", "arena"):
                        t = inputs[rank].clone()
                        if where == "arena":
                            t = extension().arena_empty(n, dtype).copy_(t)
                        dist.all_reduce(t)
                        what = f"{schedule} {where} {dtype} n={n}"
                        if rank == 0:
                            expect_equal(t, rank_order_sum(inputs), what)
                        prints[what] = digest(t)
                        # Auto goes shared for large ordinary tensors only where rank 0 has
                        # threads; arena tensors go claimed on every schedule.
                        claimed = schedule == "shared" or where == "arena" or (
                            threads_by_rank[0] > 1)
                        large += int(claimed and n * dtype.itemsize >= 1 << 20)
        engine.schedule = "auto"
    return prints, large, engine.threaded_calls - threaded, failures


def test_any_thread_count_gives_one_threads_bits():
    """3 ranks (oversubscribing 2 cores): one thread each, then 3, 1 and 2 threads; and no fewer
    than one, with the reason."""
    one, mixed = (1, 1, 1), (3, 1, 2)
    results = run_ranks(_both, 3, one, mixed, backend="ddpx", timeout=300)
    for rank, ((prints_one, _, threaded_one, f1), (prints_mixed, large, threaded, f2), refused) \
            in enumerate(results):
        assert not f1 and not f2, (rank, f1 + f2)
        assert refused is not None and "at least one thread" in refused, refused
        assert prints_mixed == prints_one, rank
        assert threaded_one == 0, rank
        # A rank's helpers took part in every large call where it has helpers.
        assert threaded == (large if mixed[rank] > 1 else 0), (rank, threaded, large)
        assert large > 0
    assert all(r[0][0] == results[0][0][0] for r in results)


def _both(rank, world, one, mixed):
    try:
        backend_of().engine.threads = 0
        refused = None
    except ValueError as error:
        refused = str(error)
    return threaded_bits(rank, world, one), threaded_bits(rank, world, mixed), refused


# ---------------------------------------------------------------------------------------------
# The policy: each rank's share of its CPUs, and torch's threads where OMP_NUM_THREADS is unset


class _Engine:
    threads = None


def _share(monkeypatch, mine, peers, pool, omp=None, setting=None):
    """What use_cpu_share does for local rank 0 allowed ``mine``, its peers ``peers``, with
    torch running ``pool`` threads: (engine threads, torch threads set or None)."""
    set_to = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: pool)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(_cpu_share, "_THREADS", setting)
    monkeypatch.setattr(_process_wide, "_told_threads", False)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    engine = _Engine()
    _cpu_share.use_cpu_share(engine, 0, [frozenset(cpus) for cpus in [mine, *peers]])
    return engine.threads, set_to[0] if set_to else None


def test_unbound_ranks_share_the_cpus_and_torch_comes_down_to_the_share(monkeypatch, caplog):
    cpus = range(16)
    with caplog.at_level(logging.WARNING, logger="ddpx"):
        assert _share(monkeypatch, cpus, [cpus], pool=16) == (8, 8)
    assert "ddpx set torch.set_num_threads(8)" in caplog.text
    assert "OMP_NUM_THREADS" in caplog.text
    assert _share(monkeypatch, cpus, [cpus] * 3, pool=16) == (4, 4)
    # More ranks than CPUs: one thread each.
    assert _share(monkeypatch, range(2), [range(2)] * 3, pool=2) == (1, 1)


def test_bound_ranks_get_their_own_cores(monkeypatch):
    # mpirun --bind-to core: one core each, shared with nobody.
    assert _share(monkeypatch, {1}, [{0}], pool=1) == (1, None)
    # Bound to a socket each (8 cores), 4 ranks per socket.
    socket0, socket1 = range(8), range(8, 16)
    assert _share(monkeypatch, socket0, [socket0] * 3 + [socket1] * 4, pool=8) == (2, 2)


def test_the_users_threads_stay(monkeypatch):
    cpus = range(16)
    # OMP_NUM_THREADS set: torch's threads are the user's; the engine still takes its share.
    assert _share(monkeypatch, cpus, [cpus], pool=16, omp="16") == (8, None)
    # A pool already within the share is left alone.
    assert _share(monkeypatch, cpus, [cpus], pool=4) == (8, None)
    # DDPX_THREADS sets the engine's.
    assert _share(monkeypatch, cpus, [cpus], pool=16, setting=3) == (3, 8)


SPAWNED = """
    import os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    def rank(r, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        import ddpx
        before = torch.get_num_threads()
        dist.init_process_group("ddpx", rank=r, world_size=2)
        print(f"rank {r}: {before} -> {torch.get_num_threads()} "
              f"engine {ddpx.backend_of().engine.threads}", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(rank, args=(sys.argv[1],), nprocs=2)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to share")
@pytest.mark.parametrize("omp", [None, "2"])
def test_mp_spawn_without_omp_num_threads_gets_the_share(omp, tmp_path):
    from distributed import free_port

    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent(SPAWNED))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    cpus = len(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, str(script), str(free_port())], env=env,
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    share = cpus // 2
    before, after = (cpus, share) if omp is None else (int(omp), int(omp))
    for r in range(2):
        assert f"rank {r}: {before} -> {after} engine {share}" in out.stdout, out.stdout
    told = out.stderr.count(f"ddpx set torch.set_num_threads({share})")
    assert told == (1 if omp is None else 0), out.stderr
