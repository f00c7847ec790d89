"""all_to_all, all_to_all_single and the rooted collectives on the ddpx backend, through shared
memory. all_to_all: the bytes gloo
moves, with equal parts, uneven splits (empty parts included) and parts of many steps; and what
gloo cannot do, checked against the parts expected: parts of different sizes in the list form,
the input as the output, and an error on every rank for splits that do not match."""

import pytest
import torch

from ddpx import backend_of

from distributed import payload, run_ranks


def _payload(rank, dest, rows, dtype):
    """Rank `rank`'s part for `dest`: rows of 3 values that name both, and the row."""
    return payload(rank, dest, rows * 3, dtype).view(rows, 3)


def _splits(world, rank):
    """Uneven rows per destination, zero for one pair: rank r sends (r + d) % 3 rows to d."""
    return [(rank + d) % 3 for d in range(world)]


def _refused_then_usable(call) -> dict:
    """What `call`, which every rank must refuse, raised ("mismatch"); an all-reduce after it
    ("after"); the backend's routes."""
    import torch.distributed as dist

    try:
        call()
        mismatch = "no error"
    except (RuntimeError, ValueError) as error:
        mismatch = str(error)
    after = torch.ones(4)
    dist.all_reduce(after)
    routes = backend_of().routes()
    return {"mismatch": mismatch, "after": after, "routes": routes}


def _all_to_all(rank, world, ddpx_only):
    """ddpx_only: also the calls gloo refuses or mishandles (parts of different sizes in the
    list form, which gloo refuses; splits that do not match)."""
    import torch.distributed as dist

    results = {}
    # Equal parts, small and of many steps (4 MiB per part), and in place.
    for name, rows, dtype in [("equal", 5, torch.float32), ("large", 1 << 18, torch.float32),
                              ("int", 7, torch.int64)]:
        inp = torch.cat([_payload(rank, d, rows, dtype) for d in range(world)])
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp)
        results[name] = out
    # Uneven splits.
    sends = _splits(world, rank)
    receives = [_splits(world, src)[rank] for src in range(world)]
    inp = torch.cat([_payload(rank, d, sends[d], torch.bfloat16) for d in range(world)])
    out = torch.empty(sum(receives), 3, dtype=torch.bfloat16)
    dist.all_to_all_single(out, inp, output_split_sizes=receives, input_split_sizes=sends)
    results["splits"] = out
    # The list form (which gloo has from torch 2.13 on).
    ins = [_payload(rank, d, 2, torch.float64) for d in range(world)]
    outs = [torch.empty(2, 3, dtype=torch.float64) for _ in range(world)]
    try:
        dist.all_to_all(outs, ins)
        results["list"] = torch.cat(outs)
    except RuntimeError as error:
        if ddpx_only or "does not support alltoall" not in str(error):
            raise
    if not ddpx_only:
        return results
    # The input as the output (gloo returns the input unchanged).
    same = torch.cat([_payload(rank, d, 4, torch.float32) for d in range(world)])
    dist.all_to_all_single(same, same)
    results["in place"] = same
    ins = [_payload(rank, d, sends[d], torch.float64) for d in range(world)]
    outs = [torch.empty(receives[s], 3, dtype=torch.float64) for s in range(world)]
    dist.all_to_all(outs, ins)
    results["uneven list"] = torch.cat(outs)
    # Splits that do not match: an error on every rank, and the group stays usable.
    wrong = [s + (1 if rank == 0 else 0) for s in receives]
    return {**results, **_refused_then_usable(
        lambda: dist.all_to_all_single(torch.empty(sum(wrong), 3), torch.empty(sum(sends), 3),
                                       output_split_sizes=wrong, input_split_sizes=sends))}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_all_to_all_moves_what_gloo_moves(world):
    ddpx = run_ranks(_all_to_all, world, True, backend="ddpx")
    gloo = run_ranks(_all_to_all, world, False, backend="gloo")
    for rank in range(world):
        for name in ("equal", "large", "int", "splits", "list"):
            if name in gloo[rank]:
                assert ddpx[rank][name].dtype == gloo[rank][name].dtype, name
                assert torch.equal(ddpx[rank][name], gloo[rank][name]), (rank, name)
        assert torch.equal(ddpx[rank]["list"], torch.cat([_payload(src, rank, 2, torch.float64)
                                                          for src in range(world)]))
        receives = [_splits(world, src)[rank] for src in range(world)]
        expected = torch.cat([_payload(src, rank, receives[src], torch.float64)
                              for src in range(world)])
        assert torch.equal(ddpx[rank]["uneven list"], expected)
        assert torch.equal(ddpx[rank]["in place"],
                           torch.cat([_payload(src, rank, 4, torch.float32)
                                      for src in range(world)]))
        assert "the ranks' splits must match" in ddpx[rank]["mismatch"] or \
            "rejected its input" in ddpx[rank]["mismatch"], ddpx[rank]["mismatch"]
        assert torch.equal(ddpx[rank]["after"], torch.full((4,), float(world)))
        routes = ddpx[rank]["routes"]
        assert routes["all_to_all_single"] == {"engine": 6, "gloo": 0}, routes
        assert routes["all_to_all"] == {"engine": 2, "gloo": 0}, routes


