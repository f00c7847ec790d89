"""The steps of tools/gpu_check.sh that need ddpx, one subcommand each:

    python tools/gpu_report.py build-info --json OUT/build_info.json
    python tools/gpu_report.py speed --json OUT/speed.json --text OUT/speed.txt

build-info: ddpx.build_info() of the extension built in this checkout; fails when it is not that
in-place build, or when torch is a CUDA build and the extension has no CUDA kernels.

speed, on the first GPU: a device-to-device copy_ of 1 GiB of float32, then each CUDA kernel of
ddpx on the same data (GB/s counting the bytes read plus the bytes written; the median of CUDA
event timings; the ratio to the copy's GB/s, the most a pass over memory gets); ddpx.all_reduce
and torch.distributed.all_reduce of that 1 GiB at world size 1 over NCCL (GB/s of the tensor's
bytes); and DDP training steps of ddpx_bench.models.MLP with 25M parameters at world size 1: DDP's
default all-reduce, torch's bf16_compress_hook, ddpx's hook, ddpx's hook over a bf16 wire (median
step ms, and each model's final parameters against the default model's, within ddpx-bench train's
tolerance or the exit status is 1). Without a CUDA device it writes {"cuda": false, "reason": ...}
and exits 0.

A script of its own rather than a ddpx-bench mode: ddpx-bench spawns gloo ranks for several world
sizes and times CPU collectives on the slowest rank; this times one GPU from one process.
"""

import argparse
import gc
import json
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
GIB_OF_FLOAT32 = 2**28
TRAIN_HOOKS = ("default", "bf16", "ddpx", "ddpx-bf16")
TRAIN_PARAMS = 25_000_000
# ddpx-bench train's defaults, so that the two read alike.
TRAIN_BATCH, TRAIN_LR = 16, 0.01
TRAIN_WARMUP, TRAIN_STEPS = 5, 30
KERNEL_REPEATS = 20


def build_info() -> tuple[dict, str | None]:
    """ddpx.build_info() of the in-place build, and why it is not the build this check needs (None
    when it is). Checked before ddpx loads it, which would build it (minutes) if it did not fit."""
    import ddpx

    built = ROOT / "ddpx" / f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    if Path(ddpx.__file__).resolve().parent != built.parent:
        return {}, (f"import ddpx found {ddpx.__file__}, not this checkout's: put {ROOT} first "
                    "on PYTHONPATH")
    if not built.is_file():
        return {}, f"there is no {built}: the build failed (see build.log)"
    from ddpx import _C

    if _C.torch_version != torch.__version__:
        return {}, (f"{built} was built for torch {_C.torch_version}, this is torch "
                    f"{torch.__version__}: build again (the build step)")
    info = ddpx.build_info()
    if torch.version.cuda is not None and not info["cuda"]:
        return info, (f"torch {torch.__version__} is a CUDA build, but ddpx._C has no CUDA "
                      "kernels: the build found no CUDA toolkit (bin/nvcc and "
                      "include/cuda_runtime.h under CUDA_HOME or /usr/local/cuda); set CUDA_HOME "
                      "and build again (see build.log)")
    return info, None


def _median_ms(run, repeats: int = KERNEL_REPEATS, warmup: int = 3) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _rate_rows(cases: list, column: str) -> list[dict]:
    """Times each (name, bytes, run); GB/s, and x copy against the first case's GB/s."""
    rows = []
    for name, nbytes, run in cases:
        ms = _median_ms(run)
        rows.append({column: name, "bytes": nbytes, "median_ms": ms,
                     "gb_per_s": nbytes / (ms / 1e3) / 1e9})
    for row in rows:
        row["x_copy"] = row["gb_per_s"] / rows[0]["gb_per_s"]
    return rows


