"""Lost ranks under elastic restarts: scripts/checkpoint.py trains under
`torchrun --max-restarts` (or `accelerate launch --max_restarts`), a random rank is SIGKILLed (or
SIGSTOPped) at a random step, the launcher restarts the job and the script resumes from its latest
checkpoint by itself (--resume_from_checkpoint auto), again and again; then the final parameters
are compared with an uninterrupted run's.

    python -m ddpx_bench.faults --faults 20                       # ddpx, 20 SIGKILLs
    python -m ddpx_bench.faults --backend gloo --timeout 60 --faults 10
    python -m ddpx_bench.faults --launcher accelerate --faults 5
    python -m ddpx_bench.faults --soak_s 600 --fault_every 30,60 --signals kill,stop

Each fault's line: the rank and signal, the step it came at and the checkpoint the run resumed from
(the steps redone), and the time from the fault to each event the harness sees: `down` (every rank
of the dead start has exited), `restarted` (torchrun has started the new ranks: its rendezvous and
process start), `up` (rank 0 printed its world: imports, the process group, the model and DDP),
`resumed` (the checkpoint loaded) and `training` (the first step after it); and, measured apart,
how long a rank takes to import what it imports and build a DDP model (which imports much of
torch._dynamo), which the summary takes away with the launcher's restart. A restart
that does not reach a step within --restart_limit seconds counts as not come up, and the job is
stopped. After the job: what is left in /dev/shm and of its processes, and whether the final
parameter digest equals the uninterrupted run's. --json keeps every figure."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ddpx_bench.processes import alive, free_port, job_processes, kill_job, shm_segments

__all__ = ["Job", "main", "run_faults"]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "checkpoint.py"
_STEP = re.compile(r"^step\s+(\d+)\s+loss")
_RESUMED = re.compile(r"^resumed from .* after step (\d+)")
_DIGEST = re.compile(r"^parameter digest (\w+)")
_WORLD = re.compile(r"^world size ")
_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _environ(pid: int, name: str) -> int | None:
    """The integer the environment variable ``name`` holds in process ``pid``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(name.encode() + b"="):
            return int(entry.partition(b"=")[2])
    return None


def _restart_count(pids: list[int]) -> int | None:
    """TORCHELASTIC_RESTART_COUNT of these ranks: how many times the launcher restarted them."""
    return next((n for n in (_environ(pid, "TORCHELASTIC_RESTART_COUNT") for pid in pids)
                 if n is not None), None)


