"""The flight record: what every rank of the node was doing (its process, its last calls, what it
waits for), read from the node's shared memory by any rank. A stopped peer's survivors raise with
it and it names the stopped rank and its last call; an abort's error carries it; any rank dumps
it on demand (``ddpx.flight_record``). One pool of 3 ranks runs the module."""

from __future__ import annotations

import os
import re
import signal
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import ddpx

# Short: the survivors of a stopped rank raise after it.
TIMEOUT_S = 2


def _rank_lines(record: str, rank: int) -> str:
    """The lines the record gives local rank ``rank`` (its line and its calls)."""
    found = re.search(rf"^  rank {rank} \(.*?(?=^  \S)", record, re.S | re.M)
    assert found, record
    return found.group(0)


def calls_then_dump(rank: int, world: int) -> dict:
    # Each group's engine numbers its calls from #1; the record keeps each rank's last 4.
    group = dist.new_group(backend="ddpx")
    dist.all_reduce(torch.ones(1000), group=group)  # 1
    dist.all_reduce(torch.ones(4096, dtype=torch.bfloat16), group=group)  # 2
    dist.broadcast(torch.ones(300, dtype=torch.float64), 0, group=group)  # 3
    dist.barrier(group=group)  # 4
    ddpx.all_reduce(torch.ones(2048), group=group, compression="bf16")  # 5, the same engine
    dist.barrier()  # every rank's #5 is done
    record = ddpx.flight_record(group)
    dist.destroy_process_group(group)
    # The hook's engine on a gloo group, and engines that keep no record.
    ddpx.all_reduce(torch.ones(10))
    return {"record": record, "world": ddpx.flight_record(),
            "none_yet": ddpx.flight_record(dist.new_group(backend="gloo")),
            "process_group": ddpx._ext.extension().make_process_group_engine(
                dist.group.WORLD, "a test's").flight_record()}


def test_a_dump_lists_every_ranks_last_calls(rank_pool):
    results = rank_pool(3).run(calls_then_dump, timeout=60)
    for me, result in enumerate(results):
        record = result["record"]
        assert record.startswith(f"ddpx flight record, as rank {me} reads it"), record
        for rank in range(3):
            lines = _rank_lines(record, rank)
            assert f"(pid {rank_pool(3).pids[rank]}, " in lines, record
            assert "not waiting; 0 jobs queued" in lines, record
            calls = re.findall(r"^    (#\d+ .*?): (\w+)", lines, re.M)
            assert calls == [("#5 all_reduce of 2048 float32 (bfloat16 on the wire)", "done"),
                             ("#4 barrier", "done"),
                             ("#3 broadcast of 2400 bytes of Double", "done"),
                             ("#2 all_reduce of 4096 bfloat16", "done")], record
        assert record.endswith("behind: none, every rank is in #5 at step 5"), record
        assert re.search(r"^    #1 all_reduce of 10 float32: done", result["world"], re.M), \
            result["world"]
        assert "no ddpx engine serves this group yet" in result["none_yet"]
        assert result["process_group"].startswith("ddpx: no flight record (ddpx process-group "
                                                  "path (gloo): a test's)"), result


def stop_after_three_calls(rank: int, world: int) -> dict:
    group = dist.new_group(backend="ddpx", timeout=timedelta(seconds=TIMEOUT_S))
    survivors = dist.new_group([0, 1], backend="gloo")
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    for _ in range(3):
        dist.all_reduce(torch.ones(1000), group=group)
    error = None
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 sends SIGCONT
    else:
        try:
            dist.all_reduce(torch.ones(1 << 16), group=group)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            error = str(e)
        dist.barrier(group=survivors)  # both have read rank 2 stopped
        if rank == 0:
            os.kill(pids[2], signal.SIGCONT)
    dist.barrier()
    dist.destroy_process_group(group)
    dist.destroy_process_group(survivors)
    return {"error": error, "pid": os.getpid()}


def test_a_stopped_ranks_survivors_name_it_and_its_last_call(rank_pool):
    results = rank_pool(3).run(stop_after_three_calls, timeout=60)
    stopped_pid = results[2]["pid"]
    for me in (0, 1):
        error = results[me]["error"]
        assert error is not None, results
        first = error.splitlines()[0]
        assert "timed out after 2 s waiting for rank(s) 2 " in first or "aborted by rank" in first
        assert "ddpx flight record" in error, error
        assert f"rank 2 (pid {stopped_pid}, stopped (SIGSTOP)): last published step 3" in error
        assert re.search(r"^    #3 all_reduce of 1000 float32: done", _rank_lines(error, 2),
                         re.M), error
        assert re.search(r"^    #4 all_reduce of 65536 float32: in flight for ",
                         _rank_lines(error, me), re.M), error
        assert re.search(r"behind: rank 2 \(stopped \(SIGSTOP\)\), its last call #3 all_reduce of "
                         r"1000 float32: done in .*; ranks 0, 1 are in #4$", error), error


def abort_while_the_others_are_elsewhere(rank: int, world: int) -> str | None:
    group = dist.new_group(backend="ddpx", timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(4), group=group)
    error = None
    if rank == 0:
        # Ranks 1 and 2 never make this call: the abort ends it.
        timer = threading.Timer(0.5, group.abort)
        timer.start()
        try:
            dist.all_reduce(torch.ones(1 << 10), group=group)
        except Exception as e:  # noqa: BLE001 - the message is what is checked
            error = str(e)
        timer.join()
    dist.barrier()
    dist.destroy_process_group(group)
    return error


def test_an_aborts_error_carries_the_record(rank_pool):
    error = rank_pool(3).run(abort_while_the_others_are_elsewhere, timeout=60)[0]
    assert error is not None and "process group was aborted" in error.splitlines()[0], error
    assert re.search(r"^  rank 0 \(.*\): last published step 2[^;]*; waiting .* for ranks 1, 2 to "
                     r"send step 2", error, re.M), error
    assert re.search(r"behind: rank 1 \(\w+\), its last call #1 all_reduce of 4 float32: done .*; "
                     r"rank 2 \(\w+\), its last call #1 .*; rank 0 is in #2$", error), error
