"""How the ranks of a process group set up its engine for CPU tensors.

The ranks of the group meet through the job's c10d store, the lowest rank of each node creates the
node's shared-memory segment under a random name, every rank maps it, and the name is unlinked as
soon as all have, so nothing is left in /dev/shm whatever happens to the job afterwards. A group
that spans nodes is reduced hierarchically, between nodes through process groups of the ranks
with the same local index. Where shared memory cannot serve (no room in /dev/shm on some node),
every rank of the group is told why, the same on each, and falls back to the process group.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import weakref
from dataclasses import dataclass, fields
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _ProcessGroupWrapper

from ddpx import _numa, settings
from ddpx._ext import extension

__all__ = [
    "EngineOptions",
    "Meeting",
    "SharedMemoryUnavailable",
    "create_cpu_engine",
    "create_node_engine",
    "cross_chunk_bytes",
    "cross_node_groups",
    "ddpx_backend",
    "group_timeout",
    "group_with_timeout",
    "resolve_group",
]

logger = logging.getLogger("ddpx")

_SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX = "ddpx-"
# A step's slots stay in the last-level cache (docs/design.md, "Where the defaults come from");
# wide blocks are there for engine.schedule "wide" and "timed".
_BLOCK_KB = settings.positive_int("DDPX_BLOCK_KB")
_WIDE_KB = settings.positive_int("DDPX_WIDE_KB")
# Up to which size every rank sums whole blocks after one exchange (one-shot) instead of a slice
# each with a second exchange (two-phase; docs/under-load.md, "Narrow steps on an idle machine").
_ONE_SHOT_KB = settings.positive_int("DDPX_ONE_SHOT_KB")
# Across nodes (docs/benchmarks.md, "Across a network"): slices cross in chunks of this much of
# the message, taking turns on this many lanes (two process groups each), so the link never waits
# for the node.
_CROSS_CHUNK_KB = settings.positive_int("DDPX_CROSS_CHUNK_KB")
_CROSS_LANES = settings.positive_int("DDPX_CROSS_LANES")
_SHM_MB = settings.optional_positive_int("DDPX_SHM_MB")
# Threads per rank that move a large call's data (docs/design.md, "A rank's cores"); None: the
# rank's share of its CPUs.
_THREADS = settings.auto_or_positive_int("DDPX_THREADS")
_told_threads = False

_generation: dict[str, int] = {}


def cross_chunk_bytes() -> int:
    """How much of a message crosses nodes per chunk of the hierarchical all-reduce."""
    return _CROSS_CHUNK_KB * 1024


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


def _node_identity() -> str:
    """The machine, and the launcher's node rank (GROUP_RANK, which torchrun and accelerate
    launch set), so that launcher nodes sharing a machine stay apart."""
    return f"{_host_identity()}#{os.environ.get('GROUP_RANK', '0')}"


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


class SharedMemoryUnavailable(Exception):
    """Why shared memory cannot serve a group, the same on every rank of it: the caller falls
    back to the process group's collectives. Only the conditions docs/design.md lists as
    fallbacks raise it (/dev/shm too small or refused, too many ranks on a node); any other
    failure of the set-up is an error on every rank of the group (``_failed``)."""


def _failed(error: BaseException) -> dict:
    """What a rank whose set-up failed other than by a fallback tells its peers."""
    return {"fatal": f"{type(error).__name__}: {error}"}


def _raise_if_failed(report, rank: int) -> None:
    if isinstance(report, dict) and "fatal" in report:
        raise RuntimeError(f"ddpx: rank {rank} failed to set up the group's shared-memory engine: "
                           f"{report['fatal']}")


def _create_segment(name: str, size: int, block_bytes: int, wide_bytes: int,
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


@dataclass(frozen=True)
class EngineOptions:
    """One rank's shared-memory engine, field by field the keyword arguments of
    ``_C.make_shm_engine`` (csrc/bindings.cpp)."""

    segment: object  # the node's ShmSegment: created by local rank 0, mapped by the others
    nranks: int  # the group's ranks on this node
    block_bytes: int  # one rank's block of a narrow step
    wide_bytes: int  # one rank's block of a wide step
    local_rank: int
    ranks: list[int]  # the global rank of each local rank, which errors name
    one_shot_bytes: int  # messages up to this size are summed whole by every rank
    timeout_s: float  # the longest wait for a peer
    initialize: bool  # local rank 0's engine writes the segment's headers
    cross_node_groups: list  # between nodes: a dealing and a gathering group per lane; or none
    cross_chunk_bytes: int  # how much of a message crosses nodes per chunk
    store: object  # where a rank that gives up across nodes puts why, under abort_key
    abort_key: str
    node_ranks: list[int]  # the group ranks node by node, where the group spans nodes
    numa: str  # where the segment's slots lie on the machine's NUMA nodes, for describe()


def _make_shm_engine(options: EngineOptions):
    """The engine ``options`` describe; by keyword, so that no argument lands in another's place."""
    return extension().make_shm_engine(
        **{field.name: getattr(options, field.name) for field in fields(options)})


