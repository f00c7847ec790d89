"""basic.py with checkpoints: one rank writes, every rank reads, a resumed run continues exactly.

By default a run does DDP's checkpoint cycle halfway through training: rank 0 saves, every rank
waits, every rank loads the checkpoint with its own map_location into its model and checks (and
prints) that the loaded weights are the ones saved, and training goes on. The checkpoint goes to a
temporary directory, removed at the end; --output_dir keeps it there instead (across machines,
give a directory every machine sees). --checkpointing_steps N repeats the cycle every N steps
(0: never).

A checkpoint is a plain dict: the model's state from the unwrapped model (keys without DDP's
"module." prefix, so it loads with or without DDP), the optimizer's state, the number of steps done
and the arguments. Rank 0 writes it to a temporary file and renames that over
output_dir/checkpoint.pt: os.replace is atomic, so a crash during a save leaves the previous
checkpoint whole. The other ranks wait for the write; then every rank can load it with
map_location set to its own device ("cpu" on CPU, not "cpu:N").

With --comm_hook ddpx-int8 (or ddpx-int4) each rank also saves its hook state (what the roundings
have not sent yet) as output_dir/hook_state_rank<N>.pt and loads its own back, so a resumed run goes
on with the same bits across machines too.

--use_accelerate_state saves with Accelerate's save_state instead, in output_dir/accelerate_state:
every rank calls it, and it writes model, optimizer, random states and the registered step counter
in place (a crash during a save can leave that folder half written).

Each step's batch is a function of (seed, rank, step) alone, so a resumed run sees the same data as
an uninterrupted one and ends with bit-identical weights: compare the "parameter digest" lines.

Launch from the repository root (every launch of basic.py works here too):

    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py \\
        --output_dir /tmp/ddpx_ckpt --steps 50 --checkpointing_steps 25
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py \\
        --output_dir /tmp/ddpx_ckpt --steps 100 --resume_from_checkpoint latest
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py \\
        --output_dir /tmp/ddpx_whole --steps 100         # uninterrupted: the same final digest

--resume_from_checkpoint auto resumes from the checkpoint in --output_dir if there is one, else
starts at step 0: a run that restarts itself after a lost rank, as torchrun's elastic restarts do,
resumes by itself (docs/recovery.md measures it):

    torchrun --nproc_per_node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint localhost:29500 scripts/checkpoint.py --backend ddpx \\
        --output_dir /tmp/ddpx_elastic --steps 3000 --checkpointing_steps 100 \\
        --resume_from_checkpoint auto
"""

import hashlib
import os
import shutil
import tempfile

import torch
from accelerate.utils import broadcast_object_list

from ddpx import record

from common import ToyModel, ToyTask, attach_comm_hook, make_accelerator, make_parser, shutdown

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


def hook_state_path(args, rank):
    return os.path.join(args.output_dir, f"hook_state_rank{rank}.pt")


def save_checkpoint(accelerator, model, optimizer, progress, hook, args):
    """Save the run after `progress.step` steps; every rank returns once it is on disk. ddpx's int8
    and int4 hooks keep each rank's residuals (what its roundings have not sent yet): every rank
    saves its own beside the checkpoint."""
    if hook is not None and hook.state_dict()["buckets"]:
        path = hook_state_path(args, accelerator.process_index)
        os.makedirs(args.output_dir, exist_ok=True)
        torch.save(hook.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)
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
    accelerator.print(f"saved checkpoint after step {progress.step}")
    accelerator.wait_for_everyone()


def latest_checkpoint(args):
    return os.path.join(args.output_dir,
                        ACCELERATE_STATE if args.use_accelerate_state else CHECKPOINT)


def checkpoint_to_resume(parser, args):
    """The checkpoint --resume_from_checkpoint names; exits, naming what it looked for, if none
    (auto: "", to start at step 0)."""
    if args.resume_from_checkpoint == "auto":
        path = latest_checkpoint(args)
        return path if os.path.exists(path) else ""
    if args.resume_from_checkpoint == "latest":
        path = latest_checkpoint(args)
        missing = f"no {os.path.basename(path)} in {args.output_dir}"
    else:
        path = args.resume_from_checkpoint
        saved = "folder of Accelerate's state" if args.use_accelerate_state else "checkpoint file"
        missing = f"no {saved} there"
    if not (os.path.isdir(path) if args.use_accelerate_state else os.path.isfile(path)):
        parser.exit(1, f"{parser.prog}: error: --resume_from_checkpoint "
                       f"{args.resume_from_checkpoint}: {missing}\n")
    return path


