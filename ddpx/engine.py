"""Which engine reduces a process group's tensors, and how the node's ranks set it up.

One engine per process group, made collectively the first time the group is used: the ranks of
the group meet through the job's c10d store, the lowest rank of each node creates the node's
shared-memory segment under a random name, every rank maps it, and the name is unlinked as soon
as all have, so nothing is left in /dev/shm whatever happens to the job afterwards. A group that
spans nodes is reduced hierarchically, between nodes through a process group of the ranks with
the same local index. Where shared memory cannot serve (no room in /dev/shm on some node), the
engine is the process group's own all-reduce. CUDA tensors go to the CUDA engine (csrc/cuda)
where the extension was built with its kernels, else to the process group's all-reduce too.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import socket
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from ddpx import settings
from ddpx._ext import extension

__all__ = ["all_reduce", "create_node_engine", "engine_for", "wire_dtype"]

logger = logging.getLogger("ddpx")

_SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX = "ddpx-"
# Measured on 2 cores with 2 and 4 ranks (docs/under-load.md): 256 KiB blocks keep a step's
# slots in the last-level cache. Wide blocks, 16 times fewer, are there for engine.steps "wide"
# and "timed".
_BLOCK_KB = settings.positive_int("DDPX_BLOCK_KB")
_WIDE_KB = settings.positive_int("DDPX_WIDE_KB")
# Up to which size every rank sums whole blocks after one exchange (one-shot) instead of a slice
# each with a second exchange (two-phase): above 32 KiB, narrow two-phase steps were the fastest
# schedule here idle, in every launch measured; busy, the shared blocks (docs/under-load.md).
_ONE_SHOT_KB = settings.positive_int("DDPX_ONE_SHOT_KB")
# Across nodes (docs/benchmarks.md, "Across a network"): slices cross in chunks of this much of
# the message, taking turns on this many lanes (two process groups each), so the link never waits
# for the node.
_CROSS_CHUNK_KB = settings.positive_int("DDPX_CROSS_CHUNK_KB")
_CROSS_LANES = settings.positive_int("DDPX_CROSS_LANES")
_SHM_MB = None if settings.value("DDPX_SHM_MB") is None else settings.positive_int("DDPX_SHM_MB")
_COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16,
                "bfloat16": torch.bfloat16, "float16": torch.float16,
                torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}

# group -> {device type -> engine}. Weak on the group: a destroyed process group must not be kept
# alive (with its threads) by ddpx until interpreter exit.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_generation: dict[str, int] = {}


def cross_chunk_bytes() -> int:
    """How much of a message crosses nodes per chunk of the hierarchical all-reduce."""
    return _CROSS_CHUNK_KB * 1024


def wire_dtype(compression: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype gradients travel in for a ``compression`` setting (None: their own)."""
    if compression not in _COMPRESSION:
        raise ValueError(
            f"ddpx: compression={compression!r} is not one of None, 'bf16' ('bfloat16', "
            "torch.bfloat16), 'fp16' ('float16', torch.float16)"
        )
    return _COMPRESSION[compression]