def _create_shm_engine(meeting: Meeting, me: int, local: list[int], node: int, ranks: list[int],
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

    def engine_on(segment, wide_bytes: int, numa: str):
        return _make_shm_engine(EngineOptions(
            segment=segment, nranks=size, block_bytes=block_bytes, wide_bytes=wide_bytes,
            local_rank=index, ranks=names, one_shot_bytes=one_shot_bytes,
            timeout_s=timeout.total_seconds(), initialize=index == 0,
            cross_node_groups=cross_node, cross_chunk_bytes=cross_chunk_bytes(),
            store=meeting.store, abort_key=f"{meeting.prefix}/abort", node_ranks=node_ranks,
            numa=numa))

    # The CPUs each rank may run on: local rank 0 places the slots by them (the pages are
    # allocated as the segment is made, so every rank's NUMA node is known first), and each rank
    # takes its share of its own (_use_cpu_share).
    meeting.put(f"cpus/{node}/{index}", _numa.format_cpulist(os.sched_getaffinity(0)))
    rank_cpus = [_numa.parse_cpulist(meeting.get(f"cpus/{node}/{i}", names[i]))
                 for i in range(size)]
    if index == 0:
        name = f"/{_SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            topology = _numa.topology()
            rank_nodes = _numa.rank_nodes(topology, rank_cpus)
            placed = _numa.placeable(topology, rank_nodes)
            segment, wide_bytes = _create_segment(name, size, block_bytes, wide_bytes,
                                                  rank_nodes if placed else None)
            numa = _numa.layout_text(topology, rank_nodes, segment.not_placed)
            engine = engine_on(segment, wide_bytes, numa)
        except BaseException as error:
            fallback = isinstance(error, SharedMemoryUnavailable)
            meeting.put(f"segment/{node}", {"error": str(error)} if fallback else _failed(error))
            C.ShmSegment.unlink(name)
            raise
        meeting.put(f"segment/{node}", {"name": name, "wide_bytes": wide_bytes, "numa": numa})
        try:
            reports = [meeting.get(f"attached/{node}/{i}", names[i]) for i in range(1, size)]
        finally:
            C.ShmSegment.unlink(name)
    else:
        segment_of_node = meeting.get(f"segment/{node}", names[0])
        _raise_if_failed(segment_of_node, names[0])
        if "error" in segment_of_node:
            raise SharedMemoryUnavailable(segment_of_node["error"])
        wide_bytes = segment_of_node["wide_bytes"]
        engine, report = None, None
        try:
            segment = C.ShmSegment.attach(segment_of_node["name"],
                                          C.shm_segment_bytes(size, block_bytes, wide_bytes))
        except RuntimeError as error:  # the kernel would not map it here: a fallback
            report = f"rank {ranks[me]} could not map the segment: {error}"
        else:
            try:
                engine = engine_on(segment, wide_bytes, segment_of_node["numa"])
            except BaseException as error:
                meeting.put(f"attached/{node}/{index}", _failed(error))
                raise
        meeting.put(f"attached/{node}/{index}", report)
        reports = [report if i == index else meeting.get(f"attached/{node}/{i}", names[i])
                   for i in range(1, size)]
    for i, report in enumerate(reports, start=1):
        _raise_if_failed(report, names[i])
    failures = [f for f in reports if f is not None]
    if failures:
        raise SharedMemoryUnavailable(failures[0])
    _use_cpu_share(engine, index, rank_cpus)
    return engine


def _use_cpu_share(engine, index: int, rank_cpus: list[frozenset[int]]) -> None:
    """Gives the engine DDPX_THREADS threads, or local rank ``index``'s share of the CPUs it may
    run on (``rank_cpus``, by local rank): them divided among the node's ranks that may run on
    any of them (all of the node's, unbound; none but itself, each bound to its own cores). Where
    OMP_NUM_THREADS is unset (mp.spawn sets nothing), torch's intra-op threads come down to that
    share too, as torchrun and Accelerate set them for their launches: a pool of every CPU in each
    rank oversubscribes the node, and its workers spin after each op on the cores the ranks'
    communication needs (docs/design.md, "A rank's cores")."""
    global _told_threads
    mine = rank_cpus[index]
    sharing = sum(1 for cpus in rank_cpus if cpus & mine)
    share = max(1, len(mine) // sharing)
    engine.threads = _THREADS if _THREADS is not None else share
    pool = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or pool <= share:
        return
    torch.set_num_threads(share)
    if not _told_threads and index == 0:
        _told_threads = True
        logger.warning(
            "ddpx: OMP_NUM_THREADS is unset and torch ran %d intra-op threads per rank, with %d "
            "ranks on these %d CPUs: ddpx set torch.set_num_threads(%d), each rank's share. Set "
            "OMP_NUM_THREADS to choose another number.", pool, sharing, len(mine), share)


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


def create_node_engine(meeting: Meeting, me: int, ranks: list[int], timeout: timedelta,
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
    if len(members[node]) > extension().max_local_ranks:
        # Every rank sees the same node sizes: all of them take this path, no segment is made.
        reason = (f"{len(members[node])} ranks of this group share a node, and the shared-memory "
                  f"engine serves at most {extension().max_local_ranks} per node: launch at most "
                  f"{extension().max_local_ranks} processes per node, or reduce over groups of at "
                  f"most that many ranks per node (torch.distributed.new_group)")
        if settings.flag("DDPX_STRICT"):
            raise RuntimeError(f"ddpx: {reason} (DDPX_STRICT=1 forbids the process-group "
                               "fallback)")
        raise SharedMemoryUnavailable(reason)
    index = members[node].index(me)
    cross_node = (make_cross_node_groups([ranks[m[index]] for m in members])
                  if len(names) > 1 else [])
    engine, failure = None, None
    try:
        engine = _create_shm_engine(meeting, me, members[node], node, ranks, timeout, cross_node,
                                    [r for m in members for r in m] if cross_node else [])
    except SharedMemoryUnavailable as why:
        failure = str(why)
    except BaseException as error:  # the other nodes must not wait for this rank in vain
        meeting.put(f"usable/{me}", _failed(error))
        raise
    # One node without shared memory makes every node fall back: the paths must match.
    meeting.put(f"usable/{me}", failure)
    reports = [meeting.get(f"usable/{r}", ranks[r]) for r in range(size)]
    for r, report in enumerate(reports):
        _raise_if_failed(report, ranks[r])
    failures = [f for f in reports if f is not None]
    if failures:
        reason = f"shared memory is unavailable: {failures[0]}"
        if settings.flag("DDPX_STRICT"):
            raise RuntimeError(f"ddpx: {reason} (DDPX_STRICT=1 forbids the process-group fallback)")
        raise SharedMemoryUnavailable(reason)
    return engine


def ddpx_backend(group):
    """The ddpx backend that serves ``group``'s CPU tensors, or None where another does."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):  # no CPU backend, or a group traced by torch.compile
        return None
    if isinstance(backend, _ProcessGroupWrapper):  # TORCH_DISTRIBUTED_DEBUG=DETAIL's checks
        backend = backend.wrapped_pg
    return backend if isinstance(backend, extension().Backend) else None


def create_cpu_engine(group, timeout: timedelta | None):
    """The engine of ``group``'s CPU tensors: on a group of ddpx's backend, the backend's own (one
    engine, one segment and one order of calls for the hook, ddpx.all_reduce and
    torch.distributed), unless another timeout is asked for; else made collectively by the
    group's ranks: the node's shared memory, or the process group's all-reduce where that cannot
    serve (said once, by rank 0)."""
    own = group_timeout(group)
    backend = ddpx_backend(group)
    if backend is not None and backend.engine is not None and timeout in (None, own):
        return backend.engine
    timeout = timeout if timeout is not None else own
    me = dist.get_rank(group)
    try:
        return create_node_engine(Meeting.of_group(group), me,
                                  dist.get_process_group_ranks(group), timeout,
                                  _shared_cross_node_groups)
    except SharedMemoryUnavailable as why:
        if me == 0:
            logger.warning("ddpx: %s; using the process group's all-reduce instead", why)
        return extension().make_process_group_engine(group, str(why))