def _gather_scatter(rank, world):
    import torch.distributed as dist

    results = {}
    for root in (0, world - 1):
        for rows in (3, 1 << 17):  # one step, and parts of many steps (1.5 MiB)
            mine = _payload(rank, root, rows, torch.float32)
            gathered = [torch.empty_like(mine) for _ in range(world)] if rank == root else None
            dist.gather(mine, gathered, dst=root)
            results[("gather", root, rows)] = torch.cat(gathered) if rank == root else None
            parts = [_payload(root, d, rows, torch.float32) for d in range(world)]
            got = torch.empty(rows, 3)
            dist.scatter(got, parts if rank == root else None, src=root)
            results[("scatter", root, rows)] = got
        # reduce: the root gets the all-reduce's result; the others keep their tensors.
        for op, dtype in ((dist.ReduceOp.SUM, torch.float32), (dist.ReduceOp.MAX, torch.int64)):
            t = (torch.arange(10) * (rank + 1) % 7).to(dtype)
            dist.reduce(t, dst=root, op=op)
            results[("reduce", root, str(op))] = t
    # The root's parts of the wrong size: an error on every rank, and the group stays usable.
    parts = [torch.zeros(4 + (d == 1), 3) for d in range(world)]
    return {**results, **_refused_then_usable(
        lambda: dist.scatter(torch.empty(4, 3), parts if rank == 0 else None, src=0))}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_gather_scatter_and_reduce_on_the_engine(world):
    """gather and scatter, to and from the first and the last rank, one step and many: the
    parts expected, on the engine; parts of the wrong size are an error on every rank. reduce
    (a float sum, an integer max): the root gets the exact result, the others keep their
    tensors."""
    runs = run_ranks(_gather_scatter, world, backend="ddpx")
    for rank, results in enumerate(runs):
        for root in (0, world - 1):
            for rows in (3, 1 << 17):
                if rank == root:
                    expected = torch.cat([_payload(src, root, rows, torch.float32)
                                          for src in range(world)])
                    assert torch.equal(results[("gather", root, rows)], expected)
                assert torch.equal(results[("scatter", root, rows)],
                                   _payload(root, rank, rows, torch.float32))
            inputs = [torch.arange(10) * (r + 1) % 7 for r in range(world)]
            reduced = {"SUM": sum(inputs).float(), "MAX": torch.stack(inputs).max(0).values}
            for op, expected in reduced.items():
                got = results[("reduce", root, f"RedOpType.{op}")]
                if rank != root:
                    expected = inputs[rank].to(expected.dtype)
                assert torch.equal(got, expected), (rank, root, op)
        # The root raises at its call, naming the size; the others, naming the root.
        assert ("invalid tensor size" if rank == 0 else "rank 0 rejected its input") in \
            results["mismatch"], results["mismatch"]
        assert torch.equal(results["after"], torch.full((4,), float(world)))
        assert results["routes"]["gather"] == {"engine": 4, "gloo": 0}, results["routes"]
        assert results["routes"]["scatter"] == {"engine": 5, "gloo": 0}, results["routes"]
        assert results["routes"]["reduce"] == {"engine": 4, "gloo": 0}, results["routes"]
