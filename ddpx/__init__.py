"""ddpx: a fast, exact DDP communication path (shared-memory all-reduce between the ranks of a
node, fused scaling and compression, float32 accumulation) and the DDP examples that use it."""

import importlib

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

# Submodules that need a library ddpx does not depend on, imported when first named
# (`ddpx.lightning.FusedHook` after `import ddpx`): the name of what to install.
_NEEDS = {"lightning": "lightning", "transformers": "transformers", "training": "accelerate"}


def __getattr__(name: str):
    if name not in _NEEDS:
        raise AttributeError(f"module 'ddpx' has no attribute {name!r}")
    try:
        return importlib.import_module(f"ddpx.{name}")
    except ModuleNotFoundError as missing:
        if missing.name is None or missing.name.split(".")[0] != _NEEDS[name]:
            raise
        raise ModuleNotFoundError(
            f"ddpx.{name} needs {_NEEDS[name]}, which is not installed: pip install "
            f"{_NEEDS[name]}", name=missing.name) from None
