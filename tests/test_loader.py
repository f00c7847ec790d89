"""The extension loader: the prebuilt ddpx._C, and the build at first use when it is missing."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddpx
from ddpx._buildspec import CPP_SOURCES, CUDA_SOURCES, plan, static_libstdcxx

ROOT = Path(__file__).resolve().parents[1]
# An editable install maps ddpx to the checkout through a finder ahead of PYTHONPATH; drop it so
# the copy under test is the ddpx that gets imported.
PRINT_INFO = (
    "import sys; sys.meta_path = [f for f in sys.meta_path if '__editable__' not in repr(f)]; "
    "import json, ddpx; print(json.dumps(ddpx.build_info()))"
)


def test_prebuilt_extension_matches_this_torch():
    info = ddpx.build_info()
    assert info["loaded"] == "prebuilt"
    assert info["torch_version"] == torch.__version__
    assert info["cpu_isa"] in ("avx2", "portable")
    assert info["cuda"] is False or torch.version.cuda is not None
    assert Path(info["path"]).name.startswith("_C")


@pytest.mark.skipif(shutil.which("readelf") is None or shutil.which("g++") is None,
                    reason="needs readelf and g++")
def test_a_static_libstdcxx_is_refused_with_its_cause_and_fix(tmp_path, monkeypatch):
    """A GPU image's compiler wrapper linked libstdc++ into ddpx._C statically: its first
    std::ostringstream number then segfaulted beside torch's libstdc++.so. The loader refuses such
    a library by its dynamic section; the one built here passes."""
    assert static_libstdcxx(ddpx._ext.extension().__file__) is None
    source = tmp_path / "streams.cpp"
    source.write_text("#include <sstream>\n#include <string>\n"
                      "std::string digits(long x) { std::ostringstream out; out << x; "
                      "return out.str(); }\n")
    for static, name in ((False, "shared.so"), (True, "static.so")):
        command = ["g++", "-shared", "-fPIC", str(source), "-o", str(tmp_path / name)]
        subprocess.run(command + ["-static-libstdc++"] * static, check=True, timeout=120)
    assert static_libstdcxx(str(tmp_path / "shared.so")) is None
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    why = static_libstdcxx(str(tmp_path / "static.so"))
    assert why.startswith(f"ddpx: {tmp_path / 'static.so'} was linked without libstdc++.so"), why
    assert "(/opt/gcc/bin/g++) put a static libstdc++ into it" in why
    assert "CXX=/usr/bin/g++ python setup.py build_ext --inplace" in why


def test_build_plan_adds_cuda_only_for_a_cuda_torch_with_a_toolkit(tmp_path, monkeypatch):
    """setup.py and the loader build from this plan; no GPU or CUDA torch is needed to check it."""
    for name in ("DDPX_SKIP_CUDA", "TORCH_CUDA_ARCH_LIST"):
        monkeypatch.delenv(name, raising=False)
    toolkit = tmp_path / "cuda"
    for path in ("bin/nvcc", "include/cuda_runtime.h"):
        (toolkit / path).parent.mkdir(parents=True, exist_ok=True)
        (toolkit / path).touch()

    cpu = plan("2.13.0", None, str(toolkit), "/torch")
    assert cpu == {"sources": list(CPP_SOURCES), "cxx": cpu["cxx"], "nvcc": None,
                   "cuda_home": None}
    assert "-DDDPX_TORCH_VERSION=2.13.0" in cpu["cxx"]
    assert not any(flag.startswith("-march") or flag.startswith("-std") for flag in cpu["cxx"])

    gpu = plan("2.13.0", "13.0", str(toolkit), "/torch")
    assert gpu["cuda_home"] == str(toolkit)
    assert gpu["sources"] == [*CPP_SOURCES, *CUDA_SOURCES]
    assert gpu["cxx"][: len(cpu["cxx"])] == cpu["cxx"] and "-DDDPX_WITH_CUDA" in gpu["cxx"]
    assert "-gencode=arch=compute_90,code=sm_90" in gpu["nvcc"]  # Hopper, listed explicitly
    assert "--use_fast_math" not in gpu["nvcc"]

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert not any("gencode" in flag for flag in plan("2.13.0", "13.0", str(toolkit), "/t")["nvcc"])
    monkeypatch.setenv("DDPX_SKIP_CUDA", "1")
    assert plan("2.13.0", "13.0", str(toolkit), "/torch")["cuda_home"] is None


def source_copy_without_extension(tmp_path: Path) -> dict:
    """A checkout with ddpx/ and csrc/ but no compiled ddpx._C; returns the env that imports it."""
    shutil.copytree(ROOT / "ddpx", tmp_path / "ddpx",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__"))
    shutil.copytree(ROOT / "csrc", tmp_path / "csrc")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), DDPX_CACHE_DIR=str(tmp_path / "cache"))
    return env


def run_python(code: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # a minute: a whole build of the extension
def test_missing_extension_is_built_once_and_cached(tmp_path):
    env = source_copy_without_extension(tmp_path)
    first = run_python(PRINT_INFO, env, tmp_path)
    assert first.returncode == 0, first.stderr
    info = json.loads(first.stdout)
    assert info["loaded"] == "jit"
    assert info["torch_version"] == torch.__version__
    assert Path(info["path"]).is_relative_to(tmp_path / "cache")
    assert first.stderr.count("building it once") == 1

    second = run_python(PRINT_INFO, env, tmp_path)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["path"] == info["path"]
    assert "building it once" not in second.stderr


def test_missing_compiler_names_what_to_install(tmp_path):
    env = source_copy_without_extension(tmp_path)
    env["CXX"] = "no-such-compiler"
    result = run_python(PRINT_INFO, env, tmp_path)
    assert result.returncode != 0
    assert "C++17 compiler" in result.stderr and "apt-get install g++" in result.stderr
    # Where the unbuilt ddpx came from: a checkout imported instead of the installed ddpx.
    assert f"ddpx._C is not built in {tmp_path / 'ddpx'} " in result.stderr, result.stderr


def source_checkout(tmp_path: Path) -> Path:
    """What a fresh clone holds (tracked and new files, no build outputs), copied to tmp_path."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    checkout = tmp_path / "ddpx-src"
    for name in listed:
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    return checkout


