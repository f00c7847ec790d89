"""The first step of tools/gpu_check.sh: what this machine has and lacks, before anything runs.

    python tools/gpu_preflight.py OUT

prints one line per check (ok, MISSING or note) and writes OUT/preflight.json (the checks, and the
environment: python, torch with its CUDA and NCCL, the GPUs, the CUDA toolkit) and
OUT/preflight.env, the findings gpu_check.sh sources: MISSING (the names of what is missing, which
gpu_check.sh matches against what each step needs), CAPABILITY (the first GPU's, "-" for none),
GPUS, and the folders to use for the toolkit (TOOLKIT) and ninja (NINJA_DIR, when the ninja that
runs is not the first on PATH), and the C++ compiler to build with (BUILD_CXX, when CXX's links
libstdc++ statically, which ddpx refuses to load). Standard library only besides torch, so that
it reports even where torch does not import. Exit status 0 whatever is missing: gpu_check.sh
decides what that stops.
"""

import glob
import importlib
import json
import os
import platform
import runpy
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A CUDA build writes a few hundred MB of objects into build/; less than this is a build that dies
# half way with a full disk.
BUILD_DISK_GIB = 1.0
# Read from the file, not imported: importing ddpx would load (or build) the extension.
STATIC_LIBSTDCXX = runpy.run_path(str(ROOT / "ddpx" / "_buildspec.py"))["static_libstdcxx"]


def _check(name: str, ok: bool, detail: str, note: bool = False) -> dict:
    """A check's record; a `note` is only reported, it is never missing."""
    return {"name": name, "ok": ok, "note": note, "detail": detail}


def _module(name: str, why: str) -> dict:
    # Imported, not looked up: an install that is there but broken (built for another torch or
    # numpy) is missing too, and only an import shows it.
    try:
        module = importlib.import_module(name)
    except Exception as error:  # noqa: BLE001 - whatever stops the import
        return _check(name, False, f"does not import ({type(error).__name__}: {error}): {why}")
    return _check(name, True, f"{getattr(module, '__version__', '')} {module.__file__}".strip())


def toolkit_candidates(torch_module) -> list[str]:
    """Where a CUDA toolkit may be, in the order tried: CUDA_HOME, the nvcc on PATH,
    /usr/local/cuda(-*), then pip's CUDA 13 wheels (a whole toolkit with nvidia-cuda-nvcc)."""
    found = [os.environ.get("CUDA_HOME", "")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        found.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    found.append("/usr/local/cuda")
    found += sorted(glob.glob("/usr/local/cuda-*"),
                    key=lambda path: [int(part) for part in path.rsplit("-", 1)[1].split(".")
                                      if part.isdigit()], reverse=True)
    found.append(os.path.join(os.path.dirname(torch_module.__path__[0]), "nvidia", "cu13"))
    return [path for path in found if path]


def _nvcc_version(home: str) -> str:
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], text=True,
                             capture_output=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "nvcc --version failed"
    return out.strip().splitlines()[-1] if out.strip() else "nvcc --version said nothing"


def _ninjas() -> list[str]:
    """The ninja on PATH, then pip's."""
    found = [shutil.which("ninja")]
    try:
        import ninja

        found.append(os.path.join(ninja.BIN_DIR, "ninja"))
    except ImportError:
        pass
    return [path for path in found if path]


def _runs(command: str) -> bool:
    try:
        return subprocess.run([command, "--version"], capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _free_gib(path: str) -> float | None:
    try:
        return shutil.disk_usage(path).free / 2**30
    except OSError:
        return None


def _torch_checks(checks: list[dict], env: dict, shell: dict) -> None:
    """torch, its GPUs and, for a CUDA torch, the toolkit its build needs."""
    try:
        import torch
    except Exception as error:  # noqa: BLE001 - whatever stops the import
        checks.append(_check("torch", False, f"does not import ({type(error).__name__}: "
                                             f"{error}): no step can run"))
        return
    env["torch"], env["torch_cuda"] = torch.__version__, torch.version.cuda
    checks.append(_check("torch", True, f"{torch.__version__} (CUDA "
                                        f"{torch.version.cuda or 'none: a CPU build'})"))
    env["cuda_available"] = torch.cuda.is_available()
    if env["cuda_available"]:
        nccl = torch.cuda.nccl.version()
        env["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            env["gpus"].append({"name": props.name, "capability": f"{props.major}.{props.minor}",
                                "memory_gib": round(props.total_memory / 2**30, 1),
                                "multiprocessors": props.multi_processor_count})
        shell["CAPABILITY"] = env["gpus"][0]["capability"]
    shell["GPUS"] = str(len(env["gpus"]))
    gpus = ", ".join(f"{gpu['name']} (sm_{gpu['capability'].replace('.', '')}, "
                     f"{gpu['memory_gib']} GiB)" for gpu in env["gpus"])
    if not env["gpus"]:
        gpus = ("none: a dry run (the GPU tests skip, the speed step times nothing, "
                "model_parallel.py trains on the CPU)")
    elif len(env["gpus"]) == 1:
        gpus += "; the tests for 2 GPUs skip"
    checks.append(_check("gpus", bool(env["gpus"]), f"{len(env['gpus'])}: {gpus}", note=True))
    if torch.version.cuda is None:
        return
    # A CUDA torch's build without a toolkit has no CUDA kernels, which is no GPU check.
    candidates = toolkit_candidates(torch)
    home = next((path for path in candidates
                 if os.path.isfile(os.path.join(path, "bin", "nvcc"))
                 and os.path.isfile(os.path.join(path, "include", "cuda_runtime.h"))), None)
    if home is None:
        checks.append(_check("nvcc", False, "no CUDA toolkit (bin/nvcc and "
                             f"include/cuda_runtime.h) in {', '.join(candidates)}: set CUDA_HOME "
                             "to one"))
        return
    env["cuda_home"] = shell["TOOLKIT"] = home
    env["nvcc"] = os.path.join(home, "bin", "nvcc")
    checks.append(_check("nvcc", True, f"{home}: {_nvcc_version(home)}"))


