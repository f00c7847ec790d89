"""tools/gpu_check.sh, the one command for a GPU machine, run here end to end without a GPU
(every step still runs: the GPU tests skip, the speed report says there is no CUDA device,
model_parallel.py trains on the CPU) and with an interpreter that fails (every step is still
tried and reported); its summary of failed steps and tests; and the speed report's DDP steps and
tables, on the CPU."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_ranks, shm_segments

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS_WITHOUT_GPU = ["environment", "build", "build_info", "tests", "speed", "model_parallel-cpu"]


def session_processes(session: int) -> list[int]:
    """Pids of the live processes (zombies excluded) of a session."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(int(entry))
    return found


def run_check(out: Path, *args: str, timeout: float = 120, **env: str) -> subprocess.Popen:
    """gpu_check.sh with OUT=out, in a session of its own; returns it finished, after checking
    that it left no process of that session running."""
    process = subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True, env=dict(os.environ, OUT=str(out), **env))
    try:
        process.output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"gpu_check.sh did not finish in {timeout} s:\n{process.communicate()[0]}")
    assert not session_processes(process.pid), "gpu_check.sh left processes running"
    return process


@pytest.mark.slow  # 22 s
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is here: run `bash tools/gpu_check.sh` itself (minutes)")
def test_every_step_runs_and_reports_without_a_gpu(tmp_path):
    segments = shm_segments()
    check = run_check(tmp_path, "--skip-build")
    assert check.returncode == 0, check.output
    assert shm_segments() == segments
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == STEPS_WITHOUT_GPU
    assert steps["build"]["status"] == "skipped"
    for name in STEPS_WITHOUT_GPU[2:]:
        assert (steps[name]["status"], steps[name]["exit_code"]) == ("passed", 0), name
        assert steps[name]["seconds"] > 0 and (tmp_path / steps[name]["log"]).is_file()
    assert report["environment"]["cuda_available"] is False
    assert report["build"]["cuda"] is False and report["build"]["loaded"] == "prebuilt"
    tests = report["tests"]
    assert (tests["failed"], tests["errors"]) == (0, 0) and tests["passed"] > 0, tests
    assert tests["skip_reasons"]["needs a CUDA GPU"] >= 30, tests
    assert report["speed"]["cuda"] is False
    assert report["speed"]["reason"].startswith("no CUDA device"), report["speed"]
    text = (tmp_path / "report.txt").read_text()
    assert text.startswith("ddpx GPU check: 5 steps passed, 1 skipped on request (build)"), text
    assert "speed: no CUDA device" in text and "NO GPU here" in text, text
    trained = (tmp_path / "model_parallel-cpu.log").read_text()
    assert "model split: net1 on cpu, net2 on cpu" in trained, trained


def test_a_failing_interpreter_fails_every_step_and_still_reports(tmp_path):
    check = run_check(tmp_path, "--skip-build", timeout=60, PYTHON="false")
    assert check.returncode == 1, check.output
    assert "the summary failed" in check.output, check.output
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [(name, status) for name, status, *_ in rows] == [
        (name, "skipped" if name == "build" else "failed") for name in STEPS_WITHOUT_GPU]


def test_summary_names_failed_steps_and_tests(tmp_path):
    (tmp_path / "steps.tsv").write_text(
        "build\tpassed\t0\t61.0\t240\tbuild.log\tbash -c step_build\n"
        "tests\tfailed\t1\t80.5\t200\ttests.log\tpython -m pytest\n"
        "speed\ttimed out\t124\t120.0\t120\tspeed.log\tpython tools/gpu_report.py speed\n"
        "model_parallel-cuda0-cpu\tout of time\t\t0\t\tmodel_parallel-cuda0-cpu.log\tpython\n")
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b">'
        '<failure message="AssertionError: 3 of 8 elements differ">trace</failure></testcase>'
        '<testcase classname="tests.test_cuda" name="test_c[nccl-2]">'
        '<skipped type="pytest.skip" message="needs 2 CUDA GPUs">where</skipped></testcase>'
        '</testsuite></testsuites>')
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_summary.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is False
    assert report["tests"] == {
        "passed": 1, "failed": 1, "errors": 0, "skipped": 1,
        "skip_reasons": {"needs 2 CUDA GPUs": 1},
        "failures": ["tests.test_cuda::test_b: AssertionError: 3 of 8 elements differ"]}
    assert [step["exit_code"] for step in report["steps"]] == [0, 1, 124, None]
    assert result.stdout.startswith(
        "ddpx GPU check: FAILED: 3 of 4 steps (tests, speed, model_parallel-cuda0-cpu)")
    assert "FAILED tests.test_cuda::test_b" in result.stdout


def gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "tools" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_speeds_on_cpu(rank, world):
    return gpu_report().train_speeds(torch.device("cpu"), params=50_000)


def test_speed_report_trains_and_tabulates():
    """The speed report's DDP part, on the CPU over gloo (where torch's bf16 hook is left out,
    needing NCCL), and its tables, with made-up GPU numbers."""
    [(rows, left_out, failures)] = run_ranks(_train_speeds_on_cpu, 1)
    assert [row["hook"] for row in rows] == ["default", "ddpx", "ddpx-bf16"]
    assert list(left_out) == ["bf16"] and not failures, (left_out, failures)
    assert all(row["within_tolerance"] and row["median_ms"] > 0 for row in rows), rows
    assert rows[0]["x_vs_default"] == 1.0
    rate = {"bytes": 2**30, "median_ms": 0.5, "gb_per_s": 2147.5, "x_copy": 1.0}
    text = gpu_report().speed_text({
        "cuda": True, "gpu": "a GPU", "capability": "9.0", "torch": "2.11.0", "torch_cuda": "13.0",
        "kernels": [{"kernel": "copy_ float32 (device to device)", **rate}],
        "all_reduce": [{"all_reduce": "ddpx.all_reduce float32", **rate}],
        "train": rows, "train_left_out": left_out, "failures": ["ddpx: made up"]})
    lines = text.splitlines()
    assert lines[0] == "speed on a GPU (sm_90), torch 2.11.0, CUDA 13.0", text
    assert any(line.startswith("copy_ float32 (device to device)") and "2148" in line
               for line in lines), text
    assert sum(line.startswith(("default ", "ddpx ", "ddpx-bf16 ")) for line in lines) == 3, text
    assert lines[-2].startswith("left out bf16: ") and lines[-1] == "FAILED: ddpx: made up", text
