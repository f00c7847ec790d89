"""What the example scripts share: the toy models and task, flags, the Accelerator, the comm
hook, and a clean exit. Each script imports it from beside itself (scripts/), so it is not part of
the installed ddpx: run the scripts from a checkout.
"""

import argparse
import gc
import os
import shlex
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel

import ddpx

try:
    import numpy as np
    from accelerate import Accelerator, InitProcessGroupKwargs
except ModuleNotFoundError as missing:
    # ddpx itself needs neither: say which extra brings them, not only which module is missing.
    if (missing.name or "").partition(".")[0] not in ("accelerate", "numpy"):
        raise
    raise ModuleNotFoundError(f"the example scripts need {missing.name}, which is not installed: "
                              'pip install "ddpx[examples]"', name=missing.name) from None

__all__ = [
    "ToyModel",
    "ToyMpModel",
    "ToyTask",
    "attach_comm_hook",
    "make_accelerator",
    "make_parser",
    "random_batch",
    "shutdown",
    "whole_lines",
]

COMM_HOOKS = ("ddpx", "ddpx-bf16", "ddpx-fp16", "ddpx-int8", "ddpx-int4", "default", "fp16")
BACKENDS = ("auto", "ddpx")
# How long a rank that fails without printing waits to be stopped by its launcher (seconds).
_SILENT_FAILURE_WAIT_S = 60


class ToyModel(nn.Module):
    """Linear(10, 10) -> ReLU -> Linear(10, 5): (batch, 10) -> (batch, 5)."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class ToyMpModel(ToyModel):
    """ToyModel split over two devices: net1 on `dev0`, net2 and the output on `dev1`."""

    def __init__(self, dev0: torch.device | str, dev1: torch.device | str):
        super().__init__()
        self.dev0, self.dev1 = torch.device(dev0), torch.device(dev1)
        self.net1.to(self.dev0)
        self.net2.to(self.dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.net1(x.to(self.dev0)))
        return self.net2(x.to(self.dev1))


class _OncePerMachineParser(argparse.ArgumentParser):
    """An ArgumentParser that prints usage, help and errors on each machine's first rank only.

    Every rank of a launch parses the same command line to the same verdict: printed by every
    rank, an error or the whole --help appeared once per rank. The other ranks exit with the
    first one's status, silently. Once per machine, as accelerator.print: each machine's
    launcher has a terminal of its own.
    """

    def print_usage(self, file=None):
        if _first_local_rank():
            super().print_usage(file)

    def print_help(self, file=None):
        if _first_local_rank():
            super().print_help(file)

    def exit(self, status=0, message=None):
        if _first_local_rank():
            super().exit(status, message)
        if status:
            # torchrun stops every rank as soon as one fails, so a silent rank that failed first
            # could get the printing one stopped before it printed. This one waits instead: the
            # printing rank fails, and the launcher stops this one (the limit ends the wait
            # under a launcher that stops no one).
            time.sleep(_SILENT_FAILURE_WAIT_S)
        super().exit(status)


def _first_local_rank() -> bool:
    # Read from the launcher's environment: flags are parsed before any process group exists.
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def make_parser(description: str, steps: int = 100) -> argparse.ArgumentParser:
    """A parser with the flags all scripts share; scripts add their own.

    `description` (the script's docstring, its launch manual) keeps its line breaks, and what
    the parser prints (usage, --help, errors, `parser.exit(status, message)`) appears once per
    machine, not once per rank.
    """
    parser = _OncePerMachineParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=steps, help="training steps")
    parser.add_argument(
        "--comm_hook", choices=COMM_HOOKS, default="ddpx",
        help="who all-reduces the gradients: ddpx's fused hook (-bf16, -fp16: that wire, float32 "
             "accumulation; -int8, -int4: 8- or 4-bit integers between nodes, with error "
             "feedback), DDP's default "
             "all-reduce, or torch's fp16 compression hook"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--batch_size", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--log_every", type=int, default=10, help="print the loss every N steps")
    parser.add_argument("--cpu", action="store_true", help="train on CPU even with CUDA")
    parser.add_argument(
        "--backend", choices=BACKENDS, default="auto",
        help="the process group's backend: Accelerate's choice (gloo on CPU, NCCL on GPUs), or "
             "ddpx's for CPU tensors (with NCCL for CUDA tensors), which every collective of "
             "the job then uses")
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="SECONDS",
        help="how long a rank waits for a stopped or dead peer before it raises (the process "
             "group's timeout; default: torch's, 30 minutes)")
    return parser


def make_accelerator(args: argparse.Namespace) -> Accelerator:
    """The Accelerator of this process; seeds torch with --seed so all ranks build the same weights.

    `cpu=True` without CUDA matters: under a multi-process launcher, a plain `Accelerator()` on a
    machine without GPUs initializes no process group and every process trains alone (world size 1).
    A CPU process that no launcher started as a rank says so first, with the command of two.
    """
    whole_lines(sys.stdout)
    torch.manual_seed(args.seed)
    cpu = args.cpu or not torch.cuda.is_available()
    if cpu and "WORLD_SIZE" not in os.environ:
        print(_one_process_line())
    # Accelerate takes no backend of its own on CPU (InitProcessGroupKwargs(backend="ddpx") is
    # refused as "not available"), and uses the process group it finds initialized.
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    timeout = {} if args.timeout is None else {"timeout": timedelta(seconds=args.timeout)}
    if args.backend == "ddpx" and launched and not dist.is_initialized():
        dist.init_process_group("ddpx" if cpu else "cpu:ddpx,cuda:nccl", **timeout)
    return Accelerator(cpu=cpu, kwargs_handlers=[InitProcessGroupKwargs(**timeout)])


def whole_lines(stream) -> None:
    """Make `stream` write each line in one write(), so the lines of ranks sharing it never mix.

    Ranks share the launcher's stdout. Unbuffered (PYTHONUNBUFFERED=1, as in many containers and
    CI runners), print() writes its text and its newline apart, and another rank's line can land
    between them: "parameter digest 1f..rank 1: loaded...". Line buffering holds a line until its
    newline and writes it whole, and a write of a line is atomic on a pipe.
    """
    stream.reconfigure(line_buffering=True, write_through=False)


def attach_comm_hook(accelerator: Accelerator, model: torch.nn.Module, name: str,
                     *details: str) -> "ddpx.FusedHookState | None":
    """Register the comm hook `name` (one of COMM_HOOKS) on a DDP model, and print the run: its
    world size, backend and device, the lines `details`, and the communication path in use.
    Returns ddpx's hook state (whose state_dict a checkpoint keeps), or None for other hooks.

    A model that is not wrapped in DDP (one process: Accelerate does not wrap it) exchanges no
    gradients and gets no hook.
    """
    backend = dist.get_backend() if dist.is_initialized() else "none"
    accelerator.print(f"world size {accelerator.num_processes}, backend {backend}, "
                      f"device {accelerator.device}")
    for line in details:
        accelerator.print(line)
    path, state = _hooked(model, name)
    accelerator.print(f"comm path: {path}")
    return state


def _hooked(model: torch.nn.Module, name: str) -> tuple[str, "ddpx.FusedHookState | None"]:
    """Registers the comm hook `name` on `model`; returns what then exchanges its gradients, and
    ddpx's hook state where it is ddpx's."""
    if not isinstance(model, DistributedDataParallel):
        return "none (1 process: no DDP wrapper, no gradients to exchange)", None
    if name.startswith("ddpx"):
        compression = name.partition("-")[2] or None
        state = ddpx.register_fused_hook(model, compression=compression)
        return state.describe(), state
    if name == "fp16":
        model.register_comm_hook(None, fp16_compress_hook)
        return "torch fp16_compress_hook", None
    backend = dist.get_backend()
    if "ddpx" not in backend:
        return f"DDP default all-reduce ({backend})", None
    path = ddpx.backend_of().describe()
    return f"DDP default all-reduce ({backend}: {path})", None


def _one_process_line() -> str:
    """One line: this process runs alone, why, and this command line on two CPU processes.

    Without a config file, `accelerate launch` on a machine without GPUs starts one process and
    drops --num_processes without a word: a user who asked for ranks would train alone unaware.
    """
    how = ("`accelerate launch` without --multi_gpu or a config file starts one on a machine "
           "without GPUs, whatever --num_processes says"
           if "ACCELERATE_USE_CPU" in os.environ else "no launcher")
    two = ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", *sys.argv]
    return f"ddpx: 1 process ({how}); 2 processes: {shlex.join(two)}"


def random_batch(
    seed: int, rank: int, step: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, labels) of one rank at one step, on CPU: a function of (seed, rank, step) alone.

    Every rank gets different data, and step k's batch is the same whether or not the run resumed
    from a checkpoint. The labels are a fixed linear function of the inputs, so the loss can fall.
    """
    rng = np.random.default_rng([seed, rank, step])
    inputs = torch.from_numpy(rng.standard_normal((batch_size, 10), dtype=np.float32))
    return inputs, inputs[:, :5] - 0.5 * inputs[:, 5:]


