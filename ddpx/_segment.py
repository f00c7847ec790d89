"""The node's shared-memory segment: whether /dev/shm has room for it, and its creation under a
name that a creator which died before unlinking it does not leave behind for long."""

from __future__ import annotations

import os

from ddpx import settings
from ddpx._ext import extension

__all__ = ["SEGMENT_PREFIX", "SharedMemoryUnavailable", "create_segment"]

_SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "ddpx-"
_SHM_MB = settings.optional_positive_int("DDPX_SHM_MB")


class SharedMemoryUnavailable(Exception):
    """Why shared memory cannot serve a group, the same on every rank of it: the caller falls
    back to the process group's collectives. Only the conditions docs/design.md lists as
    fallbacks raise it (/dev/shm too small or refused, too many ranks on a node); any other
    failure of the set-up is an error on every rank of the group (``_meeting.failed``)."""


def _remove_stale_segments() -> None:
    """Unlinks segments whose creator died between creating and unlinking them."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        pid = name[len(SEGMENT_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            extension().ShmSegment.unlink("/" + name)


def _shm_free_bytes() -> int:
    stats = os.statvfs(_SHM_DIR)
    return stats.f_bavail * stats.f_frsize


def create_segment(name: str, size: int, block_bytes: int, wide_bytes: int,
                   rank_nodes: list[int] | None = None):
    """The segment and its wide block: the one asked for, halved while it would take more than
    half of what /dev/shm has free (or more than DDPX_SHM_MB), down to the block itself. With
    ``rank_nodes``, each local rank's slots go on that NUMA node (``segment.not_placed``: why
    not)."""
    C = extension()
    _remove_stale_segments()
    free = _shm_free_bytes()
    room = free // 2 if _SHM_MB is None else _SHM_MB << 20
    wide_bytes = max(wide_bytes, block_bytes) // block_bytes * block_bytes
    while (wide_bytes > block_bytes
           and C.shm_segment_bytes(size, block_bytes, wide_bytes) > room):
        wide_bytes = max(block_bytes, wide_bytes // 2 // block_bytes * block_bytes)
    nbytes = C.shm_segment_bytes(size, block_bytes, wide_bytes)
    needs = f"the shared-memory engine needs {(nbytes >> 20) + 1} MiB for {size} ranks"
    if _SHM_MB is not None and nbytes > _SHM_MB << 20:
        raise SharedMemoryUnavailable(
            f"DDPX_SHM_MB={_SHM_MB} lets a segment take {_SHM_MB} MiB of /dev/shm and {needs}: "
            "unset DDPX_SHM_MB, or raise it")
    if free < nbytes + (1 << 20):
        raise SharedMemoryUnavailable(
            f"/dev/shm has {free >> 20} MiB free and {needs}: start the container with a larger "
            "/dev/shm (docker run --shm-size=1g) or set a smaller DDPX_BLOCK_KB"
        )
    placement = ([] if rank_nodes is None
                 else C.shm_numa_ranges(size, block_bytes, wide_bytes, rank_nodes))
    try:
        return C.ShmSegment.create(name, nbytes, placement), wide_bytes
    except RuntimeError as refused:  # shm_open, fallocate or mmap said no: the system's limits
        raise SharedMemoryUnavailable(str(refused)) from None
