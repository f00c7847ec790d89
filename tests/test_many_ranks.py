"""Many ranks on one node: 8 by default, 16, 32 and 64 (slow), oversubscribing the machine's CPUs
as users do. One process per rank runs every check in one body (``every_collective``): each
collective of the ddpx backend against a reference the rank computes itself from integer-valued
data (so every expected value is exact), served by the engine and not by the fallback, and the
fused hook on a DDP model against DDP's default all-reduce on a gloo group of the same ranks.
Also: a rank killed mid-collective at 16 ranks makes every survivor raise within the timeout,
and more local ranks than the engine takes fall back to the process group, said once."""

import gc
import resource
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from distributed import left_in_shm, run_ranks, shm_segments, train_small_ddp

R = dist.ReduceOp
ENGINE_ROUTES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast",
                 "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv")


def rank_input(rank: int, n: int, dtype: torch.dtype, salt: int = 0,
               start: int = 0) -> torch.Tensor:
    """Positions [start, start + n) of rank ``rank``'s input: small integers in [-8, 8], different
    per rank and position, exact in every float dtype, and any sum of 64 of them exact in
    float32. A rank makes its peers' inputs for its references, a chunk at a time: whole ones
    would take world^2 elements at once in each of the world ranks."""
    i = torch.arange(start, start + n, dtype=torch.int64)
    return ((i * 3 + rank * 7 + salt * 5) % 17 - 8).to(dtype)


def _expect(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).flatten().nonzero().flatten() if got.shape == want.shape else []
        first = int(bad[0]) if len(bad) else None
        raise AssertionError(
            f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
            + (f"; {len(bad)} elements differ, first at {first}: got "
               f"{got.flatten()[first].item()}, want {want.flatten()[first].item()}"
               if first is not None else ""))


def _collectives(rank: int, world: int) -> None:
    """Every collective, checked exactly. Sizes: one element, an odd size under the one-shot
    threshold, and an odd size over a 256 KiB block."""
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1023, 150_001):
            exact = sum(rank_input(r, n, torch.float64) for r in range(world))
            for op, want in ((R.SUM, exact), (R.AVG, exact / world)):
                t = rank_input(rank, n, dtype)
                dist.all_reduce(t, op=op)
                # One rounding of the exact result: ddpx sums in float32 (exact here).
                _expect(t, want.to(dtype), f"all_reduce {op} {dtype} n={n}")

    # Each rank's part: 5 elements, and an odd size that makes every call ~2 MiB in all (8 blocks
    # and more) at every world size, with references of that size too: 64 ranks' memory is tight.
    for n in (5, (560_000 // world) | 1):
        mine = rank_input(rank, n, torch.float32, salt=1)
        every = [rank_input(r, n, torch.float32, salt=1) for r in range(world)]
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, mine)
        _expect(out, torch.cat(every), f"all_gather_into_tensor n={n}")
        outs = [torch.empty(n) for _ in range(world)]
        dist.all_gather(outs, mine)
        _expect(torch.cat(outs), torch.cat(every), f"all_gather n={n}")

        for root in (0, world - 1):
            t = mine.clone() if rank == root else torch.zeros(n)
            dist.broadcast(t, src=root)
            _expect(t, every[root], f"broadcast from {root} n={n}")

        # reduce_scatter: rank r ends with the sum of everyone's r-th chunk.
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, rank_input(rank, world * n, torch.float32, salt=2),
                                   op=R.SUM)
        want = sum(rank_input(r, n, torch.float64, salt=2, start=rank * n) for r in range(world))
        _expect(out, want.float(), f"reduce_scatter_tensor n={n}")

        # all_to_all: rank r's chunk j goes to rank j, as chunk r there.
        out = torch.empty(world * n)
        dist.all_to_all_single(out, rank_input(rank, world * n, torch.float32, salt=3))
        want = torch.cat([rank_input(r, n, torch.float32, salt=3, start=rank * n)
                          for r in range(world)])
        _expect(out, want, f"all_to_all_single n={n}")

    dist.barrier()

    # send/recv between every pair at once, each message over a ring's size at 64 ranks.
    n = 5001
    got = {peer: torch.empty(n) for peer in range(world) if peer != rank}
    ops = [op for peer in got for op in (
        dist.P2POp(dist.isend, rank_input(rank, n, torch.float32, salt=100 + peer), peer),
        dist.P2POp(dist.irecv, got[peer], peer))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for peer, t in got.items():
        _expect(t, rank_input(peer, n, torch.float32, salt=100 + rank), f"recv from {peer}")


def every_collective(rank: int, world: int) -> dict:
    """The body every rank runs: the collectives, the hook against DDP's default, and what the
    backend served by which path; returns this rank's peak RSS and its PSS after each part (MiB)
    too."""
    import ddpx

    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's name
    backend = ddpx.backend_of()
    assert backend.engine is not None, backend.why_not
    pss = {"set up": _pss_mb()}
    _collectives(rank, world)
    pss["collectives"] = _pss_mb()
    gloo = dist.new_group(backend="gloo")
    pss["gloo group"] = _pss_mb()
    # The hook on the ddpx world against DDP's own all-reduce on a gloo group.
    with_hook, _ = train_small_ddp(rank, ddpx.register_fused_hook)
    default, _ = train_small_ddp(rank, group=gloo)
    gc.collect()  # the DDP models (reference cycles) before the next part's PSS
    for mine, theirs in zip(with_hook, default, strict=True):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs))
    pss["DDP"] = _pss_mb()
    routes = {name: dict(counts) for name, counts in backend.routes().items()}
    return {"routes": routes, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "pss_mb": pss}


