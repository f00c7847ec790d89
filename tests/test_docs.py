"""Every command of docs/ a user can copy, checked as written. The multi-node launches of
docs/design.md run on two network-namespace hosts at their own addresses. The benchmark
commands, the ones that made docs/' measured tables, take minutes to an hour each with the
peers, loaded cores and shaped links, so they are not run here: the tool's own parser, with
every check it makes before it starts, accepts each (a renamed flag, a value out of range or a
refused combination fails). The torch suite's commands are -m slow's (tests/test_torch_suite.py
runs the suite the same way), and tools/gpu_check.sh needs a GPU."""

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from ddpx.bench import cli, testbed

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))


def doc_commands() -> dict[str, str]:
    """Each command line of docs/' code blocks (a continued line joined, comments left out), with
    the page it is on."""
    found = {}
    for page in DOCS:
        for block in re.findall(r"^```\w*\n(.*?)^```", page.read_text(), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                command = " ".join(re.sub(r"\s+#.*$", "", line).split())
                if command:
                    found[command] = page.name
    return found


COMMANDS = doc_commands()
BENCH = sorted(command for command in COMMANDS if command.startswith("ddpx-bench "))
# Run on two hosts made with the addresses they name (the other node with its own rank).
MULTINODE = {
    "accelerate launch --config_file scripts/configs/multinode.yaml --machine_rank 0 "
    "--main_process_ip 10.0.0.1 --main_process_port 29500 scripts/basic.py":
        ("--machine_rank 0", "--machine_rank 1"),
    "torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 10.0.0.1 "
    "--master_port 29500 scripts/basic.py": ("--node_rank 0", "--node_rank 1"),
}
ELSEWHERE = {
    "BACKEND=gloo WORLD_SIZE=2 python -m pytest tests/torch_suite.py -p no:cacheprovider -o "
    "addopts=": "the torch suite on gloo: tests/test_torch_suite.py runs it (-m slow)",
    "python -m pytest -m slow tests/test_torch_suite.py": "-m slow",
    "bash tools/gpu_check.sh": "needs a CUDA GPU",
    "bash tools/gpu_check.sh --only tests": "needs a CUDA GPU",
}


def test_every_command_of_the_docs_is_checked():
    assert sorted(COMMANDS) == sorted([*BENCH, *MULTINODE, *ELSEWHERE])
    assert len(BENCH) >= 20  # the measured tables' commands


@pytest.mark.parametrize("command", BENCH)
def test_a_benchmark_command_of_the_docs_is_accepted(command):
    """`ddpx-bench MODE ...` as the page writes it, through everything the tool checks before
    it runs; --plot needs matplotlib, which the test extras install."""
    argv = shlex.split(command)[1:]
    args = cli.parse_args(argv)
    assert args.mode == argv[0]


@pytest.mark.skipif(testbed.unavailable() is not None, reason=str(testbed.unavailable()))
@pytest.mark.parametrize("command", sorted(MULTINODE))
def test_a_multinode_command_of_the_docs_runs_on_two_hosts(command, tmp_path):
    (tmp_path / "scripts").symlink_to(REPO / "scripts")
    first, second = MULTINODE[command]
    with testbed.Testbed(2, rate=None, subnet="10.0.0") as bed:
        env = {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
        jobs = [bed.popen(node, ["bash", "-c", line], env=env, cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for node, line in enumerate([command, command.replace(first, second)])]
        outputs = bed.communicate(jobs, timeout=300)
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(outputs)
    assert "world size 4" in outputs[0] and "final loss" in outputs[0], outputs[0]