def _links_static_libstdcxx(compiler: str) -> bool:
    """Whether ``compiler`` puts libstdc++ into a shared library statically (the H200 image's
    CXX wrapper did: ddpx's streams then crashed beside torch's)."""
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp, "streams.cpp"), Path(tmp, "streams.so")
        source.write_text("#include <sstream>\n#include <string>\nstd::string digits(long x) "
                          "{ std::ostringstream out; out << x; return out.str(); }\n")
        built = subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)],
                               capture_output=True, timeout=60).returncode == 0
        return built and STATIC_LIBSTDCXX(str(library)) is not None


def _compiler_check(shell: dict) -> dict:
    compiler = os.environ.get("CXX", "c++")
    path = shutil.which(compiler)
    if path is None:
        return _check("compiler", False, f"`{compiler}` is not on PATH (set CXX)")
    if not _links_static_libstdcxx(path):
        return _check("compiler", True, path)
    for other in ("/usr/bin/g++", "/usr/bin/c++"):
        if os.access(other, os.X_OK) and not _links_static_libstdcxx(other):
            shell["BUILD_CXX"] = other
            return _check("compiler", True, f"{path} links libstdc++ statically, which ddpx "
                          f"refuses to load: the build uses {other}")
    return _check("compiler", False, f"{path} links libstdc++ statically, which ddpx refuses to "
                  "load, and no /usr/bin/g++ or /usr/bin/c++ links libstdc++.so: set CXX")


def preflight() -> tuple[list[dict], dict, dict]:
    """The checks, the environment, and the findings for the shell."""
    checks = [_check("python", True, f"{sys.version.split()[0]} {sys.executable}", note=True)]
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": None,
           "torch_cuda": None, "cuda_available": False, "gpus": [], "nccl": None,
           "cuda_home": None, "nvcc": None,
           "torch_cuda_arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    shell = {"CAPABILITY": "-", "GPUS": "0", "TOOLKIT": "", "NINJA_DIR": "", "BUILD_CXX": ""}
    _torch_checks(checks, env, shell)
    checks.append(_compiler_check(shell))
    ninja = next((path for path in _ninjas() if _runs(path)), None)
    if ninja is not None and ninja != shutil.which("ninja"):
        # torch's build runs the first ninja on PATH: pip's one goes first, when the environment's
        # bin/ is not on PATH (its python run by path) or an older one is there.
        shell["NINJA_DIR"] = os.path.dirname(ninja)
    checks.append(_check("ninja", ninja is not None, ninja or (
        "none on PATH runs `ninja --version`, nor pip's: without it the build compiles one file "
        "at a time (minutes, past its limit)")))
    checks.append(_module("setuptools", "setup.py needs it"))
    free = _free_gib(str(ROOT))
    if free is None:
        checks.append(_check("disk", False, f"cannot find the free space in {ROOT}"))
    else:
        checks.append(_check("disk", free >= BUILD_DISK_GIB, f"{free:.1f} GiB free in {ROOT}" + (
            "" if free >= BUILD_DISK_GIB else f"; the build needs {BUILD_DISK_GIB:.0f} GiB")))
    shm = _free_gib("/dev/shm")
    checks.append(_check("shm", True, f"{shm:.1f} GiB free in /dev/shm" if shm is not None
                         else "no /dev/shm", note=True))
    checks.append(_module("pytest", "the tests need it"))
    checks.append(_module("numpy", "scripts/model_parallel.py needs it"))
    checks.append(_module("accelerate", "scripts/model_parallel.py needs it"))
    shell["MISSING"] = " ".join(check["name"] for check in checks
                                if not check["ok"] and not check["note"])
    return checks, env, shell


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    checks, env, shell = preflight()
    width = max(len(check["name"]) for check in checks)
    for check in checks:
        mark = "ok" if check["ok"] else "note" if check["note"] else "MISSING"
        print(f"  {mark:<8} {check['name']:<{width}}  {check['detail']}")
    (out / "preflight.json").write_text(json.dumps(
        {"checks": checks, "missing": shell["MISSING"].split(), "environment": env},
        indent=2) + "\n")
    (out / "preflight.env").write_text("".join(f"{key}={shlex.quote(value)}\n"
                                               for key, value in shell.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
