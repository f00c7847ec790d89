"""The element kernels' torch-free test program, tests/kernels_check.cpp: built with this
machine's g++ and run here (every implementation this CPU runs, AVX2 included), and built for
aarch64 and run under qemu-aarch64 where Debian's cross compiler and qemu-user are installed.
`bash tools/arm_check.sh` does both too, and compiles every source of ddpx._C for aarch64."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [str(ROOT / path) for path in
           ("tests/kernels_check.cpp", "csrc/kernels/kernels.cpp",
            "csrc/kernels/kernels_avx2.cpp")]
FLAGS = ["-std=c++17", "-O2", "-Wall", f"-I{ROOT / 'csrc' / 'kernels'}"]
CROSS_TOOLS = ("aarch64-linux-gnu-g++", "qemu-aarch64")


def build_and_run(compiler: list[str], run: list[str], exe: Path) -> str:
    """Compiles the program with ``compiler``, runs it through ``run``, asserts that it passed
    and returns its output."""
    build = subprocess.run([*compiler, *FLAGS, *SOURCES, "-o", str(exe)], capture_output=True,
                           text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    result = subprocess.run([*run, str(exe)], capture_output=True, text=True, timeout=120)
    lines = result.stdout.strip().splitlines()
    closing = re.fullmatch(r"(\d+) passed, (\d+) failed", lines[-1] if lines else "")
    assert closing, result.stdout + result.stderr
    passed, failed = map(int, closing.groups())
    assert failed == 0 and passed > 0 and result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_kernels_pass_on_this_cpu(tmp_path):
    out = build_and_run(["g++"], [], tmp_path / "kernels_check")
    assert re.search(r"^portable reduce .* 0 failed$", out, re.M), out


@pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in CROSS_TOOLS),
    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64: "
           "apt-get install g++-aarch64-linux-gnu qemu-user")
def test_kernels_pass_on_aarch64_under_qemu(tmp_path):
    # Static, so that qemu needs no aarch64 libraries.
    out = build_and_run(["aarch64-linux-gnu-g++", "-static"], ["qemu-aarch64"],
                        tmp_path / "kernels_check_arm")
    assert "on aarch64: kernels() chooses portable" in out, out
    assert re.search(r"^portable reduce .* 0 failed$", out, re.M), out
