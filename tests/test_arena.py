"""The arena (csrc/node/arena.h): CPU tensors in memfd shared memory that every local rank maps,
and the collectives that read and write them where they lie (csrc/collectives/opening.h's Direct
method).

On real ranks of a ddpx world (2, 3 and 4 of them; 4 oversubscribes two cores): all-reduces of
arena tensors (and of views into them, and on a subgroup) give the copy path's bits on the same
engine, within the float64 reference's bound, compressed too, and count in the engine's
zero_copy_calls exactly when every rank's tensor lies in its arena; calls where only some ranks'
do (or where one rank's chunk was refused it) give the same bits and count nothing; chunks are
reused and live tensors never share one. DDP on a ddpx world puts its gradients (as bucket views)
in the arena and trains to gloo's bits, unless the user says otherwise (DDPX_COMM_MEMORY=0,
DDP_DISABLE_COMM_MEM=1) or the arena is unusable (memfd_create refused). Ranks that cannot reach
each other's memory still reduce arena tensors right. Faults: a peer that dies in a zero-copy
all-reduce fails every survivor, and ranks SIGKILLed under torchrun leave nothing in /dev/shm or
running.

All-gathers (FSDP2's way, in place), broadcasts and reduce-scatters of arena tensors read the
peers' where they lie too, to the copy path's bits; so do FSDP2's with its buffers from the
backend, and the fused hook on a gloo group, which moves DDP's buckets into the arena.

An engine's first call never goes zero-copy: a rank posts an arena tensor only once its probe
of its peers' memory (ShmChannel::probe_peers, at its first call) found it reaches them, so
every job here makes ordinary calls first (warm_up) before it counts zero-copy calls.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import resource
import signal
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
from test_faults import (
    assert_no_job_left,
    fork_to_fail,
    kill_every_rank,
    launch,
    reap,
    wait_for_pids,
)
from test_hook import SUM_ORDER_TOLERANCE
from torch import nn

from ddpx import backend_of
from ddpx._ext import extension

from collective_checks import (
    Routes,
    check,
    close_to_scaled_sum,
    close_to_sum,
    collecting,
    digest,
    expect_equal,
    is_pow2,
    make,
    quiet,
    rank_order_sum,
)
from distributed import run_ranks

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
BIG = 600_001  # elements: over 1 MiB in every dtype (1.2 MB of bfloat16, 2.4 MB of float32)
SIZES = [0, 1, 3, 17, 4097, 65537, BIG]
REFUSED = 2_500_001  # float32 elements: 10 MB, more than any chunk made before it
# How each call reduces: torch.distributed on the ddpx world, or ddpx.all_reduce (same engine).
CALLS = ("dist SUM", "dist AVG", "ddpx average")


def engine(group=None):
    return backend_of(group).engine


def warm_up() -> None:
    """Two calls on the world's engine: after them every rank has seen every peer's verdict on
    reaching its memory, which a call needs to go zero-copy (see the module's docstring)."""
    for _ in range(2):
        dist.all_reduce(torch.ones(4))


def in_arena(source: torch.Tensor) -> torch.Tensor:
    out = extension().arena_empty(source.numel(), source.dtype)
    return out.copy_(source)


def reduce(t: torch.Tensor, call: str, world: int) -> float:
    """Reduces t in place as ``call`` says; returns the scale the call applies."""
    import ddpx

    if call == "dist SUM":
        dist.all_reduce(t)
        return 1.0
    if call == "dist AVG":
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    else:
        ddpx.all_reduce(t, average=True)
    return 1.0 / world


def near_reference(out, inputs, scale: float, what: str) -> None:
    """Within the float64 reference's bound (collective_checks: the float32 rank-order sum's
    rounding, plus the scale's where it is not a power of two); bit for bit the rank-order sum
    where the scale is exact."""
    if is_pow2(scale):
        expect_equal(out, rank_order_sum(inputs, scale), what + " vs rank-order sum")
        close_to_sum(out, inputs, scale, what)
    else:
        close_to_scaled_sum(out, inputs, scale, what)


def zero_copy_counted(fn, *args) -> int:
    """How many zero-copy calls the world's engine counted while fn ran."""
    before = engine().zero_copy_calls
    fn(*args)
    return engine().zero_copy_calls - before


# ---------------------------------------------------------------------------------------------
# Sections run on a pool of ranks per world size; each returns (digests, counts, failures).

def bits(rank, world):
    """SUM and AVG of arena tensors against the same call on ordinary tensors, and the
    reference; each arena call counted once in zero_copy_calls, each ordinary call not."""
    quiet()
    warm_up()
    prints, counts = {}, {"arena calls": 0, "zero-copy": 0}
    with collecting() as failures:
        for dtype in FLOATS:
            for n in SIZES:
                inputs = [make(r, (n,), dtype, "arena") for r in range(world)]
                for call in CALLS:
                    what = f"{call} {dtype} n={n} world={world}"
                    ordinary = inputs[rank].clone()
                    counted = zero_copy_counted(reduce, ordinary, call, world)
                    check(counted == 0, f"{what}: an ordinary tensor counted {counted} zero-copy")
                    arena = in_arena(inputs[rank])
                    held = extension().arena_holds(arena)
                    # An empty tensor has no bytes (its data pointer is null) to lie anywhere.
                    check(held or n == 0, f"{what}: arena_empty's tensor is not in the arena")
                    before = engine().zero_copy_calls
                    scale = reduce(arena, call, world)
                    counted = engine().zero_copy_calls - before
                    check(counted == int(held), f"{what}: zero_copy_calls went up by {counted}")
                    counts["arena calls"] += int(held)
                    counts["zero-copy"] += counted
                    expect_equal(arena, ordinary, what + ": arena vs copy path")
                    if rank == 0:  # the others hold the same bits: the test compares digests
                        near_reference(arena, inputs, scale, what)
                    prints[what] = digest(arena)
        # Views into a chunk, 3 elements in (not 8-byte aligned): the peers read and write at
        # that offset, and the elements around the view stay as they were.
        for dtype in (torch.float32, torch.bfloat16):
            for n in (17, BIG):
                what = f"an arena view at element 3: {dtype} n={n} world={world}"
                inputs = [make(r, (n,), dtype, "arena-view") for r in range(world)]
                ordinary = inputs[rank].clone()
                dist.all_reduce(ordinary)
                base = extension().arena_empty(n + 5, dtype).fill_(7.0)
                view = base[3:3 + n].copy_(inputs[rank])
                counted = zero_copy_counted(dist.all_reduce, view)
                check(counted == 1, f"{what}: zero_copy_calls went up by {counted}")
                counts["arena calls"] += 1
                counts["zero-copy"] += counted
                expect_equal(view, ordinary, what + ": arena vs copy path")
                around = torch.cat([base[:3], base[3 + n:]])
                check(bool((around == 7.0).all()), f"{what}: wrote around the view: {around}")
                prints[what] = digest(base)
        usage = extension().arena_usage()
        check(usage["usable"] and usage["why_not"] == "", f"arena not usable: {usage}")
        check(usage["peer_chunks"] > 0, f"no peer's chunk was mapped: {usage}")
    return prints, counts, failures


def compression(rank, world):
    """ddpx.all_reduce(compression=...) of float32 arena tensors: the copy path's bits, and each
    input rounded once to the wire dtype (after the scale) and summed in float32."""
    import ddpx

    quiet()
    warm_up()
    prints, counts = {}, {"arena calls": 0, "zero-copy": 0}
    with collecting() as failures:
        for mode, wire in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            for n in SIZES:
                inputs = [make(r, (n,), torch.float32, f"arena-{mode}") for r in range(world)]
                for average in (False, True):
                    what = f"compression={mode} average={average} n={n} world={world}"
                    ordinary = inputs[rank].clone()
                    ddpx.all_reduce(ordinary, average=average, compression=mode)
                    arena = in_arena(inputs[rank])
                    held = extension().arena_holds(arena)
                    before = engine().zero_copy_calls
                    ddpx.all_reduce(arena, average=average, compression=mode)
                    counted = engine().zero_copy_calls - before
                    check(counted == int(held), f"{what}: zero_copy_calls went up by {counted}")
                    counts["arena calls"] += int(held)
                    counts["zero-copy"] += counted
                    check(arena.dtype == torch.float32, f"{what}: became {arena.dtype}")
                    expect_equal(arena, ordinary, what + ": arena vs copy path")
                    if rank == 0:  # the others hold the same bits: the test compares digests
                        scale = 1.0 / world if average else 1.0
                        wired = [(x * scale).to(wire).float() for x in inputs]
                        close_to_sum(arena, wired, 1.0, what)
                    prints[what] = digest(arena)
    return prints, counts, failures


def refused_chunk(n: int, dtype: torch.dtype) -> torch.Tensor:
    """arena_empty while the kernel refuses this process a chunk that large: a soft
    RLIMIT_FSIZE of 1 MiB makes the memfd's ftruncate fail with EFBIG (SIGXFSZ ignored)."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        return extension().arena_empty(n, dtype)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


MIXED_CASES = [(torch.float32, 1, "dist SUM"), (torch.float32, 4097, "dist AVG"),
               (torch.bfloat16, 65537, "ddpx average"), (torch.float64, 17, "dist SUM"),
               (torch.float16, 3, "dist AVG"), (torch.float32, BIG, "dist SUM"),
               (torch.bfloat16, BIG, "dist AVG")]


def mixed(rank, world):
    """Only rank 0's tensor in its arena, then every rank's but rank 0's, then rank 0's chunk
    refused it (ordinary memory) and the others' in theirs: the copy path's bits, nothing counted
    as zero-copy; and once rank 0 gets its chunk again, the call counts."""
    import ddpx

    quiet()
    warm_up()
    prints, counts = {}, {"arena calls": 0, "zero-copy": 0}
    layouts = {"rank 0 only": lambda r: r == 0, "all but rank 0": lambda r: r != 0}
    with collecting() as failures:
        for name, placed in layouts.items():
            for dtype, n, call in MIXED_CASES:
                what = f"{name}: {call} {dtype} n={n} world={world}"
                inputs = [make(r, (n,), dtype, f"mixed-{call}") for r in range(world)]
                ordinary = inputs[rank].clone()
                reduce(ordinary, call, world)
                t = in_arena(inputs[rank]) if placed(rank) else inputs[rank].clone()
                check(extension().arena_holds(t) == placed(rank), f"{what}: misplaced")
                before = engine().zero_copy_calls
                scale = reduce(t, call, world)
                counted = engine().zero_copy_calls - before
                check(counted == 0, f"{what}: zero_copy_calls went up by {counted}")
                expect_equal(t, ordinary, what + ": vs copy path")
                if rank == 0:  # the others hold the same bits: the test compares digests
                    near_reference(t, inputs, scale, what)
                prints[what] = digest(t)
            # A compressed call, mixed the same way.
            what = f"{name}: compression=bf16 n={BIG} world={world}"
            inputs = [make(r, (BIG,), torch.float32, "mixed-bf16") for r in range(world)]
            ordinary = inputs[rank].clone()
            ddpx.all_reduce(ordinary, average=True, compression="bf16")
            t = in_arena(inputs[rank]) if placed(rank) else inputs[rank].clone()
            before = engine().zero_copy_calls
            ddpx.all_reduce(t, average=True, compression="bf16")
            check(engine().zero_copy_calls == before, f"{what}: counted as zero-copy")
            expect_equal(t, ordinary, what + ": vs copy path")
            prints[what] = digest(t)
        # Rank 0's chunk refused: its tensor is in ordinary memory, the others' in their arenas.
        # (A size no free chunk fits: a free one would be handed out without asking the kernel.)
        inputs = [make(r, (REFUSED,), torch.float32, "refused") for r in range(world)]
        ordinary = inputs[rank].clone()
        dist.all_reduce(ordinary)
        t = refused_chunk(REFUSED, torch.float32) if rank == 0 else extension().arena_empty(
            REFUSED, torch.float32)
        if rank == 0:
            check(not extension().arena_holds(t), "a refused chunk: the tensor is in the arena")
            check(extension().arena_usage()["fell_back"], "a refused chunk: fell_back not set")
        t.copy_(inputs[rank])
        before = engine().zero_copy_calls
        dist.all_reduce(t)
        check(engine().zero_copy_calls == before, "a refused chunk: counted as zero-copy")
        expect_equal(t, ordinary, f"rank 0's chunk refused, world={world}: vs copy path")
        expect_equal(t, rank_order_sum(inputs), f"rank 0's chunk refused, world={world}")
        # The limit lifted, rank 0 gets a chunk again: every rank's tensor in its arena.
        t = in_arena(inputs[rank])
        check(zero_copy_counted(dist.all_reduce, t) == 1, "after the refusal: not zero-copy")
        expect_equal(t, ordinary, f"after the refusal, world={world}: vs copy path")
        prints["refused"] = digest(t)
    return prints, counts, failures


def disjoint(tensors) -> bool:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


def reuse(rank, world):
    """Tensors of a few sizes allocated, all-reduced and freed round after round: no chunk made
    after the first round, the peers' mappings too, and every sum right (a peer reads a chunk it
    mapped for an earlier tensor). Then tensors kept alive never share memory, nor with a view
    that outlives its tensor, and keep their values while others come and go."""
    quiet()
    warm_up()
    ext = extension()
    with collecting() as failures:
        usage = ext.arena_usage()
        check(usage["usable"] and usage["why_not"] == "", f"arena not usable here: {usage}")
        with pytest.raises(ValueError, match="cannot allocate -1 elements"):
            ext.arena_empty(-1, torch.float32)
        sizes = [(1000, torch.float32), (70_000, torch.bfloat16), (300_000, torch.float32)]
        in_use = ext.arena_usage()["in_use"]
        after_first = None
        for round_ in range(12):
            for n, dtype in sizes:
                t = ext.arena_empty(n, dtype)
                t.fill_(rank + round_)
                counted = zero_copy_counted(dist.all_reduce, t)
                check(counted == 1, f"round {round_} n={n}: zero_copy_calls went up by {counted}")
                want = float(sum(range(world)) + world * round_)
                check(bool((t == want).all()), f"round {round_} n={n}: want {want}, got {t[:3]}")
                del t
            if round_ == 0:
                after_first = ext.arena_usage()
        now = ext.arena_usage()
        check(now["chunks"] == after_first["chunks"],
              f"chunks grew from {after_first['chunks']} to {now['chunks']} reusing 3 sizes")
        check(now["peer_chunks"] == after_first["peer_chunks"],
              f"peer chunks grew from {after_first['peer_chunks']} to {now['peer_chunks']}")
        check(now["in_use"] == in_use, f"in use {now['in_use']} after freeing, was {in_use}")

        # Live tensors: never one chunk for two, values kept.
        g = torch.Generator().manual_seed(rank)
        kinds = [torch.float32, torch.bfloat16, torch.float64, torch.uint8]
        choices = [1, 100, 1024, 1025, 4096, 70_000, 300_000]
        live = {}
        for i in range(60):
            n = choices[int(torch.randint(len(choices), (1,), generator=g))]
            live[i] = ext.arena_empty(n, kinds[i % len(kinds)]).fill_(i % 200)
            if i % 3 == 2:  # free every third one as we go: their chunks get handed out again
                del live[i - 1]
        view = live[0][:1]
        del live[0]  # the view keeps its chunk in use
        live["view"] = view
        for n in choices:  # every size once more, while the others live
            live[f"again {n}"] = ext.arena_empty(n, torch.float32).fill_(-1)
        check(all(ext.arena_holds(t) for t in live.values()), "a live tensor left the arena")
        check(disjoint(live.values()), "two live arena tensors share memory")
        for key, t in live.items():
            want = -1 if str(key).startswith("again") else (0 if key == "view" else key % 200)
            check(bool((t == want).all()), f"tensor {key} lost its values")
    return {}, {"arena calls": 0, "zero-copy": 0}, failures


@functools.cache
def ends_group(world: int):
    """new_group([0, world - 1]) on ddpx, made once per rank process (every rank takes part)."""
    return dist.new_group([0, world - 1], backend="ddpx")


def subgroup(rank, world):
    """A ddpx group of ranks 0 and world-1 (local rank 1 is global rank world-1, another
    process than global rank 1): arena tensors go zero-copy on its engine, to the copy path's
    bits."""
    quiet()
    group, members = ends_group(world), [0, world - 1]
    prints, counts = {}, {"arena calls": 0, "zero-copy": 0}
    with collecting() as failures:
        if rank in members:
            for _ in range(2):  # the group's engine's first two calls (module docstring)
                dist.all_reduce(torch.ones(4), group=group)
            for dtype, n in ((torch.float32, BIG), (torch.bfloat16, 4097), (torch.float64, 1)):
                what = f"ranks {members}: {dtype} n={n}"
                inputs = [make(r, (n,), dtype, "ends") for r in members]
                mine = inputs[members.index(rank)]
                ordinary = mine.clone()
                dist.all_reduce(ordinary, group=group)
                arena = in_arena(mine)
                before = engine(group).zero_copy_calls
                dist.all_reduce(arena, group=group)
                counted = engine(group).zero_copy_calls - before
                check(counted == 1, f"{what}: zero_copy_calls went up by {counted}")
                counts["arena calls"] += 1
                counts["zero-copy"] += counted
                expect_equal(arena, ordinary, what + ": arena vs copy path")
                expect_equal(arena, rank_order_sum(inputs), what + " vs rank-order sum")
                prints[what] = digest(arena)
        dist.barrier()  # the world's engine: every rank leaves together
    return prints, counts, failures


def collectives(rank, world):
    """all_gather_into_tensor in place (FSDP2's way: the input is this rank's part of the arena
    output), broadcast from every root and reduce_scatter_tensor (SUM, AVG) of arena tensors,
    against the same calls on ordinary tensors: the same bits, each counted once as zero-copy;
    then with only rank 0's tensors in the arena: the same bits, and only the broadcasts from
    rank 0, whose data is all a broadcast reads, counted."""
    quiet()
    warm_up()
    prints, counts = {}, {"arena calls": 0, "zero-copy": 0}
    with collecting() as failures:
        for layout in ("every rank", "rank 0 only"):
            arena_here = layout == "every rank" or rank == 0
            place = in_arena if arena_here else torch.Tensor.clone
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                for n in (1, 4097, BIG // 3):
                    what = f"{layout}: {dtype} n={n} world={world}"
                    part = make(rank, (n,), dtype, "gather")
                    out = place(torch.zeros(world * n, dtype=dtype))
                    out[rank * n:(rank + 1) * n].copy_(part)
                    ordinary = torch.empty(world * n, dtype=dtype)
                    dist.all_gather_into_tensor(ordinary, part.clone())
                    counted = zero_copy_counted(dist.all_gather_into_tensor, out,
                                                out[rank * n:(rank + 1) * n])
                    expect_equal(out, ordinary, what + ": all-gather, arena vs copy path")
                    expected = [int(layout == "every rank")]
                    for root in range(world):
                        data = place(make(rank, (n,), dtype, f"bcast{root}"))
                        want = make(root, (n,), dtype, f"bcast{root}")
                        counted += zero_copy_counted(dist.broadcast, data, root)
                        expect_equal(data, want, f"{what}: broadcast from {root}")
                        expected.append(int(layout == "every rank" or root == 0))
                    inputs = [make(r, (world * n,), dtype, "scatter") for r in range(world)]
                    for op, scale in ((dist.ReduceOp.SUM, 1.0), (dist.ReduceOp.AVG, 1 / world)):
                        mine = place(inputs[rank])
                        got, want = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                        counted += zero_copy_counted(dist.reduce_scatter_tensor, got, mine, op)
                        dist.reduce_scatter_tensor(want, inputs[rank].clone(), op)
                        expect_equal(got, want, f"{what}: reduce-scatter {op}, arena vs copy")
                        near_reference(got, [t[rank * n:(rank + 1) * n] for t in inputs], scale,
                                       f"{what}: reduce-scatter {op}")
                        expected.append(int(layout == "every rank"))
                    check(counted == sum(expected),
                          f"{what}: zero_copy_calls went up by {counted}, not {sum(expected)}")
                    counts["arena calls"] += sum(expected)
                    counts["zero-copy"] += counted
                    prints[what] = digest(out)
    return prints, counts, failures


SECTIONS = {"bits": bits, "compression": compression, "mixed": mixed, "reuse": reuse,
            "subgroup": subgroup, "collectives": collectives}


# (world, section), by world: the sections of a world share its ranks. The arena is per process:
# one world size shows its reuse; a subgroup needs a rank outside it.
SECTION_RUNS = [(world, section) for world in (2, 3, 4) for section in SECTIONS
                if (section != "reuse" or world == 2) and (section != "subgroup" or world > 2)]


@pytest.mark.parametrize("world, section", SECTION_RUNS)
def test_arena_all_reduces(rank_pool, world, section):
    """bits, compression, subgroup: arena tensors reduce to the copy path's bits and count once
    each as zero-copy. mixed: calls where some ranks' tensors are not in their arenas. reuse: the
    arena's chunks. Failures name their cases; every rank holds the same bits."""
    pool = rank_pool(world, backend="ddpx", group_timeout=60)
    results = pool.run(SECTIONS[section], timeout=240)
    by_message = {}
    for rank, (_, _, failures) in enumerate(results):
        for message in failures:
            by_message.setdefault(message, []).append(rank)
    assert not by_message, f"{len(by_message)} failed checks:\n" + "\n".join(
        f"ranks {ranks}: {message}" for message, ranks in list(by_message.items())[:40])
    prints = {rank: p for rank, (p, _, _) in enumerate(results) if p}  # a subgroup's members
    for rank, other in prints.items():
        first = min(prints)
        assert other == prints[first], f"rank {rank} holds other bits than rank {first}"
    counts = results[0][1]
    if section in ("bits", "compression"):
        # Every non-empty case went zero-copy, each once: the count is no vacuous 0 == 0.
        cases = len(FLOATS) * len(CALLS) if section == "bits" else 2 * 2
        views = 4 if section == "bits" else 0
        assert counts["arena calls"] == cases * (len(SIZES) - 1) + views, counts
    if section == "subgroup":
        assert counts["arena calls"] == 3, counts
    if section == "collectives":
        # every rank's: 1 all-gather + world broadcasts + 2 reduce-scatters; rank 0's only: the
        # broadcasts from rank 0; per dtype and size
        assert counts["arena calls"] == 9 * ((1 + world + 2) + 1), counts
    assert counts["zero-copy"] == counts["arena calls"], counts


