"""The installed package ddpx is the runtime: the benchmark and its network testbed are the package
ddpx_bench beside it (the `ddpx-bench` command; tests/tooling/test_build.py checks the wheel), and
a DDP job with ddpx's hook, ddpx.all_reduce and the ddpx backend runs where accelerate and numpy
cannot be imported: only the example scripts (their shared scripts/common.py) need them, and say
how to install them."""

import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import ddpx
import ddpx_bench

from distributed import torchrun

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def not_installed(*libraries: str) -> str:
    """Source that makes `libraries` unimportable in the interpreter that runs it first, as where
    they are not installed (torch runs without numpy, and its find_spec checks say None)."""
    return "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in libraries)


HOOK_JOB = not_installed("accelerate", "numpy") + '''
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import ddpx

dist.init_process_group("ddpx")
model = DistributedDataParallel(torch.nn.Linear(8, 4))
state = ddpx.register_fused_hook(model, compression="bf16")
model(torch.full((2, 8), float(dist.get_rank()))).sum().backward()
tensor = torch.full((4,), float(dist.get_rank() + 1))
ddpx.all_reduce(tensor)
assert tensor.tolist() == [3.0] * 4
print(f"HOOK {state.describe()}")
loaded = [name for name, module in sys.modules.items()
          if module is not None and name.partition(".")[0] in ("accelerate", "numpy", "ddpx_bench")]
print(f"MODULES {loaded}")
del model, state
dist.destroy_process_group()
'''


def test_the_benchmark_and_its_testbed_are_not_in_ddpx():
    runtime = {module.name for module in pkgutil.iter_modules(ddpx.__path__)}
    tools = {module.name for module in pkgutil.iter_modules(ddpx_bench.__path__)}
    assert {"cli", "testbed", "costmodel"} <= tools
    assert runtime & {"bench", *tools} == set()
    sources = [path for folder in ddpx.__path__ for path in Path(folder).glob("*.py")]
    assert [path.name for path in sources
            if re.search(r"^\s*(from|import) ddpx_bench", path.read_text(), re.M)] == []


def test_the_hook_and_the_backend_need_neither_accelerate_nor_numpy(tmp_path):
    stdout = torchrun(tmp_path, "job.py", HOOK_JOB)
    assert stdout.count("HOOK ddpx shared memory, 2 ranks a node; bfloat16; zero-copy: yes") == 2, \
        stdout
    assert stdout.count("MODULES []") == 2, stdout


def test_the_example_scripts_name_their_extra_when_a_library_is_missing():
    """scripts/common.py, imported from beside it as the scripts do (tests/test_trainers.py
    checks the trainers' modules the same way)."""
    for library in ("accelerate", "numpy"):
        done = subprocess.run([sys.executable, "-c", not_installed(library) + "import common"],
                              capture_output=True, text=True, timeout=120, cwd=SCRIPTS)
        assert done.returncode == 1
        assert done.stderr.splitlines()[-1] == (
            f"ModuleNotFoundError: the example scripts need {library}, which is not installed: "
            'pip install "ddpx[examples]"'), done.stderr
