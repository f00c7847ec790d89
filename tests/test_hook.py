"""The fused hook against DDP's default all-reduce, in real multi-process DDP runs where every
rank trains on different data: gradients after one backward and parameters after several steps
agree, and every rank holds the same bits. Both registrations (C++ and the Python hook), several
buckets, unused parameters, gradients as bucket views, and accumulation with no_sync."""

import pytest
import torch
from torch import nn

from distributed import run_ranks

OPTIONS = {
    "one bucket": {},
    "many buckets": {"bucket_cap_mb": 0.004},
    "unused parameters": {"find_unused_parameters": True, "bucket_cap_mb": 0.01},
    "bucket views": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01},
    "no_sync accumulation": {"accumulate": 3, "bucket_cap_mb": 0.01},
}
STEPS = 5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                  nn.Linear(64, 8))
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x)


def train(rank, hook, options):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    options = dict(options)
    accumulate = options.pop("accumulate", 1)
    torch.manual_seed(0)
    net = Net()
    if not options.get("find_unused_parameters"):
        net.unused.requires_grad_(False)
    model = DDP(net, **options)
    if hook == "cpp":
        ddpx.register_fused_hook(model)
    elif hook == "python":
        model.register_comm_hook(ddpx.FusedHookState(), ddpx.fused_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    first_grads = None
    for _ in range(STEPS):
        for micro in range(accumulate):
            x = torch.randn(16, 32, generator=data)
            y = torch.randn(16, 8, generator=data)
            if micro < accumulate - 1:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
        if first_grads is None:
            first_grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    dist.barrier()
    return first_grads, [p.detach().clone() for p in net.parameters()]


def compare_hooks(rank, world, option_names):
    runs = {}
    for name in option_names:
        for hook in ("default", "cpp", "python"):
            runs[(name, hook)] = train(rank, hook, OPTIONS[name])
    return runs


def assert_matches_default(runs):
    by_rank = runs
    for (name, hook), (grads, params) in by_rank[0].items():
        if hook == "default":
            continue
        ref_grads, ref_params = by_rank[0][(name, "default")]
        # The only difference from DDP's default path is the order of the float32 additions
        # (gloo's ring vs ddpx's rank order) and x*(1/n) for x/n: a few ulp per gradient, which
        # five SGD steps with lr 0.1 cannot grow past 1e-5 relative on these O(1) values.
        for g, ref in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6, msg=f"{name}/{hook} grads")
        for p, ref in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-6, msg=f"{name}/{hook} params")
        for other in by_rank[1:]:
            other_params = other[(name, hook)][1]
            for p, q in zip(params, other_params, strict=True):
                assert torch.equal(p, q), f"{name}/{hook}: ranks hold different parameters"


def test_hook_matches_default_allreduce_on_2_ranks():
    assert_matches_default(run_ranks(compare_hooks, 2, list(OPTIONS)))


@pytest.mark.parametrize("world", [3, 4])
def test_hook_matches_default_allreduce_on_more_ranks(world):
    names = ["many buckets", "unused parameters", "no_sync accumulation"]
    assert_matches_default(run_ranks(compare_hooks, world, names))


def registration_errors(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddpx.register_fused_hook(Net())
    with pytest.raises(ValueError, match="compression"):
        ddpx.register_fused_hook(DDP(Net().body), compression="int4")
    model = DDP(Net().body)
    state = ddpx.register_fused_hook(model)
    assert "shared-memory engine, 2 local ranks" in state.describe()
    with pytest.raises(RuntimeError, match="only be called once"):
        ddpx.register_fused_hook(model)


def test_registration_errors():
    run_ranks(registration_errors, 2)
