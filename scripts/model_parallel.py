"""basic.py with the model split over two devices per process: DDP over model parallelism.

ToyMpModel keeps net1 on one device and net2 on another; DDP then averages the gradients of both
halves across processes. `accelerator.prepare` cannot wrap such a model (it moves the model to one
device and gives DDP that one device id), so this script wraps it in DDP itself, with
device_ids=None, whenever a launcher made a process group (one process too), and uses Accelerate
only to launch, to know its rank, and to print.
On GPUs, the process of local rank r uses cuda:2r and cuda:2r+1: launch half as many processes
as GPUs. On CPU both halves live on "cpu" (the split is then only in the code). --devices DEV0,DEV1
puts the halves of every process on those two devices instead: both on one GPU, or one on a GPU
and one on the CPU (for one process without a launcher only, as DDP takes no model that spans
device types).

Launch from the repository root:

    python scripts/model_parallel.py            # 1 process: no DDP
    torchrun --nproc_per_node 2 scripts/model_parallel.py
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/model_parallel.py
    accelerate launch --config_file scripts/configs/cpu.yaml --num_processes 4 \\
        scripts/model_parallel.py
    accelerate launch --config_file scripts/configs/gpu.yaml --num_processes 2 \\
        scripts/model_parallel.py               # 4 GPUs
    python scripts/model_parallel.py --devices cuda:0,cuda:0   # 1 GPU
    python scripts/model_parallel.py --devices cuda:0,cpu
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpx import record

from common import ToyMpModel, ToyTask, attach_comm_hook, make_accelerator, make_parser, shutdown


def named_devices(spec: str, distributed: bool) -> tuple[torch.device, torch.device]:
    """The two devices of --devices DEV0,DEV1; exits with the reason when they cannot serve."""
    names = spec.split(",")
    if len(names) != 2:
        raise SystemExit(f"--devices takes two devices, DEV0,DEV1 (e.g. cuda:0,cpu), got {spec!r}")
    try:
        devices = tuple(torch.device(name) for name in names)
    except RuntimeError as error:
        raise SystemExit(f"--devices {spec}: {error}") from None
    for device in devices:
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise SystemExit(f"--devices {spec}: there is no {device}, this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    if distributed and devices[0].type != devices[1].type:
        raise SystemExit(f"--devices {spec}: DDP takes no model that spans device types; with "
                         "several processes put both halves on one (e.g. cuda:0,cuda:0)")
    return devices


def split_devices(accelerator, devices: str | None):
    """The two devices of this process; exits with the reason when the GPUs are too few."""
    if devices is not None:
        return named_devices(devices, dist.is_initialized())
    if accelerator.device.type == "cpu":
        return torch.device("cpu"), torch.device("cpu")
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() < 2 * local_processes:
        raise SystemExit(
            f"model_parallel.py needs 2 GPUs per process: {local_processes} process(es) on "
            f"this machine need {2 * local_processes} GPUs, and it has "
            f"{torch.cuda.device_count()}. Launch {torch.cuda.device_count() // 2 or 'no'} "
            "process(es) per machine, add --cpu, or name the devices with --devices "
            "(e.g. cuda:0,cuda:0)."
        )
    first = 2 * accelerator.local_process_index
    return torch.device("cuda", first), torch.device("cuda", first + 1)


def train(accelerator, args):
    dev0, dev1 = split_devices(accelerator, args.devices)
    model = ToyMpModel(dev0, dev1)
    if dist.is_initialized():  # launched by torchrun or accelerate launch, one process too
        model = DistributedDataParallel(model, device_ids=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    attach_comm_hook(accelerator, model, args.comm_hook,
                     f"model split: net1 on {dev0}, net2 on {dev1} (rank 0)")

    task = ToyTask(accelerator, args)
    for step in range(args.steps):
        loss = task.loss(model, step)  # from net1's device, compared on net2's
        optimizer.zero_grad()
        loss.backward()  # not accelerator.backward: the model is not Accelerate's
        optimizer.step()
        task.log(step, loss)
    accelerator.print(f"final loss {task.last_loss:.6f}")


@record  # so that the launcher's failure report quotes the first failed rank's error
def main():
    parser = make_parser(__doc__)
    parser.add_argument("--devices", metavar="DEV0,DEV1",
                        help="the devices of net1 and net2 (e.g. cuda:0,cuda:0 or cuda:0,cpu)")
    args = parser.parse_args()
    accelerator = make_accelerator(args)
    train(accelerator, args)
    shutdown(accelerator)


if __name__ == "__main__":
    main()
