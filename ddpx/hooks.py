"""ddpx's DDP communication hook, in C++ (``register_fused_hook``) and as a Python hook with
PyTorch's signature (``fused_allreduce_hook``). Both hand the bucket to the same engine."""

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpx import settings
from ddpx._bucket_steps import BucketSteps, checked_optimizer
from ddpx._ext import extension
from ddpx._groups import ddpx_backend, resolve_group
from ddpx.engine import (
    QUANTIZED,
    checked_device,
    checked_timeout,
    engine_for,
    wire_dtype,
    wire_name,
)

__all__ = ["FusedHookState", "fused_allreduce_hook", "register_fused_hook"]


class FusedHookState:
    """What the fused hook needs: the engine of ``process_group`` (default: the world) for
    ``device`` buckets, the 1/world_size scale that makes DDP's sum an average, and the wire dtype
    of ``compression`` (None, "bf16" or "fp16"; "int8" or "int4" with register_fused_hook, which
    keeps their error feedback here). Made where torch.distributed is initialized, it binds to
    the group at once, collectively; made before (as PyTorch Lightning's
    ``DDPStrategy(ddp_comm_state=...)`` does), it binds at the first bucket, which every rank
    reduces in the same order.

    ``state_dict()`` and ``load_state_dict()`` carry int8's (int4's) error feedback through a
    checkpoint: each rank saves and loads its own."""

    __slots__ = ("_group", "compression", "device", "timeout", "wire", "_engine", "_moves_buckets",
                 "_feedback", "_optimizer")

    def __init__(self, process_group=None, compression: str | torch.dtype | None = None, *,
                 device: str = "cpu", timeout: timedelta | None = None):
        self.wire = wire_dtype(compression)
        self.compression = compression
        self.device, self.timeout = checked_device(device), checked_timeout(timeout)
        self._group, self._engine = process_group, None
        self._moves_buckets = False  # register_fused_hook's hook moves buckets into the arena
        self._feedback = None  # int8's or int4's residuals, per bucket (register_fused_hook)
        self._optimizer = ""  # register_fused_hook(optimizer=...): where it steps, in words
        if process_group is not None or (dist.is_available() and dist.is_initialized()):
            resolve_group(process_group, "process_group")
            self._engine = engine_for(process_group, self.device, self.timeout)

    @property
    def engine(self):
        if self._engine is None:
            self._engine = engine_for(self._group, self.device, self.timeout)
        return self._engine

    @property
    def process_group(self):
        return self._group if self._group is not None else dist.group.WORLD

    @property
    def scale(self) -> float:
        return 1.0 / self.process_group.size()

    def state_dict(self) -> dict:
        """This rank's hook state: int8's (int4's) residual of every bucket (what its roundings
        lost and the next step sends), with the bucket's layout. Call it between steps."""
        buckets = [] if self._feedback is None else [
            {"index": index, "parameters": layout, "residual": residual}
            for index, layout, residual in self._feedback.state()]
        return {"compression": self.wire, "rank": self.process_group.rank(),
                "world_size": self.process_group.size(), "buckets": buckets}

    def load_state_dict(self, state: dict) -> None:
        """Loads what ``state_dict()`` saved on this rank, before the next step."""
        group = self.process_group
        theirs = (state.get("rank"), state.get("world_size"))
        if theirs != (group.rank(), group.size()):
            raise ValueError(
                f"ddpx: this hook state is rank {theirs[0]}'s of {theirs[1]} ranks, and this is "
                f"rank {group.rank()} of {group.size()}: load the file this rank saved (each rank "
                "keeps its own residuals); on another world size, start without it")
        if state.get("compression") != self.wire:
            raise ValueError(
                f"ddpx: this hook state was saved with compression {state.get('compression')}, "
                f"the hook has {self.wire}: register the hook with the compression it was saved "
                "with, or start without the state")
        if self._feedback is not None:
            self._feedback.load([(b["index"], b["parameters"], b["residual"])
                                 for b in state["buckets"]])

    def describe(self, details: bool = False) -> str:
        """One line: which path reduces the buckets, their wire dtype, and whether they are
        zero-copy (and if not, why); ``details=True`` adds the engine's settings."""
        engine = self.engine
        wire = wire_name(self.wire) if self.wire is not None else "no compression"
        if self.wire in QUANTIZED:
            wire = f"{wire} between nodes with error feedback, uncompressed within a node"
        if isinstance(engine, extension().ShmEngine):
            nodes = f" and {engine.nodes} nodes" if engine.nodes > 1 else ""
            path = f"ddpx shared memory, {engine.local_ranks} ranks a node{nodes}"
        else:
            path = engine.describe()
        why_not = self._why_not_zero_copy()
        zero_copy = (f"zero-copy: no ({why_not})" if why_not else
                     f"zero-copy: yes ({engine.zero_copy_calls} calls so far)")
        line = f"{path}; {wire}; {zero_copy}{self._optimizer}"
        return f"{line}\n{engine.describe()}" if details else line

    def _why_not_zero_copy(self) -> str:
        """Why DDP's buckets are not reduced in place in ddpx's arena, or "" where they are."""
        engine = self.engine
        if not isinstance(engine, extension().ShmEngine):
            return "the buckets go through the process group"
        arena = extension().arena_usage()
        if not arena["usable"]:
            return arena["why_not"]
        if not settings.flag("DDPX_COMM_MEMORY"):
            return "DDPX_COMM_MEMORY=0"
        if self._moves_buckets:
            return ""
        if (ddpx_backend(self.process_group) is not None
                and os.environ.get("DDP_DISABLE_COMM_MEM") == "0"):
            return ""  # DDP allocates its buckets through the ddpx backend, in the arena
        return ("this Python hook reduces the buckets where DDP keeps them: "
                "ddpx.register_fused_hook moves them into the arena")


