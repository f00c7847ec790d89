"""Which process group a ddpx call means, and whether ddpx's backend serves its CPU tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _ProcessGroupWrapper

from ddpx._ext import extension

__all__ = ["ddpx_backend", "resolve_group"]


def resolve_group(group, name: str = "group"):
    """``group`` (default: the world), checked: a process group this rank belongs to, of an
    initialized torch.distributed; ``name`` is the argument errors name."""
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER \
            and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"ddpx: {name}={group!r} is not a torch.distributed process group: pass "
                        f"one that init_process_group or new_group made, or None for the world")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "ddpx: torch.distributed is not initialized: call "
            "torch.distributed.init_process_group('gloo') first, or launch with "
            "`accelerate launch` / `torchrun`"
        )
    group = group if group is not None else dist.group.WORLD
    # new_group() hands ranks outside the group a placeholder instead of a group.
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"ddpx: rank {dist.get_rank()} is not a member of this process group; "
            "call ddpx only from the ranks of the group, with the group they share"
        )
    return group


def ddpx_backend(group):
    """The ddpx backend that serves ``group``'s CPU tensors, or None where another does."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):  # no CPU backend, or a group traced by torch.compile
        return None
    if isinstance(backend, _ProcessGroupWrapper):  # TORCH_DISTRIBUTED_DEBUG=DETAIL's checks
        backend = backend.wrapped_pg
    return backend if isinstance(backend, extension().Backend) else None
