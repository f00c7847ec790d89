"""What ddpx._C is built from and how (``plan``), shared by setup.py and the loader's build at
first use. ``python3 ddpx/_buildspec.py VERSION`` prints the C++ sources and their flags for that
torch version, a line each: the Arm scripts build from them (tools/arm_check.sh, arm_run.sh).

Kept free of imports from ddpx (and of torch) so that setup.py can read it before the package
exists.
"""

import glob
import os
import re
import shutil
import subprocess

CPP_SOURCES = (
    "kernels/kernels.cpp",
    "kernels/kernels_avx2.cpp",
    "kernels/quantize.cpp",
    "node/shm_segment.cpp",
    "node/numa.cpp",
    "node/arena.cpp",
    "node/waiter.cpp",
    "node/peer_memory.cpp",
    "node/shm_channel.cpp",
    "collectives/schedule.cpp",
    "node/workers.cpp",
    "collectives/node_comm.cpp",
    "collectives/opening.cpp",
    "collectives/allreduce.cpp",
    "collectives/allgather.cpp",
    "collectives/broadcast.cpp",
    "collectives/reduce_scatter.cpp",
    "collectives/alltoall.cpp",
    "collectives/barrier.cpp",
    "collectives/shm_p2p.cpp",
    "common/torch_compat.cpp",
    "engine/request.cpp",
    "cross_node/abort_watch.cpp",
    "cross_node/cross_node.cpp",
    "engine/engine.cpp",
    "torch_api/reduce_ops.cpp",
    "torch_api/backend_work.cpp",
    "torch_api/backend_tasks.cpp",
    "torch_api/backend.cpp",
    "torch_api/ops.cpp",
    "torch_api/bindings.cpp",
)

# Built only where CUDA is usable (see cuda_toolkit): kernels that include CUDA headers only, and
# the torch glue around them.
CUDA_SOURCES = (
    "cuda/compress_kernels.cu",
    "cuda/cuda_engine.cpp",
)

# GPUs compiled for unless TORCH_CUDA_ARCH_LIST says otherwise: Ampere, Ada and Hopper, plus
# Hopper's PTX, which newer GPUs compile when the extension loads.
CUDA_ARCHS = ("80", "86", "89", "90")


def plan(torch_version: str, torch_cuda: str | None, cuda_home: str | None,
         torch_dir: str) -> dict:
    """The build of ddpx._C for this torch: ``sources`` (paths under csrc/), ``cxx`` and ``nvcc``
    flags, and ``cuda_home``, the toolkit to compile the CUDA sources with (None, and nvcc None,
    for a C++-only build).

    ``torch_cuda`` is torch.version.cuda, ``cuda_home`` torch.utils.cpp_extension.CUDA_HOME and
    ``torch_dir`` the folder of the torch package.
    """
    toolkit = cuda_toolkit(torch_cuda, cuda_home)
    if toolkit is None:
        return {"sources": list(CPP_SOURCES), "cxx": cxx_flags(torch_version), "nvcc": None,
                "cuda_home": None}
    return {
        "sources": [*CPP_SOURCES, *CUDA_SOURCES],
        "cxx": cxx_flags(torch_version) + cuda_cxx_flags(torch_dir),
        "nvcc": nvcc_flags(),
        "cuda_home": toolkit,
    }


def cxx_flags(torch_version: str) -> list[str]:
    # Portable code only: the AVX2 kernels carry their own target attributes and are chosen at
    # run time, so the build never uses -march=native. No -std: torch.utils.cpp_extension adds
    # the standard its headers need (C++20 from torch 2.14 on, whose headers reject C++17).
    # -g0: setuptools passes on Python's own CFLAGS, which hold -g, and the debug information
    # for torch's headers is much of the time each source takes; the code is the same either
    # way. DEBUG=1 builds with -g. -ffp-contract=off: a multiply and an add are never fused into
    # one rounding, which GCC does by default where the CPU has FMA (Arm), so every instruction
    # set sums to the same bits.
    return ["-O3", "-Wall", "-g0", "-ffp-contract=off", f"-DDDPX_TORCH_VERSION={torch_version}"]


def cuda_toolkit(torch_cuda: str | None, guess: str | None) -> str | None:
    """The CUDA toolkit to compile the CUDA sources with, or None for a C++-only build.

    None when DDPX_SKIP_CUDA=1 or torch is a CPU build (``torch_cuda``: torch.version.cuda); a
    GPU is not needed. ``guess`` is torch.utils.cpp_extension.CUDA_HOME, which is /usr/local when
    nvcc is a wrapper script in /usr/local/bin, so /usr/local/cuda is tried after it.
    """
    if os.environ.get("DDPX_SKIP_CUDA") == "1" or torch_cuda is None:
        return None
    for home in (guess, "/usr/local/cuda"):
        if (home and os.path.isfile(os.path.join(home, "bin", "nvcc"))
                and os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))):
            return home
    return None


def cuda_cxx_flags(torch_dir: str) -> list[str]:
    """C++ flags added for a CUDA build; ``torch_dir`` is the folder of the torch package."""
    # pip's CUDA wheels carry headers that a bare toolkit may lack (cusparse.h, which
    # ATen/cuda/CUDAContext.h includes); searched after the toolkit's own, so those win.
    wheel_headers = sorted(glob.glob(os.path.join(os.path.dirname(torch_dir), "nvidia", "*",
                                                  "include")))
    return ["-DDDPX_WITH_CUDA"] + [f"-idirafter{path}" for path in wheel_headers]


def nvcc_flags() -> list[str]:
    # No --use_fast_math: the kernels must round exactly as torch does. No -std, as for C++.
    flags = ["-O3"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        flags += [f"-gencode=arch=compute_{arch},code=sm_{arch}" for arch in CUDA_ARCHS]
        flags.append(f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}")
    return flags


def static_libstdcxx(library: str) -> str | None:
    """Why the built ``library`` cannot run beside torch, or None (also where readelf cannot
    tell). A compiler that links libstdc++ into it statically (a toolchain wrapper whose -B
    folder holds libstdc++.a does) gives it streams of its own whose locale the process's shared
    libstdc++ never sets up: the first number written to a std::ostringstream crashes."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return None
    dynamic = subprocess.run([readelf, "-d", library], capture_output=True, text=True).stdout
    needed = re.findall(r"\(NEEDED\).*\[(.+?)\]", dynamic)
    if not needed or any(name.startswith(("libstdc++.so", "libc++.so")) for name in needed):
        return None
    compiler = os.environ.get("CXX", "c++")
    return (f"ddpx: {library} was linked without libstdc++.so (it needs {', '.join(needed)}): "
            f"the C++ compiler ({compiler}) put a static libstdc++ into it, whose streams crash "
            "beside torch's. Rebuild with a compiler that links libstdc++.so.6, e.g. "
            "CXX=/usr/bin/g++ python setup.py build_ext --inplace")


if __name__ == "__main__":
    import sys

    print(" ".join(CPP_SOURCES))
    print(" ".join(cxx_flags(sys.argv[1])))
