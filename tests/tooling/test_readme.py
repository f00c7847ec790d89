"""Every line of code a user can copy from the README, run as written: its Python examples under
torchrun (2 processes), ten launches each, every one ending cleanly; its commands in a shell,
from a folder that sees the repository's scripts/ (the scripts' launch lines in
tests/test_scripts.py, with the scripts' checks), the multi-node one on two network-namespace
hosts at the README's own addresses (in tests/tooling/test_docs.py, where docs/ give the same
line); its API and trainer lines in jobs that hold them verbatim (here, and in
tests/test_trainers.py), the API table's signatures against the functions'; the install, test
and results commands as .ci/run's own steps; the accelerate launch lines without a config in
tests/test_scripts.py, the Arm run in a slow test. A line added to the README fails the first
test until this file says what runs it."""

import inspect
import operator
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_docs import MULTINODE as DOCS_MULTINODE
from test_faults import run_job

from distributed import folder_with_scripts, fork_job, torchrun
from documents import code_block_commands

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
# A python block whose first line is "# NAME.py: torchrun --nproc_per_node 2 NAME.py".
RUNNABLE = {found.group(1): found.group(0)
            for found in re.finditer(r"^# (\S+\.py): torchrun --nproc_per_node 2 \1\n.*?(?=^```)",
                                     README, re.S | re.M)}
COMMAND = re.compile(r"(pip|python|accelerate|torchrun|ddpx-bench|bash|docker) \S")