def _pss_mb() -> float:
    """This process's proportional set size: its share of the pages it maps with others (torch's
    libraries, the segment), which, unlike RSS, adds up over the ranks to the memory they use."""
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:")) / 1024


def _check_many_ranks(world: int) -> None:
    started = time.monotonic()
    results = run_ranks(every_collective, world, backend="ddpx", timeout=60 + 20 * world,
                        env={"OMP_NUM_THREADS": "1"})
    for rank, result in enumerate(results):
        routes = result["routes"]
        for name in ENGINE_ROUTES:
            assert routes[name].get("engine", 0) > 0, (rank, name, routes[name])
            assert routes[name].get("gloo", 0) == 0, (rank, name, routes[name])
    rss = [result["rss_mb"] for result in results]
    pss = ", ".join(f"{part} {sum(r['pss_mb'][part] for r in results) / 1024:.1f}"
                    for part in results[0]["pss_mb"])
    print(f"\n{world} ranks: {time.monotonic() - started:.0f} s, peak RSS per rank "
          f"{min(rss):.0f}-{max(rss):.0f} MiB, PSS of all ranks after each part (GiB): {pss}")


def test_8_ranks_run_every_collective_exactly():
    _check_many_ranks(8)


@pytest.mark.slow
@pytest.mark.parametrize("world", [16, 32, 64])
def test_many_ranks_run_every_collective_exactly(world):
    _check_many_ranks(world)


DIE_MID_ALL_REDUCE = """
    import os, signal, threading
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ddpx

    torch.set_num_threads(1)
    # torchrun SIGTERMs the other workers once it sees the victim die; ignoring that lets every
    # survivor show what ddpx raised (torchrun still SIGKILLs them after its grace period).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A timeout the survivors must not need: they learn of the death from the victim's exit.
    dist.init_process_group("ddpx", timeout=timedelta(seconds=600))
    rank, victim = dist.get_rank(), int(os.environ["VICTIM"])
    open(f"pid.{rank}", "w").write(str(os.getpid()))
    t = torch.ones(1 << 20)  # 4 MiB: 16 blocks a call, so the kill lands mid-call
    dist.barrier()
    if rank == victim:  # from a timer: wherever the rank is in its call
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
    calls = 0
    try:
        while True:
            dist.all_reduce(t.fill_(1))
            calls += 1
    except Exception as error:
        open(f"error.{rank}", "w").write(f"after {calls} calls: {error}")
        raise
"""


@pytest.mark.slow
def test_a_rank_killed_mid_all_reduce_at_16_ranks_fails_every_survivor(tmp_path):
    from test_faults import assert_no_job_left, read_pids, run_job

    world, victim = 16, 5
    before = shm_segments()
    # Well within the group's 600 s: a survivor that waited out its timeout fails this.
    rc, out, _ = run_job(DIE_MID_ALL_REDUCE, world, tmp_path, env={"VICTIM": str(victim)},
                         timeout=300)
    assert rc != 0, out
    raised = {p.name: p.read_text() for p in tmp_path.glob("error.*")}
    print("\n".join(f"{name}: {text}" for name, text in sorted(raised.items())))
    assert sorted(raised) == sorted(f"error.{r}" for r in range(world) if r != victim), out
    for name, text in raised.items():
        # Directly (a wait, or a copy from or into its tensor), or as the message of the rank
        # that aborted the call for all; never a timeout.
        assert f"rank {victim}" in text and "exited" in text, (name, text)
    pids = read_pids(tmp_path)
    assert len(pids) == world
    assert_no_job_left(tmp_path, pids)
    assert not left_in_shm(before)


def _set_up_alone(world: int):
    """Rank 0's side of create_node_engine for ``world`` ranks on this node, the others' node
    identities already in the store and none of them there to go on: what rank 0 decides."""
    from datetime import timedelta

    from ddpx import _setup
    from ddpx._meeting import Meeting, node_identity

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    meeting = Meeting(store, "ddpx")
    for r in range(1, world):
        meeting.put(f"node/{r}", node_identity())
    return _setup.create_node_engine(meeting, 0, list(range(world)), timedelta(seconds=1),
                                     lambda ranks: [])


@pytest.mark.parametrize("strict", [False, True])
def test_more_local_ranks_than_the_engine_takes_say_why_and_how_to_fix_it(strict, monkeypatch):
    """65 ranks on a node: the decision every rank takes alike from the node sizes, before any
    segment is made: fall back to the process group (rank 0 says so once, at the group's
    creation), or under DDPX_STRICT=1 raise."""
    from ddpx._ext import extension
    from ddpx._segment import SharedMemoryUnavailable

    limit = extension().max_local_ranks
    assert limit == 64
    if strict:
        monkeypatch.setenv("DDPX_STRICT", "1")
    before = shm_segments()
    with pytest.raises(RuntimeError if strict else SharedMemoryUnavailable) as raised:
        _set_up_alone(limit + 1)
    message = str(raised.value)
    assert f"{limit + 1} ranks of this group share a node" in message, message
    assert f"at most {limit} per node" in message and "launch at most" in message, message
    assert ("DDPX_STRICT=1 forbids" in message) == strict, message
    assert not left_in_shm(before)


def test_64_local_ranks_are_within_the_limit():
    """The contrast: at 64, rank 0 makes the segment and waits for its peers to map it (here,
    none come: the store's timeout), and leaves nothing in /dev/shm."""
    before = shm_segments()
    with pytest.raises(RuntimeError, match="rank 1 did not join the set-up"):
        _set_up_alone(64)
    assert not left_in_shm(before)
