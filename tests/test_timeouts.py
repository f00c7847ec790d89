"""A group's timeout is the one every ddpx wait uses, whatever the group's backend: a peer stopped
with SIGSTOP (alive, holding its part of the call) makes every other rank raise within the
group's timeout, naming it, on each way users reach ddpx with a ddpx-backend group: the hook on
a plain script, the scripts' ``--backend ddpx``, Lightning's ``DDPStrategy(timeout=...)`` with
ddpx's callback, and the Hugging Face Trainer. Before, the hook there waited torch's default,
30 minutes, and a longer timeout was cut to it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from distributed import folder_with_scripts, job_processes, kill_job, run_ranks

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 6


def group_timeouts(rank, world):
    """What ddpx reads as the timeout of groups made with each backend and timeout."""
    import torch.distributed as dist

    from ddpx._timeouts import group_timeout

    found = {}
    for backend in ("gloo", "ddpx"):
        for seconds in (7, 2 * 3600):
            group = dist.new_group(list(range(world)), backend=backend,
                                   timeout=timedelta(seconds=seconds))
            found[(backend, seconds)] = group_timeout(group).total_seconds()
    found[("world", 0)] = group_timeout(dist.group.WORLD).total_seconds()
    return found


@pytest.mark.parametrize("debug", ["OFF", "DETAIL"])
def test_a_groups_timeout_is_read_from_every_backend(debug):
    results = run_ranks(group_timeouts, 2, backend="ddpx", group_timeout=11,
                        env={"TORCH_DISTRIBUTED_DEBUG": debug})
    for found in results:
        assert found == {("gloo", 7): 7, ("gloo", 7200): 7200, ("ddpx", 7): 7,
                         ("ddpx", 7200): 7200, ("world", 0): 11}


HOOK_JOB = f"""
from datetime import timedelta
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import ddpx

torch.set_num_threads(1)
dist.init_process_group("ddpx", timeout=timedelta(seconds={TIMEOUT_S}))
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)))
ddpx.register_fused_hook(model)
for step in range(100000):
    if step == 5:
        print("READY", flush=True)
    model(torch.randn(32, 64)).square().mean().backward()
"""

# The shared blocks (any rank sums any block for all): a rank stopped while it holds a block it
# claimed, which its peers then wait for, is named too.
SHARED_BLOCKS_JOB = f"""
from datetime import timedelta
import torch, torch.distributed as dist
import ddpx

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=timedelta(seconds={TIMEOUT_S}))
ddpx.engine.engine_for().schedule = "shared"
big = torch.ones(64 << 20 >> 2)
for call in range(100000):
    if call == 3:
        print("READY", flush=True)
    ddpx.all_reduce(big, average=True)
"""

LIGHTNING_JOB = f"""
from datetime import timedelta
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
import ddpx


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 8)

    def training_step(self, batch, step):
        if step == 3:
            print("READY", flush=True)
        return self.net(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.TensorDataset(torch.randn(4096, 64))
trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=1000, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False,
                    strategy=DDPStrategy(process_group_backend="ddpx",
                                         timeout=timedelta(seconds={TIMEOUT_S})),
                    callbacks=[ddpx.lightning.FusedHook()])
trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))
"""

TRAINER_JOB = f"""
from datetime import timedelta
import torch, torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments
import ddpx

dist.init_process_group("ddpx", timeout=timedelta(seconds={TIMEOUT_S}))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(64, 8)

    def forward(self, x, labels=None):
        return {{"loss": self.net(x).square().mean()}}


class Ready(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 3:
            print("READY", flush=True)


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        return {{"x": torch.randn(64)}}


trainer = Trainer(model=Net(), train_dataset=Rows(), callbacks=[Ready()],
                  args=TrainingArguments(output_dir="out", use_cpu=True, max_steps=1000,
                                         per_device_train_batch_size=8, report_to=[],
                                         save_strategy="no", logging_strategy="no",
                                         dataloader_num_workers=0))
trainer.add_callback(ddpx.transformers.FusedHook(trainer))
trainer.train()
"""


def _torchrun(job: str, tmp_path) -> list[str]:
    (tmp_path / "job.py").write_text(job)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", "--monitor-interval=1", str(tmp_path / "job.py")]


def _script(tmp_path) -> list[str]:
    # Through tmp_path, so that the ranks' command lines name it (how the test finds them).
    folder_with_scripts(tmp_path)
    return ["accelerate", "launch", "--config_file", str(REPO / "scripts/configs/cpu.yaml"),
            str(tmp_path / "scripts/basic.py"), "--backend", "ddpx", "--timeout", str(TIMEOUT_S),
            "--steps", "100000", "--log_every", "5"]


# How to launch each entry point, and the line its ranks print once they train.
ENTRY_POINTS = {
    "hook": (lambda tmp_path: _torchrun(HOOK_JOB, tmp_path), "READY"),
    "script": (_script, "step    5"),
    "lightning": (lambda tmp_path: _torchrun(LIGHTNING_JOB, tmp_path), "READY"),
    "shared-blocks": (lambda tmp_path: _torchrun(SHARED_BLOCKS_JOB, tmp_path), "READY"),
    "trainer": (lambda tmp_path: _torchrun(TRAINER_JOB, tmp_path), "READY"),
}
NEEDS = {"lightning": "lightning", "trainer": "transformers"}


def _rank_process(marker: str, rank: int) -> int | None:
    for pid in job_processes(marker):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    return None


# Lightning's and the Trainer's own timeouts reaching ddpx: -m slow (11-12 s each); the hook on a
# ddpx-backend group too, which the script's launch (--backend ddpx, its hook) shows by default.
@pytest.mark.parametrize("entry", [pytest.param(entry, marks=pytest.mark.slow)
                                   if entry in ("lightning", "trainer", "hook") else entry
                                   for entry in sorted(ENTRY_POINTS)])
def test_a_stopped_peer_raises_within_the_groups_timeout(entry, tmp_path):
    if entry in NEEDS:
        pytest.importorskip(NEEDS[entry])
    launch, ready = ENTRY_POINTS[entry]
    marker = str(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(launch(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=tmp_path, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        # Generous bounds: start-up (Lightning and transformers import for seconds per rank) on
        # a busy machine. What is checked is that rank 0 raises and exits in about the group's
        # timeout, where torch's default would hold it for 30 minutes.
        deadline = time.monotonic() + 180
        while not any(ready in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        stopped = _rank_process(marker, 1)
        assert stopped is not None, "".join(lines)
        os.kill(stopped, signal.SIGSTOP)
        # Rank 0's error, then its exit. The launcher would then wait out its grace period for
        # the stopped rank, which only SIGKILL ends: the test ends the job there instead.
        deadline = time.monotonic() + 120
        while not any("timed out after" in line for line in lines) or _rank_process(marker, 0):
            assert time.monotonic() < deadline, (
                f"rank 0 outlived the group's {TIMEOUT_S} s timeout:\n{''.join(lines)}")
            time.sleep(0.1)
    finally:
        kill_job(proc, marker)
    reader.join(timeout=10)
    out = "".join(lines)
    timed_out = re.findall(r"rank 0 timed out after (\S+) s waiting for rank\(s\) 1\b", out)
    assert timed_out and float(timed_out[0]) == TIMEOUT_S, out
    assert not job_processes(marker)
