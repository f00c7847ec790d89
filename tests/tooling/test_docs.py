"""Every command of docs/ a user can copy, checked as written. The multi-node launches of
docs/design.md run on two network-namespace hosts at their own addresses. The benchmark
commands, the ones that made docs/' measured tables, take minutes to an hour each with the
peers, loaded cores and shaped links (and the fault harness's, docs/recovery.md's, minutes of
restarts), so they are not run here: the tool's own parser, with
every check it makes before it starts, accepts each (a renamed flag, a value out of range or a
refused combination fails). The torch suite's commands are -m slow's (tests/test_torch_suite.py
runs the suite the same way), and tools/gpu_check.sh needs a GPU."""

import shlex
from pathlib import Path

import pytest

from ddpx import settings
from ddpx_bench import cli, faults, testbed

from distributed import run_on_two_hosts
from documents import code_block_commands

REPO = Path(__file__).resolve().parents[2]
COMMANDS = sorted({command for page in (REPO / "docs").glob("*.md")
                   for command in code_block_commands(page.read_text())})


def bench_words(command: str) -> tuple[dict, list[str]] | None:
    """A `ddpx-bench` command's settings (the NAME=value words before it) and its arguments;
    None for any other command."""
    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return (env, words[1:]) if words and words[0] == "ddpx-bench" else None


BENCH = sorted(command for command in COMMANDS if bench_words(command) is not None)
FAULTS = sorted(command for command in COMMANDS
                if command.startswith("python -m ddpx_bench.faults "))
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
    # PyTorch's test_c10d_gloo.py, which the wheel does not ship: test_torch_suite.py runs it
    # (-m slow) where DDPX_TORCH_TESTS names a copy.
    "export DDPX_TORCH_TESTS=/path/to/torch-tests PYTHONPATH=$DDPX_TORCH_TESTS:tests":
        "names a copy of PyTorch's test files",
    "DDPX_GLOO_SUITE_ON=gloo python -m pytest tests/torch_gloo_suite.py -p no:cacheprovider "
    "-o addopts= -q": "needs PyTorch's test files",
    "python -m pytest tests/torch_gloo_suite.py -p no:cacheprovider -o addopts= -q":
        "needs PyTorch's test files",
    "python -m pytest -m slow tests/test_torch_suite.py -k gloo_file": "-m slow",
    "python -m pytest -q -s -m slow tests/test_torchft.py -k what_a_fault":
        "-m slow: tests/test_torchft.py's default test runs the same jobs, a fault each",
    "bash tools/gpu_check.sh": "needs a CUDA GPU",
    "bash tools/gpu_check.sh --only tests": "needs a CUDA GPU",
}


def test_every_command_of_the_docs_is_checked():
    assert sorted(COMMANDS) == sorted([*BENCH, *FAULTS, *MULTINODE, *ELSEWHERE])
    assert len(BENCH) >= 20  # the measured tables' commands


@pytest.mark.parametrize("command", BENCH)
def test_a_benchmark_command_of_the_docs_is_accepted(command):
    """`ddpx-bench MODE ...` as the page writes it, through everything the tool checks before
    it runs, and any setting before it a ddpx setting; --plot needs matplotlib, which the test
    extras install."""
    env, argv = bench_words(command)
    assert set(env) <= {setting.name for setting in settings.SETTINGS}, env
    args = cli.parse_args(argv)
    assert args.mode == argv[0]


@pytest.mark.parametrize("command", FAULTS)
def test_a_faults_command_of_the_docs_is_accepted(command):
    """`python -m ddpx_bench.faults ...` (docs/recovery.md's measurements, minutes each) through
    its parser."""
    args = faults.parse_args(shlex.split(command)[3:])
    assert args.faults > 0 or args.soak_s > 0


@pytest.mark.skipif(testbed.unavailable() is not None, reason=str(testbed.unavailable()))
@pytest.mark.parametrize("command", sorted(MULTINODE))
def test_a_multinode_command_of_the_docs_runs_on_two_hosts(command, tmp_path):
    first, second = MULTINODE[command]
    outputs = run_on_two_hosts([command, command.replace(first, second)], tmp_path)
    assert "world size 4" in outputs[0] and "final loss" in outputs[0], outputs[0]
