"""How ranks wait for each other, on an idle machine and on a busy one (a CPU-bound process
outside the job on every core): what each wait did, from the engine's own counts and the kernel's
count of the thread's context switches, never from timings."""

import os
import resource
import time

import pytest
import torch

from distributed import alive, run_ranks

CPUS = len(os.sched_getaffinity(0))
# A sleeper checks its peers every 100 ms (csrc/node/waiter.h, kPoll), and a yield that gave
# the CPU away bans yielding for at least 100 ms (kFirstYieldBan).
POLL_S = BAN_S = 0.1
# (elements, calls): one-shot single-block calls, and 25 MB two-phase calls of 100 blocks.
CALLS = [(16 * 1024, 300), (25 * 1024 * 1024 // 4, 4)]


@pytest.fixture
def busy_machine():
    """One CPU-bound process pinned to each core for the test, gone after it: the benchmark's
    --load 1."""
    # Not imported at the top: the ranks import this module before run_ranks sets their
    # environment, and ddpx reads its settings (DDPX_BLOCK_KB) when it is imported.
    from ddpx_bench.launch import cpu_load

    with cpu_load(1) as pids:
        time.sleep(0.2)
        assert all(alive(pid) for pid in pids)
        yield len(pids)
    assert not any(alive(pid) for pid in pids)


@pytest.fixture
def two_cpus():
    """The test process on 2 of its CPUs for the test, so the ranks and the load it starts run
    there as on a 2-CPU machine: 4 ranks oversubscribe them on any machine."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:2])
    yield
    os.sched_setaffinity(0, allowed)


def waits_of_calls(rank, world):
    """Reduces CALLS; returns what this rank's waits did and whether every sum was exact."""
    import ddpx
    from ddpx.engine import engine_for

    engine = engine_for()
    ddpx.all_reduce(torch.ones(8))
    before, usage = engine.wait_stats, resource.getrusage(resource.RUSAGE_THREAD)
    start, exact = time.monotonic(), True
    for numel, calls in CALLS:
        # Small integers: the float32 sum is exact, so it must equal the reference.
        x = torch.arange(numel, dtype=torch.float32).remainder_(97).add_(rank)
        expected = x * world - rank * world + sum(range(world))
        for _ in range(calls):
            y = x.clone()
            ddpx.all_reduce(y)
            exact = exact and torch.equal(y, expected)
    elapsed = time.monotonic() - start
    after, usage_after = engine.wait_stats, resource.getrusage(resource.RUSAGE_THREAD)
    stats = {key: after[key] - before[key] for key in after}
    stats["voluntary_switches"] = usage_after.ru_nvcsw - usage.ru_nvcsw
    return stats, elapsed, exact


def check_bounded(stats: dict, elapsed: float, world: int) -> None:
    # A wait sleeps on each rank it waits for at most once (that rank's publish wakes it), and
    # once more per 100 ms it lasts.
    assert stats["sleeps"] <= (world - 1) * (stats["waits"] + elapsed / POLL_S), stats
    # Waiting is part of the calls' time, and there is some whenever a wait happened.
    assert (stats["waits"] > 0) == (stats["waited_ns"] > 0), stats
    assert stats["waited_ns"] <= elapsed * 1e9, (stats, elapsed)
    # The thread gives up its CPU only in those sleeps (sched_yield does not count here).
    assert stats["voluntary_switches"] <= stats["sleeps"] + 20, stats


@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs for 2 ranks without oversubscription")
def test_busy_machine_no_yields_and_a_bounded_sleep_per_wait(busy_machine):
    for stats, elapsed, exact in run_ranks(waits_of_calls, 2, timeout=180):
        assert exact
        # With a CPU for each rank, a wait never hands its CPU to the scheduler's next task
        # (under load that is a process outside the job, for a whole time slice).
        assert stats["yields"] == 0, stats
        check_bounded(stats, elapsed, 2)
        assert stats["waits"] > 0, "the load did not make any rank wait: the test shows nothing"


def test_oversubscribed_busy_machine_stops_yielding(two_cpus, busy_machine):
    for stats, elapsed, exact in run_ranks(waits_of_calls, 4, timeout=300):
        assert exact
        # A yield that gave the CPU away bans yielding for 100 ms and more: at most one per ban.
        assert stats["lost_yields"] <= 1 + elapsed / BAN_S, (stats, elapsed)
        check_bounded(stats, elapsed, 4)


def test_oversubscribed_idle_machine_hands_the_cpu_to_peers(two_cpus):
    results = run_ranks(waits_of_calls, 4, timeout=180)
    assert all(exact for _, _, exact in results)
    # With more ranks than CPUs the awaited rank is most likely queued on this CPU: yield to it.
    assert sum(stats["yields"] for stats, _, _ in results) > 0
    for stats, elapsed, _ in results:
        check_bounded(stats, elapsed, 4)


def stats_and_engine(rank, world):
    from ddpx.engine import engine_for

    engine = engine_for()
    return hasattr(engine, "wait_stats"), type(engine).__name__


def test_wait_stats_only_on_the_shared_memory_engine():
    # Blocks larger than /dev/shm make every rank fall back to the process group.
    huge_blocks = {"DDPX_BLOCK_KB": str(1 << 30)}
    for has_wait_stats, engine in run_ranks(stats_and_engine, 2, env=huge_blocks):
        assert engine == "Engine"  # the process-group path's, not ShmEngine
        assert not has_wait_stats


def _bind(cpu: int) -> None:
    """Binds the calling thread, which makes every ddpx call of the tests, to `cpu`."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[cpu % CPUS]})


def bound_waits_of_calls(rank, world):
    """waits_of_calls with each rank bound to a core of its own, as mpirun binds 2 ranks."""
    from ddpx.engine import engine_for

    _bind(rank)
    result = waits_of_calls(rank, world)
    engine = engine_for()
    # ShmChannel has no field yet for a binding apart from the peers: describe() says it.
    return (*result, {"described": engine.describe(), "shared_now": engine.shared_now,
                      "always_one_shot_bytes": engine.always_one_shot_bytes})


@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs to bind 2 ranks apart")
def test_bound_busy_machine_no_yields(busy_machine):
    # Each rank and a process outside the job share one core. A rank alone in its binding is
    # not oversubscribed: its peer runs elsewhere, and a yield would hand the core to the other
    # process for a time slice at every wait (the cliff mpirun's default binding showed).
    for stats, elapsed, exact, engine in run_ranks(bound_waits_of_calls, 2, timeout=180):
        assert exact
        assert stats["yields"] == 0, stats
        check_bounded(stats, elapsed, 2)
        assert stats["waits"] > 0, "the load did not make any rank wait: the test shows nothing"
        assert "spin up to 500 us (this rank is bound apart from its peers)" in engine["described"]
        # Each rank waits for its core about half the time: the calls over 32 KiB go shared.
        assert engine["always_one_shot_bytes"] == 32 * 1024 and engine["shared_now"], engine


def rebound_yields(rank, world):
    """The yields of calls with the ranks unbound, then with every rank bound to one CPU."""
    import ddpx
    from ddpx.engine import engine_for

    engine = engine_for()
    yields, policies = [], []
    for bind in (False, True):
        if bind:
            _bind(0)
        before = engine.wait_stats["yields"]
        # Long enough for the ranks to measure how long they wait for their CPUs (every 0.1 s).
        for _ in range(30_000):
            ddpx.all_reduce(torch.ones(1024))
        yields.append(engine.wait_stats["yields"] - before)
        policies.append({"oversubscribed": engine.oversubscribed, "shared_now": engine.shared_now})
    return yields, policies


@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs for the unbound half")
def test_ranks_rebound_to_one_cpu_yield_to_each_other():
    # The bindings are read at every call: unbound, 2 ranks have 2 CPUs and never yield; bound
    # to one CPU together, the awaited rank can only run when this one gives the CPU up.
    results = run_ranks(rebound_yields, 2, timeout=120)
    for (unbound, _), (free, together) in results:
        assert unbound == 0
        assert not free["oversubscribed"] and together["oversubscribed"], (free, together)
        # Sharing one CPU, each waits while the other runs. (Unbound, whether a rank waits for
        # its CPU depends on what else the machine runs, which a test must not assume.)
        assert together["shared_now"], (free, together)
    assert sum(bound for (_, bound), _ in results) > 0


def sums_while_a_peer_is_stopped(rank, world):
    """Rank 1 is stopped (SIGSTOP) for 20 ms at a time while both reduce 25 MB, as a busy core
    deschedules a rank mid-call; returns whether every sum was exact."""
    import subprocess

    import torch.distributed as dist

    import ddpx

    x = torch.arange(25 * 1024 * 1024 // 4, dtype=torch.float32).remainder_(97).add_(rank)
    expected = x * world - rank * world + sum(range(world))
    stopper = None
    if rank == 1:
        pid = os.getpid()
        stopper = subprocess.Popen(
            ["sh", "-c", f"for i in 1 2 3 4 5 6 7 8; do sleep 0.01; kill -STOP {pid}; "
                         f"sleep 0.02; kill -CONT {pid}; done"])
    dist.barrier()
    exact = True
    for _ in range(16):
        y = x.clone()
        ddpx.all_reduce(y)
        exact &= torch.equal(y, expected)
    if stopper is not None:
        stopper.wait()
    return exact


def test_sums_stay_exact_while_a_peer_is_stopped_mid_call():
    """A rank descheduled for 20 ms again and again in the middle of calls (its peer waits,
    sleeps, and is woken) changes no bit of any result."""
    assert run_ranks(sums_while_a_peer_is_stopped, 2) == [True, True]
