"""ddpx.all_reduce under torch.compile: the call is torch.ops.ddpx.all_reduce_ in the graph (no
graph break: fullgraph=True), with the bits of the eager call; and the operator passes
torch.library.opcheck (schema, fake tensor, functionalization)."""

import torch

from distributed import run_ranks


def _compiled_against_eager(rank, world):
    import torch.distributed as dist

    import ddpx

    def step(x, group, average, compression):
        y = torch.sin(x) * 3
        ddpx.all_reduce(y, group=group, average=average, compression=compression)
        return y + 1

    group = dist.new_group(list(range(world)))
    results = []
    for args in [(None, False, None), (None, True, None), (group, True, "bf16")]:
        x = torch.linspace(-2, 2, 1000) * (rank + 1)
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x.clone(), *args)
        eager = step(x.clone(), *args)
        results.append((compiled, eager))

    # opcheck calls the operator several times, the same on every rank: each is a collective.
    t = torch.full((64,), float(rank + 1))
    torch.library.opcheck(torch.ops.ddpx.all_reduce_.default,
                          (t, dist.group.WORLD.group_name, 1.0, None))
    return results


def test_compiled_all_reduce_matches_eager_bit_for_bit():
    for results in run_ranks(_compiled_against_eager, 2, backend="ddpx"):
        for compiled, eager in results:
            assert torch.equal(compiled, eager)


def _unpublished(rank, world):
    t = torch.ones(4)
    try:
        torch.ops.ddpx.all_reduce_(t, "no-such-group", 1.0, None)
    except ValueError as error:
        return str(error)
    return "no error"


def test_operator_names_a_group_without_an_engine():
    from ddpx._ext import extension

    extension()  # loading it registers the operators

    message = _unpublished(0, 1)
    assert "no engine for cpu tensors on process group 'no-such-group'" in message
