"""ddpx: a fast, exact DDP communication path (shared-memory all-reduce between the ranks of a
node, fused scaling and compression, float32 accumulation)."""

import contextlib
import importlib

from ddpx import backend as _backend
from ddpx._ext import build_info
from ddpx.backend import backend_of
from ddpx.engine import all_reduce, flight_record
from ddpx.errors import record
from ddpx.hooks import FusedHookState, fused_allreduce_hook, register_fused_hook

__version__ = "0.1.0"

__all__ = [
    "FusedHookState",
    "all_reduce",
    "backend_of",
    "build_info",
    "flight_record",
    "fused_allreduce_hook",
    "record",
    "register_fused_hook",
]

_backend.register()

# Submodules that need libraries ddpx does not depend on, imported when first named
# (`ddpx.lightning.FusedHook` after `import ddpx`): how to install what each needs, and those
# libraries, which each imports inside `_needs` so that `from ddpx.lightning import ...` says it
# too.
_OPTIONAL = {
    "lightning": ("pip install lightning", "lightning"),
    "transformers": ("pip install transformers", "transformers"),
    "torchft": ("pip install torchft", "torchft"),
}


def __getattr__(name: str):
    if name not in _OPTIONAL:
        raise AttributeError(f"module 'ddpx' has no attribute {name!r}")
    return importlib.import_module(f"ddpx.{name}")


@contextlib.contextmanager
def _needs(module: str):
    """Around the imports of ddpx.`module` from the libraries _OPTIONAL names for it: one that is
    missing raises an error that names it and how to install it."""
    install, *libraries = _OPTIONAL[module]
    try:
        yield
    except ModuleNotFoundError as missing:
        library = (missing.name or "").partition(".")[0]
        if library not in libraries:
            raise
        raise ModuleNotFoundError(f"ddpx.{module} needs {library}, which is not installed: "
                                  f"{install}", name=missing.name) from None
