"""FSDP2 (``fully_shard``) of a small transformer on CPU ranks, trained twice in one job from the
same seed on the same per-rank data: once over a gloo group and once over the ddpx default group.
The final parameters agree, and the ddpx backend's counts show that its engine, never its inner
gloo, served every collective FSDP issued, in float32 and with bfloat16 parameters and gradient
reductions."""

import pytest
import torch

from ddpx import backend_of

from distributed import run_ranks

STEPS = 5
LR = 1e-2
# What FSDP2 issues on CPU: one all_gather_single (backend: all_gather_into_tensor) per parameter
# group unshard, forward and (the non-root groups, resharded after forward) backward, one
# reduce_scatter_single (reduce_scatter_tensor) per group and step; DTensor.full_tensor() then
# gathers every parameter with all_gather_into_tensor_coalesced.
FSDP_COLLECTIVES = {"all_gather_into_tensor", "reduce_scatter_tensor"}
GATHER = "all_gather_into_tensor_coalesced"


class Model(torch.nn.Module):
    """Two post-norm encoder layers (d_model 64, 4 heads) and a linear head; no dropout, so both
    runs compute the same thing. The head sees 2-D input, so its output is no view (FSDP warns of
    modules returning views)."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(64, 4, dim_feedforward=128, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.encoder(x).reshape(-1, 64))


class Recorder:
    """Records (name, dtype, op) of each all_gather_single / reduce_scatter_single call (what
    FSDP2's default collectives call, looked up on torch.distributed at each call)."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        import torch.distributed as dist

        self.saved = dist.all_gather_single, dist.reduce_scatter_single
        gather, scatter = self.saved

        def all_gather_single(output, input, *args, **kwargs):
            self.calls.append(("all_gather_single", input.dtype, None))
            return gather(output, input, *args, **kwargs)

        def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, *args, **kwargs):
            self.calls.append(("reduce_scatter_single", input.dtype, str(op)))
            return scatter(output, input, op, *args, **kwargs)

        dist.all_gather_single = all_gather_single
        dist.reduce_scatter_single = reduce_scatter_single
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_gather_single, dist.reduce_scatter_single = self.saved


def train(rank, group, name, bf16):
    """fully_shard of each layer and the root over a mesh of ``group``; STEPS AdamW steps on data
    seeded by rank. Returns the full final parameters, FSDP's recorded collectives and, for the
    ddpx group, its backend's routes before and after the final gather, and this rank's shard of
    the first step's gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Model()
    # DeviceMesh equality ignores the process group: two meshes of the same ranks alike but for
    # their groups compare equal, and DTensor's caches then give the second model's parameters
    # the first mesh (full_tensor() would gather over the other group). Names tell them apart.
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(name,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) \
        if bf16 else MixedPrecisionPolicy()
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for p in model.parameters():
        assert p.device_mesh.get_group() is group
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    data = torch.Generator().manual_seed(rank)
    routes = backend_of(group).routes if name == "ddpx" else dict
    before = routes()
    with Recorder() as recorder:
        for step in range(STEPS):
            x, y = torch.randn(4, 16, 64, generator=data), torch.randn(64, 8, generator=data)
            torch.nn.functional.mse_loss(model(x).float(), y).backward()
            if step == 0:  # this rank's shard of the averaged gradients, before Adam rescales them
                grads = {k: p.grad.to_local().clone() for k, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    trained = routes()
    full = {k: p.full_tensor().detach() for k, p in model.named_parameters()}
    gathered = routes()
    dist.barrier(group)
    return full, recorder.calls, [before, trained, gathered], grads


def fsdp_runs(rank, world):
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo")
    return {(name, bf16): train(rank, group, name, bf16)
            for bf16 in (False, True)
            for name, group in (("gloo", gloo), ("ddpx", dist.group.WORLD))}


def calls_between(a: dict, b: dict) -> dict:
    return {k: {path: v[path] - a.get(k, {}).get(path, 0) for path in v}
            for k, v in b.items() if v != a.get(k)}


def same_bits(xs: dict, ys: dict) -> bool:
    return xs.keys() == ys.keys() and all(torch.equal(xs[k], ys[k]) for k in xs)


def max_diff(xs: dict, ys: dict, skip=()) -> float:
    return max((xs[k].double() - ys[k].double()).abs().max().item() for k in xs if k not in skip)


def update(params: dict) -> torch.Tensor:
    """What training changed: final minus initial parameters, all of them in one flat vector."""
    torch.manual_seed(0)
    initial = dict(Model().named_parameters())
    return torch.cat([(params[k].double() - initial[k].double()).flatten() for k in initial])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)])
def runs(request):
    return request.param, run_ranks(fsdp_runs, request.param, backend="ddpx")


def test_ddpx_matches_gloo_in_float32(runs):
    world, results = runs
    for r in results:
        gloo, ddpx = r[("gloo", False)][0], r[("ddpx", False)][0]
        assert all(p.dtype == torch.float32 for p in ddpx.values())
        if world == 2:
            # a + b is commutative and the engine's AVG scales by 1/2 before the sum, exactly
            # what gloo's sum then halving gives: the same gradients, so the same bits.
            assert same_bits(gloo, ddpx), max_diff(gloo, ddpx)
        else:
            # Three ranks: the engine scales by 1/3 and then sums in float32, gloo sums in its
            # order and divides, so gradients differ by float32 ulps (2^-23 relative). Adam's
            # m / (sqrt(v) + eps) keeps that relative size, amplified only where the ranks'
            # gradients cancel; measured: at most 7e-7 after 5 steps. Allowed: 1e-5 = LR / 1000,
            # far below what a wrong reduction (a rank's data lost or misplaced) gives, O(LR).
            # Left out: the attention's key bias (in_proj_bias[64:128]). Softmax ignores a shift
            # of every key score, so its true gradient is 0 and what it gets is rounding noise
            # (~1e-10), which Adam still turns into moves of up to ~5e-4: noise on both paths.
            keys = {k for k in gloo if k.endswith("in_proj_bias")}
            assert max_diff(gloo, ddpx, skip=keys) <= 1e-5
            for k in keys:  # [query, key, value] biases, 64 each
                assert max_diff({k: gloo[k][:64]}, {k: ddpx[k][:64]}) <= 1e-5
                assert max_diff({k: gloo[k][128:]}, {k: ddpx[k][128:]}) <= 1e-5
                assert ddpx[k][64:128].abs().max() < STEPS * LR
    for r in results[1:]:
        assert same_bits(r[("ddpx", False)][0], results[0][("ddpx", False)][0])


def test_first_gradients_are_gloos_average(runs):
    """Adam's step hardly depends on the gradients' scale, so a reduce-scatter that summed
    instead of averaging would pass the checks above; the first step's gradient shards, read
    before the optimizer, show it: the same as gloo's up to float32 summation order."""
    _, results = runs
    for r in results:
        gloo, ddpx = r[("gloo", False)][3], r[("ddpx", False)][3]
        assert gloo.keys() == ddpx.keys()
        for k in gloo:
            torch.testing.assert_close(ddpx[k], gloo[k], rtol=1e-5, atol=1e-7, msg=k)


