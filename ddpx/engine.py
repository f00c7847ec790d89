"""Which engine reduces a process group's tensors, and ``ddpx.all_reduce``, its public call.

One engine per process group and device type, made collectively the first time the group is used
(ddpx/_setup.py): CPU tensors go to the node's shared-memory engine, or to the process group's
all-reduce where shared memory cannot serve; CUDA tensors to the CUDA engine (csrc/cuda) where the
extension was built with its kernels, else to the process group's all-reduce too. Each engine
sends a sparse COO tensor to the process group's all-reduce itself (csrc/engine/engine.h).
"""

from __future__ import annotations

import atexit
import math
import numbers
import weakref
from datetime import timedelta

import torch
from torch.distributed.distributed_c10d import _world

from ddpx._ext import extension
from ddpx._groups import ddpx_backend, resolve_group
from ddpx._setup import create_cpu_engine
from ddpx._timeouts import group_with_timeout

__all__ = ["all_reduce", "checked_device", "checked_timeout", "engine_for", "flight_record",
           "wire_dtype", "wire_name"]

_COMPRESSION = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16,
                "bfloat16": torch.bfloat16, "float16": torch.float16,
                torch.bfloat16: torch.bfloat16, torch.float16: torch.float16,
                "int8": torch.int8, torch.int8: torch.int8,
                "int4": torch.int4, torch.int4: torch.int4}
# The block-scaled wires (int8 and int4 between nodes), which keep error feedback per bucket.
QUANTIZED = (torch.int8, torch.int4)

# group -> {device type -> engine}. Weak on the group: a destroyed process group must not be kept
# alive (with its threads) by ddpx until interpreter exit.
_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wire_dtype(compression: str | torch.dtype | None) -> torch.dtype | None:
    """The dtype gradients travel in for a ``compression`` setting (None: their own; int8, int4:
    block-scaled between nodes, the data's own within a node)."""
    if compression not in _COMPRESSION:
        raise ValueError(
            f"ddpx: compression={compression!r} is not one of None, 'bf16' ('bfloat16', "
            "torch.bfloat16), 'fp16' ('float16', torch.float16), 'int8' (torch.int8), 'int4' "
            "(torch.int4)"
        )
    return _COMPRESSION[compression]


def wire_name(wire: torch.dtype) -> str:
    """torch's name of a wire dtype, as a user writes it for ``compression`` ("int8")."""
    return str(wire).removeprefix("torch.")


def _all_reduce_wire(compression) -> torch.dtype | None:
    """``wire_dtype`` for ddpx.all_reduce, which has no int8 or int4: only the hook keeps the
    error feedback that they need."""
    wire = None if compression is None else wire_dtype(compression)
    if wire in QUANTIZED:
        raise ValueError(f"ddpx.all_reduce: compression='{wire_name(wire)}' needs error feedback, "
                         "which ddpx.register_fused_hook keeps per gradient bucket; all-reduce "
                         "with compression='bf16' here, or none")
    return wire