# ---------------------------------------------------------------------------------------------
# DDP on a ddpx world: gradients in the arena, gloo's parameters

STEPS = 5


def ddp_train(rank: int, on_ddpx: bool = True, group=None) -> dict:
    """DDP over ``group`` (gradients as bucket views, several buckets after the first step) of a
    small MLP from seed 0, STEPS SGD steps on data seeded by rank: the final parameters, whether
    each step's gradients lay in the arena, and, on ddpx, the zero-copy calls and the engine's
    all-reduces."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 8))
    model = DDP(net, bucket_cap_mb=0.01, gradient_as_bucket_view=True, process_group=group)
    if on_ddpx:
        routes, zero_copy = Routes(group), engine(group).zero_copy_calls
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(rank)
    held = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
        nn.functional.mse_loss(model(x), y).backward()
        held.append([extension().arena_holds(p.grad) for p in net.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    out = {"params": [p.detach().clone() for p in net.parameters()], "held": held}
    if on_ddpx:
        out["zero_copy"] = engine(group).zero_copy_calls - zero_copy
        out["all_reduce"] = routes.served().get("all_reduce", (0, 0))
    return out


def ddp_job(rank, world, gloo_store):
    """On the ddpx world: DDP as ddpx sets it up (buckets in the arena), then with the user's
    DDP_DISABLE_COMM_MEM=1 (the copy path, same engine); then the same processes on gloo."""
    quiet()
    chosen = os.environ.get("DDP_DISABLE_COMM_MEM")
    arena = ddp_train(rank)
    os.environ["DDP_DISABLE_COMM_MEM"] = "1"
    try:
        copy = ddp_train(rank)
    finally:
        os.environ["DDP_DISABLE_COMM_MEM"] = chosen
    gc.collect()  # the models' reducers go before the group (tests/test_backend.py's ddp_job)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{gloo_store}", rank=rank,
                            world_size=world)
    return {"set": chosen, "arena": arena, "copy": copy, "gloo": ddp_train(rank, on_ddpx=False)}


@functools.cache
def ddp_runs(world: int):
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(ddp_job, world, os.path.join(tmp, "gloo-store"), backend="ddpx",
                         timeout=180)


def assert_bits_equal(ours, theirs, what):
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {index} differs"


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ddp_on_a_ddpx_world_keeps_its_gradients_in_the_arena(world):
    runs = ddp_runs(world)
    for rank, run in enumerate(runs):
        assert run["set"] == "0", f"ddpx set DDP_DISABLE_COMM_MEM={run['set']!r}, not '0'"
        arena, copy = run["arena"], run["copy"]
        assert all(all(step) for step in arena["held"]), arena["held"]
        engine_calls, gloo_calls = arena["all_reduce"]
        assert engine_calls >= STEPS and gloo_calls == 0, arena["all_reduce"]
        # Every bucket's all-reduce went zero-copy (the engine was warm: DDP's broadcasts).
        assert arena["zero_copy"] == engine_calls, (arena["zero_copy"], engine_calls)
        assert not any(any(step) for step in copy["held"]), copy["held"]
        assert copy["zero_copy"] == 0 and copy["all_reduce"][0] >= STEPS, copy
        # The same engine sums in the same rank order either way.
        assert_bits_equal(arena["params"], copy["params"], f"rank {rank}: arena vs copy path")
        assert_bits_equal(arena["params"], runs[0]["arena"]["params"], f"rank {rank} vs rank 0")
        if world == 2:
            # DDP halves each gradient (exact) and sums two buckets: a+b, one rounding on both.
            assert_bits_equal(arena["params"], run["gloo"]["params"], f"rank {rank} vs gloo")
        else:
            # gloo adds the 3 ranks' buckets in another order than ddpx's rank order.
            for a, b in zip(arena["params"], run["gloo"]["params"], strict=True):
                torch.testing.assert_close(a, b, **SUM_ORDER_TOLERANCE)
        assert not any(any(step) for step in run["gloo"]["held"])


def hook_on_gloo(rank, world):
    """DDP on gloo with ddpx's fused hook, gradients as bucket views or not, against DDP's own
    all-reduce: the hook moves each bucket into the arena when it first meets it, so from the
    second step (the rebuilt buckets met once) every bucket's all-reduce is zero-copy; with
    DDPX_COMM_MEMORY=0 none is moved."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    quiet()
    out = {}
    for view, setting in ((True, "1"), (False, "1"), (True, "0")):
        os.environ["DDPX_COMM_MEMORY"] = setting
        models = {}
        for name in ("default", "hook"):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                nn.Linear(64, 8))
            models[name] = DDP(net, bucket_cap_mb=0.01, gradient_as_bucket_view=view)
        state = ddpx.register_fused_hook(models["hook"])
        optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in models.items()}
        data = torch.Generator().manual_seed(rank)
        counted, held = [], []
        for _ in range(STEPS):
            x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
            for name, model in models.items():
                before = state.engine.zero_copy_calls
                nn.functional.mse_loss(model(x), y).backward()
                if name == "hook":
                    counted.append(state.engine.zero_copy_calls - before)
                    held.append(all(extension().arena_holds(p.grad)
                                    for p in model.module.parameters()))
                optimizers[name].step()
                optimizers[name].zero_grad()
        same = all(torch.equal(a, b) for a, b in zip(models["default"].parameters(),
                                                     models["hook"].parameters(), strict=True))
        buckets = len(models["hook"].reducer._get_zeros_like_grad_buckets())
        out[f"view={view} setting={setting}"] = {"same": same, "counted": counted, "held": held,
                                                 "buckets": buckets}
        del models, optimizers
        gc.collect()
    os.environ.pop("DDPX_COMM_MEMORY")
    return out


