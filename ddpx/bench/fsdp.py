"""`ddpx-bench fsdp`: FSDP2 training steps (fully_shard per layer and root) of one small
transformer over the gloo world and one over a group of the same ranks with ddpx's backend, per
precision, taking turns step by step, timed on the slowest rank; the two models' parameters
compared after the warm-up, and the calls ddpx's backend served by its engine and by gloo (its
routes())."""

import copy
import functools
import gc
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ddpx.bench.common import (
    ddpx_group,
    node_count,
    progress,
    routes_since,
    served_by,
    slowest_rank_stats,
    steps_in_turns,
)

PRECISIONS = ("fp32", "bf16")
POLICIES = {
    "fp32": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
}
# fp32: how far (max |diff|) the two models' parameters may be apart after the warm-up, as a
# fraction of the furthest AdamW's steps can move a parameter in it (lr per step): a reduction that
# is wrong (a rank's gradients lost or misplaced) moves them about that far apart, two that round
# differently far less. At 2 ranks both groups average the gradients the same way (one rounding of
# an exact sum): the same bits. At 3+ ranks ddpx scales by 1/W and then sums, gloo sums in its
# order and divides: gradients a few float32 ulps apart, which grow with each step through the
# model (measured on the default 25M model: 5.5e-6 at 3 ranks and 7.6e-6 at 4 after 2 steps of
# lr 1e-3, 4.4e-5 at 3 ranks after 5; a tolerance of 2e-4, 5e-4 there). The attention's key biases
# are left out: softmax ignores a shift of every key score, so their true gradient is 0 and what
# they get is rounding noise, which Adam turns into moves that differ between any two runs that
# round differently.
FP32_TOLERANCE_OF_ADAM_MOVE = 0.1
# bf16: the least cosine between the two models' updates (parameters after the warm-up minus
# before, all of them as one vector). bfloat16 gradients differ elementwise by up to Adam's step
# at 3+ ranks, but the update keeps its direction: tests/test_fsdp.py measured 0.999 between the
# two groups (and 0.73 for training on other data).
BF16_MIN_COSINE = 0.98


class Transformer(nn.Module):
    """`layers` post-norm torch.nn.TransformerEncoderLayer (`heads` heads, feed-forward 4 x
    d_model, no dropout) and a linear head: (batch, seq, d_model) -> (batch * seq, d_model). The
    head sees 2-D input, so its output is no view (FSDP warns of modules returning views)."""

    def __init__(self, d_model: int, heads: int, layers: int):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model,
                                           dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, d_model)
        self.d_model, self.heads = d_model, heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).reshape(-1, self.d_model))

    @classmethod
    def with_params(cls, n_params: int, heads: int = 8, layers: int = 8) -> "Transformer":
        """The one of `layers` layers with about `n_params` parameters: a layer has
        12 d^2 + 13 d, the head d^2 + d, for d_model d a multiple of 8 x `heads` (so 25M, 8 heads
        and 8 layers: d_model 512, 25.5M parameters)."""
        a, b = 12 * layers + 1, 13 * layers + 1
        exact = (math.sqrt(b * b + 4 * a * n_params) - b) / (2 * a)
        step = 8 * heads
        return cls(max(step, round(exact / step) * step), heads, layers)


def bench_fsdp(args) -> dict:
    left_out, notes = {}, []
    world_size, nodes = dist.get_world_size(), node_count()
    group, backend = ddpx_group(left_out)
    # DeviceMesh equality ignores the process group: two meshes of the same ranks alike but for
    # their groups compare equal, and DTensor's caches would then mix them up. Names tell them
    # apart.
    meshes = {"gloo": DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("gloo",))}
    if group is not None:
        meshes["ddpx"] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("ddpx",))
    torch.manual_seed(args.seed)
    initial = Transformer.with_params(args.params, args.heads, args.layers)
    batches = _batches(initial.d_model, args)
    rows, started = [], time.perf_counter()
    for index, precision in enumerate(args.precisions):
        cell = f"world {world_size}, {precision}"
        progress(
            f"{cell} (cell {index + 1}/{len(args.precisions)}): sharding {', '.join(meshes)}; "
            f"{time.perf_counter() - started:.0f} s elapsed"
        )
        rows += _bench_cell(initial, meshes, backend, batches, precision, args, cell, nodes)
        gc.collect()  # the cell's models and optimizers, before the next cell's
    if backend is not None:
        notes.append(f"ddpx backend on {world_size} ranks: {backend.describe()}")
    return {"rows": rows, "left_out": left_out, "notes": notes, "failures": []}


def _batches(d_model: int, args, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (input, target) pairs, seeded by rank."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank())
    tokens = args.batch_size * args.seq_len
    return [
        (torch.randn(args.batch_size, args.seq_len, d_model, generator=generator),
         torch.randn(tokens, d_model, generator=generator))
        for _ in range(count)
    ]


def _sharded(initial: Transformer, mesh: DeviceMesh, precision: str) -> Transformer:
    """A copy of `initial` with fully_shard on each layer and on the root, over `mesh`."""
    model = copy.deepcopy(initial)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=POLICIES[precision])
    fully_shard(model, mesh=mesh, mp_policy=POLICIES[precision])
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, index: int) -> None:
    x, target = batches[index % len(batches)]
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x).float(), target).backward()
    optimizer.step()


