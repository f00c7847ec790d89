"""ddpx as a torch.distributed backend for CPU tensors, registered as "ddpx" by ``import ddpx``.

    import ddpx
    dist.init_process_group("ddpx")                 # or "cpu:ddpx,cuda:nccl"
    group = dist.new_group(ranks, backend="ddpx")

Every collective a job issues, not only DDP's buckets, then runs on the node's shared-memory
engine (csrc/backend.cpp says which go where), 16-bit floats summed in float32 and rounded once
(gloo rounds after every addition). Each group
holds its own engine, made collectively when the group is made, and an inner gloo of the same
ranks for what the engine does not serve. ``ddpx.backend_of(group)`` is the backend:
``describe()`` says which path serves it, ``routes()`` counts each collective's calls by path.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo

from ddpx import settings
from ddpx._ext import extension
from ddpx._setup import (
    Meeting,
    SharedMemoryUnavailable,
    create_node_engine,
    cross_node_groups,
    ddpx_backend,
    resolve_group,
)

__all__ = ["NAME", "backend_of"]

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
    store, rank, size, timeout = options.store, options.group_rank, options.group_size, \
        options.timeout
    ranks = [int(r) for r in options.global_ranks_in_group] or list(range(size))
    gloo = ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)

    def make_cross_node_groups(node_ranks: list[int]) -> list:
        me = node_ranks.index(ranks[rank])
        return cross_node_groups(
            node_ranks, lambda r, lane: _cross_node_group(store, r, lane, timeout, me))

    engine, why_not = None, ""
    try:
        engine = create_node_engine(Meeting(store, "ddpx"), rank, ranks, timeout,
                                    make_cross_node_groups)
    except SharedMemoryUnavailable as why:
        why_not = str(why)
        if rank == 0:
            logger.warning("ddpx: %s; the ddpx backend runs every collective on gloo", why_not)
    backend = extension().Backend(rank, size, timeout, gloo, engine, why_not)
    _turn_on_comm_memory(backend, size)
    return backend


def _turn_on_comm_memory(backend, size: int) -> None:
    """Makes DDP allocate its buckets through the backend, in ddpx's arena, unless the user chose
    (DDP_DISABLE_COMM_MEM, DDPX_COMM_MEMORY=0). torch reads the variable for every process group,
    NCCL's too, so ddpx sets it only where no GPU is visible."""
    if (size > 1 and settings.flag("DDPX_COMM_MEMORY") and "DDP_DISABLE_COMM_MEM" not in os.environ
            and backend.supports_tensor_alloc(torch.device("cpu"))
            and not torch.cuda.is_available()):
        os.environ["DDP_DISABLE_COMM_MEM"] = "0"


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
