"""PyTorch's own distributed test suite with every group it makes as gloo made on ddpx
(tests/torch_suite.py), in a fresh interpreter per world size: no test may fail but those listed
in BY_CONSTRUCTION, which must fail (so the list cannot go stale). A representative part runs by
default; `-m slow` runs the whole suite at 2 and at 4 ranks. And PyTorch's gloo file,
test_c10d_gloo.py (tests/torch_gloo_suite.py), on gloo and on ddpx: no test may fail on ddpx that
passes on gloo but those GLOO_SET_ASIDE lists; it needs the file, which the wheel does not ship
(DDPX_TORCH_TESTS, docs/backend-dropin.md)."""

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from distributed import left_in_shm, shm_segments

SUITE = Path(__file__).with_name("torch_suite.py")
GLOO_SUITE = Path(__file__).with_name("torch_gloo_suite.py")
TORCH_TESTS = os.environ.get("DDPX_TORCH_TESTS")

# test_c10d_gloo.py's tests that cannot pass on a backend other than gloo, and why.
GLOO_SET_ASIDE = {
    "GlooProcessGroupWithDispatchedCollectivesTests::test_monitored_barrier":
        "monitored_barrier is gloo's: torch checks the backend's name in Python",
    "GlooProcessGroupWithDispatchedCollectivesTests::test_init_process_group_for_all_backends":
        "torch names every out-of-tree backend 'custom'",
    # They call ProcessGroupGloo.create_device, gloo's own transport, on the group's backend;
    # DDP on a ddpx group is test_backend.py's.
    "CommTest::test_broadcast_coalesced_gloo_cpu": "gloo's create_device",
    "DistributedDataParallelTest::test_gloo_backend_cpu_module": "gloo's create_device",
    "DistributedDataParallelTest::test_gloo_backend_cpu_module_grad_is_view":
        "gloo's create_device",
}

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
              timeout: float = 600, suite: Path = SUITE,
              env: dict | None = None) -> dict[str, str]:
    """Each test's outcome ("passed", "skipped", "failed") and, for a failure, its message, by
    name (tests/torch_suite.py's) or Class::name (other suites, whose classes share names)."""
    report = tmp_path / f"suite-{world}-{len(list(tmp_path.glob('suite-*')))}.xml"
    tests = [f"{suite}::TestDdpxAsGloo::{name}" for name in select] if select else [str(suite)]
    command = [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-q",
               "-o", "addopts=", f"--junitxml={report}"]
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join(filter(None, [str(SUITE.parent), TORCH_TESTS])),
               **(env or {}))
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
        name = case.get("name") if suite == SUITE else \
            f"{case.get('classname').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            outcomes[name] = "failed: " + (failure.get("message") or "")[:300]
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
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
    assert not left_in_shm(before), f"the suite left {sorted(left_in_shm(before))}"


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


@pytest.mark.slow
@pytest.mark.skipif(not TORCH_TESTS, reason="needs PyTorch's test/distributed/test_c10d_gloo.py "
                    "and test_c10d_common.py, which the wheel does not ship: DDPX_TORCH_TESTS=DIR")
def test_torchs_gloo_file_fails_on_ddpx_nowhere_it_passes_on_gloo(tmp_path):
    before = shm_segments()
    gloo = run_suite(2, tmp_path, suite=GLOO_SUITE, env={"DDPX_GLOO_SUITE_ON": "gloo"},
                     timeout=3600)
    ddpx = run_suite(2, tmp_path, suite=GLOO_SUITE, timeout=3600)
    worse = {n: o for n, o in ddpx.items()
             if o.startswith("failed") and gloo.get(n) == "passed" and n not in GLOO_SET_ASIDE}
    assert not worse, f"tests that pass on gloo and fail on ddpx: {worse}"
    stale = {n for n in GLOO_SET_ASIDE if ddpx.get(n) == "passed"}
    assert not stale, f"set aside but passed on ddpx: {sorted(stale)}"
    assert sum(o == "passed" for o in ddpx.values()) >= 90, ddpx
    _clean(before)
