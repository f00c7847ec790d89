"""Two nodes on one machine, 2 ranks each, every rank with the environment that torchrun's
--nnodes 2 gives it (distributed.run_nodes; CI also runs the docs' torchrun and Accelerate
launch lines on two network hosts: tests/tooling/test_docs.py), so ddpx must find its nodes from
the launcher (GROUP_RANK) and reduce hierarchically: within each node through that node's own
segment, across nodes through the process group. Also with
compression, for groups other than the world, and with bad calls that must raise on every node.
The backend's collectives the same way, against gloo and the references (collective_checks.py,
as test_backend.py checks one node), on two nodes and on three."""

import inspect
import os
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ddpx import backend_of

from collective_checks import (
    R,
    Routes,
    check,
    close_to_gloo,
    close_to_sum,
    collecting,
    digest,
    exact_reduction,
    expect_equal,
    fail,
    make,
    make_op,
    op_scale,
    quiet,
)
from distributed import left_in_shm, run_nodes, run_ranks, shm_segments, train_small_ddp

JOB = inspect.getsource(train_small_ddp) + textwrap.dedent('''
    import gc, json, os, sys
    import torch, torch.distributed as dist
    import ddpx

    def shape(state):
        return {"local_ranks": state.engine.local_ranks, "nodes": state.engine.nodes}

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    out["default"], _ = train_small_ddp(rank)
    for hook, compression in (("ddpx", None), ("ddpx-bf16", "bf16")):
        out[hook], out["engine"] = train_small_ddp(
            rank, lambda model: shape(ddpx.register_fused_hook(model, compression=compression)))
    engine = ddpx.FusedHookState().engine
    out["hook-zero-copy"] = engine.zero_copy_calls
    for compression in (None, "bf16", "fp16"):
        big = torch.full((300_000,), float(rank + 1))
        before = engine.cross_node_bytes
        ddpx.all_reduce(big, compression=compression)
        out[f"sum-{compression}"] = [big.min().item(), big.max().item()]
        out[f"bytes-{compression}"] = engine.cross_node_bytes - before
    # Bad calls: the sizes differ within node 1, between the nodes, or rank 1 passes integers.
    # Every rank must raise (none may hang in the exchange across nodes), and stay in step.
    bad_calls = {
        "within": lambda: torch.ones(1000 + (rank == 3)),
        "across": lambda: torch.ones(1000 if rank < 2 else 2000),
        "rejected": lambda: torch.ones(1000, dtype=torch.int64 if rank == 1 else torch.float32),
    }
    for case, make in bad_calls.items():
        try:
            ddpx.all_reduce(make())
            out[case] = "no error"
        except (RuntimeError, ValueError) as error:
            out[case] = str(error)
        after = torch.full((1000,), float(rank + 1))
        ddpx.all_reduce(after)
        out[f"after-{case}"] = [after.min().item(), after.max().item()]
    # Other groups that span nodes: one rank per node, sharing the world's cross-node groups,
    # and all four ranks listed node 1 first.
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    backwards = dist.new_group([2, 3, 0, 1])
    for name, group in (("pair", pairs[rank % 2]), ("backwards", backwards)):
        t = torch.full((300_000,), float(rank + 1))
        ddpx.all_reduce(t, group=group, compression="bf16" if name == "pair" else None)
        out[name] = [t.min().item(), t.max().item(), shape(ddpx.FusedHookState(group))]
    # Tensors in the arenas: read and written where they lie within each node, whichever ranks'
    # lie there; the sums must be the bits of the slots' path (placement "none").
    from ddpx._ext import extension
    placements = {"all": {0, 1, 2, 3}, "node0": {0, 1}, "rank0": {0}, "none": set()}
    for placement, ranks in placements.items():
        for n in (1, 3000, 2_500_000):
            for wire in (None, torch.int8):
                values = torch.randn(n, generator=torch.Generator().manual_seed(7 + rank))
                t = extension().arena_empty(n, torch.float32) if rank in ranks else torch.empty(n)
                t.copy_(values)
                before = engine.zero_copy_calls
                engine.run(t, 0.25, wire, "arena sum")
                out[f"arena-{placement}-{n}-{wire}"] = [t.sum(dtype=torch.float64).item(),
                                                        t[::997].tolist()]
                out[f"arena-{placement}-{n}-{wire}-zero-copy"] = engine.zero_copy_calls - before
    out["threads"] = sorted({open(f"/proc/self/task/{task}/comm").read().strip()
                             for task in os.listdir("/proc/self/task")})
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()
''')


