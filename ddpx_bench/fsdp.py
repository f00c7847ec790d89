"""`ddpx-bench fsdp`: FSDP2 training steps (fully_shard per layer and root) of one small
transformer over the gloo world and over groups of the same ranks with ddpx's backend, FSDP2's
buffers in ordinary memory and in ddpx's arena, per precision, taking turns step by step, timed on
the slowest rank; the models' parameters compared with the gloo model's after the warm-up, and the
calls ddpx's backend served by its engine and by gloo (its routes()).

About 4 minutes on 2 cores at the defaults (its bf16 cells, not run by default, about an hour
and a half on AVX2 cores: see below).

    ddpx-bench fsdp --json bench_out/fsdp.json --plot bench_out/fsdp.png
    ddpx-bench fsdp --world_sizes 2 --precisions fp32 --params 2M --steps 5
    ddpx-bench fsdp --world_sizes 2 --params 200K --layers 2 --steps 5 --load 1

In detail: FSDP2 training steps (forward, backward, AdamW step of --lr, default 1e-3) of a
transformer: --layers (default 8) post-norm torch.nn.TransformerEncoderLayer of --heads (default 8)
heads, feed-forward 4 x d_model and no dropout, and a linear head, d_model the multiple of 8 x
--heads that comes nearest to --params parameters in all (default 25M: d_model 512, 25.5M), on
--batch_size (default 8) sequences of --seq_len (default 64) random tokens per rank, against random
targets (mean squared error). fully_shard shards each layer and the root over the gloo world
(`gloo`) and over two groups of the same ranks with ddpx's backend (dist.new_group(ranks,
backend="ddpx")), in the same processes, from the same parameters on the same data: `ddpx`, whose
FSDP2 takes the buffers of its all-gathers and reduce-scatters from torch.empty, as by default, and
`ddpx-mem`, whose FSDP2 takes them from the group's backend, ddpx's arena
(set_allocate_memory_from_process_group_for_comm(True) on every module; the all-gathers and
reduce-scatters still copy; after the warm-up the arena must hold memory on every rank, else the
run stops; left out where the backend allocates no tensors: without an arena).
For each of --precisions (default fp32): `fp32`, and `bf16`
(MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16): bfloat16 gathers of
the parameters, compute and reduce-scatters of the gradients, float32 sharded parameters for
AdamW). In each cell (world size, precision):
  - every model takes --warmup steps (default 2), then each ddpx model's parameters are compared
    with the gloo model's. fp32: max |diff| at most a tenth of lr x --warmup, the furthest AdamW
    can move a parameter in the warm-up (a wrong reduction moves them about that far apart; gloo's
    and ddpx's roundings, which differ at 3+ ranks, much less; at 2 ranks they give the same
    bits), the attention's key biases left out (their true gradient is 0: Adam turns rounding
    noise into steps). bf16: the updates (parameters after the warm-up minus before, as one
    vector) have cosine at least 0.98. Models that are apart stop the run with exit status 1;
  - then --steps timed steps each (default 10), the models taking turns step by step; a sample is
    one step on the slowest rank, started right after a barrier.
Reported per cell and group: its median ms per step; x vs gloo = gloo's median / the group's
(bigger: faster than gloo); the comparison after the warm-up (same bits, max |diff| or cosine);
which path served the calls of the cell of the group's ddpx backend, from its routes() (FSDP2's
all_gather_into_tensor and reduce_scatter_tensor, the comparison's
all_gather_into_tensor_coalesced). The JSON holds p10-p90, the counts and the comparison's
numbers. A CPU without bfloat16 instructions (AVX512-BF16, AMX)
multiplies bfloat16 matrices far more slowly than float32 ones (AVX2: about 200 times), so there
the bf16 cells time mostly the compute. Where ddpx registers no backend, its groups are left out
with a note.
"""

