"""Builds ddpx and its extension ddpx._C against the torch that is installed.

    pip install -e .

(pip's isolated build sees that torch through build_backend/ddpx_backend.py.)

The CUDA kernels are compiled too where torch is a CUDA build and a CUDA toolkit is found
(CUDA_HOME, else /usr/local/cuda); no GPU is needed to build them.

Environment: DDPX_SKIP_CUDA=1 builds the C++ extension only; DEBUG=1 builds without optimisation;
TORCH_CUDA_ARCH_LIST replaces the GPU architectures compiled for (ddpx/_buildspec.py lists them).
"""

import os
import runpy
import sys
import sysconfig

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit(
        "ddpx: torch is not importable here. ddpx's extension is compiled against the torch that "
        "will run it: install torch first, e.g.\n"
        "    pip install torch==2.13.0 ninja && pip install -e ."
    )

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = runpy.run_path(os.path.join(HERE, "ddpx", "_buildspec.py"))
# csrc/'s folders, one per layer, installed with their sources for the loader's build at first use.
CSRC_LAYERS = sorted(e.name for e in os.scandir(os.path.join(HERE, "csrc")) if e.is_dir())


def _debug(flags):
    if os.environ.get("DEBUG") != "1":
        return flags
    return [f for f in flags if not f.startswith("-O")] + ["-O0", "-g"]


class BuildReusingObjects(BuildExtension):
    """torch's BuildExtension, keeping the objects in build/ from one build to the next.

    setuptools gives each editable install a new temporary folder for them, so the test extras'
    `pip install -e ".[test]"` after `pip install -e .` compiled everything again. With one
    folder per kind of build, the editable and regular installs and `pip wheel .` share the
    objects, and ninja compiles only what changed since: it knows the headers each object was
    built from and the command that built it. The kind is what makes objects unfit for another
    build: the platform, Python, torch, the CUDA kernels or not, and DEBUG.
    """

    def finalize_options(self):
        if self.build_temp is None:  # a --build-temp given to build_ext itself is kept
            cuda = SPEC["cuda_toolkit"](torch.version.cuda, cpp_extension.CUDA_HOME) is not None
            kind = (f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
                    f"-torch{torch.__version__}-{'cuda' if cuda else 'cpu'}"
                    f"{'-debug' if os.environ.get('DEBUG') == '1' else ''}")
            self.build_temp = os.path.join(HERE, "build", f"temp-{kind}")
        super().finalize_options()


def get_extensions():
    build = SPEC["plan"](torch.__version__, torch.version.cuda, cpp_extension.CUDA_HOME,
                         os.path.dirname(torch.__file__))
    sources = [os.path.join("csrc", name) for name in build["sources"]]
    flags = _debug(build["cxx"])
    if build["cuda_home"] is None:
        if torch.version.cuda is not None and os.environ.get("DDPX_SKIP_CUDA") != "1":
            print(f"ddpx: torch {torch.__version__} is a CUDA build but no CUDA toolkit (bin/nvcc "
                  "and include/cuda_runtime.h) is under CUDA_HOME or /usr/local/cuda; building "
                  "without the CUDA kernels (set CUDA_HOME to build them)", file=sys.stderr)
        return [CppExtension("ddpx._C", sources, extra_compile_args={"cxx": flags})]
    # The extension's include and library paths and its nvcc all come from this global.
    cpp_extension.CUDA_HOME = build["cuda_home"]
    nvcc = _debug(build["nvcc"])
    return [CUDAExtension("ddpx._C", sources, extra_compile_args={"cxx": flags, "nvcc": nvcc})]


setup(
    packages=["ddpx", "ddpx_bench", "ddpx.csrc", *(f"ddpx.csrc.{layer}" for layer in CSRC_LAYERS)],
    package_dir={"ddpx.csrc": "csrc"},
    package_data={f"ddpx.csrc.{layer}": ["*.h", "*.cpp", "*.cu"] for layer in CSRC_LAYERS},
    ext_modules=get_extensions(),
    cmdclass={"build_ext": BuildReusingObjects},
)
