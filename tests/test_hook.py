"""The fused hook against DDP's default all-reduce, in real multi-process DDP runs where every
rank trains on different data: gradients after one backward and parameters after several steps
agree, and every rank holds the same bits. Both registrations (C++ and the Python hook), several
buckets, unused parameters, gradients as bucket views, and accumulation with no_sync."""

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from distributed import run_nodes, run_ranks

OPTIONS = {
    "one bucket": {},
    "many buckets": {"bucket_cap_mb": 0.004},
    "unused parameters": {"find_unused_parameters": True, "bucket_cap_mb": 0.01},
    "bucket views": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01},
    "no_sync accumulation": {"accumulate": 3, "bucket_cap_mb": 0.01},
}
STEPS = 5
# The fused hook against DDP's default, uncompressed: see assert_matches_default.
SUM_ORDER_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                                  nn.Linear(64, 8))
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x)


# The optimizers the steps in flight are checked with: state per parameter (momentum, Adam's
# moments and step count), and weight decay, which moves a parameter whatever its gradient.
OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1),
    "SGD momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9,
                                                   weight_decay=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def register(model, hook: str, compression: str | None = None, optimizer=None) -> None:
    """Put the hook named `hook` on a DDP model: "cpp" (register_fused_hook), "cpp-steps" (the
    same, stepping `optimizer` per bucket), "python" (fused_allreduce_hook), or "default" (none:
    DDP's own all-reduce)."""
    import ddpx

    if hook == "cpp":
        ddpx.register_fused_hook(model, compression=compression)
    elif hook == "cpp-steps":
        ddpx.register_fused_hook(model, compression=compression, optimizer=optimizer)
    elif hook == "python":
        model.register_comm_hook(ddpx.FusedHookState(compression=compression),
                                 ddpx.fused_allreduce_hook)


def train(rank, hook, options, optimizer_name="SGD", with_state=False):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    options = dict(options)
    accumulate = options.pop("accumulate", 1)
    torch.manual_seed(0)
    net = Net()
    if not options.get("find_unused_parameters"):
        net.unused.requires_grad_(False)
    model = DDP(net, **options)
    optimizer = OPTIMIZERS[optimizer_name](model.parameters())
    register(model, hook, optimizer=optimizer)
    data = torch.Generator().manual_seed(100 + rank)
    first_grads = None
    moved = []  # per backward: which parameters it moved (with cpp-steps, the sync ones should)
    for _ in range(STEPS):
        for micro in range(accumulate):
            x = torch.randn(16, 32, generator=data)
            y = torch.randn(16, 8, generator=data)
            before = [p.detach().clone() for p in net.parameters()]
            if micro < accumulate - 1:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
            else:
                nn.functional.mse_loss(model(x), y).backward()
            pairs = zip(net.parameters(), before, strict=True)
            moved.append([not torch.equal(p, b) for p, b in pairs])
        if first_grads is None:
            first_grads = [p.grad.clone() for p in net.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    dist.barrier()
    params = [p.detach().clone() for p in net.parameters()]
    if with_state:
        with_grads = [p.grad is not None for p in net.parameters()]
        return first_grads, params, optimizer.state_dict()["state"], moved, with_grads
    return first_grads, params


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
            torch.testing.assert_close(g, ref, **SUM_ORDER_TOLERANCE, msg=f"{name}/{hook} grads")
        for p, ref in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, ref, **SUM_ORDER_TOLERANCE,
                                       msg=f"{name}/{hook} params")
        for other in by_rank[1:]:
            other_params = other[(name, hook)][1]
            for p, q in zip(params, other_params, strict=True):
                assert torch.equal(p, q), f"{name}/{hook}: ranks hold different parameters"


def test_hook_matches_default_allreduce_on_2_ranks():
    assert_matches_default(run_ranks(compare_hooks, 2, list(OPTIONS)))