import copy
import functools
import gc
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ddpx._ext import extension
from ddpx_bench.common import (
    ddpx_group,
    engine_rows,
    node_count,
    progress,
    routes_since,
    served_by,
    steps_in_turns,
    why_no_comm_memory,
)
from ddpx_bench.mode import Mode, choices_option, count, node_options, positive
from ddpx_bench.report import (
    PER_STEP,
    format_ms,
    format_ratio,
    format_served,
    format_table,
    pyplot,
    save_figure,
    step_bars,
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
# The groups with ddpx's backend: whether FSDP2 takes the buffers of its all-gathers and
# reduce-scatters from the group's backend, ddpx's arena (set_allocate_memory_from_process_group_
# for_comm), or from torch.empty as by default.
COMM_MEMORY = {"ddpx": False, "ddpx-mem": True}
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
    # DeviceMesh equality ignores the process group: two meshes of the same ranks alike but for
    # their groups compare equal, and DTensor's caches would then mix them up. Names tell them
    # apart.
    meshes = {"gloo": DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("gloo",))}
    groups = _ddpx_groups(left_out)
    for name, (group, _) in groups.items():
        meshes[name] = DeviceMesh.from_group(group, "cpu", mesh_dim_names=(name,))
    backends = {name: backend for name, (_, backend) in groups.items()}
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
        rows += _bench_cell(initial, meshes, backends, batches, precision, args, cell, nodes)
        gc.collect()  # the cell's models and optimizers, before the next cell's
    if "ddpx" in backends:
        notes.append(f"ddpx backend on {world_size} ranks: {backends['ddpx'].describe()}")
    if "ddpx-mem" in backends:
        usage = extension().arena_usage()
        notes.append(f"ddpx-mem: FSDP2's buffers from ddpx's arena, which holds {usage['chunks']} "
                     f"chunks, {usage['bytes'] >> 10} KiB on rank 0")
    return {"rows": rows, "left_out": left_out, "notes": notes, "failures": []}


def _ddpx_groups(left_out: dict) -> dict:
    """name -> (group, backend) for each of COMM_MEMORY that works here, each a group of every
    rank with ddpx's backend of its own (its routes() count its own calls); why the others do not
    goes in `left_out`, alike on every rank."""
    group, backend = ddpx_group(left_out)
    if group is None:
        left_out["ddpx-mem"] = left_out["ddpx"]
        return {}
    groups = {"ddpx": (group, backend)}
    why_not = why_no_comm_memory(backend)
    if why_not:
        left_out["ddpx-mem"] = why_not
    else:
        groups["ddpx-mem"] = ddpx_group(left_out)
    return groups


def _batches(d_model: int, args, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (input, target) pairs, seeded by rank."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank())
    tokens = args.batch_size * args.seq_len
    return [
        (torch.randn(args.batch_size, args.seq_len, d_model, generator=generator),
         torch.randn(tokens, d_model, generator=generator))
        for _ in range(count)
    ]


def _sharded(initial: Transformer, mesh: DeviceMesh, precision: str,
             comm_memory: bool | None = None) -> Transformer:
    """A copy of `initial` with fully_shard on each layer and on the root, over `mesh`; with
    `comm_memory` given, each takes its communication buffers from the group's backend (True) or
    not (False)."""
    model = copy.deepcopy(initial)
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=POLICIES[precision])
    fully_shard(model, mesh=mesh, mp_policy=POLICIES[precision])
    if comm_memory is not None:
        for module in [*model.encoder.layers, model]:
            module.set_allocate_memory_from_process_group_for_comm(comm_memory)
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, index: int) -> None:
    x, target = batches[index % len(batches)]
    optimizer.zero_grad()
    nn.functional.mse_loss(model(x).float(), target).backward()
    optimizer.step()


