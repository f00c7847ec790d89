"""Loads the extension ddpx._C: the one pip built, or, when it is missing or was built for another
torch, a build made once at first use with torch.utils.cpp_extension and cached on disk (with the
CUDA kernels where setup.py would compile them)."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from ddpx import settings
from ddpx._buildspec import CPP_SOURCES, plan, static_libstdcxx

logger = logging.getLogger("ddpx")

_module: ModuleType | None = None
_how: str | None = None
# Where this ddpx was imported from (a checkout in the working directory can come before the
# installed one): said whenever its ddpx._C is missing.
_PACKAGE = Path(__file__).resolve().parent


def _source_dir() -> Path:
    for candidate in (_PACKAGE / "csrc", _PACKAGE.parent / "csrc"):
        if all((candidate / name).is_file() for name in CPP_SOURCES):
            return candidate
    raise ImportError(
        f"ddpx: the extension ddpx._C is not built in {_PACKAGE} and its C++ sources are not "
        "installed either; reinstall ddpx with `pip install .` from a source checkout"
    )


def _cache_dir(sources: list[Path], flags: list[str]) -> Path:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    for header in sorted(sources[0].parent.rglob("*.h")):
        digest.update(header.read_bytes())
    digest.update(" ".join(flags).encode())
    root = Path(settings.value("DDPX_CACHE_DIR")).expanduser()
    return root / f"torch-{torch.__version__}-{digest.hexdigest()[:16]}"


def _build(reason: str) -> ModuleType:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise ImportError(
            f"ddpx: {reason}, and building it needs a C++17 compiler, but `{compiler}` is not on "
            "PATH: install one (Debian/Ubuntu: apt-get install g++; Fedora: dnf install gcc-c++) "
            "or set CXX"
        )
    if shutil.which("ninja") is None:
        raise ImportError(f"ddpx: {reason}, and building it needs ninja: pip install ninja")
    source_dir = _source_dir()
    build = plan(torch.__version__, torch.version.cuda, cpp_extension.CUDA_HOME,
                 os.path.dirname(torch.__file__))
    sources = [source_dir / name for name in build["sources"]]
    flags, cuda_flags = build["cxx"], build["nvcc"] or []
    if build["cuda_home"] is not None:
        # The build's include and library paths and its nvcc all come from this global.
        cpp_extension.CUDA_HOME = build["cuda_home"]
    build_dir = _cache_dir(sources, flags + cuda_flags)
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("ddpx_C*.so")):
        logger.warning("ddpx: %s; building it once into %s", reason, build_dir)
    return cpp_extension.load(
        name="ddpx_C",
        sources=[str(s) for s in sources],
        extra_cflags=flags,
        extra_cuda_cflags=cuda_flags,
        build_directory=str(build_dir),
        verbose=False,
    )


def extension() -> ModuleType:
    """The loaded ddpx._C module, building it on first use if needed."""
    global _module, _how
    if _module is not None:
        return _module
    try:
        from ddpx import _C
    except ImportError as error:
        _C, reason = None, f"ddpx._C is not built in {_PACKAGE} ({error})"
    if _C is not None and _C.torch_version != torch.__version__:
        _C, reason = None, (f"ddpx._C was built for torch {_C.torch_version}, "
                            f"this is torch {torch.__version__}")
    module, how = (_C, "prebuilt") if _C is not None else (_build(reason), "jit")
    why = static_libstdcxx(module.__file__)
    if why:
        raise ImportError(why)
    _module, _how = module, how
    return _module


def build_info() -> dict:
    """How the extension was loaded and what it was built with.

    Keys: ``loaded`` ("prebuilt" or "jit"), ``path``, ``torch_version`` (the torch it was built
    against), ``cuda`` (whether CUDA kernels are compiled in) and ``cpu_isa`` (the vector kernels
    chosen for this CPU at run time).
    """
    module = extension()
    return {
        "loaded": _how,
        "path": module.__file__,
        "torch_version": module.torch_version,
        "cuda": bool(module.has_cuda_kernels),
        "cpu_isa": module.kernel_isa(),
    }
