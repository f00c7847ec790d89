"""How the ranks of a group meet to set up its engine: keys in a c10d store they share, under a
token of this meeting alone; the node each rank is on; and how a rank whose set-up failed tells
the others, so none waits in vain."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["Meeting", "failed", "node_identity", "raise_if_failed"]

# How often a rank that read a stale token looks for the one its rank 0 draws (seconds).
_TOKEN_POLL_S = 0.005


class Meeting:
    """Keys of one engine set-up in a store the group's ranks share."""

    def __init__(self, store, prefix: str):
        self.store = store
        self.prefix = prefix

    @classmethod
    def open(cls, store, place: str, me: int, ranks: list[int], timeout: timedelta) -> Meeting:
        """The meeting of the group's ranks at ``place`` in ``store``, keyed by a token that its
        rank 0 draws and every rank confirms: keys a rank of an earlier start of the job left
        there are never read.

        torchrun's restarts hand every start of a job the same store, and the keys of the dead
        start stay in it (torch 2.13's rendezvous prefixes none by restart); the restart count
        (TORCHELASTIC_RESTART_COUNT) differs between nodes, as only the node whose rank failed
        counts its restart. So rank 0 puts a fresh random token at ``place``; each other rank
        reads what is there, however old, and acknowledges it with a random name of its own; rank
        0 confirms the token with the names of its ranks; a rank that reads a confirmation without
        its own name read a stale token, and reads ``place`` again until the fresh one is there.
        """
        if len(ranks) == 1:
            return cls(store, f"{place}/{secrets.token_hex(8)}")
        meeting = cls(store, place)
        if me == 0:
            token = secrets.token_hex(8)
            store.set(f"{place}/token", token)
            names = [meeting._wait(f"{place}/ack/{token}/{r}", ranks[r]).decode()
                     for r in range(1, len(ranks))]
            store.set(f"{place}/confirmed/{token}", json.dumps(names))
            return cls(store, f"{place}/{token}")
        name = secrets.token_hex(8)
        deadline = time.monotonic() + timeout.total_seconds()
        acknowledged = None
        while True:
            token = meeting._wait(f"{place}/token", ranks[0]).decode()
            if token != acknowledged:
                store.set(f"{place}/ack/{token}/{me}", name)
                acknowledged = token
            confirmed = f"{place}/confirmed/{token}"
            if store.check([confirmed]):
                if json.loads(store.get(confirmed))[me - 1] == name:
                    return cls(store, f"{place}/{token}")
            if time.monotonic() > deadline:
                raise meeting._absent(ranks[0], RuntimeError(
                    f"no token of this start of the job confirmed within {timeout}"))
            time.sleep(_TOKEN_POLL_S)

    @classmethod
    def of_group(cls, group, timeout: timedelta) -> Meeting:
        # Each meeting's token keeps it apart from the group's earlier ones at the same place.
        return cls.open(dist.distributed_c10d._get_default_store(), f"ddpx/{group.group_name}",
                        dist.get_rank(group), dist.get_process_group_ranks(group), timeout)

    def _wait(self, key: str, rank: int) -> bytes:
        """The value at ``key`` (the whole key), which global rank ``rank`` puts, waiting for it
        up to the store's timeout."""
        try:
            return self.store.get(key)
        except RuntimeError as error:  # a timeout (DistStoreError, or FileStore's own) or a
            # store that went away: either way the rank never got here
            raise self._absent(rank, error) from None

    def put(self, key: str, value) -> None:
        self.store.set(f"{self.prefix}/{key}", json.dumps(value))

    def get(self, key: str, rank: int):
        """What global rank ``rank`` put at ``key``, waiting for it up to the store's timeout."""
        return json.loads(self._wait(f"{self.prefix}/{key}", rank))

    @staticmethod
    def _absent(rank: int, error: Exception) -> RuntimeError:
        return RuntimeError(
            f"ddpx: rank {rank} did not join the set-up of this group's shared-memory engine "
            f"({error}): every rank of the group makes it together, at the group's creation "
            f"(backend 'ddpx') or at its first ddpx call (the hook's first bucket, "
            f"ddpx.all_reduce); look at why rank {rank} has not got there")


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def node_identity() -> str:
    """The machine, and the launcher's node rank (GROUP_RANK, which torchrun and accelerate
    launch set), so that launcher nodes sharing a machine stay apart."""
    return f"{_host_identity()}#{os.environ.get('GROUP_RANK', '0')}"


def failed(error: BaseException) -> dict:
    """What a rank whose set-up failed other than by a fallback tells its peers."""
    return {"fatal": f"{type(error).__name__}: {error}"}


def raise_if_failed(report, rank: int) -> None:
    if isinstance(report, dict) and "fatal" in report:
        raise RuntimeError(f"ddpx: rank {rank} failed to set up the group's shared-memory engine: "
                           f"{report['fatal']}")