class ToyTask:
    """What the toy models learn: each rank's random_batch of a step, the MSE loss, and the loss
    averaged over ranks, printed every --log_every steps and at the last one."""

    def __init__(self, accelerator: Accelerator, args: argparse.Namespace):
        self.accelerator, self.args = accelerator, args
        self.last_loss = float("nan")  # the last one printed

    def loss(self, model: torch.nn.Module, step: int) -> torch.Tensor:
        """`model`'s loss on this rank's batch of `step`: the inputs go where the model's first
        parameters are, the labels where its outputs come out (net2's device, for ToyMpModel)."""
        args = self.args
        inputs, labels = random_batch(args.seed, self.accelerator.process_index, step,
                                      args.batch_size)
        outputs = model(inputs.to(next(model.parameters()).device))
        return F.mse_loss(outputs, labels.to(outputs.device))

    def log(self, step: int, loss: torch.Tensor) -> None:
        if step % self.args.log_every == 0 or step == self.args.steps - 1:
            self.last_loss = self.accelerator.reduce(loss.detach(), "mean").item()
            self.accelerator.print(f"step {step:4d}  loss {self.last_loss:.6f}")


def shutdown(accelerator: Accelerator) -> None:
    """Tear down in the order that lets gloo exit cleanly.

    Call it after the model and optimizer went out of scope: once all ranks are done, Accelerate's
    references go, the garbage collector frees the DDP reducer (and the hook on it), and only then
    is the process group destroyed. A process group still alive at interpreter exit can abort
    with "terminate called without an active exception".
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()
