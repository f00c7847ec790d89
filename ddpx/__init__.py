"""ddpx: a fast, exact DDP communication path (shared-memory all-reduce between the ranks of a
node, fused scaling and compression, float32 accumulation) and the DDP examples that use it."""

from ddpx import backend as _backend
from ddpx._ext import build_info
from ddpx.backend import backend_of
from ddpx.engine import all_reduce
from ddpx.hooks import FusedHookState, fused_allreduce_hook, register_fused_hook

__version__ = "0.1.0"

__all__ = [
    "FusedHookState",
    "all_reduce",
    "backend_of",
    "build_info",
    "fused_allreduce_hook",
    "register_fused_hook",
]

_backend.register()
