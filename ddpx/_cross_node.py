"""The process groups between nodes of a group that spans several: ranks with the same local
index on every node trade their slices of the hierarchical all-reduce through them."""

from __future__ import annotations

import weakref

import torch.distributed as dist

from ddpx import settings

__all__ = ["cross_chunk_bytes", "cross_node_groups", "shared_cross_node_groups"]

# Across nodes (docs/benchmarks.md, "Across a network"): slices cross in chunks of this much of
# the message, taking turns on this many lanes (two process groups each), so the link never waits
# for the node.
_CROSS_CHUNK_KB = settings.positive_int("DDPX_CROSS_CHUNK_KB")
_CROSS_LANES = settings.positive_int("DDPX_CROSS_LANES")

# (global ranks, one per node in node order; index) -> their process group. Weak: torch holds a
# group until destroy_process_group, and a new one must be made after that.
_cross_node_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def cross_chunk_bytes() -> int:
    """How much of a message crosses nodes per chunk of the hierarchical all-reduce."""
    return _CROSS_CHUNK_KB * 1024


def cross_node_groups(ranks: list[int], make_group) -> list:
    """The process groups between nodes of these global ranks, the same local index on every
    node: a dealing and a gathering one per lane, ``make_group(ranks, lane)`` each."""
    return [make_group(ranks, lane) for lane in range(2 * _CROSS_LANES)]


def _shared_new_group(ranks: list[int], lane: int):
    """Only these ranks make it (so any group can span nodes), and engines that pair the same
    ranks share it."""
    key = (tuple(ranks), lane)
    group = _cross_node_groups.get(key)
    if group is None:
        group = dist.new_group(ranks, use_local_synchronization=True)
        _cross_node_groups[key] = group
    return group


def shared_cross_node_groups(ranks: list[int]) -> list:
    """``cross_node_groups`` made by torch.distributed.new_group, for an engine a group's first
    ddpx call makes; engines that pair the same ranks share them."""
    return cross_node_groups(ranks, _shared_new_group)
