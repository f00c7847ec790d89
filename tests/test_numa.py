"""NUMA placement of the node's segment (ddpx/_numa.py, csrc/node/numa.cpp): the topology read from
the kernel's CPU lists, the plan (which local rank's slots go to which node), the words
describe() says, and where the kernel put the pages, which get_mempolicy tells. This machine may
have one NUMA node: a faked topology (DDPX_TEST_NUMA_NODES, one CPU list per node) splits its
CPUs into nodes, and the kernel then places on the nodes it has and refuses the others, which is
the fallback. Collectives stay bit-exact whatever the placement."""

import os

import pytest
import torch

from ddpx import _numa

from collective_checks import rank_order_sum
from distributed import run_ranks

SYS_NODES = "/sys/devices/system/node"
CPUS = sorted(os.sched_getaffinity(0))
TWO_CPUS = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to fake two NUMA nodes")
# Two faked nodes: this process's first allowed CPU is node 0, its second node 1.
FAKE_TWO = {_numa.FAKE: f"{CPUS[0]};{CPUS[1]}"} if len(CPUS) >= 2 else {}


def kernel_memory_nodes() -> frozenset[int]:
    """The nodes the kernel can place pages on."""
    try:
        with open(f"{SYS_NODES}/has_memory") as f:
            return _numa.parse_cpulist(f.read())
    except OSError:
        return frozenset({0})


@pytest.mark.parametrize("text,cpus", [
    ("0-3,8-11", {0, 1, 2, 3, 8, 9, 10, 11}),
    ("5", {5}),
    ("0,2,4\n", {0, 2, 4}),
    ("", set()),
    ("\n", set()),
    ("0-0,7-8", {0, 7, 8}),
])
def test_cpu_lists_parse_as_the_kernel_writes_them(text, cpus):
    assert _numa.parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["3-1", "a", "1-", "0;1", "-2"])
def test_a_bad_cpu_list_is_an_error(text):
    with pytest.raises(ValueError, match="is not a CPU list"):
        _numa.parse_cpulist(text)


def test_cpu_lists_format_as_ranges():
    assert _numa.format_cpulist({11, 0, 1, 2, 3, 8, 9, 10}) == "0-3,8-11"
    assert _numa.format_cpulist({4, 6}) == "4,6"
    assert _numa.parse_cpulist(_numa.format_cpulist(set(CPUS))) == set(CPUS)


def test_the_real_topology_holds_this_process_cpus(monkeypatch):
    monkeypatch.delenv(_numa.FAKE, raising=False)
    topo = _numa.topology()
    assert not topo.faked
    if not os.path.isdir(SYS_NODES):
        pytest.skip("the kernel says nothing of NUMA nodes")
    everything = frozenset().union(*topo.nodes.values())
    assert set(CPUS) <= everything, (topo, CPUS)
    for a in topo.nodes:  # a CPU is on one node
        for b in topo.nodes:
            assert a == b or not topo.nodes[a] & topo.nodes[b]


def test_a_faked_topology_and_the_ranks_nodes(monkeypatch):
    monkeypatch.setenv(_numa.FAKE, "0-1;2-3;;6")
    topo = _numa.topology()
    assert topo.faked and topo.nodes == {0: {0, 1}, 1: {2, 3}, 3: {6}}  # node 2 has no CPUs
    cpus = [frozenset({0}), frozenset({0, 1}), frozenset({3}), frozenset({1, 2}), frozenset({6}),
            frozenset({4})]
    assert _numa.rank_nodes(topo, cpus) == [0, 0, 1, None, 3, None]
    monkeypatch.setenv(_numa.FAKE, "0-1;x")
    with pytest.raises(ValueError, match=f"{_numa.FAKE}='0-1;x' is not CPU lists"):
        _numa.topology()


