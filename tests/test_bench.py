"""Smoke test of scripts/bench.py: every mode end to end on 2 spawned ranks (accuracy: 2 and 3),
tiny sizes.

It checks what the benchmark reports and writes, never how fast anything is.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOCUMENT_KEYS = {"mode", "date", "command", "machine", "settings", "rows", "left_out"}
MACHINE_KEYS = {"cpu", "cores", "threads_per_rank", "torch", "ddpx"}


def ddpx_built() -> bool:
    try:
        import ddpx
    except ImportError:
        return False
    return hasattr(ddpx, "all_reduce")


def run_bench(tmp_path: Path, *args: str, world_sizes: str = "2") -> tuple[dict, str]:
    """Run bench.py on `world_sizes` ranks as a user would; return its JSON document and stdout."""
    json_path, png_path = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    command = [sys.executable, str(BENCH), *args, "--world_sizes", world_sizes]
    command += ["--json", str(json_path), "--plot", str(png_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)
    document = json.loads(json_path.read_text())
    assert DOCUMENT_KEYS <= set(document)
    assert MACHINE_KEYS <= set(document["machine"])
    assert document["machine"]["threads_per_rank"] == 1
    assert document["failures"] == []
    assert ("timing" in document) != ("errors" in document)
    if ddpx_built():
        assert "unavailable" not in document["machine"]["ddpx"]
    return document, done.stdout


def check_measured(requested: list[str], measured: list[str], left_out: dict) -> None:
    """Every requested engine or hook is measured or left out with a reason; ddpx when built."""
    assert sorted(measured + list(left_out)) == sorted(requested)
    assert all(left_out.values())
    if ddpx_built():
        assert "ddpx" in measured


def check_times(row: dict) -> None:
    assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]


def test_allreduce(tmp_path):
    engines, sizes = ["gloo", "ddpx", "ddpx-fp16", "ddpx-bf16", "copy"], [4096, 256 * 1024]
    options = "--sizes 4K,256K --iters 3 --min_time 0.05 --warmup 1".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--engines", ",".join(engines))

    measured = list(dict.fromkeys(row["engine"] for row in document["rows"]))
    check_measured(engines, measured, document["left_out"])
    rows = {(row["size_bytes"], row["engine"]): row for row in document["rows"]}
    assert sorted(rows) == sorted((size, engine) for size in sizes for engine in measured)
    for (size, _), row in rows.items():
        assert row["world_size"] == 2
        check_times(row)
        assert row["gb_per_s"] == pytest.approx(size / row["median_ms"] / 1e6)
        assert row["x_vs_gloo"] == pytest.approx(rows[size, "gloo"]["median_ms"] / row["median_ms"])
        if row["engine"] == "copy":  # the floor is timed, not checked
            assert row["max_abs_error"] is row["tolerance"] is None
        else:
            assert 0 <= row["max_abs_error"] <= row["tolerance"]
    assert "x vs gloo" in stdout
    assert sum(line.split()[:1] == ["2"] for line in stdout.splitlines()) == len(rows)


@pytest.mark.skipif(not ddpx_built(), reason="needs ddpx's extension")
def test_allreduce_on_two_simulated_nodes_counts_the_bytes_between_them(tmp_path):
    options = "--sizes 64K --iters 2 --min_time 0.05 --warmup 1 --nodes 2".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--engines",
                                 "gloo,ddpx,ddpx-bf16", world_sizes="4")

    rows = {row["engine"]: row for row in document["rows"]}
    assert sorted(rows) == ["ddpx", "ddpx-bf16", "gloo"]
    assert all(row["nodes"] == 2 for row in rows.values())
    assert rows["gloo"]["inter_node_bytes"] is None
    # Each node sends its float32 sum across once; compressed, in 2-byte elements (padded by at
    # most one element per rank).
    assert rows["ddpx"]["inter_node_bytes"] == 2 * 64 * 1024
    assert 64 * 1024 <= rows["ddpx-bf16"]["inter_node_bytes"] <= 64 * 1024 + 4 * 4
    assert "inter-node MB/call" in stdout and "4 ranks on 2" in stdout


def test_nodes_must_divide_the_world_size(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "allreduce", "--world_sizes", "4", "--nodes", "3"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "--nodes 3 does not divide world size 4 evenly" in done.stderr


def test_train(tmp_path):
    hooks = ["default", "fp16", "ddpx", "ddpx-bf16"]
    options = "--params 20K --steps 3 --warmup 1 --batch_size 4".split()
    document, stdout = run_bench(tmp_path, "train", *options, "--comm_hooks", ",".join(hooks))

    rows = {row["hook"]: row for row in document["rows"]}
    check_measured(hooks, list(rows), document["left_out"])
    assert {"default", "fp16"} <= set(rows)
    for row in rows.values():
        assert row["world_size"] == 2
        check_times(row)
        assert row["x_vs_default"] == pytest.approx(rows["default"]["median_ms"] / row["median_ms"])
        assert row["ranks_identical"]
        assert 0 <= row["max_abs_diff"] <= row["tolerance"]
    assert rows["default"]["max_abs_diff"] == 0
    assert "x vs default" in stdout


def test_accuracy(tmp_path):
    methods = ["default", "torch-fp16", "torch-bf16", "ddpx", "ddpx-fp16", "ddpx-bf16"]
    document, stdout = run_bench(tmp_path, "accuracy", "--size", "2K", world_sizes="2,3")

    assert "errors" in document
    rows = {(row["world_size"], row["method"]): row for row in document["rows"]}
    measured = list(dict.fromkeys(method for _, method in rows))
    check_measured(methods, measured, document["left_out"])
    assert sorted(rows) == sorted((ws, method) for ws in (2, 3) for method in measured)
    for (world_size, method), row in rows.items():
        assert row["elements"] == 2000
        for stat in ("max", "mean"):
            error = row[f"{stat}_abs_error"]
            assert 0 <= error < 0.1
            # A float32 result may hit the float64 reference; one rounded to a wire dtype cannot.
            if row["wire"] != "fp32":
                assert error > 0
        assert row["mean_abs_error"] <= row["max_abs_error"]
        if method.startswith("ddpx"):
            assert row["ranks_identical"]
        torch_row = rows.get((world_size, f"torch-{row['wire']}"))
        if method.startswith("ddpx-") and torch_row:
            for stat in ("max", "mean"):
                ratio = row[f"{stat}_abs_error"] / torch_row[f"{stat}_abs_error"]
                assert row[f"{stat}_vs_torch"] == pytest.approx(ratio)
                if world_size == 3:
                    assert ratio <= 1
        else:
            assert row["max_vs_torch"] is row["mean_vs_torch"] is None
    assert "mean vs torch" in stdout
    assert sum(line.split()[:1] in (["2"], ["3"]) for line in stdout.splitlines()) == len(rows)
