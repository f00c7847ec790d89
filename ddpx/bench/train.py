"""`ddpx-bench train`: DDP training steps of one MLP per comm hook, taking turns step by step,
timed on the slowest rank; the final parameters checked across ranks and against DDP's default."""

import copy
import functools

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx
from ddpx.bench.common import (
    UNIT_ROUNDOFF,
    WIRE,
    node_count,
    same_on_all_ranks,
    slowest_rank_stats,
    steps_in_turns,
)
from ddpx.models import MLP

COMM_HOOKS = ("default", "fp16", "bf16", "ddpx", "ddpx-fp16", "ddpx-bf16", "none")
# How many roundings the final parameters of a hook may differ from the default hook's by.
PARAM_TOLERANCE_ROUNDINGS = 64


def bench_train(args) -> dict:
    left_out, failures = {}, []
    torch.manual_seed(args.seed)
    initial = MLP.with_params(args.params)
    models = hooked_models(initial, args.comm_hooks, left_out)
    samples = timed_steps(models, _train_batches(initial.width, args), args.lr, args.warmup,
                          args.steps)
    rows = _train_rows(initial, models, samples, args, failures)
    return {"rows": rows, "left_out": left_out, "notes": [], "failures": failures}


def hooked_models(initial: torch.nn.Module, hooks: list[str], left_out: dict) -> dict:
    """A DDP copy of `initial` (on its device) per hook that works here: name -> (model, what its
    hook does). tools/gpu_report.py uses it too."""
    device = next(initial.parameters()).device
    models = {}
    for name in hooks:
        model = DDP(copy.deepcopy(initial),
                    device_ids=[device.index] if device.type == "cuda" else None)
        try:
            models[name] = model, _register_hook(name, model)
        # NotImplementedError: a ddpx compression not built yet; TypeError: DDP refuses torch's
        # bf16_compress_hook without NCCL 2.10+ or XCCL.
        except (NotImplementedError, TypeError) as exc:
            left_out[name] = str(exc)
    return models


def timed_steps(models: dict, batches: list[torch.Tensor], lr: float, warmup: int,
                steps: int) -> dict:
    """`warmup` + `steps` SGD steps (learning rate `lr`) of every model in turn, on `batches` in
    rotation: name -> this rank's seconds for each step after the warm-up (slowest_rank_stats
    makes them the slowest rank's). tools/gpu_report.py uses it too."""
    steps_of = {
        name: functools.partial(_step, model, torch.optim.SGD(model.parameters(), lr=lr), batches)
        for name, (model, _) in models.items()
    }
    samples = steps_in_turns(steps_of, range(warmup + steps), f"world {dist.get_world_size()}",
                             batches[0].device)
    return {name: seconds[warmup:] for name, seconds in samples.items()}


def _register_hook(name: str, model: DDP) -> str:
    """Register the comm hook `name` on `model`; say what it does."""
    if name == "default":
        return "DDP's built-in all-reduce"
    if name == "none":
        model.register_comm_hook(None, _no_communication_hook)
        return "no communication (the floor; timed, not checked)"
    if name.startswith("ddpx"):
        return ddpx.register_fused_hook(model, compression=WIRE[name]).describe()
    hook = getattr(default_hooks, f"{name}_compress_hook")
    model.register_comm_hook(dist.group.WORLD, hook)
    return f"torch {hook.__name__}"


def _no_communication_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Hands DDP the bucket as it is: each rank steps with its own gradients."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _train_batches(width: int, args, count: int = 4) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + dist.get_rank())
    return [torch.randn(args.batch_size, width, generator=generator) for _ in range(count)]


def _step(model: DDP, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor],
          index: int) -> None:
    optimizer.zero_grad()
    model(batches[index % len(batches)]).square().mean().backward()
    optimizer.step()


def _train_rows(initial, models: dict, samples: dict, args, failures: list[str]) -> list[dict]:
    checked = {name: entry for name, entry in models.items() if name != "none"}
    diffs = diffs_from_default(initial, checked)
    nodes = node_count()
    rows = []
    for name, (model, describe) in models.items():
        row = {
            "world_size": dist.get_world_size(),
            "nodes": nodes,
            "hook": name,
            "describe": describe,
            "params": sum(p.numel() for p in initial.parameters()),
            "batch_size": args.batch_size,
            "steps": args.warmup + args.steps,
            **slowest_rank_stats(samples[name]),
        }
        rows.append(row)
        if name not in checked:
            continue
        row["ranks_identical"] = same_on_all_ranks(model.module.parameters())
        row.update(diffs.get(name, {}))
        if not row["ranks_identical"]:
            failures.append(f"{name}: parameters differ across ranks")
        if diffs and not row["max_abs_diff"] <= row["tolerance"]:
            failures.append(
                f"{name}: parameters {row['max_abs_diff']:.3g} from default's, "
                f"tolerance {row['tolerance']:.3g}"
            )
    default_ms = next((row["median_ms"] for row in rows if row["hook"] == "default"), None)
    for row in rows:
        row["x_vs_default"] = default_ms / row["median_ms"] if default_ms else None
    return rows


def diffs_from_default(initial: torch.nn.Module, models: dict) -> dict:
    """Per hook, max |diff| of its final parameters from the default model's, and a tolerance.
    `models`: hook name -> (DDP model, description); `initial` is on the models' device.
    tools/gpu_report.py uses it too."""
    if "default" not in models:
        return {}
    default = models["default"][0].module
    moved = _max_abs_diff(default, initial)
    largest = max(p.abs().max().item() for p in default.parameters())
    diffs = {}
    for name, (model, _) in models.items():
        # Gradients are rounded to the wire dtype, and updated parameters to float32.
        rounding = UNIT_ROUNDOFF[WIRE[name]] * moved + UNIT_ROUNDOFF[None] * largest
        diffs[name] = {
            "max_abs_diff": _max_abs_diff(model.module, default),
            "tolerance": PARAM_TOLERANCE_ROUNDINGS * rounding,
        }
    return diffs


def _max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pairs = zip(a.parameters(), b.parameters(), strict=True)
    return max((p - q).abs().max().item() for p, q in pairs)
