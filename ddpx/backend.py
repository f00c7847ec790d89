"""ddpx as a torch.distributed backend for CPU tensors, registered as "ddpx" by ``import ddpx``.

    import ddpx
    dist.init_process_group("ddpx")                 # or "cpu:ddpx,cuda:nccl"
    group = dist.new_group(ranks, backend="ddpx")

Every collective a job issues, not only DDP's buckets, then runs on the node's shared-memory
engine (csrc/torch_api/backend.cpp says which go where), 16-bit floats summed in float32 and
rounded once (gloo rounds after every addition). Each group
holds its own engine, made collectively when the group is made, and an inner gloo of the same
ranks for what the engine does not serve. ``ddpx.backend_of(group)`` is the backend:
``describe()`` says which path serves it, ``routes()`` counts each collective's calls by path.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo

from ddpx._cross_node import cross_node_groups
from ddpx._ext import extension
from ddpx._groups import ddpx_backend, resolve_group
from ddpx._meeting import Meeting
from ddpx._process_wide import turn_on_ddp_comm_memory
from ddpx._segment import SharedMemoryUnavailable
from ddpx._setup import create_node_engine

__all__ = ["NAME", "backend_of", "create_backend"]

NAME = "ddpx"
logger = logging.getLogger("ddpx")


def _cross_node_group(store, ranks: list[int], lane: int, timeout, me: int):
    """A gloo process group of the ranks with this rank's local index on every node, from the
    group's own store: only they meet to make it, while the group itself is being made."""
    prefixed = PrefixStore(f"ddpx-lane/{'-'.join(map(str, ranks))}/{lane}/", store)
    group = ProcessGroup(prefixed, me, len(ranks))
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO,
                            ProcessGroupGloo(prefixed, me, len(ranks), timeout))
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    return group


def _create_backend(options, _backend_options):
    return create_backend(options.store, options.group_rank, options.group_size, options.timeout,
                          [int(r) for r in options.global_ranks_in_group])


def create_backend(store, rank: int, size: int, timeout, ranks: list[int] = ()):
    """The ddpx backend of rank ``rank`` of ``size``, made by every rank together through
    ``store`` (a c10d store only this group's ranks use); ``ranks``: the group's ranks as the job
    numbers them, distinct, which errors name (default: 0..size-1). What
    ``init_process_group("ddpx")`` and ``new_group(..., backend="ddpx")`` call; ddpx.torchft
    calls it for each quorum."""
    ranks = list(ranks) or list(range(size))
    # Every key of the group, its inner gloo's too, under the meeting's token: a restarted job
    # never reads what the dead start left in the store (Meeting.open).
    meeting = Meeting.open(store, "ddpx", rank, ranks, timeout)
    store = PrefixStore(f"{meeting.prefix}/", store)
    gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)

    def make_cross_node_groups(node_ranks: list[int]) -> list:
        me = node_ranks.index(ranks[rank])
        return cross_node_groups(
            node_ranks, lambda r, lane: _cross_node_group(store, r, lane, timeout, me))

    engine, why_not = None, ""
    try:
        engine = create_node_engine(meeting, rank, ranks, timeout, make_cross_node_groups)
    except SharedMemoryUnavailable as why:
        why_not = str(why)
        if rank == 0:
            logger.warning("ddpx: %s; the ddpx backend runs every collective on gloo", why_not)
    backend = extension().Backend(rank, size, timeout, gloo, engine, why_not)
    turn_on_ddp_comm_memory(backend, size)
    return backend


def register() -> None:
    """Registers the backend with torch.distributed, once per process."""
    if not hasattr(dist.Backend, NAME.upper()):
        dist.Backend.register_backend(NAME, _create_backend, extended_api=True, devices=["cpu"])


def backend_of(group=None):
    """The ddpx backend that serves ``group``'s CPU tensors (default: the world group), for
    ``describe()`` (which path serves it) and ``routes()`` (each collective's calls by path)."""
    group = resolve_group(group)
    backend = ddpx_backend(group)
    if backend is None:
        raise ValueError(
            f"ddpx: this group's CPU tensors go to {dist.get_backend(group)!r}, not to ddpx: make "
            "the group with init_process_group('ddpx') or new_group(..., backend='ddpx')"
        )
    return backend