@pytest.mark.slow  # 3 and 4 ranks; the backend battery runs 4 by default
@pytest.mark.parametrize("world", [3, 4])
def test_hook_matches_default_allreduce_on_more_ranks(world):
    names = ["many buckets", "unused parameters", "no_sync accumulation"]
    assert_matches_default(run_ranks(compare_hooks, world, names))


def check_steps(rank, world, across_nodes=False):
    """register_fused_hook(optimizer=...) against the same hook with the step after backward, for
    every DDP option above, SGD with momentum and weight decay, and AdamW (int8's in
    tests/test_int8.py): what differs, in words (nothing: []), and this rank's parameters'
    digest. Across nodes each
    backward that reduces the buckets (not one under no_sync) moves every parameter with a
    gradient by the time it returns, and only those; on one node none (the loop's step does it).
    Then an optimizer whose step raises: across nodes backward fails with its error."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    wrong, digest = [], []
    for name in OPTIONS:
        for optimizer in ("SGD momentum", "AdamW"):
            what = f"{name}/{optimizer}"
            ref_grads, ref_params, ref_state, _, _ = train(rank, "cpp", OPTIONS[name], optimizer,
                                                           True)
            grads, params, state, moved, with_grads = train(rank, "cpp-steps", OPTIONS[name],
                                                            optimizer, True)
            accumulate = OPTIONS[name].get("accumulate", 1)
            for index, moved_params in enumerate(moved):
                syncs = index % accumulate == accumulate - 1
                expected = with_grads if across_nodes and syncs else [False] * len(with_grads)
                if moved_params != expected:
                    wrong.append(f"{what}: backward {index} moved {moved_params}")
            pairs = [*zip(grads, ref_grads, strict=True), *zip(params, ref_params, strict=True)]
            pairs += [(value, ref_state[index][key]) for index, values in state.items()
                      for key, value in values.items()]
            if state.keys() != ref_state.keys() or not all(torch.equal(*p) for p in pairs):
                wrong.append(f"{what}: not the bits of the step after backward")
            digest.append([float(p.double().sum()) for p in params])
    model = DDP(Net().body)
    ddpx.register_fused_hook(model, optimizer=_FailingStep(model.parameters(), lr=0.1))
    try:
        model(torch.ones(2, 32)).sum().backward()
        raised = "nothing" if across_nodes else ""
    except RuntimeError as error:
        raised = "" if "the optimizer's step of a bucket: " in str(error) and \
            "cannot step" in str(error) and across_nodes else str(error)
    if raised:
        wrong.append(f"the failing step's backward raised {raised}")
    return {"wrong": wrong, "digest": digest}


class _FailingStep(torch.optim.SGD):
    def step(self, closure=None):
        raise ArithmeticError("this optimizer cannot step")


def test_optimizer_on_one_node_steps_after_backward_with_the_same_bits():
    """On one node, with no link to wait for, optimizer= leaves every step to the loop's."""
    runs = run_ranks(check_steps, 2)
    assert [run["wrong"] for run in runs] == [[], []]
    assert runs[0]["digest"] == runs[1]["digest"]


def test_optimizer_across_nodes_steps_each_bucket_in_flight_with_the_same_bits(tmp_path):
    """Across two nodes each bucket is stepped once reduced, before backward returns, and the
    loop's optimizer.step() after it steps none of them again: the gradients, the parameters and
    the optimizer's state are the bits of the step after backward (the same reduced gradients,
    the same elementwise update), through every DDP option (an unused parameter, which has no
    gradient, stays unstepped in both), on every rank. A step that raises fails the backward that
    ran it, with its error, on every rank, and nothing hangs. Then the same through Accelerate's
    loop and its wrapped optimizer, in the same ranks (accelerate_steps)."""
    results = run_nodes(textwrap.dedent(f'''
        import json, os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import torch.distributed as dist
        from test_hook import accelerate_steps, check_steps
        dist.init_process_group("gloo")
        out = check_steps(dist.get_rank(), dist.get_world_size(), across_nodes=True)
        accelerated = accelerate_steps()
        out["wrong"] += accelerated["wrong"]
        out["digest"].append(accelerated["digest"])
        with open(os.path.join(sys.argv[1], f"rank{{dist.get_rank()}}.json"), "w") as f:
            json.dump(out, f)
        '''), tmp_path)
    assert [result["wrong"] for result in results] == [[]] * 4
    assert all(result["digest"] == results[0]["digest"] for result in results)


