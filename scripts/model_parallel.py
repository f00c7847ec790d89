"""basic.py with the model split over two devices per process: DDP over model parallelism.

ToyMpModel keeps net1 on one device and net2 on another; DDP then averages the gradients of both
halves across processes. `accelerator.prepare` cannot wrap such a model (it moves the model to one
device and gives DDP that one device id), so this script wraps it in DDP itself, with
device_ids=None, and uses Accelerate only to launch, to know its rank, and to print.
On GPUs, the process of local rank r uses cuda:2r and cuda:2r+1: launch half as many processes
as GPUs. On CPU both halves live on "cpu" (the split is then only in the code).

Launch from the repository root:

    python scripts/model_parallel.py            # 1 process: no DDP
    torchrun --nproc_per_node 2 scripts/model_parallel.py
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/model_parallel.py
    accelerate launch --config_file scripts/configs/cpu.yaml --num_processes 4 \
        scripts/model_parallel.py
    accelerate launch --config_file scripts/configs/gpu.yaml --num_processes 2 \
        scripts/model_parallel.py               # 4 GPUs
"""

import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ddpx.models import ToyMpModel
from ddpx.training import (
    attach_comm_hook,
    make_accelerator,
    make_parser,
    random_batch,
    run_summary,
    shutdown,
)


def split_devices(accelerator):
    """The two devices of this process; exits with the reason when the GPUs are too few."""
    if accelerator.device.type == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() < 2 * local_processes:
        raise SystemExit(
            f"model_parallel.py needs 2 GPUs per process: {local_processes} process(es) on "
            f"this machine need {2 * local_processes} GPUs, and it has "
            f"{torch.cuda.device_count()}. Launch {torch.cuda.device_count() // 2 or 'no'} "
            "process(es) per machine, or add --cpu."
        )
    first = 2 * accelerator.local_process_index
    return torch.device("cuda", first), torch.device("cuda", first + 1)


def train(accelerator, args):
    dev0, dev1 = split_devices(accelerator)
    model = ToyMpModel(dev0, dev1)
    if accelerator.use_distributed:
        model = DistributedDataParallel(model, device_ids=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    comm_path = attach_comm_hook(model, args.comm_hook)
    accelerator.print(run_summary(accelerator))
    accelerator.print(f"model split: net1 on {dev0}, net2 on {dev1} (rank 0)")
    accelerator.print(f"comm path: {comm_path}")

    for step in range(args.steps):
        inputs, labels = random_batch(args.seed, accelerator.process_index, step, args.batch_size)
        loss = F.mse_loss(model(inputs), labels.to(dev1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            mean_loss = accelerator.reduce(loss.detach(), "mean").item()
            accelerator.print(f"step {step:4d}  loss {mean_loss:.6f}")
    accelerator.print(f"final loss {mean_loss:.6f}")


def main():
    args = make_parser(__doc__).parse_args()
    accelerator = make_accelerator(args)
    train(accelerator, args)
    shutdown(accelerator)


if __name__ == "__main__":
    main()
