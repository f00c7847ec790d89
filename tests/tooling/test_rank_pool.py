"""RankPool (tests/distributed.py) and conftest.py's rank_pool fixture on 2 ddpx ranks: results
come back by rank from the same processes run after run; a rank that raises fails its run with
its traceback; a dead rank, killed between runs or during one, is replaced by fresh ranks; a
hang ends at the timeout; and closing leaves no process and no ddpx segment of the pool's."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from distributed import RankPool, alive, left_in_shm, shm_segments


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, t.item(), os.getpid()


def _rank_1_raises(rank, world):
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 does not join


def _rank_1_dies(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def _rank_0_leaves_a_segment(rank, world):
    if rank == 0:
        open(f"/dev/shm/ddpx-{os.getpid()}-left-by-a-test", "w").close()


def _hang(rank, world):
    time.sleep(600)


def assert_sums(pool: RankPool):
    results = pool.run(_sum_of_ranks)
    assert [(rank, total) for rank, total, _ in results] == [(0, 3.0), (1, 3.0)]
    assert [pid for _, _, pid in results] == pool.pids


@pytest.fixture
def pool(rank_pool):
    """2 ddpx ranks shared by this module's tests: a test that breaks them pays their restart."""
    return rank_pool(2, backend="ddpx")


def test_results_come_back_by_rank_from_the_same_ranks_each_run(pool):
    assert_sums(pool)
    first = pool.pids
    assert_sums(pool)
    assert pool.pids == first


def test_an_exception_in_one_rank_fails_the_run_with_its_traceback_and_the_next_run_works(pool):
    with pytest.raises(AssertionError) as info:
        pool.run(_rank_1_raises, timeout=60)
    message = str(info.value)
    assert message.startswith("rank 1 failed:\nTraceback"), message
    assert "in _rank_1_raises" in message and "ValueError: rank 1 refuses" in message
    # Rank 0 was left inside an all_reduce: only fresh ranks can serve the next run.
    assert pool.pids == []
    assert_sums(pool)


def test_a_killed_rank_is_replaced(pool):
    assert_sums(pool)
    before = pool.pids
    os.kill(before[1], signal.SIGKILL)
    while alive(before[1]):
        time.sleep(0.1)
    assert_sums(pool)
    assert not set(pool.pids) & set(before) and not any(alive(p) for p in before)
    with pytest.raises(AssertionError, match=r"rank 1 exited with code -9"):
        pool.run(_rank_1_dies, timeout=30)
    assert_sums(pool)


def test_a_hang_ends_at_the_timeout(pool):
    pool.run(_sum_of_ranks)
    pids = pool.pids
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] did not finish in 3 s"):
        pool.run(_hang, timeout=3)
    assert not any(alive(p) for p in pids)


def test_nothing_is_left_after_close_even_after_a_failure(pool):
    segments = shm_segments()
    pool.run(_sum_of_ranks)  # through the engine's segment, unlinked once mapped
    pids = pool.pids
    with pytest.raises(AssertionError, match=r"the ranks left \['ddpx-\d+-left-by-a-test'\]"):
        pool.run(_rank_0_leaves_a_segment)
    assert not any(alive(p) for p in pids)
    assert not left_in_shm(segments)
    pool.run(_sum_of_ranks)
    pids = pool.pids
    pool.close()
    assert pool.pids == [] and not any(alive(p) for p in pids)
    assert not left_in_shm(segments)


def test_the_fixture_keeps_one_pool_per_settings_and_one_alive(rank_pool, pool):
    assert rank_pool(2, backend="ddpx") is pool
    pool.run(_sum_of_ranks)
    pids = pool.pids
    assert rank_pool(2) is not pool
    assert pool.pids == [] and not any(alive(p) for p in pids)