def kernel_speeds() -> list[dict]:
    from ddpx._ext import extension

    C = extension()
    n = GIB_OF_FLOAT32
    wide = torch.randn(n, device="cuda")
    wide_out = torch.empty_like(wide)
    bf16 = wide.to(torch.bfloat16)
    fp16 = wide.to(torch.float16)
    narrow_out = torch.empty_like(bf16)
    sums = {k: torch.empty(n // k, dtype=torch.bfloat16, device="cuda") for k in (2, 8)}
    cases = [
        ("copy_ float32 (device to device)", 8 * n, lambda: wide_out.copy_(wide)),
        ("scale_cast float32 -> bfloat16, x 1/8", 6 * n,
         lambda: C.cuda_scale_cast(narrow_out, wide, 0.125)),
        ("scale_cast float32 -> float16, x 1/8", 6 * n,
         lambda: C.cuda_scale_cast(narrow_out.view(torch.float16), wide, 0.125)),
        ("widen bfloat16 -> float32", 6 * n, lambda: C.cuda_scale_cast(wide_out, bf16, 1.0)),
        ("widen float16 -> float32", 6 * n, lambda: C.cuda_scale_cast(wide_out, fp16, 1.0)),
    ]
    for k, dst in sums.items():
        # k slices of the bf16 gigabyte read, one slice written.
        cases.append((f"sum_slices bfloat16, {k} slices", 2 * n + 2 * n // k,
                      lambda dst=dst, k=k: C.cuda_sum_slices(dst, bf16.view(k, n // k))))
    return _rate_rows(cases, "kernel")


def all_reduce_speeds() -> list[dict]:
    import ddpx

    tensor = torch.randn(GIB_OF_FLOAT32, device="cuda")
    copied = torch.empty_like(tensor)
    nbytes = tensor.numel() * tensor.element_size()
    return _rate_rows([
        ("copy_ float32 (device to device)", nbytes, lambda: copied.copy_(tensor)),
        ("torch.distributed.all_reduce float32", nbytes, lambda: dist.all_reduce(tensor)),
        ("ddpx.all_reduce float32", nbytes, lambda: ddpx.all_reduce(tensor)),
        ("ddpx.all_reduce float32 over a bf16 wire", nbytes,
         lambda: ddpx.all_reduce(tensor, compression="bf16")),
    ], "all_reduce")


def train_speeds(device: torch.device, params: int = TRAIN_PARAMS
                 ) -> tuple[list[dict], dict, list[str]]:
    """DDP steps of each TRAIN_HOOKS model on `device` (the tests take the CPU), taking turns
    step by step: rows, hooks left out (with why), failures."""
    from ddpx_bench.common import slowest_rank_stats
    from ddpx_bench.models import MLP
    from ddpx_bench.train import diffs_from_default, hooked_models, sgd, timed_steps

    torch.manual_seed(0)
    initial = MLP.with_params(params).to(device)
    left_out = {}
    models = hooked_models(initial, TRAIN_HOOKS, left_out, sgd(TRAIN_LR))
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(TRAIN_BATCH, initial.width, generator=generator).to(device)
               for _ in range(4)]
    samples = timed_steps(models, batches, TRAIN_WARMUP, TRAIN_STEPS)
    diffs = diffs_from_default(initial, models)
    rows, failures = [], []
    for name, (_, describe, _) in models.items():
        row = {"hook": name, "describe": describe,
               "params": sum(p.numel() for p in initial.parameters()),
               "batch_size": TRAIN_BATCH, "steps": TRAIN_WARMUP + TRAIN_STEPS,
               **slowest_rank_stats(samples[name]), **diffs[name]}
        row["within_tolerance"] = row["max_abs_diff"] <= row["tolerance"]
        if not row["within_tolerance"]:
            failures.append(f"{name}: parameters {row['max_abs_diff']:.3g} from default's, "
                            f"tolerance {row['tolerance']:.3g}")
        rows.append(row)
    for row in rows:
        row["x_vs_default"] = rows[0]["median_ms"] / row["median_ms"]
    return rows, left_out, failures


def speed() -> dict:
    if not torch.cuda.is_available():
        return {"cuda": False,
                "reason": f"no CUDA device: torch {torch.__version__} (CUDA "
                          f"{torch.version.cuda or 'none: a CPU build'}) sees no GPU"}
    from ddpx._ext import extension

    if not extension().has_cuda_kernels:
        return {"cuda": True, "failures": ["ddpx._C has no CUDA kernels: see build_info.json"]}
    torch.cuda.set_device(0)
    props = torch.cuda.get_device_properties(0)
    report = {"cuda": True, "gpu": props.name, "capability": f"{props.major}.{props.minor}",
              "torch": torch.__version__, "torch_cuda": torch.version.cuda,
              "kernels": kernel_speeds()}
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        # gloo for the CPU tensors of ddpx_bench's step statistics, NCCL for everything on the GPU.
        dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{folder}/store",
                                rank=0, world_size=1)
        try:
            report["all_reduce"] = all_reduce_speeds()
            torch.cuda.empty_cache()
            report["train"], report["train_left_out"], report["failures"] = train_speeds(
                torch.device("cuda", 0))
        finally:
            gc.collect()  # the DDP models and ddpx's engine let go of the group first
            dist.destroy_process_group()
    return report


def _table(rows: list[dict], columns: list[tuple[str, str, str]]) -> list[str]:
    """Lines of a table: columns are (heading, key, format)."""
    cells = [[heading for heading, _, _ in columns]]
    cells += [[format(row[key], fmt) for _, key, fmt in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return ["  ".join(cell.ljust(width) if i == 0 else cell.rjust(width)
                      for i, (cell, width) in enumerate(zip(line, widths, strict=True)))
            for line in cells]


def speed_text(report: dict) -> str:
    if not report["cuda"]:
        return f"speed: {report['reason']}"
    if "kernels" not in report:
        return "speed: " + "; ".join(report["failures"])
    lines = [f"speed on {report['gpu']} (sm_{report['capability'].replace('.', '')}), torch "
             f"{report['torch']}, CUDA {report['torch_cuda']}", "",
             "kernels on 1 GiB of float32 (GB/s: bytes read + written / median time)"]
    rates = [("median ms", "median_ms", ".3f"), ("GB/s", "gb_per_s", ".0f"),
             ("x copy", "x_copy", ".2f")]
    lines += _table(report["kernels"], [("kernel", "kernel", "")] + rates)
    if "all_reduce" in report:
        lines += ["", "all-reduce of 1 GiB of float32 at world size 1 over NCCL (GB/s: tensor "
                      "bytes / median time)"]
        lines += _table(report["all_reduce"], [("call", "all_reduce", "")] + rates)
    if "train" in report:
        first = report["train"][0]
        lines += ["", f"DDP step of ddpx_bench.models.MLP, {first['params'] / 1e6:.2f}M "
                      f"parameters, batch {first['batch_size']}, world size 1 over NCCL, "
                      f"{first['steps']} steps"]
        lines += _table(report["train"], [
            ("hook", "hook", ""), ("median ms", "median_ms", ".2f"), ("p10", "p10_ms", ".2f"),
            ("p90", "p90_ms", ".2f"), ("x vs default", "x_vs_default", ".2f"),
            ("max |diff|", "max_abs_diff", ".2e"), ("tolerance", "tolerance", ".2e")])
        lines += [f"{row['hook']}: {row['describe']}" for row in report["train"]]
        lines += [f"left out {name}: {why}" for name, why in report["train_left_out"].items()]
    lines += [f"FAILED: {failure}" for failure in report["failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["build-info", "speed"])
    parser.add_argument("--json", type=Path, required=True, help="where the JSON goes")
    parser.add_argument("--text", type=Path, help="speed: where the table goes too")
    args = parser.parse_args(argv)
    failure = None
    if args.step == "build-info":
        report, failure = build_info()
        text = json.dumps(report, indent=2) + (f"\nFAILED: {failure}" if failure else "")
        report["failure"] = failure
    else:
        report = speed()
        text = speed_text(report)
        failure = "; ".join(report.get("failures", [])) or None
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.text:
        args.text.write_text(text + "\n")
    print(text)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
