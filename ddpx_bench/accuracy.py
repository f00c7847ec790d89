"""`ddpx-bench accuracy`: the averaged all-reduce by each method (torch's default and its
compression hooks, ddpx with and without compression) against a float64 reference.

About a minute on 2 cores at the defaults (world sizes 4,8).

    ddpx-bench accuracy --json bench_out/accuracy.json --plot bench_out/accuracy.png

In detail: the averaged all-reduce of --size normally distributed float32 elements per rank (seeded
per rank) on each of --world_sizes (default 4,8), by each of --methods: `default`
(torch.distributed.all_reduce of x / world size in float32), `torch-fp16` and `torch-bf16` (torch's
fp16_compress_hook and bf16_compress_hook called on the data as DDP would: cast to the wire dtype,
divide by the world size in it, all-reduce in it with gloo, cast back), `ddpx`, `ddpx-fp16` and
`ddpx-bf16` (ddpx.all_reduce with average=True and that compression). Reported: max and mean abs
error against the float64 reference (the sum of the float64 inputs / world size; the largest over
the ranks), the ratio of each ddpx-<wire> error to torch-<wire>'s (smaller is more accurate), and
whether every rank got the same bits. A ddpx result that differs across ranks, or a non-finite
error, makes the run exit with status 1 after the table.
"""

import functools
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import ddpx
from ddpx_bench.common import WIRE, add_if_it_works, progress, random_input, same_on_all_ranks
from ddpx_bench.mode import Mode, choices_option, count
from ddpx_bench.report import format_ratio, format_table, save_figure, world_size_panels

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


ERRORS = (
    "max and mean |result - float64 reference| (the largest over the ranks), reference = sum of "
    "the float64 inputs / world size; vs torch: ddpx-<wire>'s error / torch-<wire>'s"
)


class Accuracy(Mode):
    name = "accuracy"
    help = "compare the averaged all-reduce's errors against a float64 reference"
    measured = {"errors": ERRORS}
    world_sizes = (4, 8)

    def add_arguments(self, parser):
        choices_option(parser, "--methods", METHODS)
        parser.add_argument("--size", type=count, default="1M",
                            help="float32 elements per rank, with K/M suffixes (powers of 1000; "
                            "default 1M)")

    def run(self, args):
        return bench_accuracy(args)

    def table(self, rows: list[dict]) -> list[str]:
        lines = format_table([
            ("world", ">5", lambda row: row["world_size"]),
            ("method", "<10", lambda row: row["method"]),
            ("wire", "<4", lambda row: row["wire"]),
            ("max |error|", ">11", lambda row: f"{row['max_abs_error']:.3e}"),
            ("mean |error|", ">12", lambda row: f"{row['mean_abs_error']:.3e}"),
            ("max vs torch", ">12", lambda row: format_ratio(row["max_vs_torch"])),
            ("mean vs torch", ">13", lambda row: format_ratio(row["mean_vs_torch"])),
            ("identical on ranks", "", lambda row: "yes" if row["ranks_identical"] else "no"),
        ], rows)
        lines.append(
            f"{rows[0]['elements']} standard normal float32 elements per rank, averaged; "
            "vs torch: smaller is more accurate"
        )
        return lines

    def plot(self, rows: list[dict], path: Path) -> None:
        figure, panels = world_size_panels(rows, "|error| vs float64 reference")
        for ax, world_size in panels:
            cells = [row for row in rows if row["world_size"] == world_size]
            x = range(len(cells))
            for offset, stat in ((-0.2, "max"), (0.2, "mean")):
                errors = [row[f"{stat}_abs_error"] for row in cells]
                ax.bar([i + offset for i in x], errors, 0.4, label=f"{stat} |error|")
            ax.set_xticks(x, [row["method"] for row in cells], rotation=30)
            ax.set(yscale="log", title=f"{world_size} ranks")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend()
        save_figure(figure, path)


MODE = Accuracy()