def load_checkpoint(accelerator, model, optimizer, progress, hook, args, path):
    """Restore model, optimizer, progress and this rank's hook state from `path` (and beside it)
    on every rank; returns how it loaded."""
    own = hook_state_path(args, accelerator.process_index)
    if hook is not None and os.path.exists(own):
        hook.load_state_dict(torch.load(own, map_location="cpu"))
    if args.use_accelerate_state:
        accelerator.load_state(path)
        return "Accelerate's load_state"
    # torch.load cannot map to "cpu:N", which is what accelerator.device is on CPU ranks.
    map_location = "cpu" if accelerator.device.type == "cpu" else accelerator.device
    checkpoint = torch.load(path, map_location=map_location)
    accelerator.unwrap_model(model).load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    progress.step = checkpoint["step"]
    return f"map_location={map_location}"


def reload_and_check(accelerator, model, optimizer, progress, hook, args):
    """After a save: every rank loads the checkpoint into its model and checks that the loaded
    weights are the saved ones, which are the weights it holds (DDP keeps every rank's equal)."""
    saved, step = parameter_digest(model), progress.step
    how = load_checkpoint(accelerator, model, optimizer, progress, hook, args,
                          latest_checkpoint(args))
    loaded = parameter_digest(model)
    if (loaded, progress.step) != (saved, step):
        raise RuntimeError(f"rank {accelerator.process_index}: the checkpoint loaded back holds "
                           f"step {progress.step}, digest {loaded}, not the saved step {step}, "
                           f"digest {saved}")
    print(f"rank {accelerator.process_index}: loaded the step-{step} checkpoint ({how}): "
          f"weights equal to the saved ones (digest {loaded})", flush=True)


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
    hook = attach_comm_hook(accelerator, model, args.comm_hook)

    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume_from_checkpoint:
        path = args.resume_from_checkpoint  # "latest" and "auto" became its path in main
        load_checkpoint(accelerator, model, optimizer, progress, hook, args, path)
        accelerator.print(f"resumed from {path} after step {progress.step}")
    elif args.resume_from_checkpoint is not None:
        accelerator.print(f"resumed from nothing after step 0: no checkpoint in {args.output_dir}")
    every = args.checkpointing_steps
    if every is None:
        every = max(1, args.steps // 2)

    task = ToyTask(accelerator, args)  # its last loss stays nan if the checkpoint had no steps left
    for step in range(progress.step, args.steps):
        loss = task.loss(model, step)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        task.log(step, loss)
        progress.step = step + 1
        if every and progress.step % every == 0:
            save_checkpoint(accelerator, model, optimizer, progress, hook, args)
            reload_and_check(accelerator, model, optimizer, progress, hook, args)
    accelerator.print(f"final loss {task.last_loss:.6f}")
    accelerator.print(f"parameter digest {parameter_digest(model)}")


@record  # so that the launcher's failure report quotes the first failed rank's error
def main():
    parser = make_parser(__doc__)
    parser.add_argument("--output_dir", help="where checkpoints go and stay (default: a "
                        "temporary directory, removed at the end)")
    parser.add_argument("--checkpointing_steps", type=int,
                        help="save, load back and check every N steps (default: half the steps; "
                        "0: never)")
    parser.add_argument("--resume_from_checkpoint",
                        help='a checkpoint path; "latest": the one in --output_dir; "auto": that '
                        "one if there is one, else start at step 0")
    parser.add_argument("--use_accelerate_state", action="store_true",
                        help="save and load with Accelerate's save_state/load_state")
    args = parser.parse_args()
    temporary = args.output_dir is None
    if temporary and args.resume_from_checkpoint in ("latest", "auto"):
        parser.error(f"--resume_from_checkpoint {args.resume_from_checkpoint} needs the "
                     "--output_dir it is in")
    if args.resume_from_checkpoint:
        # Checked before the process group exists: every rank stops here alike, no peer waits
        # for it and nothing needs tearing down (see shutdown).
        args.resume_from_checkpoint = checkpoint_to_resume(parser, args)
    accelerator = make_accelerator(args)
    if temporary:
        made = tempfile.mkdtemp(prefix="ddpx-checkpoint-") if accelerator.is_main_process else None
        args.output_dir = broadcast_object_list([made])[0]
    try:
        train(accelerator, args)
        accelerator.wait_for_everyone()  # every rank has read the last checkpoint
    finally:
        if temporary and accelerator.is_main_process:
            shutil.rmtree(args.output_dir, ignore_errors=True)
            print(f"removed the temporary checkpoint directory {args.output_dir}", flush=True)
    shutdown(accelerator)


if __name__ == "__main__":
    main()