class Job:
    """One launch of scripts/checkpoint.py: its output, line by line with the time each came,
    and its ranks (torchrun's children)."""

    def __init__(self, args: argparse.Namespace, output_dir: str, max_restarts: int):
        if args.launcher == "torchrun":
            launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                        str(args.nproc), "--max-restarts", str(max_restarts), "--rdzv-backend",
                        "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                        "--monitor-interval", "0.1"]
        else:
            launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                        str(SCRIPT.parent / "configs" / "cpu.yaml"), "--num_processes",
                        str(args.nproc), "--max_restarts", str(max_restarts),
                        "--monitor_interval", "0.1"]
        command = [
            *launcher, str(SCRIPT), "--output_dir", output_dir, "--steps", str(args.steps),
            "--checkpointing_steps", str(args.checkpoint_every), "--resume_from_checkpoint",
            "auto", "--log_every", str(args.log_every), "--seed", str(args.seed),
        ]
        if args.backend == "ddpx":
            command += ["--backend", "ddpx", "--comm_hook", "ddpx"]
        else:
            command += ["--comm_hook", "default"]
        if args.timeout is not None:
            command += ["--timeout", str(args.timeout)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", LOGLEVEL="ERROR")
        self.lines: list[tuple[float, str]] = []
        self.marker = output_dir  # in every rank's command line
        self._new_line = threading.Condition()
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._new_line:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new_line.notify_all()
        with self._new_line:
            self._new_line.notify_all()

    def ranks(self) -> list[int]:
        return [pid for pid in _children(self.process.pid) if alive(pid)]

    def left(self) -> list[int]:
        """The job's ranks still alive."""
        return job_processes(self.marker)

    def wait_line(self, pattern: re.Pattern, start: int, until: float):
        """The first line from index ``start`` on that matches: (index, time, match); None if
        none by monotonic time ``until`` or once the job has ended."""
        with self._new_line:
            while True:
                for i in range(start, len(self.lines)):
                    match = pattern.match(self.lines[i][1])
                    if match:
                        return i, self.lines[i][0], match
                start = len(self.lines)
                if time.monotonic() >= until or not self._reader.is_alive():
                    return None
                self._new_line.wait(min(0.05, max(0.0, until - time.monotonic())))

    def stop(self) -> None:
        """Ends the job: the launcher's session and every rank it started (each a session of its
        own), stopped ones too."""
        kill_job(self.process, self.marker)
        self._reader.join(timeout=10)

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


def _until_all_exit(pids: list[int], until: float) -> float | None:
    while time.monotonic() < until:
        if not any(alive(p) for p in pids):
            return time.monotonic()
        time.sleep(0.005)
    return None


def _until_new_ranks(job: Job, old: list[int], nproc: int, until: float) -> float | None:
    while time.monotonic() < until and job.process.poll() is None:
        if len([p for p in job.ranks() if p not in old]) == nproc:
            return time.monotonic()
        time.sleep(0.005)
    return None


def _fault(job: Job, args, rng: random.Random, index: int, at_step: int | None,
           at_time: float | None) -> dict | None:
    """Waits for the step (or the time) the fault comes at, signals a random rank, and follows
    the restart to the first step after it; None if the run finished first."""
    start = len(job.lines)
    last_step = None
    while True:
        seen = job.wait_line(_STEP, start, time.monotonic() + args.restart_limit)
        if seen is None:
            if _digest(job):
                return None  # the run finished first
            return {"fault": index, "came_up": False, "why": "no step before the fault"}
        start, _, match = seen[0] + 1, seen[1], seen[2]
        last_step = int(match.group(1))
        if (at_step is not None and last_step >= at_step) or \
                (at_time is not None and time.monotonic() >= at_time):
            break
    ranks = job.ranks()
    restarts_before = _restart_count(ranks)
    victim = rng.choice(ranks)
    how = rng.choice(args.signals)
    rank = _environ(victim, "RANK")
    killed_at, killed_line = time.monotonic(), len(job.lines)
    os.kill(victim, _SIGNALS[how])
    until = killed_at + args.restart_limit
    record = {"fault": index, "signal": how, "rank": rank, "step": last_step}
    down = _until_all_exit(ranks, until)
    if how == "stop" and args.backend == "ddpx":
        # The survivors time out on it: how many of their errors' flight records name it.
        stopped = f"behind: rank {rank} (stopped"
        record["named_by"] = sum(stopped in line for _, line in job.lines[killed_line:])
    restarted = down and _until_new_ranks(job, ranks, args.nproc, until)
    up = restarted and job.wait_line(_WORLD, start, until)
    resumed = up and job.wait_line(_RESUMED, up[0], until)
    training = resumed and job.wait_line(_STEP, resumed[0], until)
    record["came_up"] = bool(training)
    if training and restarts_before is not None:
        # More than one: a restart that failed (a rank of the new start met the dead one's keys,
        # say) and was restarted again.
        record["restarts"] = (_restart_count(job.ranks()) or 0) - restarts_before
    for name, at in (("down", down), ("restarted", restarted), ("up", up and up[1]),
                     ("resumed", resumed and resumed[1]), ("training", training and training[1])):
        record[f"{name}_s"] = round(at - killed_at, 3) if at else None
    if resumed:
        record["resumed_from"] = int(resumed[2].group(1))
        record["steps_redone"] = last_step + 1 - record["resumed_from"]
    if not training:
        record["why"] = job.tail()
    return record


# What a rank does before its first step that is not the process group's: its imports and a DDP
# model's construction (which imports much of torch._dynamo), over a process group of one.
_START_UP = """
import time
start = time.monotonic()
import torch, numpy, accelerate, ddpx
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(10, 5))
print(time.monotonic() - start)
dist.destroy_process_group()
"""


def start_up_seconds(nproc: int, times: int = 3) -> float:
    """How long ``nproc`` processes started together take to import what a rank imports and
    build a DDP model, as each times it (not its exit, which can take torch half a second): the
    median over ``times`` tries of the slowest one."""
    tries = []
    for _ in range(times):
        processes = [subprocess.Popen([sys.executable, "-c", _START_UP], stdout=subprocess.PIPE,
                                      text=True) for _ in range(nproc)]
        tries.append(max(float(p.communicate()[0]) for p in processes))
    return round(statistics.median(tries), 3)


def _digest(job: Job) -> str | None:
    found = job.wait_line(_DIGEST, 0, time.monotonic())
    return found[2].group(1) if found else None


def _job(args, max_restarts: int, plan) -> tuple[list[dict], Job, str]:
    with tempfile.TemporaryDirectory(prefix="ddpx-faults-") as output_dir:
        job = Job(args, output_dir, max_restarts)
        try:
            faults = plan(job)
            if all(f["came_up"] for f in faults):
                job.process.wait(timeout=args.restart_limit + args.steps * 0.05)
        except subprocess.TimeoutExpired:
            faults.append({"fault": len(faults), "came_up": False, "why": "did not finish"})
        finally:
            job.stop()
        shutil.rmtree(output_dir, ignore_errors=True)
        return faults, job, _digest(job)


def run_faults(args: argparse.Namespace) -> dict:
    """The uninterrupted run, then the faulted one: each fault's record, what was left, and
    whether the final parameters are equal."""
    rng = random.Random(args.seed)
    before = shm_segments()
    _, reference, reference_digest = _job(args, 0, lambda job: [])

    def plan(job: Job) -> list[dict]:
        faults: list[dict] = []
        deadline = time.monotonic() + args.soak_s if args.soak_s else None
        resumed_from = 0
        while (len(faults) < args.faults) if not deadline else (time.monotonic() < deadline):
            if deadline:
                at_step, at_time = None, time.monotonic() + rng.uniform(*args.fault_every)
                if at_time >= deadline:
                    break
            else:
                at_step = resumed_from + rng.randint(1, 2 * args.checkpoint_every)
                at_time = None
            record = _fault(job, args, rng, len(faults), at_step, at_time)
            if record is None:
                break
            faults.append(record)
            print(json.dumps(record), file=sys.stderr, flush=True)
            if not record["came_up"]:
                break
            resumed_from = record["resumed_from"]
        return faults

    faults, job, digest = _job(args, args.faults if not args.soak_s else 10_000, plan)
    time.sleep(0.5)
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "faults": faults,
        "came_up": sum(f["came_up"] for f in faults),
        "exit_code": job.process.returncode,
        "reference_exit_code": reference.process.returncode,
        "digest": digest,
        "reference_digest": reference_digest,
        "equal": digest is not None and digest == reference_digest,
        "left_in_dev_shm": sorted(shm_segments() - before),
        "left_processes": job.left() + reference.left(),
    }


