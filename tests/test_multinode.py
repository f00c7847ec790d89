"""Two nodes on one machine: two torchrun launches side by side (--nnodes 2, 2 ranks each), so
ddpx must find its nodes from the launcher (GROUP_RANK) and reduce hierarchically: within each
node through that node's own segment, across nodes through the process group. Also with
compression, for groups other than the world, and with bad calls that must raise on every node."""

import inspect
import os
import textwrap

import torch

from distributed import run_nodes, run_ranks, shm_segments, train_small_ddp

JOB = inspect.getsource(train_small_ddp) + textwrap.dedent('''
    import gc, json, os, sys
    import torch, torch.distributed as dist
    import ddpx

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    out["default"], _ = train_small_ddp(rank)
    for hook, compression in (("ddpx", None), ("ddpx-bf16", "bf16")):
        out[hook], out["path"] = train_small_ddp(
            rank, lambda model: ddpx.register_fused_hook(model, compression=compression).describe())
    engine = ddpx.FusedHookState().engine
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
        out[name] = [t.min().item(), t.max().item(), ddpx.FusedHookState(group).describe()]
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    gc.collect()
    dist.destroy_process_group()
''')


def test_two_nodes_reduce_hierarchically_and_match_the_default_all_reduce(tmp_path):
    segments = shm_segments()
    results = run_nodes(JOB, tmp_path)

    for result in results:
        assert "2 local ranks" in result["path"], result["path"]
        assert "hierarchical across 2 nodes" in result["path"], result["path"]
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
        low, high, path = result["pair"]
        assert low == high == (4.0 if rank % 2 == 0 else 6.0), result["pair"]
        assert "1 local rank," in path and "hierarchical across 2 nodes" in path, path
        low, high, path = result["backwards"]
        assert low == high == 10.0, result["backwards"]
        assert "2 local ranks" in path and "hierarchical across 2 nodes" in path, path
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

    # Each node sends its whole float32 sum across once (half of it per rank, as a two-node
    # all-reduce's 2(N-1)/N says); compressed, the same in 2-byte elements.
    for node in (results[:2], results[2:]):
        assert sum(r["bytes-None"] for r in node) == 300_000 * 4
        for compression in ("bf16", "fp16"):
            sent = sum(r[f"bytes-{compression}"] for r in node)
            # Pieces are padded to a whole element per node: at most 1 element per slice.
            assert 300_000 * 2 <= sent <= 300_000 * 2 + 2 * 2 * 64, (compression, sent)
    assert shm_segments() <= segments


def uneven_nodes(rank, world):
    import pytest

    import ddpx

    os.environ["GROUP_RANK"] = "0" if rank < 2 else "1"  # 2 ranks on node 0, 1 on node 1
    with pytest.raises(RuntimeError, match=r"different numbers of ranks \(\[2, 1\]\)") as info:
        ddpx.all_reduce(torch.ones(8))
    return str(info.value)


def test_nodes_with_different_numbers_of_ranks_fail_at_registration_on_every_rank():
    messages = run_ranks(uneven_nodes, 3)
    assert all("--nproc_per_node" in m for m in messages)
