"""The README's runnable examples, run as it says (torchrun, 2 processes): a newcomer's first
copy-paste must work."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
# A python block whose first line is "# NAME.py: torchrun --nproc_per_node 2 NAME.py".
RUNNABLE = {found.group(1): found.group(0)
            for found in re.finditer(r"^# (\S+\.py): torchrun --nproc_per_node 2 \1\n.*?(?=^```)",
                                     README, re.S | re.M)}


def test_every_python_block_of_the_readme_is_a_runnable_example():
    assert sorted(RUNNABLE) == ["collectives.py", "train.py"]
    assert README.count("```python\n") == len(RUNNABLE)


@pytest.mark.parametrize("name, expected", [
    ("train.py", "ddpx shared-memory engine, 2 local ranks"),
    ("collectives.py", "{'all_reduce': {'engine': 1, 'gloo': 0}}"),
])
def test_a_readme_example_runs_as_written(name, expected, tmp_path):
    (tmp_path / name).write_text(RUNNABLE[name])
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", name], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(expected) == 2, done.stdout  # one line from each rank


def test_the_settings_table_is_the_registry():
    from ddpx.settings import SETTINGS

    table = README.split("## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(DDPX_\w+)` \| (.+?) \| (.+?) \|$", table, re.M)
    assert rows == [(s.name, "unset" if s.default is None else f"`{s.default}`", s.meaning)
                    for s in SETTINGS]
