"""PyTorch's own distributed test suite with every group it makes as gloo made on ddpx
(tests/torch_suite.py), in a fresh interpreter per world size: no test may fail but those listed
in BY_CONSTRUCTION, which must fail (so the list cannot go stale). A representative part runs by
default; `-m slow` runs the whole suite at 2 and at 4 ranks."""

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from distributed import shm_segments

SUITE = Path(__file__).with_name("torch_suite.py")

# Tests that cannot pass on a backend other than gloo, and why.
BY_CONSTRUCTION = {
    # It asserts that dist.get_backend() is "gloo"; on ddpx it is "ddpx".
    "test_get_backend": "the backend's name",
    # torch.distributed.monitored_barrier checks the backend's name in Python and allows "gloo"
    # only, before the backend is called.
    "test_monitored_barrier_gloo": "monitored_barrier is gloo's",
    "test_monitored_barrier_gloo_rank_0_timeout": "monitored_barrier is gloo's",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier is gloo's",
    # DDP's logging reads the name from torch's ProcessGroup, which names every out-of-tree
    # backend after its BackendType, "custom" (ProcessGroup::getBackendName); the backend's own
    # getBackendName() says "ddpx", and dist.get_backend() does too.
    "test_ddp_logging_data_cpu": "torch names out-of-tree backends 'custom' in DDP's logs",
}

# The default suite's part: the collectives the engine serves, p2p and its batching under
# coalescing, groups, the object collectives, DDP, and DETAIL's wrapper.
REPRESENTATIVE = [
    "test_all_reduce_sum",
    "test_batch_isend_irecv_gloo_tags",
    "test_DistributedDataParallelCPU",
    "test_ddp_logging_data_cpu",
    "test_get_backend",
]


def run_suite(world: int, tmp_path: Path, select: list[str] | None = None,
              timeout: float = 600) -> dict[str, str]:
    """Each test's outcome ("passed", "skipped", "failed") and, for a failure, its message."""
    report = tmp_path / f"suite-{world}.xml"
    tests = [f"{SUITE}::TestDdpxAsGloo::{name}" for name in select] if select else [str(SUITE)]
    command = [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", f"--junitxml={report}"]
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE=str(world), PYTHONPATH=str(SUITE.parent))
    job = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(
            f"the suite did not finish in {timeout} s:\n{output[-3000:]}") from None
    # The multiprocessing resource tracker ends a moment after the suite: give it 10 s.
    deadline = time.monotonic() + 10
    while _in_session(job.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _in_session(job.pid)
    if left:
        os.killpg(job.pid, signal.SIGKILL)
    assert not left, f"the suite left processes {left} running"
    assert report.exists(), f"the suite made no report:\n{output[-3000:]}"
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            outcomes[case.get("name")] = "failed: " + (failure.get("message") or "")[:300]
        elif case.find("skipped") is not None:
            outcomes[case.get("name")] = "skipped"
        else:
            outcomes[case.get("name")] = "passed"
    return outcomes


def check(outcomes: dict[str, str], select: list[str] | None = None) -> None:
    ran = set(select) if select else set(outcomes)
    missing = ran - set(outcomes)
    assert not missing, f"tests not found in torch's suite: {sorted(missing)}"
    failed = {n: o for n, o in outcomes.items() if o.startswith("failed")}
    unexpected = {n: o for n, o in failed.items() if n not in BY_CONSTRUCTION}
    assert not unexpected, f"tests that fail on ddpx: {unexpected}"
    stale = {n for n in BY_CONSTRUCTION if n in outcomes and outcomes[n] == "passed"}
    assert not stale, f"listed as failing by construction but passed: {sorted(stale)}"
    assert any(o == "passed" for o in outcomes.values())


def _in_session(session: int) -> list[int]:
    """Live processes of the session (the suite and every rank it spawned)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == session and fields[0] != "Z":
            found.append(int(entry))
    return found


def _clean(before: set[str]) -> None:
    assert shm_segments() <= before, f"the suite left {sorted(shm_segments() - before)}"


def test_representative_part_at_2_ranks(tmp_path):
    before = shm_segments()
    check(run_suite(2, tmp_path, REPRESENTATIVE), REPRESENTATIVE)
    _clean(before)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_whole_suite(world, tmp_path):
    before = shm_segments()
    check(run_suite(world, tmp_path, timeout=4 * 3600))
    _clean(before)