def test_two_nodes_reduce_hierarchically_and_match_the_default_all_reduce(tmp_path):
    segments = shm_segments()
    results = run_nodes(JOB, tmp_path)

    for result in results:
        assert result["engine"] == {"local_ranks": 2, "nodes": 2}, result["engine"]
        # ddpx's threads say whose they are, for top -H, perf and py-spy.
        assert {"ddpx engine", "ddpx link"} <= set(result["threads"]), result["threads"]
        for compression in (None, "bf16", "fp16"):
            assert result[f"sum-{compression}"] == [10.0, 10.0]
        # As in test_hook.py: only the order of the float32 additions differs from DDP's.
        for mine, default in zip(result["ddpx"], result["default"], strict=True):
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(default), rtol=1e-5,
                                       atol=1e-6)
        # bf16 rounds each gradient, each node's partial sum and the total once (2^-8 each); after
        # 5 SGD steps at lr 0.1 the parameters stay within 1e-2 of the float32 run's.
        for mine, default in zip(result["ddpx-bf16"], result["default"], strict=True):
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(default), rtol=0,
                                       atol=1e-2)
    for rank, result in enumerate(results):
        low, high, engine = result["pair"]
        assert low == high == (4.0 if rank % 2 == 0 else 6.0), result["pair"]
        assert engine == {"local_ranks": 1, "nodes": 2}, engine
        low, high, engine = result["backwards"]
        assert low == high == 10.0, result["backwards"]
        assert engine == {"local_ranks": 2, "nodes": 2}, engine
    errors = {case: [r[case] for r in results] for case in ("within", "across", "rejected")}
    for case, messages in errors.items():
        assert "no error" not in messages, (case, messages)
        assert all(r[f"after-{case}"] == [10.0, 10.0] for r in results), case
    assert all("ranks disagree" in m for m in errors["within"][2:]), errors["within"]
    assert all("failed on node 1" in m for m in errors["within"][:2]), errors["within"]
    assert all("nodes disagree" in m and "2000" in m for m in errors["across"]), errors["across"]
    assert "int64" in errors["rejected"][1] and "rank 1 rejected" in errors["rejected"][0]
    assert all("failed on node 0" in m for m in errors["rejected"][2:]), errors["rejected"]
    for hook in ("ddpx", "ddpx-bf16"):
        assert all(result[hook] == results[0][hook] for result in results), \
            f"{hook}: ranks hold different parameters"
    # The hook moved DDP's buckets into the arenas, and they crossed nodes from there.
    assert all(r["hook-zero-copy"] > 0 for r in results), [r["hook-zero-copy"] for r in results]
    for n in (1, 3000, 2_500_000):
        exact = sum(torch.randn(n, generator=torch.Generator().manual_seed(7 + r)).double()
                    for r in range(4)) * 0.25
        for wire in ("None", "torch.int8"):
            case = f"{n}-{wire}"
            slots = results[0][f"arena-none-{case}"]
            for rank, result in enumerate(results):
                for placement in ("all", "node0", "rank0"):
                    assert result[f"arena-{placement}-{case}"] == slots, (placement, case, rank)
                zero_copy = result[f"arena-all-{case}-zero-copy"]
                assert zero_copy == 1, (case, rank, zero_copy)
                if rank < 2:  # node 0 read its ranks' tensors in place, node 1 through its slots
                    assert result[f"arena-node0-{case}-zero-copy"] == 1, (case, rank)
                assert result[f"arena-rank0-{case}-zero-copy"] == 0, (case, rank)
            total = slots[0]
            # float32 sums of 4 values (int8: 2 roundings of 2^-8 of a block's largest value).
            tolerance = 1e-5 if wire == "None" else 2e-2
            assert abs(total - exact.sum().item()) <= tolerance * exact.abs().sum().item(), case

    # Each node sends its whole float32 sum across once (half of it per rank, as a two-node
    # all-reduce's 2(N-1)/N says); compressed, the same in 2-byte elements.
    for node in (results[:2], results[2:]):
        assert sum(r["bytes-None"] for r in node) == 300_000 * 4
        for compression in ("bf16", "fp16"):
            sent = sum(r[f"bytes-{compression}"] for r in node)
            # Pieces are padded to a whole element per node: at most 1 element per slice.
            assert 300_000 * 2 <= sent <= 300_000 * 2 + 2 * 2 * 64, (compression, sent)
    assert not left_in_shm(segments)


