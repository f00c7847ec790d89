"""What PyTorch's own gloo tests (test/distributed/test_c10d_gloo.py) ask of a backend, on ddpx
against gloo in the same processes: lists whose tensors share memory get gloo's answer or an
error, never a sum counted twice; what the engine does not serve fast (uneven reduce-scatter, the
list forms of all-reduce, all-gather and broadcast, sparse lists) gloo serves; and a call whose own
tensors or root are wrong raises at the call, on the caller's thread, even with async_op=True,
while the peers' calls of it raise naming that rank, and the group stays in step."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

CPU = torch.device("cpu")


def groups():
    """The world, on ddpx, and a gloo group of the same ranks (made once)."""
    global _gloo
    if _gloo is None:
        _gloo = dist.new_group(backend="gloo")
    return dist.group.WORLD, _gloo


_gloo = None


def on_both(case):
    """case(group) -> (work, the tensors it writes), on ddpx and on gloo: the tensors after."""
    results = []
    for group in groups():
        work, written = case(group)
        work.wait()
        results.append([t.to_dense() if t.is_sparse else t for t in written])
    return results


def same_answer(rank, world):
    torch.manual_seed(rank)
    answers = {}

    def compare(name, case):
        on_ddpx, on_gloo = on_both(case)
        answers[name] = all(torch.equal(a, b) for a, b in zip(on_ddpx, on_gloo, strict=True))

    def in_place(method, tensors, *args):
        return lambda g: (getattr(g, method)(tensors(), *args), tensors.last)

    def fresh(make):
        """make() each call, remembered in .last: every group gets the same new inputs."""
        def tensors():
            tensors.last = make()
            return tensors.last
        return tensors

    def pair():
        return [torch.tensor([2.0 * rank]), torch.tensor([2.0 * rank + 1])]

    # The same tensor twice: each entry is the sum of the values at the call (3 at 2 ranks).
    compare("all_reduce_coalesced [t, t]", in_place(
        "allreduce_coalesced", fresh(lambda: 2 * [torch.full((3,), rank + 1.0)])))
    # Views that overlap in part, and a view beside its base.
    compare("all_reduce_coalesced of overlapping views", in_place(
        "allreduce_coalesced",
        fresh(lambda: [(base := torch.arange(8.0) + 10 * rank)[0:5], base[3:8]])))
    compare("all_reduce_coalesced of a tensor and its view", in_place(
        "allreduce_coalesced",
        fresh(lambda: [base := torch.ones(6) * (rank + 1), base[2:4]])))

    # One entry's input is another entry's output.
    def gather_into_own_output(g):
        outs = [torch.full((2 * world,), -1.0), torch.empty(2 * world)]
        ins = [torch.full((2,), rank + 1.0), outs[0][0:2]]
        return g.allgather_into_tensor_coalesced(outs, ins), outs

    def scatter_from_own_output(g):
        outs = [torch.zeros(2 * world), torch.empty(2)]
        ins = [torch.arange(4.0 * world) * (rank + 1), outs[0]]
        return g.reduce_scatter_tensor_coalesced(outs, ins), outs

    compare("all_gather_into_tensor_coalesced, an input inside an output", gather_into_own_output)
    compare("reduce_scatter_tensor_coalesced, an input inside an output", scatter_from_own_output)

    # Each rank's part of a different size.
    def uneven(g):
        out = torch.empty(rank + 1)
        parts = [torch.arange(r + 1.0) + rank for r in range(world)]
        return g.reduce_scatter([out], [parts]), [out]

    compare("reduce_scatter of uneven parts", uneven)
    # The list forms: several tensors a rank.
    compare("all_reduce of two tensors a rank", in_place("allreduce", fresh(pair)))
    # ... which sums every rank's tensors together: world * (2 world - 1) in each.
    summed = pair()
    groups()[0].allreduce(summed).wait()
    answers["all_reduce of two tensors a rank, against the reference"] = all(
        t.item() == world * (2 * world - 1) for t in summed)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 1, 1
    compare("broadcast of two tensors a rank, from the root's second",
            in_place("broadcast", fresh(pair), opts))

    def gather_pairs(g):
        outs = [[torch.empty(1) for _ in range(2 * world)] for _ in range(2)]
        return g.allgather(outs, pair()), [t for out in outs for t in out]

    compare("all_gather of two tensors a rank", gather_pairs)
    compare("sparse all_reduce of two tensors a rank", in_place("allreduce", fresh(lambda: [
        torch.sparse_coo_tensor([[rank]], [1.0 + rank], (world,)),
        torch.sparse_coo_tensor([[0]], [5.0], (world,))])))
    return answers, ddpx_routes()


def ddpx_routes():
    from ddpx import backend_of

    return {name: (paths["engine"], paths["gloo"]) for name, paths in backend_of().routes().items()}


def test_what_gloo_answers_ddpx_answers_the_same():
    for answers, routes in run_ranks(same_answer, 2, backend="ddpx"):
        wrong = [name for name, same in answers.items() if not same]
        assert not wrong, f"ddpx differs from gloo on {wrong}"
        # The aliased and overlapping lists stay on the engine; the list forms go to gloo.
        assert routes["all_reduce_coalesced"] == (3, 0), routes
        assert routes["reduce_scatter"][1] == 1 and routes["broadcast"][1] == 1, routes


def expect_at_call(call, match):
    """The call raises RuntimeError at once, before any work is returned."""
    with pytest.raises(RuntimeError, match=match):
        call()


def refused_at_the_call(rank, world):
    ddpx_backend = dist.group.WORLD._get_backend(CPU)
    t = torch.zeros(2)
    for root in (-1, world):
        expect_at_call(lambda r=root: dist.broadcast(t, r, async_op=True), "invalid root rank")
        opts = dist.ReduceOptions()
        opts.rootRank = root
        expect_at_call(lambda o=opts: ddpx_backend.reduce([t], o), "invalid root rank")
    opts = dist.ReduceOptions()
    opts.rootRank, opts.rootTensor = 0, 1
    expect_at_call(lambda: ddpx_backend.reduce([t], opts), "invalid root tensor")
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 1
    expect_at_call(lambda: ddpx_backend.broadcast([t], opts), "invalid root tensor")
    expect_at_call(lambda: ddpx_backend.allreduce_coalesced([], dist.AllreduceCoalescedOptions()),
                   "non-empty")
    expect_at_call(lambda: ddpx_backend.allreduce([], dist.AllreduceOptions()), "non-empty")
    expect_at_call(lambda: dist.all_gather([t, t], torch.ones(2), async_op=True), "share memory")
    dist.all_reduce(probe := torch.ones(1))  # every rank raised alone: the group is in step
    messages = {"in step": probe.item() == world}
    # Only the root's parts are wrong: it raises at the call, the peers at their wait, naming it.
    # (The group's methods: torch.distributed.gather checks dtypes in Python before ddpx sees them.)
    wrong_parts = [[torch.empty(2, dtype=torch.float64) for _ in range(world)]] if rank == 0 else []
    world_group = dist.group.WORLD
    gather_opts, scatter_opts = dist.GatherOptions(), dist.ScatterOptions()
    gather_opts.rootRank = scatter_opts.rootRank = 0
    for name, call in (
        ("gather", lambda: world_group.gather(wrong_parts, [torch.ones(2)], gather_opts)),
        ("scatter", lambda: world_group.scatter([torch.empty(2)], wrong_parts, scatter_opts)),
    ):
        try:
            work = call()
        except RuntimeError as error:
            messages[name] = ("at the call", str(error))
            continue
        try:
            work.wait()
            messages[name] = ("no error", "")
        except RuntimeError as error:
            messages[name] = ("at wait", str(error))
    dist.all_reduce(probe := torch.ones(1))
    messages["in step after"] = probe.item() == world
    # gloo's _set_default_timeout (torch.distributed's _set_pg_timeout asks gloo for it): the
    # group's options say the new timeout, and calls go on.
    ddpx_backend._set_default_timeout(timedelta(seconds=23))
    dist.all_reduce(probe := torch.ones(1))
    messages["new timeout"] = (ddpx_backend.options._timeout, probe.item() == world)
    return messages


def test_a_bad_call_raises_at_the_call_and_its_peers_name_it():
    root, peer = run_ranks(refused_at_the_call, 2, backend="ddpx")
    assert root["in step"] and root["in step after"] and peer["in step after"]
    assert root["new timeout"] == peer["new timeout"] == (timedelta(seconds=23), True), root
    for name in ("gather", "scatter"):
        assert root[name][0] == "at the call" and "invalid tensor type" in root[name][1], root
        assert "rank 0 rejected its input" in peer[name][1], peer
        assert "invalid tensor type" in peer[name][1], peer