def readme_inline_code() -> list[str]:
    """The prose's inline code that a user can copy as a line: commands and calls."""
    prose = re.sub(r"^```.*?^```", "", README, flags=re.S | re.M)
    spans = dict.fromkeys(" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose))
    return [span for span in spans if COMMAND.match(span) or "(" in span]


# Shell commands this file runs, and a line each prints when it worked.
RUN_HERE = {
    'python -c "import ddpx.settings as s; print(s.describe())"': "DDPX_BLOCK_KB=256 (",
    "ddpx-bench allreduce --quick": "quick mode: one launch,",
}
# Run on two hosts (node 0 as written; node 1 with its own --machine_rank, as the README says)
# by tests/tooling/test_docs.py, where docs/ gives the same line.
MULTINODE = ("accelerate launch --config_file scripts/configs/multinode.yaml --machine_rank 0 "
             "--main_process_ip 10.0.0.1 --main_process_port 29500 scripts/basic.py")
# The API table's signatures: each is its function's, checked with inspect.signature (API_JOB
# calls them).
SIGNATURES = [
    "ddpx.register_fused_hook(ddp_model, *, process_group=None, compression=None, timeout=None, "
    "optimizer=None)",
    "ddpx.all_reduce(tensor, *, group=None, average=False, compression=None)",
    "ddpx.backend_of(group=None)",
    "ddpx.build_info()",
    "ddpx.flight_record(group=None)",
    "ddpx.record(fn)",
]
# Code that a job holds verbatim: API_JOB below, or the named test's.
IN_JOBS = {
    "model.register_comm_hook(ddpx.FusedHookState(), ddpx.fused_allreduce_hook)": None,
    "ddpx.engine.engine_for(group).schedule": None,
    "describe()": None,
    ".describe()": None,
    ".routes()": None,
    "gc.collect()": None,
    "dist.destroy_process_group()": None,
    'init_process_group("ddpx")': None,
    'strategy=DDPStrategy(process_group_backend="ddpx")': "test_trainers.py",
    "callbacks=[ddpx.lightning.FusedHook()]": "test_trainers.py",
    'dist.init_process_group("ddpx")': "test_trainers.py",
    "trainer.add_callback(ddpx.transformers.FusedHook(trainer))": "test_trainers.py",
}
# Lines that .ci/run runs, verbatim.
IN_CI = {
    "pip install torch==2.13.0 ninja",
    "pip install -e .",
    'pip install -e ".[examples,bench]"',
    "pip install -v -e .",
    "pip install .",
    "pip wheel .",
    'pip install torch==2.13.0 ninja && pip install -e ".[test]" && python -m pytest -q',
    "pip install lightning",
    "pip install transformers",
    "bash tools/arm_check.sh",
    'pip install -e ".[peers]"',
    "ddpx-bench allreduce --world_sizes 2 --sizes 64K,1M,4M,25M,100M "
    "--engines gloo,ddpx,ddpx-arena,mpi,deepspeed,copy --runs 1 --bind core",
    "ddpx-bench allreduce --world_sizes 2 --sizes 64K,1M,4M,25M,100M "
    "--engines gloo,ddpx,ddpx-arena,mpi,deepspeed,copy --runs 1 --load 1 --bind core",
}
# Commands a test runs as written, and its file in tests/ (test_arm.py's: `pytest -m slow`).
IN_TESTS = {
    "bash tools/arm_run.sh": "test_arm.py",
    # Each launched once, with its script's checks.
    "accelerate launch --config_file scripts/configs/cpu.yaml scripts/basic.py": "test_scripts.py",
    "accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py":
        "test_scripts.py",
    "accelerate launch --config_file scripts/configs/cpu.yaml scripts/model_parallel.py":
        "test_scripts.py",
    "torchrun --nproc_per_node 2 scripts/basic.py": "test_scripts.py",
    "accelerate launch --num_processes 2 scripts/basic.py": "test_scripts.py",
    "accelerate launch --multi_gpu --num_processes 2 scripts/basic.py": "test_scripts.py",
}
# Lines no machine of this project's CI can run, and where they do run.
ELSEWHERE = {
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
    "pip install ninja": "reaches PyTorch's own index, which this project's machines cannot",
    "accelerate launch --config_file scripts/configs/gpu.yaml --num_processes 2 scripts/basic.py":
        "needs two CUDA GPUs",
    "bash tools/gpu_check.sh": "needs a CUDA GPU: run on the GPU machine some issues are lent",
}

API_JOB = '''
import gc

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel

import ddpx

dist.init_process_group("ddpx")
group = None


def net():
    torch.manual_seed(0)
    return DistributedDataParallel(torch.nn.Linear(8, 4))


def step(model):
    model(torch.full((2, 8), float(dist.get_rank()))).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


model = net()
state = ddpx.register_fused_hook(model, process_group=None, compression=None, timeout=None,
                                 optimizer=None)
ours = step(model)
model = net()
model.register_comm_hook(ddpx.FusedHookState(), ddpx.fused_allreduce_hook)
torch_form = step(model)
reference = step(net())
assert torch.equal(ours, reference) and torch.equal(torch_form, reference)

tensor = torch.full((4,), float(dist.get_rank() + 1))
ddpx.all_reduce(tensor, group=None, average=False, compression=None)
assert tensor.tolist() == [3.0] * 4
backend = ddpx.backend_of(group=None)
print(f"PATHS {state.describe()} | {backend.describe()} | {backend.routes()}")
print(f"BUILD {ddpx.build_info()}")
print(f"RECORD {ddpx.flight_record(group=None)}")
print(f"SCHEDULE {ddpx.engine.engine_for(group).schedule}")

accelerator = Accelerator(cpu=True)  # takes the group made above
print(f"ACCELERATE {accelerator.num_processes}")
del model, state, accelerator
gc.collect()
dist.destroy_process_group()
'''


def test_every_copyable_line_of_the_readme_is_run():
    assert sorted(RUNNABLE) == ["collectives.py", "train.py"]
    assert README.count("```python\n") == len(RUNNABLE)
    lines = code_block_commands(README, "bash") + readme_inline_code()
    known = [*RUN_HERE, MULTINODE, *SIGNATURES, *IN_JOBS, *IN_CI, *IN_TESTS, *ELSEWHERE]
    assert sorted(set(lines)) == sorted(known), "a README line this file does not run, or gone"
    ci = (REPO / ".ci" / "run").read_text()
    assert [line for line in IN_CI if line not in ci] == []
    assert MULTINODE in DOCS_MULTINODE
    assert [line for line, name in IN_TESTS.items()
            if f'"{line}"' not in (REPO / "tests" / name).read_text()] == []
    jobs = {name: (REPO / "tests" / name).read_text() for name in set(IN_JOBS.values()) if name}
    assert [code for code, where in IN_JOBS.items()
            if code not in (jobs[where] if where else API_JOB)] == []


# Launches of each Python example, every one of which must end cleanly: gloo's abort at exit
# (a process group outliving the interpreter) comes in some launches, not in every one. Ten
# launches take a minute an example here: once by default, ten times under -m slow.
@pytest.mark.parametrize("launches", [1, pytest.param(10, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name, expected", [
    ("train.py", "ddpx shared memory, 2 ranks a node"),
    ("collectives.py", "{'all_reduce': {'engine': 1, 'gloo': 0}}"),
])
def test_a_readme_example_runs_as_written_and_ends_cleanly_every_time(name, expected, launches,
                                                                      tmp_path):
    """Each launch exits 0 without "terminate called without an active exception" (torchrun
    asserts both), every rank having printed its line."""
    for _ in range(launches):
        stdout = torchrun(tmp_path, name, RUNNABLE[name], timeout=120)
        assert stdout.count(expected) == 2, stdout  # one line from each rank


def test_the_readme_example_names_a_failing_rank_as_the_root_cause(tmp_path):
    """torchrun stops the other ranks within a moment of the first failure, so the failing
    rank's own error is the one a user can be shown: with the example's ddpx.record, torchrun's
    report quotes it as the root cause (without, it says "To enable traceback see"), and not
    rank 0's error on the connection rank 1 closed as it exited, which torch's own record named
    in some launches."""
    failing = RUNNABLE["train.py"].replace(
        "        optimizer.zero_grad()\n",
        "        optimizer.zero_grad()\n"
        "        if dist.get_rank() == 1:\n"
        "            raise RuntimeError('rank 1 stopped on purpose')\n")
    assert failing != RUNNABLE["train.py"]
    rc, out, _ = run_job(failing, 2, tmp_path, timeout=120)
    assert rc != 0, out
    root_cause = out.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank +: 1 \(local_rank: 1\)", root_cause), out
    assert "RuntimeError: rank 1 stopped on purpose" in root_cause, out


def test_the_readme_example_runs_under_debug_detail_on_the_ddpx_backend(tmp_path):
    """The Known issues' advice: TORCH_DISTRIBUTED_DEBUG=DETAIL crashes the example on gloo
    (torch 2.13.0), and runs it on the ddpx backend."""
    on_ddpx = RUNNABLE["train.py"].replace('init_process_group("gloo")',
                                           'init_process_group("ddpx")')
    assert on_ddpx != RUNNABLE["train.py"]
    rc, out, _ = run_job(on_ddpx, 2, tmp_path, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                         timeout=120)
    assert rc == 0 and "terminate called" not in out, out
    assert out.count("ddpx shared memory, 2 ranks a node") == 2, out


@pytest.mark.parametrize("line", SIGNATURES)
def test_the_api_tables_signatures_are_the_functions(line):
    """Keyword-only parameters shown as such: `register_fused_hook(model, None, "bf16")`, which
    the table once suggested, raises TypeError."""
    import ddpx

    name = line.split("(", 1)[0]
    function = operator.attrgetter(name.removeprefix("ddpx."))(ddpx)
    parameters = [parameter.replace(annotation=inspect.Parameter.empty)
                  for parameter in inspect.signature(function).parameters.values()]
    assert line == f"{name}{inspect.Signature(parameters)}"


def test_the_readmes_torch_is_the_one_ci_tests():
    """Every pinned torch of the README, the CPU install's included, is .ci/run's."""
    ci = set(re.findall(r"torch==(\S+)", (REPO / ".ci" / "run").read_text()))
    assert len(ci) == 1 and set(re.findall(r"torch==([\w.]+)", README)) == ci


def test_the_readme_api_lines_run_as_written(tmp_path):
    """(On ranks forked with torchrun's environment: the examples above run under torchrun.)"""
    codes, stdout = fork_job(API_JOB, tmp_path, 2)
    assert codes == [0, 0], stdout
    assert stdout.count("PATHS ddpx shared memory, 2 ranks a node") == 2, stdout
    assert stdout.count("SCHEDULE auto") == 2 and stdout.count("ACCELERATE 2") == 2
    assert stdout.count("RECORD ddpx flight record, as rank ") == 2, stdout


@pytest.mark.parametrize("command", sorted(RUN_HERE))
def test_a_readme_command_runs_as_written(command, tmp_path):
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300,
                          cwd=folder_with_scripts(tmp_path),
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert RUN_HERE[command] in done.stdout, done.stdout + done.stderr


def test_the_settings_table_is_the_registry():
    from ddpx.settings import SETTINGS

    table = README.split("## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(DDPX_\w+)` \| (.+?) \| (.+?) \|$", table, re.M)
    assert rows == [(s.name, "unset" if s.default is None else f"`{s.default}`", s.meaning)
                    for s in SETTINGS]

