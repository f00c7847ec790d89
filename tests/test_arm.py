"""The element kernels' torch-free test program, tests/kernels_check.cpp: built with this
machine's g++ and run here (every implementation this CPU runs, AVX2 included), and built for
aarch64 and run under qemu-aarch64 where Debian's cross compiler and qemu-user are installed.
`bash tools/arm_check.sh` does both too, and compiles every source of ddpx._C for aarch64.
With -m slow: `bash tools/arm_run.sh`, the whole extension built for aarch64 and tests of the
suite run on it by an aarch64 Python under qemu."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [str(ROOT / path) for path in
           ("tests/kernels_check.cpp", "csrc/kernels/kernels.cpp",
            "csrc/kernels/kernels_avx2.cpp", "csrc/kernels/quantize.cpp")]
# -ffp-contract=off as ddpx._C is built (ddpx/_buildspec.py): aarch64's g++ fuses a multiply and
# an add into one rounding otherwise.
FLAGS = ["-std=c++17", "-O2", "-Wall", "-ffp-contract=off", f"-I{ROOT / 'csrc' / 'kernels'}"]
CROSS_TOOLS = ("aarch64-linux-gnu-g++", "qemu-aarch64")
# The README's line, run as written (tests/tooling/test_readme.py checks that it is here).
ARM_RUN = "bash tools/arm_run.sh"


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


@pytest.mark.slow
@pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in (*CROSS_TOOLS, "apt-get", "dpkg-deb")),
    reason="needs aarch64-linux-gnu-g++, qemu-aarch64 and apt-get: "
           "apt-get install g++-aarch64-linux-gnu qemu-user")
def test_the_extension_runs_on_aarch64_under_qemu():
    """tools/arm_run.sh: ddpx._C built for aarch64 against torch's aarch64 wheel, imported by
    Debian's arm64 Python under qemu-aarch64, and the hook, backend and dead-peer tests it
    selects run there (21 minutes on 2 cores; downloads 450 MB)."""
    done = subprocess.run(ARM_RUN.split(), cwd=ROOT, capture_output=True, text=True,
                          timeout=3 * 3600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-20000:]
    assert "arm_run: machine aarch64 python 3.11" in out, out[-20000:]
    assert re.search(r"^arm_run: build_info .*'loaded': 'prebuilt'", out, re.M), out[-20000:]
    assert "arm_run: backend: ddpx shared-memory engine, 2 local ranks" in out, out[-20000:]
    summary = re.search(r"^=* ?(\d+) passed(.*) in [\d.]+s", out, re.M)
    assert summary, out[-20000:]
    # The hook, the 2-rank battery's 14 sections, the 2 dead-peer tests and the arena's
    # unreachable peers (qemu's case), none failed or skipped (a skip would hide what did not
    # run on Arm).
    assert int(summary.group(1)) == 18 and "failed" not in summary.group(2) \
        and "skipped" not in summary.group(2) and "error" not in summary.group(2), summary.group(0)
    assert out.rstrip().endswith("arm_run: passed"), out[-2000:]