def test_engine_served_every_fsdp_collective(runs):
    _, results = runs
    for r in results:
        for bf16 in (False, True):
            _, calls, (before, trained, gathered), _ = r[("ddpx", bf16)]
            dtype = torch.bfloat16 if bf16 else torch.float32
            # FSDP's own calls: all-gathers of the parameters in param_dtype, and reduce-
            # scatters of the gradients in reduce_dtype, averaged by the backend (ReduceOp.AVG).
            assert {name for name, _, _ in calls} == {"all_gather_single",
                                                      "reduce_scatter_single"}
            assert all(d == dtype for _, d, _ in calls), calls
            assert {op for name, _, op in calls if name == "reduce_scatter_single"} == \
                {str(torch.distributed.ReduceOp.AVG)}
            # What the backend got from them, then from full_tensor(): all on the engine.
            training, gather = calls_between(before, trained), calls_between(trained, gathered)
            assert set(training) == FSDP_COLLECTIVES, training
            assert set(gather) == {GATHER}, gather
            for name, paths in {**training, **gather}.items():
                assert paths["engine"] > 0 and paths["gloo"] == 0, (name, paths)
            assert training["all_gather_into_tensor"]["engine"] == \
                sum(name == "all_gather_single" for name, _, _ in calls)
            assert training["reduce_scatter_tensor"]["engine"] == \
                sum(name == "reduce_scatter_single" for name, _, _ in calls)
            # The gloo group's run issued the same calls, to its own group.
            assert r[("gloo", bf16)][1] == calls


def test_bfloat16(runs):
    """gloo of torch 2.13 sums bfloat16 (reduce_scatter_tensor with AVG included), so both
    groups train. With 2 ranks each bfloat16 average is one rounding of an exact sum on either
    path: the same bits. Otherwise only the direction of training can be held to: bfloat16
    parameters and gradients (8 significant bits) perturb every gradient by ~2^-8 relative, and
    Adam's steps, ~LR each whatever the gradient's size, turn that into elementwise differences of
    up to 2 * STEPS * LR where a gradient is near 0 (measured: 0.048 against float32). The update
    (final - initial parameters, flattened) keeps its direction: measured cosine with float32's
    0.996 (and 0.999 between the two bfloat16 paths with 3 ranks), while training on other data
    (a third rank's batch added) gives 0.73. Required: cosine > 0.98 and the norm within 5%."""
    world, results = runs
    for r in results:
        gloo, ddpx, fp32 = r[("gloo", True)][0], r[("ddpx", True)][0], r[("ddpx", False)][0]
        assert all(p.dtype == torch.float32 for p in ddpx.values())  # the sharded master copy
        if world == 2:
            assert same_bits(gloo, ddpx), max_diff(gloo, ddpx)
        else:
            assert cosine(update(gloo), update(ddpx)) > 0.98
        reference = update(fp32)
        for run in (ddpx, gloo):
            assert cosine(update(run), reference) > 0.98
            assert abs(update(run).norm() / reference.norm() - 1) < 0.05