def _bench_cell(initial: Transformer, meshes: dict, backend, batches: list, precision: str, args,
                cell: str, nodes: int) -> list[dict]:
    world_size = dist.get_world_size()
    served_before = backend.routes() if backend is not None else None
    models = {name: _sharded(initial, mesh, precision) for name, mesh in meshes.items()}
    steps = {
        name: functools.partial(_step, model, torch.optim.AdamW(model.parameters(), lr=args.lr),
                                batches)
        for name, model in models.items()
    }
    steps_in_turns(steps, range(args.warmup), f"{cell}, warm-up")
    check = {}
    if "ddpx" in models:
        check = _check(initial, models, precision, args.warmup, args.lr, cell)
    samples = steps_in_turns(steps, range(args.warmup, args.warmup + args.steps), cell)
    routes = routes_since(served_before, backend.routes()) if "ddpx" in models else None
    rows = []
    for name in models:
        rows.append(
            {
                "world_size": world_size,
                "nodes": nodes,
                "precision": precision,
                "engine": name,
                "params": sum(p.numel() for p in initial.parameters()),
                "d_model": initial.d_model,
                "heads": initial.heads,
                "layers": len(initial.encoder.layers),
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "warmup": args.warmup,
                "steps": args.steps,
                **slowest_rank_stats(samples[name]),
                # The ddpx model's parameters against the gloo model's, after the warm-up.
                **(check if name == "ddpx" else dict.fromkeys(check)),
                # This rank's calls of the cell (warm-up, check, timed steps) that ddpx's backend
                # ran on its engine and through gloo: its routes() before and after.
                "routes": routes if name == "ddpx" else None,
                "served_by": served_by(routes) if name == "ddpx" else None,
            }
        )
    gloo_ms = rows[0]["median_ms"]
    for row in rows:
        row["x_vs_gloo"] = gloo_ms / row["median_ms"]
    return rows


def _check(initial: Transformer, models: dict, precision: str, warmup: int, lr: float,
           cell: str) -> dict:
    """Compare the ddpx model's full parameters with the gloo model's after `warmup` steps of
    learning rate `lr`: max |diff| (the key biases apart) within FP32_TOLERANCE_OF_ADAM_MOVE x lr
    x `warmup` in fp32, the cosine of their updates at least BF16_MIN_COSINE in bf16; raise on
    every rank if not."""
    gloo, ddpx = (dict(models[name].named_parameters()) for name in ("gloo", "ddpx"))
    d_model = initial.d_model
    # max |diff| but the key biases', the key biases', whether any bits differ; the updates' dot
    # product and squared norms.
    stats = torch.zeros(6, dtype=torch.float64)
    for key, before in initial.named_parameters():
        ours, theirs = (group[key].full_tensor().detach().double() for group in (ddpx, gloo))
        diff = (ours - theirs).abs()
        if key.endswith("self_attn.in_proj_bias"):  # [query, key, value] biases
            keys = slice(d_model, 2 * d_model)
            stats[1] = torch.maximum(stats[1], diff[keys].max())
            diff[keys] = 0
        stats[0] = torch.maximum(stats[0], diff.max())
        stats[2] = max(stats[2], float(not torch.equal(ours, theirs)))
        ours, theirs = ours - before.detach().double(), theirs - before.detach().double()
        stats[3:] += torch.stack([(ours * theirs).sum(), ours.square().sum(),
                                  theirs.square().sum()])
    # Every rank gathered the same parameters; the largest, should a rank have got others.
    dist.all_reduce(stats.nan_to_num_(nan=math.inf), op=dist.ReduceOp.MAX)
    max_diff, key_bias_diff, differ, dot, ours_sq, theirs_sq = stats.tolist()
    norms = math.sqrt(ours_sq * theirs_sq)
    fp32_tolerance = FP32_TOLERANCE_OF_ADAM_MOVE * lr * warmup
    check = {
        "check": "max_abs_diff" if precision == "fp32" else "update_cosine",
        "tolerance": fp32_tolerance if precision == "fp32" else BF16_MIN_COSINE,
        "max_abs_diff": max_diff,
        "key_bias_max_abs_diff": key_bias_diff,
        "bit_equal": not differ,
        # No update on either (a learning rate of 0): the same direction.
        "update_cosine": dot / norms if norms else float(ours_sq == theirs_sq),
        "update_norm_ratio": math.sqrt(ours_sq / theirs_sq) if theirs_sq else None,
    }
    steps = f"{warmup} step{'s' if warmup > 1 else ''}"
    if precision == "fp32":
        passed = max_diff <= fp32_tolerance
        found = f"max |diff| {max_diff:.3g} from"
        bound = f"tolerance {fp32_tolerance:.3g}"
    else:
        passed = check["update_cosine"] >= BF16_MIN_COSINE
        found = f"an update of cosine {check['update_cosine']:.6f} with"
        bound = f"at least {BF16_MIN_COSINE:g}"
    if not differ:
        found = "the same bits as"
    message = f"{cell}: after {steps} the ddpx model has {found} the gloo model's parameters"
    if not passed:
        raise RuntimeError(f"{message} ({bound})")
    progress(f"{message} ({bound})")
    return check
