"""`ddpx-bench accuracy`: the averaged all-reduce by each method (torch's default and its
compression hooks, ddpx with and without compression) against a float64 reference."""

import functools
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddpx
from ddpx.bench.common import WIRE, add_if_it_works, progress, random_input, same_on_all_ranks

METHODS = ("default", "torch-fp16", "torch-bf16", "ddpx", "ddpx-fp16", "ddpx-bf16")


def bench_accuracy(args) -> dict:
    left_out, failures = {}, []
    methods = _accuracy_methods(args.methods, left_out)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    progress(f"world {world_size}, {args.size} elements: {', '.join(methods)}")
    reference = torch.zeros(args.size, dtype=torch.float64)
    for other in range(world_size):
        reference += random_input(args.seed, other, args.size, normal=True)
    reference /= world_size
    mine = random_input(args.seed, rank, args.size, normal=True)
    rows = []
    for name, method in methods.items():
        result = method(mine.clone())
        error = (result.double() - reference).abs()
        # The largest over the ranks: rank 0's alone could hide a rank that got other bits.
        errors = torch.tensor([error.max().item(), error.mean().item()], dtype=torch.float64)
        dist.all_reduce(errors.nan_to_num_(nan=math.inf), op=dist.ReduceOp.MAX)
        row = {
            "world_size": world_size,
            "elements": args.size,
            "method": name,
            "wire": WIRE[name] or "fp32",
            "max_abs_error": errors[0].item(),
            "mean_abs_error": errors[1].item(),
            "ranks_identical": same_on_all_ranks([result]),
        }
        if not math.isfinite(row["max_abs_error"]):
            failures.append(f"{name} on {world_size} ranks: non-finite error")
        if name.startswith("ddpx") and not row["ranks_identical"]:
            failures.append(f"{name} on {world_size} ranks: results differ across ranks")
        rows.append(row)
    by_name = {row["method"]: row for row in rows}
    for row in rows:
        compressed = row["method"].startswith("ddpx-")
        torch_row = by_name.get(f"torch-{row['wire']}") if compressed else None
        for stat in ("max", "mean"):
            row[f"{stat}_vs_torch"] = (
                row[f"{stat}_abs_error"] / torch_row[f"{stat}_abs_error"] if torch_row else None
            )
    return {"rows": rows, "left_out": left_out, "notes": [], "failures": failures}


def _accuracy_methods(requested: list[str], left_out: dict) -> dict:
    """The requested methods that work here, by name: each averages its float32 argument."""
    world_size, methods = dist.get_world_size(), {}
    for name in requested:
        if name == "default":
            methods[name] = lambda t: _summed(t.div_(world_size))
        elif name.startswith("torch-"):
            hook = getattr(default_hooks, f"{WIRE[name]}_compress_hook")
            engine = functools.partial(_hooked, hook)
            # RuntimeError: gloo cannot sum the wire dtype here.
            add_if_it_works(methods, name, engine, left_out, fails=RuntimeError)
        else:
            engine = functools.partial(ddpx.all_reduce, average=True, compression=WIRE[name])
            add_if_it_works(methods, name, engine, left_out)
    return methods


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(tensor)
    return tensor


def _hooked(hook, tensor: torch.Tensor) -> torch.Tensor:
    """Average `tensor` in place with DDP comm hook `hook`, as DDP runs it on a bucket."""
    bucket = SimpleNamespace(buffer=lambda: tensor)  # what the hook reads of a GradBucket
    return hook(None, bucket).wait()
