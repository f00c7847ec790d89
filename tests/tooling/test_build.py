"""The build of ddpx._C in a checkout: a second build reuses the objects of the first."""

import hashlib
import os
import re
import signal
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import ddpx

ROOT = Path(__file__).resolve().parents[2]
# What ninja prints once a compile is done (piped, it prints "[done/total] command" per step).
NINJA_STEP = re.compile(r"^\s*\[\d+/\d+\] ")


def build_wheel(out_dir: Path) -> tuple[str, str | None]:
    """`pip -v wheel` of the checkout: its log, and the first compile ninja finished, if any.

    A build that compiles is stopped at its first object: it would take minutes to finish, and
    one object already tells that the build did not reuse the install's."""
    command = [sys.executable, "-m", "pip", "-v", "wheel", "--no-deps", "-w", str(out_dir),
               str(ROOT)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=out_dir, start_new_session=True) as pip:
        log = []
        for line in pip.stdout:
            log.append(line)
            if NINJA_STEP.match(line):
                # The whole group (pip, its build backend, ninja, the compilers), and SIGTERM,
                # which ninja answers by deleting the objects it left half written.
                os.killpg(pip.pid, signal.SIGTERM)
                pip.communicate(timeout=60)
                return "".join(log), line.strip()
        assert pip.wait() == 0, "".join(log)
    return "".join(log), None


def test_a_second_build_compiles_nothing_and_leaves_the_loaded_extension(tmp_path):
    """`pip install -e ".[test]"` after `pip install -e .` compiled ddpx._C again from nothing:
    setuptools gave each editable build a new temporary folder for the objects. Built again after
    the install, as `pip wheel .`, the checkout compiles nothing, the wheel holds the extension
    and the benchmark beside ddpx, and the library this process loaded from the checkout is left
    as it was."""
    loaded = Path(ddpx._ext.extension().__file__)
    if not loaded.is_relative_to(ROOT / "ddpx"):
        pytest.skip(f"ddpx._C was not built in this checkout (it was loaded from {loaded}), so "
                    "there is no build of it to reuse; `pip install -e .` builds it in place")
    before = loaded.stat()
    digest = hashlib.sha256(loaded.read_bytes()).hexdigest()

    log, compiled = build_wheel(tmp_path)
    assert compiled is None, (
        f"the second build compiled again ({compiled}): csrc/ changed since ddpx was "
        "installed (`pip install -e .` again), the build's settings differ from the install's "
        "(TORCH_CUDA_ARCH_LIST, DEBUG, DDPX_SKIP_CUDA), or the build lost the objects")
    assert "ninja: no work to do" in log, log

    wheels = list(tmp_path.glob("ddpx-*.whl"))
    assert len(wheels) == 1, log
    extension = f"ddpx/_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    with zipfile.ZipFile(wheels[0]) as wheel:
        assert wheel.getinfo(extension).file_size > 0
        names = wheel.namelist()
    # The runtime and the tools: the benchmark and its testbed are ddpx_bench's, not ddpx's.
    assert {"ddpx_bench/cli.py", "ddpx_bench/testbed.py"} <= set(names)
    assert [name for name in names if name.startswith("ddpx/bench/")] == []

    after = loaded.stat()
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino, before.st_mtime_ns, before.st_size)
    assert hashlib.sha256(loaded.read_bytes()).hexdigest() == digest
