"""ddpx in Hugging Face transformers' Trainer (``pip install transformers``; not a dependency of
ddpx).

The Trainer's ``ddp_backend`` takes torch's own backends only, and Accelerate uses a process
group it finds already made: make the group on ddpx before the TrainingArguments, and every
collective of the job (DDP's all-reduces, the Trainer's gathers) runs on ddpx's backend:

    dist.init_process_group("ddpx")          # under torchrun / accelerate launch
    trainer = Trainer(model=model, args=TrainingArguments(..., use_cpu=True), ...)

The fused hook goes on the DDP model the Trainer wraps at train(), from a callback that is given
the trainer (the Trainer's callbacks see the unwrapped model only):

    trainer.add_callback(ddpx.transformers.FusedHook(trainer, compression="bf16"))
"""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from ddpx import _needs
from ddpx.engine import wire_dtype
from ddpx.hooks import register_fused_hook

with _needs("transformers"):
    from transformers import Trainer, TrainerCallback

__all__ = ["FusedHook"]


class FusedHook(TrainerCallback):
    """Registers ddpx's C++ communication hook (``register_fused_hook``) on the model ``trainer``
    wrapped in DDP, when training begins; ``compression`` as there. With one process (no DDP
    wrapper) there is nothing to register; a second train() keeps the first registration."""

    def __init__(self, trainer, compression: str | torch.dtype | None = None):
        if not isinstance(trainer, Trainer):
            raise TypeError(f"ddpx.transformers.FusedHook: trainer={type(trainer).__name__} is "
                            "not a transformers.Trainer: pass the Trainer whose model it hooks")
        wire_dtype(compression)  # a bad value raises here, not at train()
        self.trainer = trainer
        self.compression = compression
        self.state = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if isinstance(model, DistributedDataParallel) and self.state is None:
            self.state = register_fused_hook(model, compression=self.compression)
