"""How the ranks of a process group make its engine for CPU tensors, together.

The ranks meet (``_meeting``), the lowest rank of each node creates the node's shared-memory
segment (``_segment``) with each rank's slots on its NUMA node (``_numa``), every rank maps it, and
the name is unlinked as soon as all have, so nothing is left in /dev/shm whatever happens to the
job afterwards; each rank then takes its share of its CPUs (``_cpu_share``). A group that spans
nodes is reduced hierarchically, between nodes through process groups of the ranks with the same
local index (``_cross_node``). Where shared memory cannot serve (no room in /dev/shm on some
node), every rank of the group is told why, the same on each, and falls back to the process group.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass, fields
from datetime import timedelta

import torch.distributed as dist

from ddpx import _numa, settings
from ddpx._cpu_share import use_cpu_share
from ddpx._cross_node import cross_chunk_bytes, shared_cross_node_groups
from ddpx._ext import extension
from ddpx._groups import ddpx_backend
from ddpx._meeting import Meeting, failed, node_identity, raise_if_failed
from ddpx._segment import SEGMENT_PREFIX, SharedMemoryUnavailable, create_segment
from ddpx._timeouts import group_timeout

__all__ = ["EngineOptions", "create_cpu_engine", "create_node_engine"]

logger = logging.getLogger("ddpx")

# A step's slots stay in the last-level cache (docs/design.md, "Where the defaults come from");
# wide blocks are there for engine.schedule "wide" and "timed".
_BLOCK_KB = settings.positive_int("DDPX_BLOCK_KB")
_WIDE_KB = settings.positive_int("DDPX_WIDE_KB")
# Up to which size every rank sums whole blocks after one exchange (one-shot) instead of a slice
# each with a second exchange (two-phase; docs/under-load.md, "Narrow steps on an idle machine").
_ONE_SHOT_KB = settings.positive_int("DDPX_ONE_SHOT_KB")


@dataclass(frozen=True)
class EngineOptions:
    """One rank's shared-memory engine, field by field the keyword arguments of
    ``_C.make_shm_engine`` (csrc/torch_api/bindings.cpp)."""

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
    # takes its share of its own (use_cpu_share).
    meeting.put(f"cpus/{node}/{index}", _numa.format_cpulist(os.sched_getaffinity(0)))
    rank_cpus = [_numa.parse_cpulist(meeting.get(f"cpus/{node}/{i}", names[i]))
                 for i in range(size)]
    if index == 0:
        name = f"/{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            topology = _numa.topology()
            rank_nodes = _numa.rank_nodes(topology, rank_cpus)
            placed = _numa.placeable(topology, rank_nodes)
            segment, wide_bytes = create_segment(name, size, block_bytes, wide_bytes,
                                                  rank_nodes if placed else None)
            numa = _numa.layout_text(topology, rank_nodes, segment.not_placed)
            engine = engine_on(segment, wide_bytes, numa)
        except BaseException as error:
            fallback = isinstance(error, SharedMemoryUnavailable)
            meeting.put(f"segment/{node}", {"error": str(error)} if fallback else failed(error))
            C.ShmSegment.unlink(name)
            raise
        meeting.put(f"segment/{node}", {"name": name, "wide_bytes": wide_bytes, "numa": numa})
        try:
            reports = [meeting.get(f"attached/{node}/{i}", names[i]) for i in range(1, size)]
        finally:
            C.ShmSegment.unlink(name)
    else:
        segment_of_node = meeting.get(f"segment/{node}", names[0])
        raise_if_failed(segment_of_node, names[0])
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
                meeting.put(f"attached/{node}/{index}", failed(error))
                raise
        meeting.put(f"attached/{node}/{index}", report)
        reports = [report if i == index else meeting.get(f"attached/{node}/{i}", names[i])
                   for i in range(1, size)]
    for i, report in enumerate(reports, start=1):
        raise_if_failed(report, names[i])
    failures = [f for f in reports if f is not None]
    if failures:
        raise SharedMemoryUnavailable(failures[0])
    use_cpu_share(engine, index, rank_cpus)
    return engine


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
    meeting.put(f"node/{me}", node_identity())
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
        meeting.put(f"usable/{me}", failed(error))
        raise
    # One node without shared memory makes every node fall back: the paths must match.
    meeting.put(f"usable/{me}", failure)
    reports = [meeting.get(f"usable/{r}", ranks[r]) for r in range(size)]
    for r, report in enumerate(reports):
        raise_if_failed(report, ranks[r])
    failures = [f for f in reports if f is not None]
    if failures:
        reason = f"shared memory is unavailable: {failures[0]}"
        if settings.flag("DDPX_STRICT"):
            raise RuntimeError(f"ddpx: {reason} (DDPX_STRICT=1 forbids the process-group fallback)")
        raise SharedMemoryUnavailable(reason)
    return engine


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
        return create_node_engine(Meeting.of_group(group, timeout), me,
                                  dist.get_process_group_ranks(group), timeout,
                                  shared_cross_node_groups)
    except SharedMemoryUnavailable as why:
        if me == 0:
            logger.warning("ddpx: %s; using the process group's all-reduce instead", why)
        return extension().make_process_group_engine(group, str(why))