def test_what_describe_says_of_each_layout():
    two = _numa.Topology({0: frozenset({0, 1}), 1: frozenset({2, 3})}, faked=False)
    assert (_numa.layout_text(two, [0, 0, 1, 1], "") ==
            "NUMA: 2 nodes, local ranks 0-1 on node 0, 2-3 on node 1, each rank's slots placed "
            "on its node, the outputs' pages interleaved over them")
    assert (_numa.layout_text(two, [0, 1, 0, 1], "mbind to node 1: Invalid argument") ==
            "NUMA: 2 nodes, local ranks 0,2 on node 0, 1,3 on node 1, slots not placed "
            "(mbind to node 1: Invalid argument)")
    assert (_numa.layout_text(two, [1, 1], "") ==
            "NUMA: 2 nodes, local ranks 0-1 on node 1, each rank's slots placed on its node, "
            "the outputs there too")
    assert (_numa.layout_text(two, [0, None, None], "") ==
            "NUMA: 2 nodes, local ranks 1-2 may run on CPUs of several (unbound): ranks span "
            "nodes, slots not placed")
    assert _numa.layout_text(_numa.Topology({0: frozenset({0})}, False), [0, 0], "") == \
        "one NUMA node"
    assert _numa.layout_text(_numa.Topology({}, False), [None], "") == "one NUMA node"
    faked = _numa.Topology(two.nodes, faked=True)
    assert _numa.layout_text(faked, [0, 1], "").startswith(
        f"NUMA (faked by {_numa.FAKE}): 2 nodes, local ranks 0 on node 0, 1 on node 1, ")
    assert not _numa.placeable(two, [0, None]) and _numa.placeable(two, [0, 1])
    assert not _numa.placeable(_numa.Topology({0: frozenset({0})}, False), [0, 0])


