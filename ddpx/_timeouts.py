"""The timeout a process group was made with, and a group of the same ranks made with another."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["group_timeout", "group_with_timeout"]


def group_timeout(group, device: str = "cpu") -> timedelta:
    """The timeout ``group`` was made with, for its ``device`` tensors' backend: gloo's, NCCL's
    and ddpx's own (under TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper too); torch's default for a
    backend that does not say."""
    try:
        return group._get_backend(torch.device(device)).options._timeout
    except (AttributeError, RuntimeError):
        return dist.distributed_c10d.default_pg_timeout


def group_with_timeout(group, device: str, timeout: timedelta | None):
    """``group``, or where ``timeout`` is not its own, a group of the same ranks on the same
    backend for ``device`` tensors made with that timeout (collectively, by the group's ranks
    alone). NCCL reads no per-call timeout (its watchdog bounds each collective by the group's),
    nor does gloo's all-to-all: a timeout of the engine's own is its group's."""
    if timeout is None or timeout == group_timeout(group, device):
        return group
    backend = group._get_backend(torch.device(device)).name()
    return dist.new_group(dist.get_process_group_ranks(group), timeout=timeout, backend=backend,
                          use_local_synchronization=True)