def uneven_nodes(rank, world):
    import ddpx

    os.environ["GROUP_RANK"] = "0" if rank < 2 else "1"  # 2 ranks on node 0, 1 on node 1
    with pytest.raises(RuntimeError, match=r"different numbers of ranks \(\[2, 1\]\)") as info:
        ddpx.all_reduce(torch.ones(8))
    return str(info.value)


def test_nodes_with_different_numbers_of_ranks_fail_at_registration_on_every_rank():
    messages = run_ranks(uneven_nodes, 3)
    assert all("--nproc_per_node" in m for m in messages)


# ---------------------------------------------------------------------------------------------
# Two nodes on one machine: two torchrun launches (GROUP_RANK tells the nodes apart)

def multinode_checks(rank, world):
    """The all-reduce, all-gather, broadcast, reduce-scatter, all-to-all of equal parts and
    barrier through the engine (hierarchically), uneven all-to-all and point-to-point through
    gloo; against gloo and the references. Returns the digests every rank must hold bit for
    bit."""
    quiet()
    gloo = dist.new_group(backend="gloo")
    routes = Routes()
    calls = Counter()
    prints = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        for n in (1, 4097, 300_001):
            for name in ("SUM", "AVG"):
                what = f"all_reduce {name} {dtype} n={n}"
                inputs = [make(r, (n,), dtype, "mn") for r in range(world)]
                scale = op_scale(name, world)
                out = inputs[rank].clone()
                dist.all_reduce(out, op=make_op(name))
                calls["all_reduce", "engine"] += 1
                # Node partial sums, then across: the order is no longer 0, 1, 2, 3, but every
                # element still sees world-1 float32 additions at most.
                close_to_sum(out, inputs, scale, what)
                theirs = inputs[rank].clone()
                dist.all_reduce(theirs, op=make_op(name), group=gloo)
                close_to_gloo(out, theirs, inputs, scale, what)
                prints[what] = digest(out)
    inputs = [make(r, (4097,), torch.int64, "mn-max") for r in range(world)]
    out = inputs[rank].clone()
    dist.all_reduce(out, op=R.MAX)
    calls["all_reduce", "engine"] += 1
    expect_equal(out, exact_reduction(inputs, "MAX"), "MAX across nodes")
    # Sizes from nothing to several of the engine's blocks, every root (each node, each lane).
    for n in (0, 5000, 300_001):
        for root in range(world):
            t = make(rank, (n,), torch.bfloat16, "mn-b")
            dist.broadcast(t, root)
            calls["broadcast", "engine"] += 1
            expect_equal(t, make(root, (n,), torch.bfloat16, "mn-b"),
                         f"broadcast of {n} from {root} across nodes")
        mine = make(rank, (n,), torch.float32, "mn-g")
        everyone = [make(r, (n,), torch.float32, "mn-g") for r in range(world)]
        gathered = torch.empty(world * n)
        dist.all_gather_into_tensor(gathered, mine)
        calls["all_gather_into_tensor", "engine"] += 1
        expect_equal(gathered, torch.cat(everyone), f"all_gather_into_tensor of {n}")
        in_place = torch.zeros(world * n)
        in_place[rank * n:(rank + 1) * n] = mine
        dist.all_gather_into_tensor(in_place, in_place[rank * n:(rank + 1) * n])
        calls["all_gather_into_tensor", "engine"] += 1
        expect_equal(in_place, torch.cat(everyone), f"in-place all_gather_into_tensor of {n}")
        parts = [torch.empty(n) for _ in range(world)]
        dist.all_gather(parts, mine)
        calls["all_gather", "engine"] += 1
        expect_equal(torch.cat(parts), torch.cat(everyone), f"all_gather of {n}")
    for dtype, name, count in ((torch.float32, "SUM", 1000), (torch.float32, "AVG", 70_001),
                               (torch.bfloat16, "SUM", 3000), (torch.float64, "AVG", 1000)):
        what = f"reduce_scatter_tensor {name} {dtype} x{count}"
        full = [make(r, (world * count,), dtype, "mn-rs") for r in range(world)]
        out = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(out, full[rank].clone(), op=make_op(name))
        calls["reduce_scatter_tensor", "engine"] += 1
        mine = [x[rank * count:(rank + 1) * count] for x in full]
        close_to_sum(out, mine, op_scale(name, world), what)
        theirs = torch.empty(count, dtype=dtype)
        dist.reduce_scatter_tensor(theirs, full[rank].clone(), op=make_op(name), group=gloo)
        close_to_gloo(out, theirs, mine, op_scale(name, world), what)
        listed = torch.empty(count, dtype=dtype)
        dist.reduce_scatter(listed, list(full[rank].clone().chunk(world)), op=make_op(name))
        calls["reduce_scatter", "engine"] += 1
        expect_equal(listed, out, f"reduce_scatter (list) against the tensor form: {what}")
    ints = [make(r, (world * 300,), torch.int32, "mn-rsi") for r in range(world)]
    out = torch.empty(300, dtype=torch.int32)
    dist.reduce_scatter_tensor(out, ints[rank].clone(), op=R.MIN)
    calls["reduce_scatter_tensor", "engine"] += 1
    expect_equal(out, exact_reduction([x[rank * 300:(rank + 1) * 300] for x in ints], "MIN"),
                 "reduce_scatter_tensor MIN of int32 across nodes")
    dist.barrier()
    calls["barrier", "engine"] += 1
    # Bad calls raise on every rank of both nodes (none waits for the other node), and the group
    # stays in step: sizes that differ between the nodes, roots that differ, a rank that rejects
    # its input.
    node = rank // 2
    dtype = torch.float32 if node == 0 else torch.int32
    bad_calls = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(world * (10 + node)), torch.ones(10 + node)),
        "broadcast": lambda: dist.broadcast(torch.ones(10), node),
        "all_gather": lambda: dist.all_gather(
            [torch.empty(10, dtype=dtype) for _ in range(world)], torch.ones(10, dtype=dtype)),
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.empty(world * (2 + node)), torch.ones(world * (2 + node))),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(10), torch.ones(world * 10 + (rank == 3))),
    }
    for name, call in bad_calls.items():
        try:
            call()
            fail(f"bad {name} across nodes: no error")
        except (RuntimeError, ValueError) as error:
            expected = ("nodes disagree" if name != "reduce_scatter_tensor" else
                        ["failed on node 1", "failed on node 1", "rank 3 rejected", "got 41"][rank])
            check(expected in str(error), f"bad {name} across nodes: {error}")
        calls[name, "engine"] += 1
        after = torch.empty(world * 3)
        dist.all_gather_into_tensor(after, torch.full((3,), float(rank)))
        calls["all_gather_into_tensor", "engine"] += 1
        expect_equal(after, torch.arange(world).float().repeat_interleave(3), f"after bad {name}")
    # DDP on a ddpx group allocates its buckets from the backend, in the arena, on every node (a
    # group of its own, so the world's routes stay as counted), and the node's side of their
    # all-reduces copies nothing; the gradients are DDP's on gloo but for the order of the four
    # float32 additions (a few units of 2^-24 of the largest).
    from ddpx._ext import extension

    ddp_group = dist.new_group(backend="ddpx")
    grads = {}
    for name, group in (("ddpx", ddp_group), ("gloo", gloo)):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
        model = torch.nn.parallel.DistributedDataParallel(net, process_group=group,
                                                          gradient_as_bucket_view=True)
        for _ in range(3):
            model.zero_grad()
            model(make(rank, (8, 64), torch.float32, "mn-ddp")).sum().backward()
        grads[name] = torch.cat([p.grad.flatten() for p in net.parameters()])
        if name == "ddpx":
            check(extension().arena_holds(net[0].weight.grad),
                  "DDP's buckets on a ddpx group across nodes lie in the arena")
            zero_copy = backend_of(ddp_group).engine.zero_copy_calls
            check(zero_copy >= 2, f"DDP on a ddpx group across nodes: {zero_copy} zero-copy")
    largest = grads["gloo"].abs().max().item()
    check((grads["ddpx"] - grads["gloo"]).abs().max().item() <= 1e-6 * largest,
          "DDP on a ddpx group across nodes against gloo")
    # A group of one rank per node: its group ranks are not the world's.
    pair = dist.new_group([1, 2], backend="ddpx")
    if rank in (1, 2):
        pair_routes = Routes(pair)
        mine = make(rank, (3000,), torch.float32, "mn-pair")
        both = torch.empty(6000)
        dist.all_gather_into_tensor(both, mine, group=pair)
        expect_equal(both, torch.cat([make(r, (3000,), torch.float32, "mn-pair") for r in (1, 2)]),
                     "all_gather_into_tensor of the pair")
        dist.broadcast(mine, 2, group=pair)
        expect_equal(mine, make(2, (3000,), torch.float32, "mn-pair"), "broadcast of the pair")
        served = pair_routes.served()
        check(served == {"all_gather_into_tensor": (1, 0), "broadcast": (1, 0)},
              f"the pair's routes {served}")
    # All-to-all of equal parts: nothing, one piece, several pieces (parts over 256 KiB).
    for n in (0, 3, 300_001):
        parts = [make(rank, (n,), torch.bfloat16, f"mn-a2a-{q}") for q in range(world)]
        out = torch.empty(world * n, dtype=torch.bfloat16)
        dist.all_to_all_single(out, torch.cat(parts))
        calls["all_to_all_single", "engine"] += 1
        expect_equal(out, torch.cat([make(q, (n,), torch.bfloat16, f"mn-a2a-{rank}")
                                     for q in range(world)]), f"all_to_all_single of {n}")
        outs = [torch.empty(n, dtype=torch.bfloat16) for _ in range(world)]
        dist.all_to_all(outs, parts)
        calls["all_to_all", "engine"] += 1
        expect_equal(torch.cat(outs), out, f"all_to_all of {n}")
    # Still gloo's across nodes: uneven splits, gather, scatter and point-to-point (a ring that
    # crosses between the nodes and within each).
    splits = [1 + q for q in range(world)]  # rank sends q + 1 elements to q
    out = torch.empty(world * (rank + 1))
    dist.all_to_all_single(out, torch.full((sum(splits),), float(rank)), output_split_sizes=[
        rank + 1] * world, input_split_sizes=splits)
    calls["all_to_all_single", "gloo"] += 1
    expect_equal(out, torch.arange(world).float().repeat_interleave(rank + 1),
                 "all_to_all_single with splits")
    got = torch.empty(5000)
    works = [dist.isend(make(rank, (5000,), torch.float32, "mn-p2p"), (rank + 1) % world),
             dist.irecv(got, (rank - 1) % world)]
    for work in works:
        work.wait()
    calls["send", "gloo"] += 1
    calls["recv", "gloo"] += 1
    expect_equal(got, make((rank - 1) % world, (5000,), torch.float32, "mn-p2p"), "isend/irecv")
    want = {}
    for (name, path), n in calls.items():
        engine, via_gloo = want.get(name, (0, 0))
        want[name] = (engine + n, via_gloo) if path == "engine" else (engine, via_gloo + n)
    served = routes.served()
    check(served == want, f"routes {served}, expected {want}")
    return prints


