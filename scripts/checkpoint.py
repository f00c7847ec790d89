"""basic.py with checkpoints: one rank writes, every rank reads, a resumed run continues exactly.

A checkpoint is a plain dict: the model's state from the unwrapped model (keys without DDP's
"module." prefix, so it loads with or without DDP), the optimizer's state, the number of steps done
and the arguments. Rank 0 writes it to a temporary file and renames that over
output_dir/checkpoint.pt: os.replace is atomic, so a crash during a save leaves the previous
checkpoint whole. The other ranks wait for the write; then every rank can load it with
map_location set to its own device ("cpu" on CPU, not "cpu:N").

--use_accelerate_state saves with Accelerate's save_state instead, in output_dir/accelerate_state:
every rank calls it, and it writes model, optimizer, random states and the registered step counter
in place (a crash during a save can leave that folder half written).

Each step's batch is a function of (seed, rank, step) alone, so a resumed run sees the same data as
an uninterrupted one and ends with bit-identical weights: compare the "parameter digest" lines.

Launch from the repository root (every launch of basic.py works here too):

    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py \\
        --output_dir /tmp/ddpx_ckpt --steps 50 --checkpointing_steps 25
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py \\
        --output_dir /tmp/ddpx_ckpt --steps 100 --resume_from_checkpoint latest
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py \\
        --output_dir /tmp/ddpx_whole --steps 100         # uninterrupted: the same final digest
"""

import hashlib
import os

import torch
import torch.nn.functional as F

from ddpx.models import ToyModel
from ddpx.training import (
    attach_comm_hook,
    make_accelerator,
    make_parser,
    random_batch,
    run_summary,
    shutdown,
)

CHECKPOINT = "checkpoint.pt"
ACCELERATE_STATE = "accelerate_state"


class Progress:
    """Steps done; registered with Accelerate, so save_state/load_state keep it with the model."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def save_checkpoint(accelerator, model, optimizer, progress, args):
    """Save the run after `progress.step` steps; every rank returns once it is on disk."""
    if args.use_accelerate_state:
        accelerator.save_state(os.path.join(args.output_dir, ACCELERATE_STATE))
    elif accelerator.is_main_process:
        checkpoint = {
            "model": accelerator.unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "step": progress.step,
            "args": vars(args),
        }
        path = os.path.join(args.output_dir, CHECKPOINT)
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(checkpoint, path + ".tmp")
        os.replace(path + ".tmp", path)
    accelerator.wait_for_everyone()


def load_checkpoint(accelerator, model, optimizer, progress, args):
    """Restore model, optimizer and progress on every rank; returns the path loaded."""
    path = args.resume_from_checkpoint
    if path == "latest":
        name = ACCELERATE_STATE if args.use_accelerate_state else CHECKPOINT
        path = os.path.join(args.output_dir, name)
    if args.use_accelerate_state:
        accelerator.load_state(path)
    else:
        # torch.load cannot map to "cpu:N", which is what accelerator.device is on CPU ranks.
        map_location = "cpu" if accelerator.device.type == "cpu" else accelerator.device
        checkpoint = torch.load(path, map_location=map_location)
        accelerator.unwrap_model(model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        progress.step = checkpoint["step"]
    return path


def parameter_digest(model):
    """A digest of the parameters' bits: equal digests mean bit-identical weights."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def train(accelerator, args):
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    comm_path = attach_comm_hook(model, args.comm_hook)
    accelerator.print(run_summary(accelerator))
    accelerator.print(f"comm path: {comm_path}")

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume_from_checkpoint:
        path = load_checkpoint(accelerator, model, optimizer, progress, args)
        accelerator.print(f"resumed from {path} after step {progress.step}")

    mean_loss = float("nan")  # stays nan when the checkpoint had no steps left to run
    for step in range(progress.step, args.steps):
        inputs, labels = random_batch(args.seed, accelerator.process_index, step, args.batch_size)
        loss = F.mse_loss(model(inputs.to(accelerator.device)), labels.to(accelerator.device))
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            mean_loss = accelerator.reduce(loss.detach(), "mean").item()
            accelerator.print(f"step {step:4d}  loss {mean_loss:.6f}")
        progress.step = step + 1
        if args.checkpointing_steps and progress.step % args.checkpointing_steps == 0:
            save_checkpoint(accelerator, model, optimizer, progress, args)
            accelerator.print(f"saved checkpoint after step {progress.step}")
    accelerator.print(f"final loss {mean_loss:.6f}")
    accelerator.print(f"parameter digest {parameter_digest(model)}")


def main():
    parser = make_parser(__doc__)
    parser.add_argument("--output_dir", default="checkpoints", help="where checkpoints go")
    parser.add_argument("--checkpointing_steps", type=int, default=0,
                        help="save every N steps (0: never)")
    parser.add_argument("--resume_from_checkpoint",
                        help='a checkpoint path, or "latest": the one in --output_dir')
    parser.add_argument("--use_accelerate_state", action="store_true",
                        help="save and load with Accelerate's save_state/load_state")
    args = parser.parse_args()
    accelerator = make_accelerator(args)
    train(accelerator, args)
    shutdown(accelerator)


if __name__ == "__main__":
    main()
