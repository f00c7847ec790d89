"""How the ranks of a group meet to set up its engine: keys in a c10d store they share, the node
each rank is on, and how a rank whose set-up failed tells the others, so none waits in vain."""

from __future__ import annotations

import json
import os
import socket

import torch.distributed as dist

__all__ = ["Meeting", "failed", "node_identity", "raise_if_failed"]

_generation: dict[str, int] = {}


class Meeting:
    """Keys of one engine set-up in a store the group's ranks share."""

    def __init__(self, store, prefix: str):
        self.store = store
        self.prefix = prefix

    @classmethod
    def of_group(cls, group) -> Meeting:
        generation = _generation.get(group.group_name, 0)
        _generation[group.group_name] = generation + 1
        return cls(dist.distributed_c10d._get_default_store(),
                   f"ddpx/{group.group_name}/{generation}")

    def put(self, key: str, value) -> None:
        self.store.set(f"{self.prefix}/{key}", json.dumps(value))

    def get(self, key: str, rank: int):
        """What global rank ``rank`` put at ``key``, waiting for it up to the store's timeout."""
        try:
            return json.loads(self.store.get(f"{self.prefix}/{key}"))
        except RuntimeError as error:  # a timeout (DistStoreError, or FileStore's own) or a
            # store that went away: either way the rank never got here
            raise RuntimeError(
                f"ddpx: rank {rank} did not join the set-up of this group's shared-memory engine "
                f"({error}): every rank of the group makes it together, at the group's creation "
                f"(backend 'ddpx') or at its first ddpx call (the hook's first bucket, "
                f"ddpx.all_reduce); look at why rank {rank} has not got there"
            ) from None


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
