"""ddpx: a fast, exact DDP communication path (shared-memory all-reduce between the ranks of a
node, fused scaling and compression, float32 accumulation) and the DDP examples that use it."""

from ddpx import backend as _backend
from ddpx._ext import build_info
from ddpx.engine import all_reduce
from ddpx.hooks import FusedHookState, fused_allreduce_hook, register_fused_hook

__all__ = [
    "FusedHookState",
    "all_reduce",
    "build_info",
    "fused_allreduce_hook",
    "register_fused_hook",
]

_backend.register()