def _bench_cell(initial: Transformer, meshes: dict, backends: dict, batches: list,
                precision: str, args, cell: str, nodes: int) -> list[dict]:
    world_size = dist.get_world_size()
    served_before = {name: backend.routes() for name, backend in backends.items()}
    models = {name: _sharded(initial, mesh, precision, COMM_MEMORY.get(name))
              for name, mesh in meshes.items()}
    steps = {
        name: functools.partial(_step, model, torch.optim.AdamW(model.parameters(), lr=args.lr),
                                batches)
        for name, model in models.items()
    }
    steps_in_turns(steps, range(args.warmup), f"{cell}, warm-up")
    checks = {name: _check(initial, models, name, precision, args.warmup, args.lr, cell)
              for name in backends}
    if "ddpx-mem" in models:
        _require_arena(cell)
    samples = steps_in_turns(steps, range(args.warmup, args.warmup + args.steps), cell)
    routes = {name: routes_since(served_before[name], backend.routes())
              for name, backend in backends.items()}
    no_check = dict.fromkeys(next(iter(checks.values()), {}))
    cell_keys = {
        "world_size": world_size,
        "nodes": nodes,
        "precision": precision,
        "params": sum(p.numel() for p in initial.parameters()),
        "d_model": initial.d_model,
        "heads": initial.heads,
        "layers": len(initial.encoder.layers),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    rows = engine_rows(cell_keys, samples, lambda name: {
        # FSDP2's buffers from the group's backend, ddpx's arena (None: gloo's, default).
        "comm_memory": COMM_MEMORY.get(name),
        # A ddpx model's parameters against the gloo model's, after the warm-up.
        **checks.get(name, no_check),
        # This rank's calls of the cell (warm-up, check, timed steps) that the ddpx backend of the
        # model's group ran on its engine and through gloo: its routes() before and after.
        "routes": routes.get(name),
        "served_by": served_by(routes[name]) if name in routes else None,
    })
    gloo_ms = rows[0]["median_ms"]
    for row in rows:
        row["x_vs_gloo"] = gloo_ms / row["median_ms"]
    return rows


def _require_arena(cell: str) -> None:
    """Raise on every rank unless ddpx's arena holds memory on every rank after the warm-up: in
    this process only the ddpx-mem model's FSDP2 takes any from it."""
    held = torch.tensor([extension().arena_usage()["bytes"]], dtype=torch.float64)
    dist.all_reduce(held, op=dist.ReduceOp.MIN)
    if held.item() == 0:
        raise RuntimeError(
            f"{cell}: after the warm-up ddpx's arena holds nothing on some rank, so the ddpx-mem "
            f"model's buffers came from elsewhere (this rank: {extension().arena_usage()})"
        )


def _check(initial: Transformer, models: dict, name: str, precision: str, warmup: int, lr: float,
           cell: str) -> dict:
    """Compare the `name` model's full parameters with the gloo model's after `warmup` steps of
    learning rate `lr`: max |diff| (the key biases apart) within FP32_TOLERANCE_OF_ADAM_MOVE x lr
    x `warmup` in fp32, the cosine of their updates at least BF16_MIN_COSINE in bf16; raise on
    every rank if not."""
    gloo, ddpx = (dict(models[model].named_parameters()) for model in ("gloo", name))
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
    message = f"{cell}: after {steps} the {name} model has {found} the gloo model's parameters"
    if not passed:
        raise RuntimeError(f"{message} ({bound})")
    progress(f"{message} ({bound})")
    return check


def _agreement(row: dict | None) -> str:
    if row is None or row.get("check") is None:
        return "-"
    if row["bit_equal"]:
        return "same bits"
    if row["check"] == "update_cosine":
        return f"cosine {row['update_cosine']:.6f}"
    return f"max |diff| {row['max_abs_diff']:.2e}"


class Fsdp(Mode):
    name = "fsdp"
    help = "time FSDP2 training steps on gloo and on ddpx's backend"
    measured = {"timing": PER_STEP}

    def add_arguments(self, parser):
        choices_option(parser, "--precisions", PRECISIONS, default=("fp32",),
                       said="fp32: bf16 is slow on CPUs without bfloat16 instructions")
        parser.add_argument(
            "--params",
            type=count,
            default="25M",
            help="parameters of the transformer, with K/M suffixes (powers of 1000): d_model is "
            "the multiple of 8 x --heads that comes nearest (default 25M: d_model 512)",
        )
        parser.add_argument("--layers", type=int, default=8, help="encoder layers (default 8)")
        parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
        parser.add_argument("--batch_size", type=int, default=8,
                            help="sequences per rank (default 8)")
        parser.add_argument("--seq_len", type=int, default=64,
                            help="tokens per sequence (default 64)")
        parser.add_argument("--steps", type=int, default=10,
                            help="timed steps per model and precision")
        parser.add_argument(
            "--warmup",
            type=positive,
            default=2,
            help="untimed steps per model and precision, after which the models are compared",
        )
        parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate")
        node_options(parser)

    def run(self, args):
        return bench_fsdp(args)

    def table(self, rows: list[dict]) -> list[str]:
        """One line per cell (world size, precision) and group: its median step against gloo's."""
        lines = format_table([
            ("ranks", ">5", lambda row: row["world_size"]),
            ("precision", "<9", lambda row: row["precision"]),
            ("group", "<8", lambda row: row["engine"]),
            ("ms/step", ">9", lambda row: format_ms(row["median_ms"])),
            ("x vs gloo", ">9", lambda row: format_ratio(row["x_vs_gloo"])),
            ("params vs gloo", "<20", _agreement),
            ("served by", "", format_served),
        ], rows)
        first = rows[0]
        lines += [
            f"TransformerEncoder of {first['params']} parameters (d_model {first['d_model']}, "
            f"{first['heads']} heads, feed-forward {4 * first['d_model']}, {first['layers']} "
            f"layers, linear head), fully_shard per layer and root; batch {first['batch_size']} x "
            f"seq {first['seq_len']} per rank; AdamW; {first['warmup']} warm-up + "
            f"{first['steps']} timed steps per model",
            "groups: gloo, the world; ddpx and ddpx-mem, groups of the same ranks with ddpx's "
            "backend, ddpx-mem's FSDP2 taking its all-gather and reduce-scatter buffers from "
            "ddpx's arena (set_allocate_memory_from_process_group_for_comm)",
            "ms/step: median step; x vs gloo: gloo's median / the group's (above 1: faster than "
            "gloo); bf16: bfloat16 parameters and gradient reductions (MixedPrecisionPolicy)",
            "params vs gloo: the model's parameters after the warm-up against the gloo model's: "
            "the same bits, or fp32: max |diff| (key biases apart; at most lr x warm-up steps / "
            "10), bf16: the cosine of the updates (at least 0.98)",
            "served by: the group's ddpx backend's routes(), the calls of the cell (warm-up, "
            "check, timed steps) on its engine and through gloo",
        ]
        nodes = {row["world_size"]: row["nodes"] for row in rows if row.get("nodes", 1) > 1}
        if nodes:
            lines.append("nodes: " + ", ".join(f"{size} ranks on {count}"
                                               for size, count in nodes.items()))
        return lines

    def plot(self, rows: list[dict], path: Path) -> None:
        """The median step per world size, a bar per group, a panel per precision."""
        plt = pyplot()
        world_sizes = sorted({row["world_size"] for row in rows})
        precisions = list(dict.fromkeys(row["precision"] for row in rows))
        engines = list(dict.fromkeys(row["engine"] for row in rows))
        width = (2 + 1.2 * len(engines) * len(world_sizes)) * len(precisions)
        figure, axes = plt.subplots(1, len(precisions), figsize=(width, 4.5), squeeze=False)
        for ax, precision in zip(axes[0], precisions, strict=True):
            step_bars(ax, [row for row in rows if row["precision"] == precision], "engine")
            ax.set(ylabel="ms per training step (median, p10-p90)",
                   title=f"FSDP2 step time, {precision}")
            ax.legend()
        save_figure(figure, path)


MODE = Fsdp()