def extension():
    from ddpx._ext import extension

    return extension()


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_plan_puts_each_rank_slots_on_its_node(ranks):
    C = extension()
    block, wide = 256 << 10, 4 << 20
    nodes = [r * 2 // ranks for r in range(ranks)]  # the first half on node 0, the rest on 1
    plan = C.shm_numa_ranges(ranks, block, wide, nodes)
    assert len(plan) == ranks + 1
    inputs, output = plan[:ranks], plan[ranks]
    for r, (offset, nbytes, mode, on) in enumerate(inputs):
        assert (nbytes, mode, on) == (2 * wide, "preferred", [nodes[r]])
        assert offset % 4096 == 0
        if r:
            assert offset == inputs[r - 1][0] + 2 * wide  # one after another
    assert output[0] == inputs[-1][0] + 2 * wide
    assert output[1:] == (4 * wide, "interleave", [0, 1])
    assert output[0] + output[1] <= C.shm_segment_bytes(ranks, block, wide)
    assert C.shm_numa_ranges(2, block, wide, [1, 1])[2][2:] == ("preferred", [1])
    with pytest.raises(ValueError, match="3 ranks' NUMA nodes for a segment of 2 ranks"):
        C.shm_numa_ranges(2, block, wide, [0, 0, 0])


def make_segment(nodes, wide=1 << 20):
    C = extension()
    name = f"/ddpx-{os.getpid()}-numa-test"
    nbytes = C.shm_segment_bytes(len(nodes), 64 << 10, wide)
    plan = C.shm_numa_ranges(len(nodes), 64 << 10, wide, nodes)
    try:
        return C.ShmSegment.create(name, nbytes, plan), plan
    finally:
        C.ShmSegment.unlink(name)


def test_the_kernel_puts_the_pages_where_the_plan_says():
    C = extension()
    node = min(kernel_memory_nodes())
    segment, plan = make_segment([node, node, node])
    assert segment.not_placed == ""
    for offset, nbytes, _, _ in plan:
        for page in (offset, offset + nbytes - 4096):
            where = C.numa_where(segment.address + page)
            assert where == {"node": node, "policy": "preferred", "nodes": [node]}, (page, where)
    # The header and control blocks, before the first slot, keep the default policy.
    assert C.numa_where(segment.address)["policy"] == "default"


def test_a_node_the_kernel_lacks_leaves_every_page_unplaced():
    C = extension()
    real, missing = min(kernel_memory_nodes()), max(kernel_memory_nodes()) + 1
    segment, plan = make_segment([real, missing])
    assert segment.not_placed == f"mbind to node {missing}: Invalid argument"
    for offset, _, _, _ in plan:  # rank 0's range, placed first, was undone
        where = C.numa_where(segment.address + offset)
        assert where["policy"] == "default" and where["node"] in kernel_memory_nodes(), where


def placed_ranks(rank, world, cpus):
    """Binds this rank to ``cpus[rank]`` (all its CPUs where None), makes the engine, and returns
    what it says of its placement, where its pages lie, and its sums' bits (checked here
    against the rank-order reference)."""
    import ddpx
    from ddpx.engine import engine_for

    if cpus[rank] is not None:
        os.sched_setaffinity(0, {cpus[rank]})
    engine = engine_for(None)
    sums = {}
    for dtype, n in [(torch.float32, 1000), (torch.float32, 300_001), (torch.bfloat16, 200_003),
                     (torch.float32, 2_000_003)]:
        inputs = [(torch.randn(n, generator=torch.Generator().manual_seed(r * 7 + n)) * (r + 1))
                  .to(dtype) for r in range(world)]
        out = ddpx.all_reduce(inputs[rank].clone())
        assert torch.equal(out, rank_order_sum(inputs)), (dtype, n)
        sums[(str(dtype), n)] = bytes(out.view(torch.uint8).numpy())
    # The arena's chunks are reserved by their owner (fallocate): on the node it runs on.
    C = extension()
    chunk = C.arena_empty(1 << 20, torch.float32)
    arena_node = C.numa_where(chunk.data_ptr())["node"]
    os.environ.pop(_numa.FAKE, None)
    here = _numa.rank_nodes(_numa.topology(), [frozenset(os.sched_getaffinity(0))])[0]
    return {"describe": engine.describe(), "numa": engine.numa, "slots": engine.slot_memory,
            "sums": sums, "arena": (arena_node, here)}


def run_placed(world, cpus, env):
    results = run_ranks(placed_ranks, world, cpus, env=env)
    for r in results[1:]:
        assert r["sums"] == results[0]["sums"], "every rank holds the same bits"
        assert r["numa"] == results[0]["numa"], "every rank says the same of the segment"
    for r in results:
        assert r["numa"] in r["describe"]
        arena_node, here = r["arena"]
        assert arena_node in kernel_memory_nodes(), r["arena"]
        assert here is None or arena_node == here, r["arena"]
    return results


@TWO_CPUS
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_on_two_faked_nodes(world):
    """Local ranks 0-1 on CPU 0 (node 0), 2-3 on CPU 1 (node 1) at 4 ranks; 0 and 1 at 2. The
    kernel places them where it has both nodes, and refuses node 1 where it has one."""
    per_node = world // 2
    cpus = [CPUS[r // per_node] for r in range(world)]
    results = run_placed(world, cpus, FAKE_TWO)
    ranks = ("0-1 on node 0, 2-3 on node 1" if world == 4 else "0 on node 0, 1 on node 1")
    head = f"NUMA (faked by {_numa.FAKE}): 2 nodes, local ranks {ranks}, "
    slots = results[0]["slots"]
    if 1 in kernel_memory_nodes():
        assert results[0]["numa"] == head + ("each rank's slots placed on its node, the outputs' "
                                             "pages interleaved over them")
        for r in range(world):
            assert slots[r] == {"node": r // per_node, "policy": "preferred",
                                "nodes": [r // per_node]}
        assert slots[world]["policy"] == "interleave" and slots[world]["nodes"] == [0, 1]
    else:
        assert results[0]["numa"] == head + "slots not placed (mbind to node 1: Invalid argument)"
        assert all(s["policy"] == "default" for s in slots), slots


@TWO_CPUS
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ranks_on_one_of_two_faked_nodes_are_placed_there(world):
    """Every rank on node 0's CPU: the kernel has node 0, so the placement takes, and each
    rank's slots carry node 0 as their policy (the pages lie there)."""
    node = min(kernel_memory_nodes())
    fake = {_numa.FAKE: ";" * node + f"{CPUS[0]};{CPUS[1]}"}  # CPU 0 is node `node`
    results = run_placed(world, [CPUS[0]] * world, fake)
    assert results[0]["numa"] == (
        f"NUMA (faked by {_numa.FAKE}): 2 nodes, local ranks 0-{world - 1} on node {node}, "
        "each rank's slots placed on its node, the outputs there too")
    assert results[0]["slots"] == [{"node": node, "policy": "preferred", "nodes": [node]}] * (
        world + 1)


@TWO_CPUS
def test_unbound_ranks_span_faked_nodes_and_nothing_is_placed():
    results = run_placed(2, [None, CPUS[1]], FAKE_TWO)
    assert results[0]["numa"] == (f"NUMA (faked by {_numa.FAKE}): 2 nodes, local rank 0 may run "
                                  "on CPUs of several (unbound): ranks span nodes, slots not "
                                  "placed")
    assert all(s["policy"] == "default" for s in results[0]["slots"])


def test_the_real_topology_is_described(monkeypatch):
    monkeypatch.delenv(_numa.FAKE, raising=False)  # the ranks take this process's environment
    results = run_placed(2, [None, None], {})
    if len(_numa.topology().nodes) <= 1:
        assert results[0]["numa"] == "one NUMA node"
        assert all(s["policy"] == "default" for s in results[0]["slots"])
    else:
        assert results[0]["numa"].startswith("NUMA: ")