def fused_allreduce_hook(
    state: FusedHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket over ``state.process_group`` with ddpx's engine, in place: the
    1/world_size scale (and the cast, with compression) is fused into the copy to shared memory
    (CPU buckets) or into the collective and its kernels (CUDA buckets), and the sum is
    accumulated in float32. Returns at once; the future completes when the bucket is reduced.
    A sparse gradient's bucket goes where the engine sends every sparse tensor: to the process
    group's all-reduce, uncompressed.

    Example::
        >>> state = ddpx.FusedHookState(process_group=None)
        >>> ddp_model.register_comm_hook(state, ddpx.fused_allreduce_hook)
    """
    if state.wire in QUANTIZED:
        name = wire_name(state.wire)
        raise ValueError(f"ddpx: compression='{name}' keeps error feedback per gradient bucket, "
                         f"which ddpx.register_fused_hook(model, compression='{name}') registers; "
                         "this Python hook takes compression None, 'bf16' or 'fp16'")
    future = state.engine.run_async(bucket.buffer(), state.scale, state.wire,
                                    f"gradient bucket {bucket.index()}", dense_wire_only=True)
    # DDP's Python hook wrapper reads a Python object out of the future, not a C++ tensor.
    return future.then(lambda done: done.value())


def register_fused_hook(ddp_model: DistributedDataParallel, *, process_group=None,
                        compression: str | torch.dtype | None = None,
                        timeout: timedelta | None = None,
                        optimizer: torch.optim.Optimizer | None = None) -> FusedHookState:
    """Registers ddpx's C++ communication hook on ``ddp_model``: DDP passes each gradient bucket
    to it on the autograd thread, with no Python on that path. ``process_group`` defaults to the
    model's own; ``timeout`` (default: the group's) bounds every wait for a peer. A model takes
    one hook, once, before its first backward. ``compression``: None, "bf16" or "fp16" (the
    dtype every bucket travels in), or "int8" / "int4": block-scaled 8- or 4-bit integers between
    nodes (0.27 / 0.14 of float32's bytes), each rank keeping what the rounding lost and sending it
    with the next step (error feedback), the buckets summed uncompressed within a node.

    ``optimizer`` (CPU buckets): across nodes, steps each bucket's parameters once that bucket is
    reduced, in the time ddpx's engine waits for the link to bring the last bucket back; backward
    returns with every bucket stepped, and the loop's own ``optimizer.step()`` then steps only the
    parameters no bucket did, so the loop stays as it is. On one node, where there is no wait to
    fill, the loop's step does it all, as without it. For optimizers that update each parameter
    from its own gradient (SGD, Adam, AdamW, ...); not with anything that must see every gradient
    before the step (clipping by their total norm, a GradScaler): the step has happened by then.

    Example::
        >>> model = DistributedDataParallel(net)
        >>> state = ddpx.register_fused_hook(model)
        >>> print(state.describe())
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"ddpx.register_fused_hook takes a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; wrap it first (accelerator.prepare does)"
        )
    wire, timeout = wire_dtype(compression), checked_timeout(timeout)
    group = resolve_group(process_group if process_group is not None else ddp_model.process_group,
                          "process_group")
    devices = {p.device.type for p in ddp_model.parameters() if p.requires_grad}
    if len(devices) != 1:
        raise ValueError(f"ddpx: the model's trainable parameters are on {sorted(devices)}; "
                         "DDP buckets must all be on one device type")
    device = devices.pop()
    for name, parameter in _dense_gradients(ddp_model).items():  # a bucket has their dtype
        why = extension().invalid_input(torch.empty(0, dtype=parameter.dtype, device=device),
                                        wire, f"parameter {name}", device)
        if why:
            raise ValueError(why)
    optimizer = None if optimizer is None else checked_optimizer(optimizer, device)
    state = FusedHookState(group, compression, device=device, timeout=timeout)
    steps = None
    if optimizer is not None:
        ddpx_engine = isinstance(state.engine, extension().ShmEngine)
        if ddpx_engine and state.engine.nodes > 1:
            steps = BucketSteps(optimizer)
            state._optimizer = "; the optimizer steps each bucket in flight"
        else:
            why = "one node: no link to wait for" if ddpx_engine else "the process group's engine"
            state._optimizer = f"; the optimizer steps after backward ({why})"
    if wire in QUANTIZED:
        state._feedback = extension().ErrorFeedback(list(ddp_model.parameters()))
    extension().register_fused_hook(ddp_model.reducer, state.engine, state.scale, state.wire,
                                    into_arena=settings.flag("DDPX_COMM_MEMORY"),
                                    feedback=state._feedback, step=steps)
    state._moves_buckets = settings.flag("DDPX_COMM_MEMORY")
    ddp_model.logger._set_comm_hook_name("ddpx.register_fused_hook")
    return state


def _dense_gradients(ddp_model: DistributedDataParallel) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters whose gradients are dense: all but those of the embeddings with
    sparse=True, which DDP puts in buckets of their own (sparse buckets)."""
    sparse = {id(parameter) for module in ddp_model.module.modules()
              if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse
              for parameter in module.parameters(recurse=False)}
    return {name: parameter for name, parameter in ddp_model.module.named_parameters()
            if parameter.requires_grad and id(parameter) not in sparse}
