"""What ddpx._C is built from, shared by setup.py and the loader's build at first use.

Kept free of imports from ddpx so that setup.py can read it before the package exists.
"""

CPP_SOURCES = (
    "kernels.cpp",
    "kernels_avx2.cpp",
    "shm_allreduce.cpp",
    "engine.cpp",
    "bindings.cpp",
)


def cxx_flags(torch_version: str) -> list[str]:
    # Portable code only: the AVX2 kernels carry their own target attributes and are chosen at
    # run time, so the build never uses -march=native.
    return ["-O3", "-std=c++17", "-Wall", f"-DDDPX_TORCH_VERSION={torch_version}"]
