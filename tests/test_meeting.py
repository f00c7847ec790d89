"""The meeting of a group's ranks in a store that an earlier start of the job left keys in, as
torchrun's restarts do: every rank of the new start agrees on a token the old one never drew, in
whatever order the ranks come, and a rank 0 that never comes is named."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddpx._meeting import Meeting

TIMEOUT = timedelta(seconds=20)


def _meet(store, world: int, delays: list[float]) -> list[str]:
    """Each rank's meeting prefix, rank r arriving after delays[r] seconds."""
    prefixes: list = [None] * world

    def rank(r: int) -> None:
        time.sleep(delays[r])
        try:
            prefixes[r] = Meeting.open(store, "ddpx", r, list(range(world)), TIMEOUT).prefix
        except Exception as error:  # noqa: BLE001 - handed to the test
            prefixes[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in prefixes:
        if isinstance(p, Exception):
            raise p
    return prefixes


@pytest.mark.parametrize("delays", [[0.0, 0.0, 0.0], [0.3, 0.0, 0.1], [0.0, 0.2, 0.4]],
                         ids=["together", "rank0-last", "rank0-first"])
def test_a_restart_never_meets_the_dead_start(delays):
    store = dist.HashStore()
    first = _meet(store, 3, [0.0, 0.0, 0.0])
    assert len(set(first)) == 1
    # The first start's keys stay, its confirmed token among them.
    second = _meet(store, 3, delays)
    assert len(set(second)) == 1 and second[0] != first[0]
    # A start that died while it met: its rank 0 drew a token, rank 1 acknowledged it, rank 2
    # never came, and nothing was confirmed.
    store.set("ddpx/token", "0123456789abcdef")
    store.set("ddpx/ack/0123456789abcdef/1", "fedcba9876543210")
    third = _meet(store, 3, list(reversed(delays)))
    assert len(set(third)) == 1
    assert third[0] not in (first[0], second[0], "ddpx/0123456789abcdef")


def test_a_rank_0_that_never_comes_is_named():
    store = dist.HashStore()
    _meet(store, 2, [0.0, 0.0])  # a stale token and its confirmation, which rank 1 must not take
    store.set_timeout(timedelta(seconds=0.5))
    with pytest.raises(RuntimeError, match="rank 0 did not join"):
        Meeting.open(store, "ddpx", 1, [0, 1], timedelta(seconds=0.5))