def multinode_body(rank, world):
    with collecting() as failures:
        prints = multinode_checks(rank, world)
    return {"prints": prints, "group_rank": os.environ.get("GROUP_RANK"), "failures": failures}


def three_node_body(rank, world):
    """Between 3 nodes the pieces cross as all-to-alls (between 2, as all-gathers) and each node
    keeps its own part: the all-to-all of equal parts and the reduce-scatter, in one piece and in
    several, on the engine."""
    with collecting() as failures:
        routes = Routes()
        for n in (3, 300_001):
            parts = [make(rank, (n,), torch.bfloat16, f"3n-a2a-{q}") for q in range(world)]
            out = torch.empty(world * n, dtype=torch.bfloat16)
            dist.all_to_all_single(out, torch.cat(parts))
            expect_equal(out, torch.cat([make(q, (n,), torch.bfloat16, f"3n-a2a-{rank}")
                                         for q in range(world)]), f"all_to_all_single of {n}")
            # +-{1/2, 1, 2}: every float32 sum of 6 is exact, so is any order of adding them.
            full = [make(r, (world * n,), torch.float32, "3n-rs", kind="pow2")
                    for r in range(world)]
            mine = torch.empty(n)
            dist.reduce_scatter_tensor(mine, full[rank])
            expect_equal(mine, torch.stack(full).sum(0)[rank * n:(rank + 1) * n],
                         f"reduce_scatter_tensor of {n}")
        served = routes.served()
        check(served == {"all_to_all_single": (2, 0), "reduce_scatter_tensor": (2, 0)},
              f"routes {served}")
    backend = backend_of()
    return {"nodes": backend.engine.nodes if backend.engine else None,
            "why_not": backend.why_not, "failures": failures}


