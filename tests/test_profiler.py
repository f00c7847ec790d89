"""ddpx in a torch.profiler trace, as a user reads it: every call of the ddpx backend opens a range
named after the torch.distributed call ("ddpx::all_reduce"), its steps show as
"ddpx::all_reduce (engine)" where the engine runs them (on the engine's thread for async_op=True,
on the caller's for a call that waits), the fused hook opens "ddpx::fused_hook" per bucket, and
each bucket's all-reduce shows where the engine's thread runs it, as does ddpx.all_reduce's."""

import pytest

from distributed import train_small_ddp

CALLS = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier"]


def _ranges(prof, tmp_name: str) -> dict[str, set[int]]:
    """The ranges of prof's chrome trace whose names start with "ddpx::", with the threads they
    lie on."""
    import json

    prof.export_chrome_trace(tmp_name)
    with open(tmp_name) as f:
        events = json.load(f)["traceEvents"]
    ranges = {}
    for e in events:
        if e.get("ph") == "X" and e["name"].startswith("ddpx::"):
            ranges.setdefault(e["name"], set()).add(e["tid"])
    return ranges


def _traced_calls(rank, world, async_op, tmp_name):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    t, part, whole = torch.ones(4), torch.ones(4), torch.empty(4 * world)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        works = [dist.all_reduce(t, async_op=async_op),
                 dist.broadcast(t, 0, async_op=async_op),
                 dist.all_gather_into_tensor(whole, part, async_op=async_op),
                 dist.reduce_scatter_tensor(part, whole, async_op=async_op),
                 dist.barrier(async_op=async_op)]
        for work in works if async_op else []:
            work.wait()
    return _ranges(prof, f"{tmp_name}.{rank}.json")


@pytest.mark.parametrize("async_op", [True, False], ids=["async", "waiting"])
def test_backend_calls_show_in_trace(rank_pool, tmp_path, async_op):
    """Each call's range on the caller's thread, and its engine range beside it: on the engine's
    own thread when the caller does not wait, within the call's range when it does."""
    for ranges in rank_pool(2, backend="ddpx").run(_traced_calls, async_op,
                                                   str(tmp_path / "trace")):
        for call in CALLS:
            caller, engine = ranges.get(f"ddpx::{call}"), ranges.get(f"ddpx::{call} (engine)")
            assert caller and engine, f"{call}: ranges {sorted(ranges)}"
            assert (caller.isdisjoint(engine) if async_op else caller == engine), (call, ranges)


def _traced_hook(rank, world, tmp_name):
    import torch
    from torch.profiler import ProfilerActivity, profile

    import ddpx

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_small_ddp(rank, ddpx.register_fused_hook)
        ddpx.all_reduce(torch.ones(4))
    return _ranges(prof, f"{tmp_name}.{rank}.json")


def test_fused_hook_shows_in_trace(rank_pool, tmp_path):
    """The C++ hook's range on the autograd thread, on a gloo group, and the buckets' all-reduce on
    the engine's thread; ddpx.all_reduce's on the caller's."""
    for ranges in rank_pool(2).run(_traced_hook, str(tmp_path / "trace")):
        hook, engine = ranges.get("ddpx::fused_hook"), ranges.get("ddpx::all_reduce (engine)")
        assert hook and engine and hook.isdisjoint(engine), sorted(ranges)
        assert "ddpx::all_reduce" in ranges, sorted(ranges)