def test_plain_install_without_torch_says_what_to_install(tmp_path):
    """`pip install -e .` into an environment without torch stops before compiling, naming what
    to install; an isolated build never fetches a torch of its own to compile against."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-deps", "-e", str(source_checkout(tmp_path))],
        capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"{venv / 'bin' / 'python'} cannot import one" in output
    assert "pip install torch==2.13.0 ninja && pip install -e ." in output
    assert not list(venv.glob("lib/python*/site-packages/torch"))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["editable", "regular", "wheel"])
def test_plain_pip_builds_against_the_installed_torch(tmp_path, how):
    """The plain commands, no flag, in a fresh environment holding the pinned torch and ninja:
    ddpx._C is compiled there (isolated from it) against that torch, and is the prebuilt one
    `import ddpx` loads. Minutes: it compiles the extension."""
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [python, "-m", "pip"]
    subprocess.run([*pip, "install", "-q", f"torch=={torch.__version__.split('+')[0]}", "ninja"],
                   check=True, timeout=600)
    site_packages = next(venv.glob("lib/python*/site-packages"))
    checkout = source_checkout(tmp_path)
    command = {"editable": ["install", "--no-deps", "-e"], "regular": ["install", "--no-deps"],
               "wheel": ["wheel", "--no-deps", "-w", str(tmp_path / "wheels")]}[how]
    build = subprocess.run([*pip, "-v", *command, str(checkout)],
                           capture_output=True, text=True, cwd=tmp_path, timeout=1200)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    assert f"ddpx: building against torch {torch.__version__} at {site_packages / 'torch'}" in log
    assert "Collecting torch" not in log and "Downloading torch" not in log
    if how == "wheel":
        wheels = list((tmp_path / "wheels").glob("ddpx-*.whl"))
        assert len(wheels) == 1
        subprocess.run([*pip, "install", "-q", "--no-deps", str(wheels[0])], check=True,
                       timeout=300)
    info = subprocess.run([python, "-c", "import json, ddpx, torch; "
                           "print(json.dumps([ddpx.build_info(), torch.__version__]))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert info.returncode == 0, info.stderr
    build_info, installed_torch = json.loads(info.stdout)
    assert build_info["loaded"] == "prebuilt"
    assert build_info["torch_version"] == installed_torch == torch.__version__
    expected_home = checkout if how == "editable" else venv
    assert Path(build_info["path"]).is_relative_to(expected_home)


def test_import_ddpx_loads_the_library_only():
    """The benchmark, its network testbed and the trainers' adapters stay off the import path."""
    done = subprocess.run([sys.executable, "-c", "import sys, ddpx; print(sorted(m for m in "
                           "sys.modules if m.startswith('ddpx')))"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == str(sorted([
        "ddpx", "ddpx._bucket_steps", "ddpx._buildspec", "ddpx._cpu_share", "ddpx._cross_node",
        "ddpx._ext", "ddpx._groups", "ddpx._meeting", "ddpx._numa", "ddpx._process_wide",
        "ddpx._segment", "ddpx._setup", "ddpx._timeouts", "ddpx.backend", "ddpx.engine",
        "ddpx.errors", "ddpx.hooks", "ddpx.settings"]))
