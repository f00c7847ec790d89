"""Data-parallel training with DDP, gradients all-reduced by ddpx.

Every rank trains the same ToyModel on its own random batches; DDP averages the gradients across
ranks, so all ranks take the same step and keep the same weights. The printed loss is the mean over
ranks.

Launch from the repository root:

    python scripts/basic.py                     # 1 process
    accelerate launch scripts/basic.py          # 1 process without GPUs (its first line says so)
    accelerate launch --multi_gpu --num_processes 2 scripts/basic.py   # 2 CPU processes, no config
    torchrun --nproc_per_node 2 scripts/basic.py
    accelerate launch --config_file scripts/configs/cpu.yaml scripts/basic.py    # 2 CPU processes
    accelerate launch --config_file scripts/configs/cpu.yaml --num_processes 4 scripts/basic.py
    accelerate launch --config_file scripts/configs/gpu.yaml --num_processes 2 scripts/basic.py

Add --comm_hook default (DDP's own all-reduce) or --comm_hook fp16 (torch's fp16 compression hook)
to compare. With one process, Accelerate does not wrap the model in DDP: there is nothing to
exchange, no hook is registered, and the script says so in its "comm path" line. Should a rank
fail under torchrun or accelerate launch, the launcher's report quotes its error as the root cause.
"""

import torch

from ddpx import record

from common import ToyModel, ToyTask, attach_comm_hook, make_accelerator, make_parser, shutdown


def train(accelerator, args):
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    attach_comm_hook(accelerator, model, args.comm_hook)

    task = ToyTask(accelerator, args)
    for step in range(args.steps):
        loss = task.loss(model, step)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        task.log(step, loss)
    accelerator.print(f"final loss {task.last_loss:.6f}")


@record  # so that the launcher's failure report quotes the first failed rank's error
def main():
    args = make_parser(__doc__).parse_args()
    accelerator = make_accelerator(args)
    train(accelerator, args)
    shutdown(accelerator)


if __name__ == "__main__":
    main()