def checked_timeout(timeout, name: str = "timeout") -> timedelta | None:
    """``timeout`` as a timedelta: users pass seconds as a number or a timedelta; None (the
    group's own) stays None. Anything else, and a timeout of zero or less, is refused."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"ddpx: {name}={timeout!r} is neither a number of seconds nor a "
                        f"datetime.timedelta: pass {name}=60 or {name}=timedelta(minutes=1), or "
                        f"leave it out for the process group's own")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"ddpx: {name}={timeout!r} is not a positive time: every wait for a peer "
                         f"needs a bound above zero; leave it out for the process group's own")
    return timedelta(seconds=seconds)


def checked_device(device) -> str:
    """The device type a ``device`` argument names: "cpu" or "cuda" (a torch.device too)."""
    kind = device.type if isinstance(device, torch.device) else device
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"ddpx: device={device!r} is not 'cpu' or 'cuda': ddpx reduces the "
                         "buckets of CPU and CUDA models")
    return kind


def engine_for(group=None, device: str = "cpu", timeout: timedelta | None = None):
    """The engine that reduces ``device`` tensors over ``group`` (default: the world), made
    collectively by every rank of the group on first use; it sends sparse ones to ``group``."""
    timeout = checked_timeout(timeout)
    group = resolve_group(group)
    by_device = _engines.setdefault(group, {})
    if device not in by_device:
        if device == "cpu":
            by_device[device] = create_cpu_engine(group, timeout)
        elif device == "cuda" and extension().has_cuda_kernels:
            by_device[device] = extension().make_cuda_engine(
                group_with_timeout(group, device, timeout))
        else:
            by_device[device] = extension().make_process_group_engine(
                group, f"{device} tensors go through the process group's all-reduce")
        by_device[device].set_group(group.group_name)
        extension().publish_engine(group.group_name, device, by_device[device])
    return by_device[device]


def flight_record(group=None) -> str:
    """What every rank of this node in ``group`` (default: the world) was doing, as this rank
    reads it from the node's shared memory now: each rank's process state, the step it last
    published, what it waits for and since when, its queued jobs and its last calls (number,
    collective, size, dtype, state), newest first; then the rank(s) behind the others. The errors
    of a timeout or an abort carry the same record. Not collective: any rank may call it at any
    time, from any thread.

    It is the record of the engine of ddpx's backend on a group of it, and of the engine the hook
    and ``ddpx.all_reduce`` made for the group, where that is another.

    Example::
        >>> print(ddpx.flight_record())
    """
    group = resolve_group(group)
    backend = ddpx_backend(group)
    records = [backend.flight_record()] if backend is not None else []
    engine = _engines.get(group, {}).get("cpu")
    if engine is not None and (backend is None or engine is not backend.engine):
        records.append(("the hook's engine, beside the backend's:\n" if records else "")
                       + engine.flight_record())
    if not records:
        return ("ddpx: no flight record: no ddpx engine serves this group yet (make it with "
                "backend='ddpx', or reduce over it with the hook or ddpx.all_reduce)")
    return "\n".join(records)


@atexit.register
def _shutdown() -> None:
    """Stops the communication threads and drops the engines (and the groups they hold) while
    the interpreter is whole: gloo's threads must not outlive it."""
    for by_device in list(_engines.values()):
        for engine in by_device.values():
            engine.shutdown()
    _engines.clear()


def all_reduce(tensor: torch.Tensor, *, group=None, average: bool = False,
               compression: str | torch.dtype | None = None) -> torch.Tensor:
    """Sums ``tensor`` in place over ``group`` (averages with ``average=True``) and returns it.

    Blocking, and collective: every rank of the group calls it with the same size and dtype.
    float32, float64, bfloat16 and float16 are summed in float32 (float64 in float64), in rank
    order, so every rank gets the same bits; complex64 and complex128 as their real and imaginary
    parts. ``compression="bf16"`` or ``"fp16"`` sends float32 data in that dtype and still sums
    in float32 ("int8" and "int4" are the hook's alone: it keeps error feedback). A sparse COO
    tensor is summed by the process group (uncompressed), as torch.distributed.all_reduce would.
    Traced by torch.compile, the call is the operator torch.ops.ddpx.all_reduce_, in the graph,
    with the same bits.

    Example::
        >>> t = torch.full((4,), float(dist.get_rank()))
        >>> ddpx.all_reduce(t, average=True)
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"ddpx.all_reduce takes a torch.Tensor, got {type(tensor).__name__}")
    if average is not True and average is not False:
        raise TypeError(f"ddpx.all_reduce: average={average!r} is not True or False")
    if torch.compiler.is_compiling():
        name, scale = _operator_group(group, tensor.device.type, average)
        torch.ops.ddpx.all_reduce_(tensor, name, scale, _all_reduce_wire(compression))
        return tensor
    # The per-call path is two dictionary lookups: this is benchmarked at microsecond sizes.
    pg = group if group is not None else _world.default_pg
    # tensor.device builds a torch.device at every call (docs/design.md); is_cpu does not.
    device = "cpu" if tensor.is_cpu else tensor.device.type
    try:
        engine = _engines[pg][device]
    except (KeyError, TypeError):  # first use, or no group (None / a non-member's placeholder)
        engine = engine_for(group, device)
    scale = 1.0 / pg.size() if average else 1.0
    wire = None if compression is None else _all_reduce_wire(compression)
    engine.run(tensor, scale, wire, "ddpx.all_reduce")
    return tensor


def _operator_group(group, device: str, average: bool) -> tuple[str, float]:
    """torch.ops.ddpx.all_reduce_'s group name and scale for a call traced by torch.compile: run
    once, while tracing (on every rank, so the engine is made collectively), not in the graph."""
    engine_for(group, device)
    pg = resolve_group(group)
    return pg.group_name, 1.0 / pg.size() if average else 1.0


# What torch.compiler.assume_constant_result sets, and all it does: calling it would import
# torch._dynamo, which slows every rank's `import ddpx` (docs/design.md). torch marks its own
# functions so (torch/_dynamo/decorators.py), and tests/test_compile.py fails if the mark stops
# keeping the call out of the graph.
_operator_group._dynamo_marked_constant = True
