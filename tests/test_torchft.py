"""ddpx as the process group torchft reconfigures at each quorum change (ddpx.torchft): three
replica processes (tests/torchft_replica.py) train a small model in torchft's DDP under a
lighthouse; one is SIGKILLed mid-run, the other two train on without it and without a restart,
the killed one is started again, heals from a peer and rejoins, and at the end every replica holds
the same parameters. The same job on torchft's own ProcessGroupGloo gives the time a fault costs
to compare with; docs/recovery.md has the numbers of the -m slow run."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import JOB_MARK, free_port, job_processes, kill_job, left_in_shm, shm_segments

TORCHFT = importlib.util.find_spec("torchft") is not None
needs_torchft = pytest.mark.skipif(
    not TORCHFT, reason="torchft is not installed (pip install torchft): the torchft jobs need it")
REPLICA = Path(__file__).resolve().with_name("torchft_replica.py")
LIGHTHOUSE = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
# How long the lighthouse waits for a silent replica's heartbeat (torchft's default: 5 s) before a
# quorum leaves it out; the Managers beat every 100 ms.
HEARTBEAT_TIMEOUT_MS = 1000


def test_ddpx_torchft_says_what_to_install_without_torchft(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # as where it is not installed
    monkeypatch.delitem(sys.modules, "ddpx.torchft", raising=False)
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module("ddpx.torchft")
    assert str(raised.value) == ("ddpx.torchft needs torchft, which is not installed: "
                                 "pip install torchft")


class Job:
    """A lighthouse and ``replicas`` replica processes on process group ``pg``, in ``folder``,
    each replica's steps read back from the lines it writes there."""

    def __init__(self, pg: str, folder: Path, replicas: int = 3, ddp: str = "ddpx"):
        self.pg, self.ddp, self.folder, self.marker = pg, ddp, folder, str(folder)
        self.env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn",
                        **{JOB_MARK: self.marker})
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPLICA.parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])])
        port = free_port()
        self.lighthouse_address = f"http://localhost:{port}"
        self.lighthouse = subprocess.Popen(
            [LIGHTHOUSE, "--bind", f"[::]:{port}", "--min_replicas", "2", "--quorum_tick_ms", "50",
             "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)],
            env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        self._read = {}  # for each replica log: how far it was read, and the entries so far
        self.procs = [self.start(r) for r in range(replicas)]

    def start(self, replica: int) -> subprocess.Popen:
        output = open(self.folder / f"output{replica}.txt", "a")
        with output:
            return subprocess.Popen(
                [sys.executable, str(REPLICA), "--pg", self.pg, "--ddp", self.ddp,
                 "--replica", str(replica), "--lighthouse", self.lighthouse_address,
                 "--out", str(self.folder)],
                env=self.env, stdout=output, stderr=subprocess.STDOUT)

    def log(self, replica: int) -> list[dict]:
        """What the live process of ``replica`` has logged, read on from the last look."""
        path = self.folder / f"replica{replica}.{self.procs[replica].pid}.jsonl"
        offset, entries = self._read.get(path, (0, []))
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                text = f.read()
            whole = text[:text.rfind(b"\n") + 1]  # a line being written waits for the next look
            entries += [json.loads(line) for line in whole.splitlines()]
            self._read[path] = (offset + len(whole), entries)
        return entries

    def steps(self, replica: int) -> list[dict]:
        return [e for e in self.log(replica) if "step" in e]

    def outputs(self) -> str:
        return "\n".join(f"--- {path.name}\n{path.read_text()[-3000:]}"
                         for path in sorted(self.folder.glob("output*.txt")))

    def wait_until(self, what: str, done, timeout: float = 60, dead_already=()) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            dead = [r for r, p in enumerate(self.procs)
                    if p.poll() is not None and r not in dead_already]
            assert not dead, f"replicas {dead} exited while waiting until {what}\n{self.outputs()}"
            assert time.monotonic() < deadline, f"not {what} in {timeout} s\n{self.outputs()}"
            time.sleep(0.05)

    def committed_with(self, replica: int, replicas: int, after: float, count: int = 1) -> list:
        return [e for e in self.steps(replica)
                if e["committed"] and e["replicas"] == replicas and e["time"] > after][:count]

    def kill_when_settled(self, victim: int) -> float:
        """SIGKILLs replica ``victim`` once all have committed 5 steps together; when."""
        settled = time.time()
        self.wait_until("all replicas commit together", lambda: all(
            len(self.committed_with(r, len(self.procs), settled, 5)) == 5
            for r in range(len(self.procs))))
        killed = time.time()
        self.procs[victim].send_signal(signal.SIGKILL)
        self.procs[victim].wait()
        return killed

    def fault(self, victim: int) -> dict:
        """SIGKILLs replica ``victim`` once all commit together, restarts it once the others
        commit without it, and returns what it cost once all commit together again."""
        everyone = range(len(self.procs))
        survivors = [r for r in everyone if r != victim]
        pids = [self.procs[r].pid for r in survivors]
        killed = self.kill_when_settled(victim)
        self.wait_until("the survivors commit without the killed replica", lambda: all(
            self.committed_with(r, len(survivors), killed) for r in survivors),
            dead_already=[victim])
        commits = [self.committed_with(r, len(survivors), killed)[0]["time"] for r in survivors]
        # When each survivor's step failed (none where the kill came after its all-reduce).
        failed = [min(times) for r in survivors if (times := [
            e["time"] for e in self.steps(r) if e["time"] > killed and not e["committed"]])]
        configured = [e["configure"] for r in survivors for e in self.log(r)
                      if "configure" in e and e["time"] > killed]
        reached = max(e["step"] for r in survivors for e in self.steps(r))
        restarted = time.time()
        self.procs[victim] = self.start(victim)
        self.wait_until("the restarted replica rejoins", lambda: all(
            self.committed_with(r, len(self.procs), restarted) for r in everyone))
        assert [self.procs[r].pid for r in survivors] == pids  # trained on, never restarted
        # Its first step is the survivors', whose state it took from one of them.
        assert self.steps(victim)[0]["step"] > reached, (reached, self.steps(victim)[:3])
        return {"lost": max(commits) - killed,
                "detected": max(failed) - killed if failed else None,
                "configure": max(configured),
                "rejoined": self.committed_with(victim, len(self.procs), restarted)[0]["time"]
                - restarted}

    def finish(self) -> list[dict]:
        """Every replica trains to a step ahead of all and exits; their parameters."""
        ahead = max(e["step"] for r in range(len(self.procs)) for e in self.steps(r)) + 20
        (self.folder / "stop.tmp").write_text(str(ahead))
        (self.folder / "stop.tmp").rename(self.folder / "stop")
        for proc in self.procs:
            proc.wait(timeout=60)
        assert [p.returncode for p in self.procs] == [0] * len(self.procs), self.outputs()
        return [json.loads((self.folder / f"params{r}.json").read_text())
                for r in range(len(self.procs))]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        kill_job(self.lighthouse, self.marker)


def run_faults(pg: str, victims: list[int], folder: Path) -> list[dict]:
    """The job on ``pg``, a fault of each replica in ``victims`` in turn; what each cost, after
    checking that the replicas end with the same parameters, leaving no process and no ddpx
    segment behind."""
    folder.mkdir()
    before = shm_segments()
    job = Job(pg, folder)
    try:
        faults = [job.fault(victim) for victim in victims]
        params = job.finish()
        configured = [e for path in folder.glob("replica*.jsonl")
                      for e in map(json.loads, path.read_text().splitlines()) if "configure" in e]
    finally:
        job.close()
    # After each configure() a replica maps the new group's segment only: the last group's went
    # with its abort.
    assert {e["mapped"] for e in configured} == {1 if pg == "ddpx" else 0}, configured
    assert not job_processes(job.marker)
    assert not left_in_shm(before), left_in_shm(before)
    assert len({p["step"] for p in params}) == 1, [p["step"] for p in params]
    assert all(p["params"] == params[0]["params"] for p in params)
    if pg == "ddpx":  # the replicas' all-reduces went through their node's shared memory
        for p in params:
            assert p["routes"]["all_reduce"]["engine"] > 0, p["routes"]
            assert all(paths["gloo"] == 0 for paths in p["routes"].values()), p["routes"]
            assert p["engine"] == "ShmEngine", p["engine"]
    # ddpx's survivors all raise at once, so none waits out the 10 s timeout
    # (tests/torchft_replica.py) for the other, as gloo's may.
    assert pg != "ddpx" or all(fault["lost"] < 10 for fault in faults), faults
    return faults


def summary(pg: str, faults: list[dict]) -> str:
    """A line per measure: its median and worst over the faults, and each fault's."""
    lines = [f"{pg}: {len(faults)} faults, seconds: median, worst (each fault)"]
    for key in ("lost", "detected", "configure", "rejoined"):
        values = [f[key] for f in faults if f[key] is not None]
        if values:
            lines.append(f"  {key:>9}: {statistics.median(values):6.2f} {max(values):6.2f}  ("
                         + " ".join(f"{v:.2f}" for v in values) + ")")
    return "\n".join(lines)


def compare(tmp_path, victims: list[int]) -> dict:
    results = {pg: run_faults(pg, victims, tmp_path / pg) for pg in ("ddpx", "gloo")}
    print("\n" + "\n".join(summary(pg, faults) for pg, faults in results.items()))
    return results


@needs_torchft
def test_replicas_on_ddpx_train_through_a_killed_replica_and_heal_it(tmp_path):
    compare(tmp_path, victims=[2])


@needs_torchft
@pytest.mark.slow
def test_what_a_fault_costs_on_ddpx_and_on_gloo(tmp_path):
    """The numbers of docs/recovery.md: each replica killed twice, the first too."""
    compare(tmp_path, victims=[2, 0, 1, 2, 0, 1])


@needs_torchft
@pytest.mark.slow
def test_torchfts_own_ddp_wrapper_ends_the_survivors_of_a_killed_replica(tmp_path):
    """What ddpx.torchft.DistributedDataParallel works around, on torchft's own gloo group: the
    hook of torchft 0.2.0's wrapper asserts on a future that a failed all-reduce never sets
    (torchft/ddp.py, _comm_hook). Once this fails, torchft has fixed it."""
    job = Job("gloo", tmp_path, ddp="torchft")
    try:
        job.kill_when_settled(2)
        deadline = time.monotonic() + 60
        while any(p.poll() is None for p in job.procs[:2]) and time.monotonic() < deadline:
            time.sleep(0.1)
        outputs = job.outputs()
    finally:
        job.close()
    assert [p.returncode for p in job.procs[:2]] == [1, 1], \
        f"the survivors trained on: ddpx.torchft's wrapper may go\n{outputs}"
    assert outputs.count("in _comm_hook\n") == 2, outputs