def accelerate_steps():
    """Accelerate's loop (prepare, accumulate over 2 micro-batches, its AcceleratedOptimizer)
    with register_fused_hook(model, optimizer=the wrapper), against the same loop with the step
    after backward: what differs, in words, and this rank's parameters' digest. ddpx steps the
    torch optimizer inside the wrapper, each sync backward moves every parameter, and the
    wrapper's step after it moves none again."""
    from accelerate import Accelerator

    import ddpx

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    runs, wrong = {}, []
    for in_flight in (False, True):
        torch.manual_seed(0)
        net = Net().body
        model, optimizer = accelerator.prepare(net, OPTIMIZERS["SGD momentum"](net.parameters()))
        ddpx.register_fused_hook(model, optimizer=optimizer if in_flight else None)
        data = torch.Generator().manual_seed(100 + accelerator.process_index)
        for micro in range(6):
            with accelerator.accumulate(model):
                before = [p.detach().clone() for p in net.parameters()]
                loss = nn.functional.mse_loss(model(torch.randn(16, 32, generator=data)),
                                              torch.randn(16, 8, generator=data))
                accelerator.backward(loss)
                pairs = zip(net.parameters(), before, strict=True)
                moved = [not torch.equal(p, b) for p, b in pairs]
                if in_flight and moved != [micro % 2 == 1] * len(moved):
                    wrong.append(f"backward {micro} moved {moved}")
                optimizer.step()
                optimizer.zero_grad()
        runs[in_flight] = [p.detach().clone() for p in net.parameters()]
    if not all(torch.equal(p, q) for p, q in zip(runs[True], runs[False], strict=True)):
        wrong.append("not the bits of the step after backward")
    digest = [float(p.double().sum()) for p in runs[True]]
    return {"wrong": wrong, "digest": digest}


