"""tools/gpu_check.sh, the one command for a GPU machine, run here without a GPU: end to end
(every step still runs: the GPU tests skip, the speed report says there is no CUDA device,
model_parallel.py trains on the CPU under DDP); with tools missing, which the preflight names
first and whose steps do not run; with its tests cut off at the deadline, which still reports them
test by test; and with an interpreter that fails (every step is still tried and reported). Also
its summary of failed steps and tests, and the speed report's DDP steps and tables, on the CPU."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distributed import left_in_shm, run_ranks, shm_segments

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS_WITHOUT_GPU = ["preflight", "build", "build_info", "speed", "model_parallel-ddp", "tests"]
# For the tests step: an outcome of each kind, then a test that outlives the budget.
TINY_TESTS = """
import time

import pytest


@pytest.fixture
def broken():
    raise RuntimeError("a fixture that breaks")


def test_passes():
    pass


def test_skips():
    pytest.skip("not here")


def test_fails():
    assert 1 == 2, "one is not two"


def test_errs(broken):
    pass


def test_hangs():
    time.sleep(300)


def test_never_reached():
    pass
"""


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
    """gpu_check.sh with OUT=out, in a session of its own; returns it finished, with its output
    and seconds, after checking that it left no process of that session running."""
    start = time.monotonic()
    process = subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True, env=dict(os.environ, OUT=str(out), **env))
    try:
        process.output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"gpu_check.sh did not finish in {timeout} s:\n{process.communicate()[0]}")
    process.seconds = time.monotonic() - start
    assert not session_processes(process.pid), "gpu_check.sh left processes running"
    return process


def steps_of(out: Path) -> dict:
    return {step["name"]: step for step in json.loads((out / "report.json").read_text())["steps"]}


@pytest.mark.slow  # 35 s
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a GPU is here: run `bash tools/gpu_check.sh` itself (minutes)")
def test_every_step_runs_and_reports_without_a_gpu(tmp_path):
    segments = shm_segments()
    check = run_check(tmp_path, "--skip-build")
    assert check.returncode == 0, check.output
    assert check.seconds < 330
    assert not left_in_shm(segments)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True and report["budget_s"] == 330
    steps = steps_of(tmp_path)
    assert list(steps) == STEPS_WITHOUT_GPU
    assert steps["build"]["status"] == "skipped"
    for name in STEPS_WITHOUT_GPU[2:]:
        assert (steps[name]["status"], steps[name]["exit_code"]) == ("passed", 0), name
        assert steps[name]["seconds"] > 0 and (tmp_path / steps[name]["log"]).is_file()
    assert report["preflight"]["missing"] == []
    assert report["preflight"]["environment"]["cuda_available"] is False
    assert report["build"]["cuda"] is False and report["build"]["loaded"] == "prebuilt"
    tests = report["tests"]
    assert (tests["failed"], tests["errors"], tests["unfinished"], tests["not_reached"]) == (
        0, 0, [], 0) and tests["passed"] > 0, tests
    assert tests["passed"] + tests["skipped"] == tests["collected"], tests
    assert tests["skip_reasons"]["needs a CUDA GPU"] >= 30, tests
    assert (tmp_path / "junit.xml").is_file()
    assert report["speed"]["cuda"] is False
    assert report["speed"]["reason"].startswith("no CUDA device"), report["speed"]
    text = (tmp_path / "report.txt").read_text()
    assert text.startswith("ddpx GPU check: 5 steps passed, 1 skipped on request (build)"), text
    assert "speed: no CUDA device" in text and "NO GPU here" in text, text
    trained = (tmp_path / "model_parallel-ddp.log").read_text()
    assert "world size 2, backend gloo" in trained, trained
    assert "model split: net1 on cpu, net2 on cpu" in trained, trained
    assert "comm path: ddpx shared memory, 2 ranks a node" in trained, trained


@pytest.mark.slow  # 26 s: its tests step runs out a 38 s budget
def test_missing_tools_come_first_and_a_cut_off_step_still_reports_each_test(tmp_path):
    """ninja and accelerate missing (a ninja on PATH that fails, and modules that do not
    import), a tests step that outlives a 38 s budget: the preflight names what is missing
    before any other step runs, the build does not run, the tests that ended are reported one by
    one, the one cut off and those not reached too, and the summary ends by the deadline."""
    fake = tmp_path / "fake"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "ninja").write_text("#!/bin/sh\nexit 1\n")
    (fake / "bin" / "ninja").chmod(0o755)
    for module in ("ninja", "accelerate"):
        (fake / module).mkdir()
        (fake / module / "__init__.py").write_text(f"raise ImportError('no {module} here')\n")
    # A build in this checkout would replace the extension the tests run against.
    python = fake / "python"
    python.write_text(f'#!/bin/sh\ncase " $* " in *" setup.py "*) echo "no builds here"; exit 99;; '
                      f'esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (tmp_path / "test_tiny.py").write_text(TINY_TESTS)
    out = tmp_path / "out"
    check = run_check(out, "--only", "build,tests", timeout=90, PYTHON=str(python),
                      PATH=f"{fake / 'bin'}:{os.environ['PATH']}", PYTHONPATH=str(fake),
                      GPU_CHECK_BUDGET_S="38", GPU_CHECK_TESTS=str(tmp_path / "test_tiny.py"))
    assert check.returncode == 1, check.output
    assert check.seconds < 38 + 1, check.output
    said = check.output.splitlines()
    first_other_step = said.index("[gpu_check] build: not run, missing ninja")
    assert any(line.split()[:2] == ["MISSING", "ninja"] for line in said[:first_other_step])
    assert any(line.split()[:2] == ["MISSING", "accelerate"] for line in said[:first_other_step])
    assert "[gpu_check] will not run: build, for lack of ninja" in said, check.output
    steps = steps_of(out)
    assert [(name, step["status"]) for name, step in steps.items()] == [
        ("preflight", "passed"), ("build", "not run"), ("build_info", "passed"),
        ("speed", "skipped"), ("model_parallel-ddp", "skipped"), ("tests", "timed out")]
    assert steps["build"]["note"] == "missing: ninja"
    assert steps["tests"]["exit_code"] == 124
    assert not (out / "junit.xml").exists()  # pytest was killed before writing it
    tests = json.loads((out / "report.json").read_text())["tests"]
    assert [failure.split("::")[-1] for failure in tests["failures"]] == [
        "test_fails: AssertionError: one is not two",
        "test_errs: RuntimeError: a fixture that breaks"]
    assert tests["failures"][0].startswith("FAILED ") and tests["failures"][1].startswith("ERROR ")
    assert [nodeid.split("::")[-1] for nodeid in tests["unfinished"]] == ["test_hangs"]
    assert (tests["collected"], tests["passed"], tests["failed"], tests["errors"],
            tests["skipped"], tests["not_reached"]) == (6, 1, 1, 1, 1, 1), tests
    assert tests["skip_reasons"] == {"not here": 1}
    text = (out / "report.txt").read_text()
    assert text.startswith("ddpx GPU check: FAILED: 2 of 6 steps (build, tests)"), text
    assert "missing: ninja, accelerate (see preflight.log)" in text, text
    assert "TIMED OUT " in text and text.count("test_hangs") == 1, text


@pytest.mark.skipif(shutil.which("g++") is None or not os.access("/usr/bin/g++", os.X_OK),
                    reason="needs g++ at /usr/bin/g++")
def test_a_compiler_that_links_libstdcxx_statically_is_replaced_for_the_build(tmp_path):
    """The H200 image's CXX linked libstdc++ into ddpx._C statically, which ddpx refuses to load:
    the preflight says so and hands the build /usr/bin/g++."""
    wrapper = tmp_path / "static-g++"
    wrapper.write_text('#!/bin/sh\nexec g++ -static-libstdc++ "$@"\n')
    wrapper.chmod(0o755)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_preflight.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "CXX": str(wrapper)})
    assert out.returncode == 0, out.stderr
    assert (f"{wrapper} links libstdc++ statically, which ddpx refuses to load: the build uses "
            "/usr/bin/g++") in out.stdout, out.stdout
    assert "BUILD_CXX=/usr/bin/g++\n" in (tmp_path / "preflight.env").read_text()


def test_a_failing_interpreter_fails_every_step_and_still_reports(tmp_path):
    check = run_check(tmp_path, "--skip-build", timeout=60, PYTHON="false")
    assert check.returncode == 1, check.output
    assert "the summary failed" in check.output, check.output
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    # No ddpx that loads, so the steps that need it do not run.
    assert [(name, status) for name, status, *_ in rows] == [
        ("preflight", "failed"), ("build", "skipped"), ("build_info", "failed"),
        ("speed", "not run"), ("model_parallel-ddp", "not run"), ("tests", "not run")]


def test_summary_names_failed_steps_and_tests(tmp_path):
    (tmp_path / "steps.tsv").write_text(
        "build\tpassed\t0\t61.0\t90\tbuild.log\tbash -c step_build\t\n"
        "model_parallel-ddp\tnot run\t\t0\t\tmodel_parallel-ddp.log\tbash\tmissing: accelerate\n"
        "speed\tfailed\t1\t20.5\t45\tspeed.log\tpython tools/gpu_report.py speed\t\n"
        "tests\ttimed out\t124\t120.0\t120\ttests.log\tpython -m pytest\t\n")
    (tmp_path / "tests.tsv").write_text(
        "collected\tt.py::test_a\ncollected\tt.py::test_b\ncollected\tt.py::test_c[nccl-2]\n"
        "collected\tt.py::test_d\ncollected\tt.py::test_e\n"
        "started\tt.py::test_a\npassed\tt.py::test_a\t0.50\t\n"
        "started\tt.py::test_b\n"
        "failed\tt.py::test_b\t2.00\tAssertionError: 3 of 8 elements differ\n"
        "started\tt.py::test_c[nccl-2]\nskipped\tt.py::test_c[nccl-2]\t0.00\tneeds 2 CUDA GPUs\n"
        "started\tt.py::test_d\npass")  # killed while it wrote
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_summary.py"),
                             str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is False
    assert report["tests"] == {
        "collected": 5, "passed": 1, "failed": 1, "errors": 0, "skipped": 1,
        "unfinished": ["t.py::test_d"], "not_reached": 1,
        "skip_reasons": {"needs 2 CUDA GPUs": 1},
        "failures": ["FAILED t.py::test_b: AssertionError: 3 of 8 elements differ"],
        "slowest": [["t.py::test_b", 2.0], ["t.py::test_a", 0.5], ["t.py::test_c[nccl-2]", 0.0]]}
    assert [step["exit_code"] for step in report["steps"]] == [0, None, 1, 124]
    assert result.stdout.startswith(
        "ddpx GPU check: FAILED: 3 of 4 steps (model_parallel-ddp, speed, tests)")
    assert "(missing: accelerate)" in result.stdout
    assert "FAILED t.py::test_b" in result.stdout and "TIMED OUT t.py::test_d" in result.stdout
    assert "1 cut off, 1 not reached" in result.stdout


def gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "tools" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_speeds_on_cpu(rank, world):
    return gpu_report().train_speeds(torch.device("cpu"), params=50_000)


def test_speed_report_trains_and_tabulates():
    """The speed report's DDP part, on the CPU over gloo (which sums torch's bf16 hook's
    bfloat16 buckets too), and its tables, with made-up GPU numbers."""
    [(rows, left_out, failures)] = run_ranks(_train_speeds_on_cpu, 1)
    assert [row["hook"] for row in rows] == ["default", "bf16", "ddpx", "ddpx-bf16"]
    assert not left_out and not failures, (left_out, failures)
    assert all(row["within_tolerance"] and row["median_ms"] > 0 for row in rows), rows
    assert rows[0]["x_vs_default"] == 1.0
    rate = {"bytes": 2**30, "median_ms": 0.5, "gb_per_s": 2147.5, "x_copy": 1.0}
    text = gpu_report().speed_text({
        "cuda": True, "gpu": "a GPU", "capability": "9.0", "torch": "2.11.0", "torch_cuda": "13.0",
        "kernels": [{"kernel": "copy_ float32 (device to device)", **rate}],
        "all_reduce": [{"all_reduce": "ddpx.all_reduce float32", **rate}],
        "train": rows, "train_left_out": {"fp16": "made up"}, "failures": ["ddpx: made up"]})
    lines = text.splitlines()
    assert lines[0] == "speed on a GPU (sm_90), torch 2.11.0, CUDA 13.0", text
    assert any(line.startswith("copy_ float32 (device to device)") and "2148" in line
               for line in lines), text
    assert sum(line.startswith(("default ", "bf16 ", "ddpx ", "ddpx-bf16 "))
               for line in lines) == 4, text
    assert lines[-2] == "left out fp16: made up" and lines[-1] == "FAILED: ddpx: made up", text