def nodes_job(body: str) -> str:
    """A job for run_nodes: the world on ddpx's backend, then ``body``(rank, world) of this file,
    whose result each rank writes."""
    return textwrap.dedent(f'''
    import gc, json, os, sys
    sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
    import torch.distributed as dist
    import ddpx  # registers the backend

    dist.init_process_group("ddpx")
    from test_multinode import {body}

    out = {body}(dist.get_rank(), dist.get_world_size())
    with open(os.path.join(sys.argv[1], f"rank{{dist.get_rank()}}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()
''')


def assert_no_failed_checks(results: list[dict]) -> None:
    failures = [f"rank {rank}: {m}" for rank, r in enumerate(results) for m in r["failures"]]
    assert not failures, f"{len(failures)} failed checks:\n" + "\n".join(failures[:60])


def test_two_nodes_run_the_collectives_on_the_engine_hierarchically(tmp_path):
    segments = shm_segments()
    results = run_nodes(nodes_job("multinode_body"), tmp_path)
    assert [r["group_rank"] for r in results] == ["0", "0", "1", "1"]
    assert_no_failed_checks(results)
    for rank, result in enumerate(results):
        assert result["prints"] == results[0]["prints"], f"rank {rank} holds other bits"
    assert not left_in_shm(segments)


@pytest.mark.slow
def test_three_nodes_trade_all_to_all_and_reduce_scatter_on_the_engine(tmp_path):
    segments = shm_segments()
    results = run_nodes(nodes_job("three_node_body"), tmp_path, nodes=3)
    assert_no_failed_checks(results)
    assert all(r["nodes"] == 3 for r in results), results[0]
    assert not left_in_shm(segments)