def step_errors(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    net = Net().body
    with pytest.raises(TypeError, match=r"optimizer= takes a torch\.optim\.Optimizer"):
        ddpx.register_fused_hook(DDP(net), optimizer=object())
    with pytest.raises(ValueError, match="LBFGS cannot step a bucket's parameters alone"):
        ddpx.register_fused_hook(DDP(net), optimizer=torch.optim.LBFGS(net.parameters()))
    state = ddpx.register_fused_hook(DDP(net), optimizer=torch.optim.SGD(net.parameters(), lr=1))
    assert "the optimizer steps after backward (one node" in state.describe()


def test_an_optimizer_that_cannot_step_per_bucket_is_refused():
    run_ranks(step_errors, 2)


def registration_errors(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ddpx.register_fused_hook(Net())
    with pytest.raises(ValueError, match="compression"):
        ddpx.register_fused_hook(DDP(Net().body), compression="int2")
    model = DDP(Net().body)
    state = ddpx.register_fused_hook(model)
    assert state.engine.local_ranks == 2
    with pytest.raises(RuntimeError, match="only be called once"):
        ddpx.register_fused_hook(model)


def test_registration_errors():
    run_ranks(registration_errors, 2)


class SparseNet(nn.Module):
    """An embedding with sparse gradients (DDP gives it a bucket of its own) beside dense layers."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(50, 16, sparse=True)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, ids):
        return self.head(self.embedding(ids).mean(dim=1))


def train_sparse(rank, hook, compression=None):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP


    torch.manual_seed(0)
    net = SparseNet()
    model = DDP(net)
    register(model, hook, compression)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)
    first_grads = None
    for _ in range(STEPS):
        ids = torch.randint(0, 50, (8, 5), generator=data)
        nn.functional.mse_loss(model(ids), torch.randn(8, 4, generator=data)).backward()
        if first_grads is None:
            first_grads = [p.grad.to_dense() for p in net.parameters()]
            assert net.embedding.weight.grad.is_sparse
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return first_grads, [p.detach().clone() for p in net.parameters()]


def compare_sparse(rank, world):
    return {(hook, compression): train_sparse(rank, hook, compression)
            for hook, compression in [("default", None), ("cpp", None), ("python", None),
                                      ("cpp", "bf16")]}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sparse_gradients_train_as_with_the_default(world):
    """Sparse buckets go through the process group, dense ones through the engine: the same
    gradients and parameters as DDP's default (tolerance as in assert_matches_default), the same
    bits on every rank. With bf16 the sparse bucket still travels uncompressed: its gradient is
    the default's, and the dense ones are within bf16's rounding."""
    runs = run_ranks(compare_sparse, world)
    ref_grads, ref_params = runs[0][("default", None)]
    for (hook, compression), (grads, params) in runs[0].items():
        dense_tolerance = SUM_ORDER_TOLERANCE if compression is None else \
            {"rtol": 2 * 2.0**-8, "atol": 1e-3}
        for index, (g, ref) in enumerate(zip(grads, ref_grads, strict=True)):
            tolerance = SUM_ORDER_TOLERANCE if index == 0 else dense_tolerance
            torch.testing.assert_close(g, ref, **tolerance,
                                       msg=f"{hook}/{compression} grad {index}")
        if compression is None:
            for p, ref in zip(params, ref_params, strict=True):
                torch.testing.assert_close(p, ref, **SUM_ORDER_TOLERANCE, msg=f"{hook} params")
        for other in runs[1:]:
            for p, q in zip(params, other[(hook, compression)][1], strict=True):
                assert torch.equal(p, q), f"{hook}/{compression}: ranks hold different parameters"


def sparse_all_reduce(rank, world):
    import torch.distributed as dist

    import ddpx

    def sparse_input():
        indices = torch.tensor([[rank, 5, 7]])
        return torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]) * (rank + 1), (10,))

    reference = sparse_input()
    dist.all_reduce(reference)
    summed = ddpx.all_reduce(sparse_input())
    averaged = ddpx.all_reduce(sparse_input(), average=True)
    torch.testing.assert_close(summed.to_dense(), reference.to_dense(), rtol=0, atol=0)
    torch.testing.assert_close(averaged.to_dense(), reference.to_dense() / world)
    with pytest.raises(ValueError, match="sparse tensor .* without compression"):
        ddpx.all_reduce(sparse_input(), compression="bf16")
    with pytest.raises(ValueError, match="is a SparseCsr tensor; .*torch.distributed.all_reduce"):
        ddpx.all_reduce(torch.eye(3).to_sparse_csr())
    dense = torch.full((4,), float(rank))
    ddpx.all_reduce(dense)  # still in step after the refusals
    assert torch.equal(dense, torch.full((4,), float(sum(range(world)))))


def test_sparse_all_reduce_equals_the_process_groups():
    run_ranks(sparse_all_reduce, 2)


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.single = nn.Linear(4, 4)
        self.wide = nn.Linear(4, 2).double()

    def forward(self, x):
        return self.wide(self.single(x).double())


def refused_at_registration(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    torch.manual_seed(0)
    model = DDP(TwoDtypes())
    refusal = (r"parameter wide\.weight is float64 and cannot travel as bfloat16; "
               r"compress float32/bfloat16/float16 data only")
    with pytest.raises(ValueError, match=refusal):
        ddpx.register_fused_hook(model, compression="bf16")
    ddpx.register_fused_hook(model)  # nothing was half registered: uncompressed, it trains
    model(torch.full((3, 4), float(rank))).sum().backward()
    return [p.grad for p in model.parameters()]


def test_input_refused_at_registration_not_at_backward():
    """A float64 parameter with compression="bf16" is refused by register_fused_hook on every
    rank, before any collective; the same model then registers uncompressed and its gradients
    are the same on every rank."""
    first, second = run_ranks(refused_at_registration, 2)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


class ComplexNet(nn.Module):
    """A complex64 layer, and with `wide` a complex128 layer after it (two buckets)."""

    def __init__(self, wide: bool):
        super().__init__()
        self.single = nn.Linear(16, 16, dtype=torch.cfloat)
        self.wide = nn.Linear(16, 4, dtype=torch.cdouble) if wide else None

    def forward(self, x):
        x = self.single(x)
        return self.wide(x.to(torch.cdouble)) if self.wide is not None else x


def train_complex(rank, world):
    """A complex-valued model trained by DDP's default and by each hook: both layers
    uncompressed, the complex64 layer alone with bf16 on the wire; and ddpx.all_reduce of
    complex tensors."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx

    def run(hook, compression=None):
        torch.manual_seed(0)
        net = ComplexNet(wide=compression is None)
        model = DDP(net, bucket_cap_mb=0.001)
        register(model, hook, compression)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        data = torch.Generator().manual_seed(7 + rank)
        for _ in range(3):
            x = torch.randn(8, 16, dtype=torch.cfloat, generator=data)
            model(x).abs().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in net.parameters()]

    sums = []
    for dtype in (torch.cfloat, torch.cdouble):
        t = torch.complex(torch.arange(5.0), -torch.arange(5.0) * (rank + 1)).to(dtype)
        sums.append(ddpx.all_reduce(t, average=True))
    return {"default": run("default"), "cpp": run("cpp"), "python": run("python"),
            "bf16": run("cpp", "bf16"), "bf16 default": run("default", "bf16"), "sums": sums}


def test_complex_parameters_train_as_with_the_default():
    """DDP's default reduces complex gradients as their real pairs; so do the hooks, bit for bit
    at 2 ranks (x/2 + y/2 rounds once, in either order). With bf16 on the wire every rank holds
    the same bits, within bfloat16's rounding of the default."""
    runs = run_ranks(train_complex, 2)
    for run in runs:
        for hook in ("cpp", "python"):
            assert all(torch.equal(a, b) for a, b in zip(run[hook], run["default"], strict=True))
        for a, b in zip(run["bf16"], run["bf16 default"], strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
        for dtype, total in zip((torch.cfloat, torch.cdouble), run["sums"], strict=True):
            expected = torch.complex(torch.arange(5.0), -torch.arange(5.0) * 1.5).to(dtype)
            assert total.dtype == dtype and torch.equal(total, expected)
    assert all(torch.equal(a, b) for a, b in zip(runs[0]["bf16"], runs[1]["bf16"], strict=True))


def one_engine(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpx
    from ddpx.engine import engine_for

    engine = ddpx.backend_of().engine
    assert engine is not None and engine_for() is engine
    torch.manual_seed(0)
    model = DDP(Net().body, bucket_cap_mb=0.01)
    ddpx.register_fused_hook(model)
    # The hook's buckets, blocking and async torch.distributed calls and ddpx.all_reduce, mixed,
    # in one order on every rank, on one engine.
    pending, sums = [], []
    for step in range(3):
        model(torch.full((4, 32), float(rank + step))).sum().backward()
        t = torch.full((1000,), float(rank + 1))
        pending.append((dist.all_reduce(t, async_op=True), t))
        sums.append(ddpx.all_reduce(torch.full((10,), float(rank)), average=True))
    for work, _ in pending:
        work.wait()
    assert all(bool((t == world * (world + 1) / 2).all()) for _, t in pending)
    assert all(bool((s == (world - 1) / 2).all()) for s in sums)
    return [p.grad for p in model.parameters()]


def test_the_hook_and_ddpx_all_reduce_use_a_ddpx_groups_own_engine():
    """On a group of ddpx's backend, the hook and ddpx.all_reduce run on the backend's engine,
    not a second engine with a segment of its own, in one order with torch.distributed's calls;
    the gradients are every rank's same bits."""
    grads = run_ranks(one_engine, 2, backend="ddpx")
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