def resolve_group(group):
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


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _remove_stale_segments() -> None:
    """Unlinks segments whose creator died between creating and unlinking them."""
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith(_SEGMENT_PREFIX):
            continue
        pid = name[len(_SEGMENT_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            extension().ShmSegment.unlink("/" + name)


def _shm_free_bytes() -> int:
    stats = os.statvfs(_SHM_DIR)
    return stats.f_bavail * stats.f_frsize


class _Meeting:
    """Keys of one engine set-up in a store the group's ranks share."""

    def __init__(self, store, prefix: str):
        self.store = store
        self.prefix = prefix

    @classmethod
    def of_group(cls, group) -> _Meeting:
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


def _create_segment(name: str, size: int, block_bytes: int, wide_bytes: int):
    """The segment and its wide block: the one asked for, halved while it would take more than
    half of what /dev/shm has free (or more than DDPX_SHM_MB), down to the block itself."""
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
        raise RuntimeError(f"DDPX_SHM_MB={_SHM_MB} lets a segment take {_SHM_MB} MiB of /dev/shm "
                           f"and {needs}: unset DDPX_SHM_MB, or raise it")
    if free < nbytes + (1 << 20):
        raise RuntimeError(
            f"/dev/shm has {free >> 20} MiB free and {needs}: start the container with a larger "
            "/dev/shm (docker run --shm-size=1g) or set a smaller DDPX_BLOCK_KB"
        )
    return C.ShmSegment.create(name, nbytes), wide_bytes


class SharedMemoryUnavailable(Exception):
    """Why shared memory cannot serve a group, the same on every rank of it: the caller falls
    back to the process group's collectives."""


def _create_shm_engine(meeting: _Meeting, me: int, local: list[int], node: int, ranks: list[int],
                       timeout: timedelta, cross_node: list, node_ranks: list[int]):
    """Every rank of a node (``local``: its group ranks) returns its engine, or all raise
    SharedMemoryUnavailable. ``ranks`` maps group ranks to global ones; ``node_ranks`` lists the
    group ranks node by node, where the group spans nodes."""
    C = extension()
    size, index = len(local), local.index(me)
    names = [ranks[r] for r in local]
    block_bytes, wide_bytes, one_shot_bytes = meeting.get("layout", ranks[0])
    if cross_node:  # the nodes would have to agree on every call's steps: narrow ones only
        wide_bytes = block_bytes
    if index == 0:
        name = f"/{_SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            segment, wide_bytes = _create_segment(name, size, block_bytes, wide_bytes)
            engine = C.make_shm_engine(segment, size, block_bytes, wide_bytes, 0, names,
                                       one_shot_bytes, timeout.total_seconds(), True, cross_node,
                                       cross_chunk_bytes(), meeting.store,
                                       f"{meeting.prefix}/abort", node_ranks)
        except Exception as error:  # noqa: BLE001 - every failure here means: use the fallback
            meeting.put(f"segment/{node}", {"error": str(error)})
            C.ShmSegment.unlink(name)
            raise SharedMemoryUnavailable(str(error)) from None
        meeting.put(f"segment/{node}", {"name": name, "wide_bytes": wide_bytes})
        try:
            failures = [meeting.get(f"attached/{node}/{i}", names[i])
                        for i in range(1, size)]
        finally:
            C.ShmSegment.unlink(name)
    else:
        segment_of_node = meeting.get(f"segment/{node}", names[0])
        if "error" in segment_of_node:
            raise SharedMemoryUnavailable(segment_of_node["error"])
        wide_bytes = segment_of_node["wide_bytes"]
        engine, failure = None, None
        try:
            segment = C.ShmSegment.attach(segment_of_node["name"],
                                          C.shm_segment_bytes(size, block_bytes, wide_bytes))
            engine = C.make_shm_engine(segment, size, block_bytes, wide_bytes, index, names,
                                       one_shot_bytes, timeout.total_seconds(), False, cross_node,
                                       cross_chunk_bytes(), meeting.store,
                                       f"{meeting.prefix}/abort", node_ranks)
        except Exception as error:  # noqa: BLE001
            failure = f"rank {ranks[me]} could not map the segment: {error}"
        meeting.put(f"attached/{node}/{index}", failure)
        failures = [failure if i == index else meeting.get(f"attached/{node}/{i}", names[i])
                    for i in range(1, size)]
    failures = [f for f in failures if f is not None]
    if failures:
        raise SharedMemoryUnavailable(failures[0])
    return engine


def _node_identity() -> str:
    """The machine, and the launcher's node rank (GROUP_RANK, which torchrun and accelerate
    launch set), so that launcher nodes sharing a machine stay apart."""
    return f"{_host_identity()}#{os.environ.get('GROUP_RANK', '0')}"


# (global ranks, one per node in node order; index) -> their process group. Weak: torch holds a
# group until destroy_process_group, and a new one must be made after that.
_cross_node_groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


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


def _shared_cross_node_groups(ranks: list[int]) -> list:
    return cross_node_groups(ranks, _shared_new_group)


def create_node_engine(meeting: _Meeting, me: int, ranks: list[int], timeout: timedelta,
                       make_cross_node_groups):
    """The shared-memory engine of the group whose global ranks are ``ranks`` (this rank is
    ``ranks[me]``), made collectively through ``meeting``; the reason why shared memory
    cannot serve it is raised as SharedMemoryUnavailable, the same on every rank.
    ``make_cross_node_groups(ranks)`` makes the process groups between nodes, for a group that
    spans several."""
    size = len(ranks)
    if me == 0:
        meeting.put("layout", [_BLOCK_KB * 1024, _WIDE_KB * 1024, _ONE_SHOT_KB * 1024])
    meeting.put(f"node/{me}", _node_identity())
    nodes = [meeting.get(f"node/{r}", ranks[r]) for r in range(size)]
    names = list(dict.fromkeys(nodes))
    members = [[r for r in range(size) if nodes[r] == name] for name in names]
    node = names.index(nodes[me])
    if len({len(m) for m in members}) > 1:
        raise RuntimeError(
            f"ddpx: the job's nodes run different numbers of ranks ({[len(m) for m in members]});"
            " the hierarchical all-reduce needs the same number on every node: launch every node "
            "with the same --nproc_per_node / --num_processes")
    index = members[node].index(me)
    cross_node = (make_cross_node_groups([ranks[m[index]] for m in members])
                  if len(names) > 1 else [])
    engine, failure = None, None
    try:
        engine = _create_shm_engine(meeting, me, members[node], node, ranks, timeout, cross_node,
                                    [r for m in members for r in m] if cross_node else [])
    except SharedMemoryUnavailable as why:
        failure = str(why)
    # One node without shared memory makes every node fall back: the paths must match.
    meeting.put(f"usable/{me}", failure)
    failures = [f for f in (meeting.get(f"usable/{r}", ranks[r]) for r in range(size))
                if f is not None]
    if failures:
        reason = f"shared memory is unavailable: {failures[0]}"
        if settings.flag("DDPX_STRICT"):
            raise RuntimeError(f"ddpx: {reason} (DDPX_STRICT=1 forbids the process-group fallback)")
        raise SharedMemoryUnavailable(reason)
    return engine


def _create_engine(group, timeout: timedelta | None):
    timeout = timeout if timeout is not None else group_timeout(group)
    me = dist.get_rank(group)
    try:
        return create_node_engine(_Meeting.of_group(group), me,
                                  dist.get_process_group_ranks(group), timeout,
                                  _shared_cross_node_groups)
    except SharedMemoryUnavailable as why:
        if me == 0:
            logger.warning("ddpx: %s; using the process group's all-reduce instead", why)
        return extension().make_process_group_engine(group, str(why))


def engine_for(group=None, device: str = "cpu", timeout: timedelta | None = None):
    """The engine that reduces ``device`` tensors over ``group`` (default: the world), made
    collectively by every rank of the group on first use."""
    group = resolve_group(group)
    by_device = _engines.setdefault(group, {})
    if device not in by_device:
        if device == "cpu":
            by_device[device] = _create_engine(group, timeout)
        elif device == "cuda" and extension().has_cuda_kernels:
            by_device[device] = extension().make_cuda_engine(
                group_with_timeout(group, device, timeout))
        else:
            by_device[device] = extension().make_process_group_engine(
                group, f"{device} tensors go through the process group's all-reduce")
        extension().publish_engine(group.group_name, device, by_device[device])
    return by_device[device]


@atexit.register
def _shutdown() -> None:
    """Stops the communication threads and drops the engines (and the groups they hold) while
    the interpreter is whole: gloo's threads must not outlive it."""
    for by_device in list(_engines.values()):
        for engine in by_device.values():
            engine.shutdown()
    _engines.clear()


def all_reduce(tensor: torch.Tensor, *, group=None, average: bool = False,
               compression: str | torch.dtype | None = None) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group`` (averages with ``average=True``) and returns it.

    Blocking, and collective: every rank of the group calls it with the same size and dtype.
    float32, float64, bfloat16 and float16 are summed in float32 (float64 in float64), in rank
    order, so every rank gets the same bits; complex64 and complex128 as their real and imaginary
    parts. ``compression="bf16"`` or ``"fp16"`` sends float32
    data in that dtype and still sums in float32. A sparse COO tensor is summed by the process
    group (uncompressed), as torch.distributed.all_reduce would. Traced by torch.compile, the call
    is the operator torch.ops.ddpx.all_reduce_, in the graph, with the same bits.

    Example::
        >>> t = torch.full((4,), float(dist.get_rank()))
        >>> ddpx.all_reduce(t, average=True)
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ddpx.all_reduce takes a torch.Tensor, got {type(tensor).__name__}")
    if torch.compiler.is_compiling():
        name, scale = _operator_group(group, tensor.device.type, average)
        torch.ops.ddpx.all_reduce_(tensor, name, scale,
                                   None if compression is None else wire_dtype(compression))
        return tensor
    # The per-call path is two dictionary lookups: this is benchmarked at microsecond sizes.
    pg = group if group is not None else _world.default_pg
    if tensor.is_sparse:
        if compression is not None:
            raise ValueError("ddpx: a sparse tensor is summed by the process group in its own "
                             "dtype; call ddpx.all_reduce on it without compression")
        return sparse_all_reduce(tensor, pg, 1.0 / pg.size() if average else 1.0).wait()
    # tensor.device builds a torch.device (0.7 us); is_cpu does not.
    device = "cpu" if tensor.is_cpu else tensor.device.type
    try:
        engine = _engines[pg][device]
    except (KeyError, TypeError):  # first use, or no group (None / a non-member's placeholder)
        engine = engine_for(group, device)
    scale = 1.0 / pg.size() if average else 1.0
    wire = None if compression is None else wire_dtype(compression)
    engine.run(tensor, scale, wire, "ddpx.all_reduce")
    return tensor


def _operator_group(group, device: str, average: bool) -> tuple[str, float]:
    """torch.ops.ddpx.all_reduce_'s group name and scale for a call traced by torch.compile: run
    once, while tracing (on every rank, so the engine is made collectively), not in the graph."""
    engine_for(group, device)
    pg = resolve_group(group)
    return pg.group_name, 1.0 / pg.size() if average else 1.0


# What torch.compiler.assume_constant_result sets, and all it does; calling it would import
# torch._dynamo, which made `import ddpx` take 3.1-3.6 s on 2 cores against 1.7-1.9, in every
# rank of every job. torch marks its own functions so (torch/_dynamo/decorators.py), and
# tests/test_compile.py fails if the mark stops keeping the call out of the graph.
_operator_group._dynamo_marked_constant = True


def sparse_all_reduce(tensor: torch.Tensor, group, scale: float) -> torch.futures.Future:
    """Starts the sum of the sparse COO ``tensor``, scaled by ``scale``, over ``group`` in place
    through the process group (gloo sums sparse tensors; ddpx's engines reduce dense ones, and
    DDP's default sends sparse gradients the same way); the future holds ``tensor``."""
    if scale != 1.0:
        tensor.mul_(scale)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda _: tensor)
