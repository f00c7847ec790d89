"""A group that goes away in a process that lives on, as torchft and a survivors' re-form need:
`destroy_process_group` of a ddpx group leaves none of its threads, descriptors, mappings or
segment behind and a new group of the same ranks works at once; `ProcessGroup.abort()` from
another thread makes a call blocked on a silent peer raise, naming the abort, instead of waiting
out the group's timeout; and the calls after either raise a clear error."""

from __future__ import annotations

import gc
import os
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import ddpx  # noqa: F401 - registers the "ddpx" backend in the ranks too

from distributed import run_ranks


def _resources() -> dict:
    """What a group could leave in this process: threads, descriptors, ddpx's mappings."""
    with open("/proc/self/maps") as maps:
        mapped = sorted({line.split()[-1] for line in maps
                         if "ddpx" in line and not line.rstrip().endswith(".so")})
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")),
            "mapped": mapped}


def _use_and_destroy(rank: int, world: int) -> None:
    """A ddpx group of every rank, with everything that starts a thread: an async all-reduce (the
    engine's thread), a send and receive (point-to-point's), a collective on the inner gloo (its
    threads); then destroyed."""
    group = dist.new_group(backend="ddpx")
    total = torch.ones(1 << 20)
    dist.all_reduce(total, group=group, async_op=True).wait()
    assert total[0].item() == world
    message = torch.full((1000,), float(rank))
    peer = (rank + 1) % world
    sent = dist.isend(message, peer, group=group)
    received = torch.empty(1000)
    dist.recv(received, (rank - 1) % world, group=group)
    sent.wait()
    assert received[0].item() == (rank - 1) % world
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)), group=group)
    dist.all_reduce(torch.ones(3, dtype=torch.int64), op=dist.ReduceOp.BAND, group=group)
    backend = group._get_backend(torch.device("cpu"))
    dist.destroy_process_group(group)
    return backend


def destroy_twice(rank: int, world: int) -> dict:
    # The first group brings what a process keeps once (torch's and ddpx's imports, the arena's
    # process-wide state); what the second leaves beyond the first's is the group's.
    backend = _use_and_destroy(rank, world)
    gc.collect()
    after_first = _resources()
    # Still referenced (a DDP model or a hook can hold its group): its calls raise, naming why.
    try:
        backend.allreduce([torch.ones(2)]).wait()
        stale = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        stale = str(e)
    del backend
    _use_and_destroy(rank, world)
    gc.collect()
    # A third group right after works at once, and gets the right sum.
    group = dist.new_group(backend="ddpx")
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, group=group)
    dist.destroy_process_group(group)
    gc.collect()
    return {"after_first": after_first, "after_second": _resources(), "stale": stale,
            "sum": value.item()}


def test_destroy_process_group_leaves_nothing_of_the_group_behind():
    for rank, result in enumerate(run_ranks(destroy_twice, 3, timeout=120)):
        assert result["after_second"] == result["after_first"], (rank, result)
        assert not result["after_second"]["mapped"], (rank, result)
        assert "destroyed" in result["stale"], (rank, result["stale"])
        assert result["sum"] == 6.0


def abort_while_blocked(rank: int, world: int) -> dict:
    group = dist.new_group(backend="ddpx", timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4), group=group)
    result = {}
    if rank == 0:
        # Rank 1 never makes this call: only the abort can end it before the 120 s timeout (a
        # timeout's error says "timed out", not "aborted").
        timer = threading.Timer(0.5, group.abort)
        timer.start()
        try:
            dist.all_reduce(torch.ones(1 << 16), group=group)
            result["error"] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            result["error"] = str(e)
        timer.join()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            result["after"] = "no error"
        except Exception as e:  # noqa: BLE001
            result["after"] = str(e)
    # Every rank: a fresh group of the same ranks after the aborted one.
    dist.barrier()
    fresh = dist.new_group(backend="ddpx")
    value = torch.tensor([1.0])
    dist.all_reduce(value, group=fresh)
    result["fresh"] = value.item()
    dist.destroy_process_group(fresh)
    dist.destroy_process_group(group)
    return result


def test_abort_makes_a_blocked_call_raise_and_a_fresh_group_works():
    results = run_ranks(abort_while_blocked, 2, timeout=90)
    first = results[0]
    assert "aborted" in first["error"], first
    assert "aborted" in first["after"], first
    assert [r["fresh"] for r in results] == [2.0, 2.0]


def survivors_re_form(rank: int, world: int) -> dict:
    """The last rank leaves mid-training and is SIGKILLed; the others, blocked on it, raise,
    destroy the group and go on in a new group of themselves, in the same processes."""
    import time

    group = dist.new_group(backend="ddpx", timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(1 << 16), group=group)
    if rank == world - 1:
        # Reports, then dies while the others wait for it in their next all-reduce.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        return {"killed_at": time.time() + 0.3}
    try:
        while True:
            dist.all_reduce(torch.ones(1 << 16), group=group)
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        failed_at, error = time.time(), str(e)
    dist.destroy_process_group(group)
    survivors = dist.new_group(list(range(world - 1)), backend="ddpx",
                               use_local_synchronization=True)
    value = torch.full((1 << 16,), float(rank + 1))
    dist.all_reduce(value, group=survivors)
    resumed_at = time.time()
    dist.destroy_process_group(survivors)
    return {"error": error, "failed_at": failed_at, "resumed_at": resumed_at,
            "sum": value[0].item(),
            "equal": bool((value == value[0]).all())}


def test_survivors_of_a_killed_rank_go_on_in_a_smaller_group_at_once():
    results = run_ranks(survivors_re_form, 3, timeout=90)
    for rank, result in enumerate(results[:2]):
        assert "rank 2" in result["error"] and "exited" in result["error"], (rank, result)
        assert result["sum"] == 3.0 and result["equal"], (rank, result)
    killed_at = results[2]["killed_at"]
    print("seconds from the SIGKILL to each survivor's error, and to its first sum in the new "
          "group:", [(round(r["failed_at"] - killed_at, 3), round(r["resumed_at"] - killed_at, 3))
                     for r in results[:2]])