def test_the_hook_on_a_gloo_group_moves_ddps_buckets_into_the_arena():
    for result in run_ranks(hook_on_gloo, 2, timeout=240):
        for case, r in result.items():
            assert r["same"], f"{case}: the hook's parameters differ from DDP's default"
            if case.endswith("setting=0"):
                assert sum(r["counted"]) == 0 and not any(r["held"]), (case, r)
                continue
            # From the second step every bucket's all-reduce went zero-copy.
            assert all(c == r["buckets"] for c in r["counted"][1:]), (case, r)
            assert all(r["held"]) == case.startswith("view=True"), (case, r)


def fsdp_job(rank, world):
    """FSDP2 (fully_shard per layer and root) on a ddpx world, its buffers from the backend or
    not: the same parameters, and with them every all-gather and reduce-scatter zero-copy."""
    from torch.distributed.fsdp import fully_shard

    quiet()
    warm_up()
    out = {}
    for comm_memory in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(3)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        for module in (*model, model):
            module.set_allocate_memory_from_process_group_for_comm(comm_memory)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        before = engine().zero_copy_calls
        for _ in range(3):
            model(torch.randn(8, 64, generator=data)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        out[comm_memory] = {"zero_copy": engine().zero_copy_calls - before,
                            "params": [p.full_tensor().detach() for p in model.parameters()]}
    return out


def test_fsdp2_with_its_buffers_from_ddpx_goes_zero_copy_to_the_same_bits():
    for result in run_ranks(fsdp_job, 2, backend="ddpx", timeout=240):
        assert result[False]["zero_copy"] == 0, result[False]["zero_copy"]
        # 3 steps x 3 layers x (forward all-gather, backward all-gather, reduce-scatter)
        assert result[True]["zero_copy"] >= 3 * 3 * 3, result[True]["zero_copy"]
        for a, b in zip(result[False]["params"], result[True]["params"], strict=True):
            assert torch.equal(a, b)


def ddp_as_the_user_chose(rank, world):
    quiet()
    return os.environ.get("DDP_DISABLE_COMM_MEM"), ddp_train(rank)


@pytest.mark.parametrize("env, left", [({"DDPX_COMM_MEMORY": "0"}, None),
                                       ({"DDP_DISABLE_COMM_MEM": "1"}, "1")],
                         ids=["DDPX_COMM_MEMORY=0", "DDP_DISABLE_COMM_MEM=1"])
def test_ddp_buckets_stay_in_ordinary_memory_where_the_user_says_so(env, left):
    """Neither setting puts a gradient in the arena or a call on the zero-copy way; ddpx leaves
    DDP_DISABLE_COMM_MEM as it was (unset, or the user's 1); the parameters are the arena run's,
    bit for bit (the same engine, the same sums)."""
    results = run_ranks(ddp_as_the_user_chose, 2, backend="ddpx", env=env, timeout=120)
    arena_run = ddp_runs(2)
    for rank, (value, run) in enumerate(results):
        assert value == left, f"DDP_DISABLE_COMM_MEM={value!r}, want {left!r}"
        assert not any(any(step) for step in run["held"]), run["held"]
        assert run["zero_copy"] == 0 and run["all_reduce"][0] >= STEPS, run
        assert_bits_equal(run["params"], arena_run[rank]["arena"]["params"], f"rank {rank}")


# ---------------------------------------------------------------------------------------------
# Peers that cannot reach each other's memory

CAP_SYS_PTRACE = 19
PR_SET_DUMPABLE = 4


def cut_off_from_peers() -> None:
    """Makes this process unable to read its peers' memory and theirs unable to read its own
    (process_vm_readv, pidfd_getfd: PTRACE_MODE_ATTACH): it drops CAP_SYS_PTRACE (so, as root,
    its capabilities are no longer a superset of its peers') and becomes non-dumpable."""
    libc = ctypes.CDLL(None, use_errno=True)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
    assert libc.capget(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    data[0].effective &= ~(1 << CAP_SYS_PTRACE)
    data[0].permitted &= ~(1 << CAP_SYS_PTRACE)
    assert libc.capset(ctypes.byref(header), data) == 0, os.strerror(ctypes.get_errno())
    assert libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())


def unreachable_peers(rank, world):
    """Rank 1 cut off before the engine's first call (where each rank probes its peers): arena
    tensors reduce through the copy path to its bits, nothing zero-copy, no peer chunk mapped."""
    import ddpx

    quiet()
    if rank == 1:
        cut_off_from_peers()
    warm_up()
    with collecting() as failures:
        usage = extension().arena_usage()
        check(usage["usable"], f"the arena is not usable: {usage}")
        for dtype, n, call in [*MIXED_CASES, (torch.float32, BIG, "compression=bf16")]:
            what = f"{call} {dtype} n={n}"
            inputs = [make(r, (n,), dtype, f"cut-{call}") for r in range(world)]
            ordinary, arena = inputs[rank].clone(), in_arena(inputs[rank])
            check(extension().arena_holds(arena), f"{what}: not in the arena")
            if call.startswith("compression"):
                for t in (ordinary, arena):
                    ddpx.all_reduce(t, compression="bf16")
            else:
                reduce(ordinary, call, world)
                scale = reduce(arena, call, world)
                near_reference(arena, inputs, scale, what)
            expect_equal(arena, ordinary, what + ": arena vs copy path")
        usage = extension().arena_usage()
        check(engine().zero_copy_calls == 0, f"{engine().zero_copy_calls} zero-copy calls")
        check(usage["peer_chunks"] == 0, f"mapped a peer's chunk: {usage}")
    return backend_of().describe(), failures


def test_ranks_that_cannot_reach_each_others_memory_reduce_arena_tensors_right():
    results = run_ranks(unreachable_peers, 2, backend="ddpx", group_timeout=60, timeout=120)
    for rank, (_, failures) in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    # The simulation took: an engine says why it cannot reach its peer's memory (rank 1's, as
    # root: it lacks a capability rank 0 holds; rank 0's, where no rank has CAP_SYS_PTRACE).
    described = [d for d, _ in results]
    assert any("process_vm_readv/writev to rank" in d for d in described), described


def arena_unusable(rank, world):
    """A gloo world whose ranks' arenas are unusable: memfd_create refused at the arena's first
    use (RLIMIT_NOFILE 0 for that moment: no descriptor left). Then a ddpx group over the world,
    and DDP on it, as ddpx sets it up and with the user's DDP_DISABLE_COMM_MEM=0."""
    quiet()
    ext = extension()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
    try:
        probed = ext.arena_usage()  # the arena's first use: it probes memfd_create
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    t = ext.arena_empty(1000, torch.float32)
    held = ext.arena_holds(t)
    group = dist.new_group(backend="ddpx")
    left = os.environ.get("DDP_DISABLE_COMM_MEM")
    as_set_up = ddp_train(rank, group=group)
    os.environ["DDP_DISABLE_COMM_MEM"] = "0"  # asked for: the backend still cannot allocate
    asked = ddp_train(rank, group=group)
    return {"probed": probed, "held": held, "after": ext.arena_usage(), "left": left,
            "runs": [as_set_up, asked]}


def test_an_unusable_arena_says_why_and_ddp_trains_in_ordinary_memory():
    results = run_ranks(arena_unusable, 2, timeout=120)
    arena_run = ddp_runs(2)
    for rank, result in enumerate(results):
        probed = result["probed"]
        assert not probed["usable"] and "memfd_create" in probed["why_not"], probed
        assert not result["held"] and result["after"]["fell_back"], result
        assert result["after"]["chunks"] == 0, result["after"]
        assert result["left"] is None, "ddpx set DDP_DISABLE_COMM_MEM with no arena to use"
        for run in result["runs"]:
            assert not any(any(step) for step in run["held"]), run["held"]
            assert run["zero_copy"] == 0 and run["all_reduce"][0] >= STEPS, run
            # The same engine's sums as the arena run's, in ordinary memory.
            assert_bits_equal(run["params"], arena_run[rank]["arena"]["params"], f"rank {rank}")


# ---------------------------------------------------------------------------------------------
# Faults: a peer that dies mid zero-copy all-reduce; every rank SIGKILLed under torchrun

GROUP_TIMEOUT = 15

PEER_DIES = f"""
    import os, subprocess, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ddpx
    from ddpx._ext import extension

    torch.set_num_threads(1)
    dist.init_process_group("ddpx", timeout=timedelta(seconds={GROUP_TIMEOUT}))
    rank = dist.get_rank()
    engine = ddpx.backend_of().engine
    t = extension().arena_empty(8_000_003, torch.float32).fill_(1.0)  # 32 MB
    for _ in range(2):  # the engine's first two calls never go zero-copy
        dist.all_reduce(torch.ones(4))
    calls = 0
    try:
        while True:
            if rank == 1 and calls == 10:
                if sys.argv[1] == "exit":
                    os._exit(3)  # between calls: the others wait for it in the next one
                # From outside, 50 ms on, whatever this process is doing then: most likely in a
                # call, where ranks spend their time.
                subprocess.Popen(["sh", "-c", f"sleep 0.05; kill -KILL {{os.getpid()}}"])
            started = time.monotonic()
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            calls += 1
            assert t[0].item() == 1.0 and t[-1].item() == 1.0, t
    except Exception as error:
        waited = time.monotonic() - started
        open(f"error.{{rank}}", "w").write(f"{{waited:.1f}} {{calls}} {{engine.zero_copy_calls}} "
                                          f"{{engine.threaded_calls}}\\n{{error}}")
        raise
    print("UNREACHABLE: all-reduced with a dead peer", flush=True)
"""


def job_shm(before: set[str]) -> set[str]:
    """What appeared in /dev/shm since ``before`` that is ddpx's: a segment (ddpx-*), or
    anything naming the arena (whose chunks are memfds, never in /dev/shm)."""
    return {name for name in set(os.listdir("/dev/shm")) - before
            if name.startswith("ddpx-") or "arena" in name}


# With 3 threads per rank, a survivor's helpers are mid-block when the peer dies.
@pytest.mark.parametrize("how, threads", [("exit", 1), ("sigkill", 1), ("sigkill", 3)])
def test_a_peer_that_dies_mid_zero_copy_all_reduce_fails_every_survivor(how, threads, tmp_path):
    before = set(os.listdir("/dev/shm"))
    codes, out, _ = fork_to_fail(PEER_DIES, 3, tmp_path, how, env={"DDPX_THREADS": str(threads)})
    assert codes == [1, 3 if how == "exit" else -signal.SIGKILL, 1], out
    assert "UNREACHABLE" not in out, out
    raised = {p.name: p.read_text() for p in tmp_path.glob("error.*")}
    assert sorted(raised) == ["error.0", "error.2"], out
    for name, text in raised.items():
        head, error = text.split("\n", 1)
        waited, calls, zero_copy, threaded = head.split()
        assert int(calls) >= 10 and int(zero_copy) >= int(calls), (name, head)
        # Every 32 MB call was claimed by the rank's 3 threads, and by its one thread otherwise.
        assert int(threaded) >= int(calls) if threads > 1 else int(threaded) == 0, (name, head)
        assert error.startswith("ddpx") or "ddpx:" in error, (name, error)
        assert "rank 1" in error, (name, error)
        # Raised because the peer died, well before the group's timeout would have ended it.
        assert float(waited) < GROUP_TIMEOUT, (name, waited, error)
    assert not job_shm(before), job_shm(before)


HOLD_AND_REDUCE = """
    import json, os
    import torch, torch.distributed as dist
    import ddpx
    from ddpx._ext import extension

    torch.set_num_threads(1)
    dist.init_process_group("ddpx")
    rank = dist.get_rank()
    engine = ddpx.backend_of().engine
    for _ in range(2):  # the engine's first two calls never go zero-copy
        dist.all_reduce(torch.ones(4))
    tensors = [extension().arena_empty(n, torch.float32).fill_(1.0) for n in (1000, 3_000_000)]
    for t in tensors:
        dist.all_reduce(t)
    usage = dict(extension().arena_usage(), zero_copy=engine.zero_copy_calls)
    with open(f"usage.{rank}.tmp", "w") as f:
        json.dump(usage, f)
    os.rename(f"usage.{rank}.tmp", f"usage.{rank}")
    open(f"pid.{rank}", "w").write(str(os.getpid()))
    while True:
        dist.all_reduce(tensors[1], op=dist.ReduceOp.AVG)
"""


def arena_mappings(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "ddpx-arena" in line]


def test_every_rank_sigkilled_holding_arena_tensors_leaves_nothing_behind(tmp_path):
    before = set(os.listdir("/dev/shm"))
    proc = launch(HOLD_AND_REDUCE, 2, tmp_path)
    try:
        pids = wait_for_pids(proc, tmp_path, 2)
        for rank, pid in enumerate(pids):
            usage = json.loads((tmp_path / f"usage.{rank}").read_text())
            assert usage["chunks"] >= 2 and usage["peer_chunks"] >= 2, usage
            assert usage["zero_copy"] == 2, usage
            # The chunks are memfds: mapped as /memfd:ddpx-arena, never a file in /dev/shm.
            maps = arena_mappings(pid)
            assert len(maps) >= 4 and all("/memfd:ddpx-arena" in m for m in maps), maps
        time.sleep(0.3)  # inside the loop of 12 MB all-reduces
        kill_every_rank(proc, pids)
    finally:
        reap(proc)
    assert_no_job_left(tmp_path, pids)
    assert not job_shm(before), job_shm(before)
