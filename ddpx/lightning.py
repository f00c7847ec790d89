"""ddpx in PyTorch Lightning (``pip install lightning``; not a dependency of ddpx).

Lightning's ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers a hook on CUDA models
only and drops it silently on CPU, so on CPU the fused hook comes as a callback:

    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                        callbacks=[ddpx.lightning.FusedHook(compression="bf16")])

On GPUs the strategy's own form works too, with a state made before any process group exists
(it binds to the group at the first bucket):

    DDPStrategy(ddp_comm_state=ddpx.FusedHookState(), ddp_comm_hook=ddpx.fused_allreduce_hook)

And every collective of the job on ddpx's backend: ``DDPStrategy(process_group_backend="ddpx")``.
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpx import _needs
from ddpx.engine import wire_dtype
from ddpx.hooks import register_fused_hook

with _needs("lightning"):
    from lightning.pytorch.callbacks import Callback

__all__ = ["FusedHook"]


class FusedHook(Callback):
    """Registers ddpx's C++ communication hook (``register_fused_hook``) on the model that the
    DDP strategy wrapped, before the first backward; ``compression`` as there. With one process
    (no DDP wrapper) there is nothing to register."""

    def __init__(self, compression: str | torch.dtype | None = None):
        wire_dtype(compression)  # a bad value raises here, not at fit()
        self.compression = compression
        self.state = None

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel) and self.state is None:
            self.state = register_fused_hook(model, compression=self.compression)
