"""ddpx's PEP 517 build backend: setuptools', building against the torch of the environment that
ddpx is being installed into.

ddpx._C is compiled against torch's C++ headers and must be imported by that same torch. An
isolated build (a plain `pip install .`, `pip install -e .`, `pip wheel .`) runs in a throw-away
environment that hides the installed packages; listing torch as a build requirement would download
a torch there, perhaps another version or build (CUDA instead of CPU), and compile against that.
Instead, before any hook runs, this backend asks the interpreter of the target environment for its
import path and appends it (after the build environment's own packages, so the build tools stay
the isolated ones), and puts its scripts directory (ninja) on PATH. Without isolation torch is
importable already and nothing changes.

pip runs the hooks with the interpreter of the environment it installs into (also under
`pip --python`), so that is the interpreter asked. Builders that run the hooks in an interpreter
of their own (`python -m build`, pip's `--use-feature venv-isolation`) cannot name the target:
there the build stops with what to do.
"""

import importlib.util
import json
import os
import subprocess
import sys

from setuptools import build_meta
from setuptools.build_meta import *  # noqa: F403  (the PEP 517 hooks, unchanged)

__all__ = build_meta.__all__

_PROBE = (
    "import json, sys, sysconfig, torch; "
    "print(json.dumps({'path': sys.path, 'scripts': sysconfig.get_path('scripts'), "
    "'torch': torch.__version__, 'at': torch.__file__}))"
)
# The variables through which the build environment hides the target's packages.
_ISOLATING = ("PYTHONPATH", "PYTHONNOUSERSITE")


def _probe() -> dict | None:
    """What this interpreter imports outside the build's isolation: its path, scripts and torch."""
    env = {name: value for name, value in os.environ.items() if name not in _ISOLATING}
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd="/",
                                capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if result.returncode != 0:
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def _target_torch() -> None:
    if importlib.util.find_spec("torch") is not None:
        return
    found = _probe()
    if found is None:
        raise SystemExit(
            f"ddpx: no torch to build against. ddpx._C is compiled against the torch of the "
            f"environment it is installed into, and {sys.executable} cannot import one. Install "
            "it there first, e.g.\n"
            "    pip install torch==2.13.0 ninja && pip install -e .\n"
            "(A builder that runs the build in an interpreter of its own, such as `python -m "
            "build`, needs its no-isolation flag.)"
        )
    sys.path.extend(path for path in found["path"] if path and path not in sys.path)
    os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), found["scripts"]])
    print(f"ddpx: building against torch {found['torch']} at {os.path.dirname(found['at'])}",
          file=sys.stderr)


_target_torch()