def _summary(result: dict) -> str:
    faults = result["faults"]
    lines = [f"{result['came_up']} of {len(faults)} restarts came up; final parameters "
             f"{'equal to' if result['equal'] else 'DIFFERENT from'} the uninterrupted run's "
             f"({result['digest']} vs {result['reference_digest']}); exit code "
             f"{result['exit_code']}; left in /dev/shm: {result['left_in_dev_shm'] or 'nothing'}"]
    for name in ("down", "restarted", "up", "resumed", "training"):
        values = [f[f"{name}_s"] for f in faults if f.get(f"{name}_s") is not None]
        if values:
            lines.append(f"  fault -> {name:9s} median {statistics.median(values):6.2f} s, "
                         f"worst {max(values):6.2f} s ({len(values)} faults)")
    retried = [f for f in faults if f.get("restarts", 1) > 1]
    if retried:
        lines.append(f"  {len(retried)} faults took more than one restart: "
                     f"{', '.join(str(f['restarts']) for f in retried)}")
    beyond = [f["training_s"] - f["restarted_s"] - result["start_up_s"] for f in faults
              if f.get("training_s") is not None]
    if beyond:
        lines.append(f"  beyond the launcher's restart and a rank's imports and model "
                     f"({result['start_up_s']:.2f} s): median {statistics.median(beyond):.2f} s, "
                     f"worst {max(beyond):.2f} s")
    redone = [f["steps_redone"] for f in faults if "steps_redone" in f]
    if redone:
        lines.append(f"  steps redone: median {statistics.median(redone)}, worst {max(redone)}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddpx_bench.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("ddpx", "gloo"), default="ddpx",
                        help="ddpx: its backend and fused hook; gloo: gloo and DDP's default")
    parser.add_argument("--launcher", choices=("torchrun", "accelerate"), default="torchrun",
                        help="torchrun --max-restarts (c10d rendezvous), or accelerate launch "
                        "--max_restarts (scripts/configs/cpu.yaml, its static rendezvous)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--faults", type=int, default=20, help="faults, one after each restart")
    parser.add_argument("--soak_s", type=float, default=0,
                        help="instead of --faults: faults every --fault_every seconds for this "
                        "long, then the run finishes")
    parser.add_argument("--fault_every", default="30,60",
                        type=lambda text: tuple(float(x) for x in text.split(",")),
                        help="with --soak_s: a fault every uniform(A, B) seconds")
    parser.add_argument("--signals", default="kill",
                        type=lambda text: [s for s in text.split(",") if s in _SIGNALS] or
                        parser.error(f"--signals: from {', '.join(_SIGNALS)}"),
                        help="what a fault sends, at random: kill (SIGKILL), stop (SIGSTOP)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="the process group's timeout (default: torch's, 30 minutes)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--checkpoint_every", type=int, default=100)
    parser.add_argument("--log_every", type=int, default=1)
    parser.add_argument("--restart_limit", type=float, default=120,
                        help="seconds a fault may take to reach training again")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the result here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start_up = start_up_seconds(args.nproc)
    result = run_faults(args)
    result["start_up_s"] = start_up
    print(_summary(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["equal"] and result["came_up"] == len(result["faults"]) else 1


if __name__ == "__main__":
    sys.exit(main())
