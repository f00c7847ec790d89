"""Where a node's shared memory goes on a machine of several NUMA nodes (sockets).

A rank reads and writes its own input slots most; on a machine of several NUMA nodes those belong
on the memory node of the CPUs the rank runs on. Local rank 0 creates the segment and reserves its
pages for all, so it learns every local rank's CPUs at the set-up (``ddpx._setup``), gives each
rank's slots that rank's node as their memory policy before the pages exist, and the engine's
``describe()`` says what it did, or why not. A rank's node is the one that holds every CPU the
rank may run on; a rank allowed on the CPUs of several (unbound, as a plain ``torchrun`` leaves it)
has none, and then nothing is placed.

Tests fake a topology with ``DDPX_TEST_NUMA_NODES``: one CPU list per node, nodes numbered from 0
and separated by ``;`` (``"0;1"``: CPU 0 is node 0, CPU 1 node 1). It is for tests only, and not
among the user's settings (``ddpx.settings``): the kernel still places the pages, and refuses a
node it does not have, which is the fallback the tests see.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

__all__ = ["FAKE", "Topology", "format_cpulist", "layout_text", "parse_cpulist", "placeable",
           "rank_nodes", "topology"]

FAKE = "DDPX_TEST_NUMA_NODES"
_SYS_NODES = "/sys/devices/system/node"


def parse_cpulist(text: str) -> frozenset[int]:
    """The CPUs of a list as the kernel writes them (``"0-3,8-11"``; empty: none)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"ddpx: {text!r} is not a CPU list like '0-3,8-11'")
        cpus.update(range(int(match[1]), int(match[2] or match[1]) + 1))
    return frozenset(cpus)


def format_cpulist(cpus) -> str:
    """``parse_cpulist``'s inverse: runs of consecutive numbers as ranges."""
    return _runs(sorted(cpus), "-", ",")


def _runs(numbers: list[int], dash: str, comma: str) -> str:
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return comma.join(str(lo) if lo == hi else f"{lo}{dash}{hi}" for lo, hi in runs)


@dataclass(frozen=True)
class Topology:
    nodes: dict[int, frozenset[int]]  # each NUMA node that has CPUs, and its CPUs
    faked: bool  # read from DDPX_TEST_NUMA_NODES, not from the kernel


def topology() -> Topology:
    """The machine's NUMA nodes and their CPUs (none where the kernel does not say: a kernel
    without NUMA), or the faked ones."""
    fake = os.environ.get(FAKE)
    if fake is not None:
        try:
            nodes = {n: parse_cpulist(text) for n, text in enumerate(fake.split(";"))}
        except ValueError:
            raise ValueError(f"ddpx: {FAKE}={fake!r} is not CPU lists separated by ';', one per "
                             "NUMA node, like '0-1;2-3'") from None
        return Topology({n: cpus for n, cpus in nodes.items() if cpus}, faked=True)
    nodes = {}
    for path in glob.glob(f"{_SYS_NODES}/node[0-9]*/cpulist"):
        with open(path) as f:
            cpus = parse_cpulist(f.read())
        if cpus:  # a node of memory alone (CXL, say) runs no rank
            nodes[int(os.path.basename(os.path.dirname(path))[len("node"):])] = cpus
    return Topology(nodes, faked=False)


def rank_nodes(topo: Topology, rank_cpus: list[frozenset[int]]) -> list[int | None]:
    """The node of each rank, given the CPUs each may run on: the node that holds them all, or
    None for a rank whose CPUs span nodes."""
    def node_of(cpus: frozenset[int]) -> int | None:
        holding = [n for n, node_cpus in sorted(topo.nodes.items()) if cpus <= node_cpus]
        return holding[0] if holding and cpus else None
    return [node_of(cpus) for cpus in rank_cpus]


def placeable(topo: Topology, nodes: list[int | None]) -> bool:
    """Whether the slots go on their ranks' nodes: there are several, and every rank has one."""
    return len(topo.nodes) > 1 and None not in nodes


def layout_text(topo: Topology, nodes: list[int | None], not_placed: str) -> str:
    """What describe() says of the segment's placement: the nodes, the local ranks on each,
    and whether the slots were placed there (``not_placed``: why the kernel refused)."""
    head = f"NUMA (faked by {FAKE})" if topo.faked else "NUMA"
    if len(topo.nodes) <= 1:
        return f"{head}: one node" if topo.faked else "one NUMA node"
    count = f"{head}: {len(topo.nodes)} nodes"
    spanning = [r for r, n in enumerate(nodes) if n is None]
    if spanning:
        ranks = _runs(spanning, "-", ",")
        return (f"{count}, local rank{'s' if len(spanning) > 1 else ''} {ranks} may run on "
                "CPUs of several (unbound): ranks span nodes, slots not placed")
    by_node = {n: [r for r, rn in enumerate(nodes) if rn == n] for n in sorted(set(nodes))}
    where = ", ".join(f"{_runs(ranks, '-', ',')} on node {n}" for n, ranks in by_node.items())
    many = len(nodes) > 1
    text = f"{count}, local rank{'s' if many else ''} {where}, "
    if not_placed:
        return text + f"slots not placed ({not_placed})"
    outputs = ("the outputs' pages interleaved over them" if len(by_node) > 1
               else "the outputs there too")
    return text + f"each rank's slots placed on its node, {outputs}"
