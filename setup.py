"""Builds ddpx and its extension ddpx._C against the torch that is installed.

    pip install --no-build-isolation -e .

Environment: DDPX_SKIP_CUDA=1 builds the C++ extension only; DEBUG=1 builds without optimisation.
"""

import os
import runpy
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    sys.exit(
        "ddpx: torch is not importable in this build environment. ddpx's extension must be compiled "
        "against the torch that will run it, so install torch first and build without isolation:\n"
        "    pip install torch==2.13.0 && pip install --no-build-isolation -e ."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = runpy.run_path(os.path.join(HERE, "ddpx", "_buildspec.py"))


def get_extensions():
    flags = SPEC["cxx_flags"](torch.__version__)
    if os.environ.get("DEBUG") == "1":
        flags = [f for f in flags if not f.startswith("-O")] + ["-O0", "-g"]
    sources = [os.path.join("csrc", name) for name in SPEC["CPP_SOURCES"]]
    return [CppExtension("ddpx._C", sources, extra_compile_args={"cxx": flags})]


setup(
    packages=["ddpx", "ddpx.csrc"],
    package_dir={"ddpx.csrc": "csrc"},
    package_data={"ddpx.csrc": ["*.h", "*.cpp", "*.cu"]},
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildExtension},
)
