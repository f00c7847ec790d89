"""The example scripts, launched as a user launches them: exit code, output, files, exact resume.

Multi-process runs use `accelerate launch --config_file scripts/configs/cpu.yaml` (and torchrun
once), so they take the same path as a user on a CPU machine.
"""

import os
import re
import select
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from distributed import (
    JOB_MARK,
    folder_with_scripts,
    job_processes,
    kill_job,
    left_in_shm,
    shm_segments,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CPU_CONFIG = SCRIPTS / "configs" / "cpu.yaml"
TIMEOUT_S = 180
STEPS = 40
DEFAULT_STEPS = 100  # a script's --steps when not given
CHECKPOINT_FILES = {
    "plain": {"checkpoint.pt"},
    "accelerate_state": {"accelerate_state/model.safetensors", "accelerate_state/optimizer.bin",
                         "accelerate_state/custom_checkpoint_0.pkl"},
}
COMM_PATHS = {
    "ddpx": "comm path: ddpx",
    "default": "comm path: DDP default all-reduce (gloo)",
    "fp16": "comm path: torch fp16_compress_hook",
    "ddpx-bf16": "; bfloat16\n",
    "ddpx-fp16": "; float16\n",
}


def finish(command: list, env: dict | None = None, marker: str = str(SCRIPTS),
           cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `command` from `cwd` (the repository root) to its end, or kill it and fail at
    TIMEOUT_S.

    The command gets a session of its own, and torch's launcher gives each rank another: a hang
    is ended by kill_job, which finds the ranks by `marker`, a string in their command lines (or
    JOB_MARK's value in their environment).
    """
    with subprocess.Popen(
        [str(part) for part in command],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_job(process, marker)
            stdout, stderr = process.communicate()
            pytest.fail(f"timed out after {TIMEOUT_S} s\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run(command: list, env: dict | None = None, **where) -> str:
    """Run `command` as finish does; its stdout, after checking it exited cleanly."""
    result = finish(command, env, **where)
    output = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, output
    assert "terminate called" not in result.stderr, output
    return result.stdout


def accelerate_launch(script: str, *args, num_processes: int = 2, steps: int = STEPS) -> str:
    return run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_CONFIG,
                "--num_processes", num_processes, SCRIPTS / script, "--steps", steps, *args])


def run_readme_line(command: str, tmp_path: Path) -> str:
    """`command`, a line of the README, run as written in a shell from a folder that sees the
    repository's scripts/ (tmp_path, which JOB_MARK names in its processes' environment); its
    stdout, after checking it exited cleanly."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **{JOB_MARK: str(tmp_path)})
    return run(["bash", "-c", command], env, marker=str(tmp_path),
               cwd=folder_with_scripts(tmp_path))


def accelerate_launch_to_fail(script: str, *args) -> str:
    """`script` under accelerate launch on 2 CPU processes, which must fail: its stdout and
    stderr, after checking that it exited non-zero, with every rank gone and none aborted."""
    result = finish([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                     CPU_CONFIG, SCRIPTS / script, *args])
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert not job_processes(str(SCRIPTS / script)), f"a rank outlived its launcher\n{output}"
    assert "terminate called" not in output, output
    return output


def check_training(stdout: str, world_size: int, comm_path: str) -> None:
    """The run saw `world_size` ranks, used `comm_path`, and its loss fell."""
    assert f"world size {world_size}," in stdout, stdout
    assert comm_path in stdout, stdout
    first = float(re.search(r"^step +0 +loss (\S+)$", stdout, re.MULTILINE).group(1))
    final = float(re.search(r"^final loss (\S+)$", stdout, re.MULTILINE).group(1))
    assert final < first, stdout


def final_state(stdout: str) -> tuple[str, str]:
    return (re.search(r"^final loss (\S+)$", stdout, re.MULTILINE).group(1),
            re.search(r"^parameter digest (\S+)$", stdout, re.MULTILINE).group(1))


# The README's launch lines, which tests/tooling/test_readme.py lists as run here: each as
# written, with no flags, so on ddpx's hook for DEFAULT_STEPS steps, with its script's checks.
README_BASIC, README_CHECKPOINT, README_MODEL_PARALLEL, README_TORCHRUN = (
    "accelerate launch --config_file scripts/configs/cpu.yaml scripts/basic.py",
    "accelerate launch --config_file scripts/configs/cpu.yaml scripts/checkpoint.py",
    "accelerate launch --config_file scripts/configs/cpu.yaml scripts/model_parallel.py",
    "torchrun --nproc_per_node 2 scripts/basic.py",
)


def test_basic_two_processes_as_the_readme_launches_it(tmp_path):
    """(The README's line; the ddpx hook of test_basic_two_processes.)"""
    stdout = run_readme_line(README_BASIC, tmp_path)
    check_training(stdout, 2, COMM_PATHS["ddpx"])


# ddpx's hook: test_basic_two_processes_as_the_readme_launches_it.
@pytest.mark.parametrize("comm_hook", ["default",
                                       *(pytest.param(hook, marks=pytest.mark.slow)
                                         for hook in ("fp16", "ddpx-bf16", "ddpx-fp16"))])
def test_basic_two_processes(comm_hook):
    stdout = accelerate_launch("basic.py", "--comm_hook", comm_hook)
    check_training(stdout, 2, COMM_PATHS[comm_hook])


@pytest.mark.parametrize("comm_hook", [pytest.param("ddpx", marks=pytest.mark.slow), "default"])
def test_basic_on_the_ddpx_backend(comm_hook):
    """--backend ddpx: the job's process group is ddpx's, and DDP's own all-reduce (no hook)
    runs on its shared-memory engine."""
    stdout = accelerate_launch("basic.py", "--backend", "ddpx", "--comm_hook", comm_hook)
    path = ("comm path: DDP default all-reduce (ddpx: ddpx shared-memory engine, 2 local ranks"
            if comm_hook == "default" else COMM_PATHS["ddpx"])
    check_training(stdout, 2, path)
    assert "backend ddpx," in stdout, stdout


@pytest.mark.slow  # 8 s; 2 processes run by default
def test_basic_four_processes():
    stdout = accelerate_launch("basic.py", num_processes=4)
    check_training(stdout, 4, COMM_PATHS["ddpx"])


def test_basic_torchrun(tmp_path):
    """(The README's line.)"""
    stdout = run_readme_line(README_TORCHRUN, tmp_path)
    check_training(stdout, 2, COMM_PATHS["ddpx"])


@pytest.mark.parametrize("script", ["basic.py", "checkpoint.py", "model_parallel.py"])
def test_single_process(script):
    stdout = run([sys.executable, SCRIPTS / script, "--steps", STEPS])
    check_training(stdout, 1, "comm path: none (1 process")


def docstring_as_written(script: str) -> str:
    return (SCRIPTS / script).read_text().split('"""')[1].replace("\\\\", "\\").strip()


# checkpoint.py's: test_help_is_printed_once, from its launch.
@pytest.mark.parametrize("script", ["basic.py", "model_parallel.py"])
def test_help_shows_the_docstring_as_written(script):
    """--help prints the docstring, the launch manual, with the line breaks of its source: each
    launch command on lines of its own. (model_parallel.py ended lines in a lone backslash, which
    Python's string joined to the next, so its help ran two commands together.)"""
    result = finish([sys.executable, SCRIPTS / script, "--help"])
    assert result.returncode == 0, result.stderr
    assert docstring_as_written(script) in result.stdout, result.stdout


# The scripts share their parser (common.py's make_parser): one of them by default.
@pytest.mark.parametrize("script, flags, error", [
    ("basic.py", ["--bogus"], "unrecognized arguments: --bogus"),
    pytest.param("checkpoint.py", ["--comm_hook", "nccl"],
                 "argument --comm_hook: invalid choice: 'nccl'", marks=pytest.mark.slow),
    pytest.param("model_parallel.py", ["--steps", "many"],
                 "argument --steps: invalid int value: 'many'", marks=pytest.mark.slow),
])
def test_a_flag_error_is_printed_once(script, flags, error):
    """Every rank parses the same command line; the usage and the error appear once, not once per
    rank. (The launcher's own failure summary follows; it is not the script's.)"""
    output = accelerate_launch_to_fail(script, *flags)
    errors = re.findall(rf"^{re.escape(script)}: error: (.*)$", output, re.MULTILINE)
    assert len(errors) == 1 and errors[0].startswith(error), output
    assert len(re.findall(rf"^usage: {re.escape(script)} ", output, re.MULTILINE)) == 1, output


def test_help_is_printed_once():
    """(And shows the docstring as written: test_help_shows_the_docstring_as_written's
    checkpoint.py.)"""
    result = finish([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                     CPU_CONFIG, SCRIPTS / "checkpoint.py", "--help"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("usage: checkpoint.py ") == 1, result.stdout
    assert result.stdout.count("--use_accelerate_state ") == 1, result.stdout
    assert docstring_as_written("checkpoint.py") in result.stdout, result.stdout


def test_a_flag_error_is_printed_even_when_the_printing_rank_parses_last(tmp_path):
    """torchrun stops every rank once one fails. Rank 1, which prints nothing, fails its parse
    first here: rank 0 must still get to print the error, once."""
    program = tmp_path / "late_rank_0.py"
    program.write_text(textwrap.dedent(f"""
        import os, pathlib, sys, time
        sys.path.insert(0, {str(SCRIPTS)!r})  # where a script finds its common.py
        from common import make_parser

        parsing = pathlib.Path({str(tmp_path)!r}) / "rank 1 parses"
        if os.environ["LOCAL_RANK"] == "0":
            while not parsing.exists():
                time.sleep(0.05)
            time.sleep(2)  # long enough for torchrun to stop this rank, were rank 1 gone
        else:
            parsing.touch()
        make_parser("late_rank_0").parse_args()
    """))
    result = finish([sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc_per_node", 2, program, "--bogus"], marker=str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert not job_processes(str(tmp_path)), output
    assert re.findall(r"^late_rank_0\.py: error: (.*)$", output, re.MULTILINE) == [
        "unrecognized arguments: --bogus"], output


# The README's lines: the command the project exists for, as a newcomer types it without an
# Accelerate config, and the one that starts two CPU processes without a config.
ONE_PROCESS = "accelerate launch --num_processes 2 scripts/basic.py"
TWO_PROCESSES = "accelerate launch --multi_gpu --num_processes 2 scripts/basic.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")
def test_accelerate_launch_without_a_config_says_at_once_that_it_runs_one_process(tmp_path):
    """Accelerate without a config starts one process on a machine without GPUs, whatever
    --num_processes says. The script's first line says so, with the command that starts two,
    which does."""
    no_config = dict(os.environ, HF_HOME=str(tmp_path))  # where Accelerate's default config is
    launcher, *arguments = shlex.split(ONE_PROCESS)[1:]
    assert launcher == "launch"
    stdout = run([sys.executable, "-m", "accelerate.commands.launch", *arguments,
                  "--steps", STEPS], env=no_config)
    check_training(stdout, 1, "comm path: none (1 process")
    first = stdout.splitlines()[0]
    assert first.startswith("ddpx: 1 process (`accelerate launch` without --multi_gpu or a config "
                            "file starts one on a machine without GPUs, whatever --num_processes "
                            "says); 2 processes: "), stdout
    command = first.split("; 2 processes: ", 1)[1]
    assert command == f"{TWO_PROCESSES} --steps {STEPS}"
    launcher, *arguments = shlex.split(command)[1:]
    assert launcher == "launch"
    # The script by its full path: how finish finds the ranks, should they hang.
    arguments[arguments.index("scripts/basic.py")] = SCRIPTS / "basic.py"
    check_training(run([sys.executable, "-m", "accelerate.commands.launch", *arguments],
                       env=no_config), 2, COMM_PATHS["ddpx"])


def test_a_failing_rank_is_the_root_cause_accelerate_launch_reports(tmp_path):
    """A checkpoint that does not load: the ranks raise, the launcher stops the job, and its
    report quotes the error as the root cause (the scripts' main is ddpx.record), where it
    would otherwise say only "To enable traceback see"."""
    corrupt = tmp_path / "checkpoint.pt"
    corrupt.write_text("not a checkpoint")
    output = accelerate_launch_to_fail("checkpoint.py", "--resume_from_checkpoint", corrupt)
    root_cause = output.split("Root Cause (first observed failure):", 1)[1]
    assert "in load_checkpoint" in root_cause and "UnpicklingError" in root_cause, output


def test_model_parallel(tmp_path):
    """(The README's line.)"""
    stdout = run_readme_line(README_MODEL_PARALLEL, tmp_path)
    check_training(stdout, 2, COMM_PATHS["ddpx"])
    assert "model split: net1 on cpu, net2 on cpu" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA devices")
def test_model_parallel_names_a_missing_device():
    result = subprocess.run([sys.executable, SCRIPTS / "model_parallel.py", "--devices",
                             "cuda:0,cpu"], cwd=ROOT, capture_output=True, text=True,
                            timeout=TIMEOUT_S)
    assert result.returncode == 1, result.stderr
    assert ("--devices cuda:0,cpu: there is no cuda:0, this machine has 0 CUDA device(s)"
            in result.stderr), result.stderr


def test_ranks_write_whole_lines_even_unbuffered():
    """Under PYTHONUNBUFFERED=1 print() writes a line's text and its newline apart, and another
    rank's line landed between them in a CI run ("parameter digest eb17..rank 1: loaded ...").
    After make_accelerator's whole_lines, a line reaches the shared pipe only whole."""
    child = textwrap.dedent("""
        import sys
        from common import whole_lines
        whole_lines(sys.stdout)
        print("parameter digest", end="")
        sys.stderr.write("wrote the text\\n")
        sys.stdin.readline()
        print()
    """)
    with subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, cwd=SCRIPTS,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=dict(os.environ, PYTHONUNBUFFERED="1")) as process:
        try:
            assert process.stderr.readline() == b"wrote the text\n"
            assert select.select([process.stdout], [], [], 0.5)[0] == [], "a part line was written"
            process.stdin.write(b"\n")
            process.stdin.flush()
            assert process.stdout.read() == b"parameter digest\n"
        finally:
            process.kill()


def test_checkpoint_cycle_by_default(tmp_path):
    """With no flags (the README's line): halfway and at the end, rank 0 saves, every rank loads
    the checkpoint back with its map_location and finds the weights it saved; the temporary
    directory is gone after."""
    stdout = run_readme_line(README_CHECKPOINT, tmp_path)
    check_training(stdout, 2, COMM_PATHS["ddpx"])
    assert re.search(r"^parameter digest \S+$", stdout, re.MULTILINE), stdout
    for step in (DEFAULT_STEPS // 2, DEFAULT_STEPS):
        assert f"saved checkpoint after step {step}" in stdout
        for rank in range(2):
            assert re.search(rf"^rank {rank}: loaded the step-{step} checkpoint \(map_location=cpu"
                             r"\): weights equal to the saved ones", stdout, re.MULTILINE), stdout
    directory = re.search(r"^removed the temporary checkpoint directory (\S+)$", stdout,
                          re.MULTILINE).group(1)
    assert not Path(directory).exists()


def test_resuming_the_latest_checkpoint_needs_its_directory():
    result = subprocess.run([sys.executable, SCRIPTS / "checkpoint.py", "--resume_from_checkpoint",
                             "latest"], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 2
    assert "--resume_from_checkpoint latest needs the --output_dir it is in" in result.stderr


# Each mode and each kind of path by default; the other two pairs with -m slow.
@pytest.mark.parametrize("resume, mode", [
    ("latest", "plain"), ("a missing path", "accelerate_state"),
    pytest.param("latest", "accelerate_state", marks=pytest.mark.slow),
    pytest.param("a missing path", "plain", marks=pytest.mark.slow),
])
def test_resuming_a_missing_checkpoint_says_so_once(resume, mode, tmp_path):
    """No checkpoint where --resume_from_checkpoint points: one line, from one rank, naming what
    was looked for where; no traceback; every rank gone, with nothing left in /dev/shm."""
    flags = ["--use_accelerate_state"] if mode == "accelerate_state" else []
    if resume == "latest":
        flags += ["--output_dir", tmp_path, "--resume_from_checkpoint", "latest"]
        latest = "accelerate_state" if mode == "accelerate_state" else "checkpoint.pt"
        expected = f"--resume_from_checkpoint latest: no {latest} in {tmp_path}"
    else:
        missing = tmp_path / "no-such-checkpoint"
        flags += ["--resume_from_checkpoint", missing]
        saved = ("folder of Accelerate's state" if mode == "accelerate_state"
                 else "checkpoint file")
        expected = f"--resume_from_checkpoint {missing}: no {saved} there"
    segments = shm_segments()
    output = accelerate_launch_to_fail("checkpoint.py", *flags)
    errors = re.findall(r"^checkpoint\.py: error: (.*)$", output, re.MULTILINE)
    assert errors == [expected], output
    assert 'scripts/checkpoint.py", line' not in output, output  # the launcher's own is not ours
    assert not left_in_shm(segments)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final loss and parameter digest of checkpoint.py run for all steps at once."""
    stdout = accelerate_launch("checkpoint.py", "--output_dir", tmp_path_factory.mktemp("whole"))
    check_training(stdout, 2, COMM_PATHS["ddpx"])
    return final_state(stdout)


@pytest.mark.slow  # 24 s with its uninterrupted run; test_checkpoint_cycle_by_default stays
@pytest.mark.parametrize("mode", ["plain", "accelerate_state"])
def test_checkpoint_resume(uninterrupted, mode, tmp_path):
    """Half the steps, a checkpoint, a new launch resuming it: the same end, bit for bit.

    Equality is exact, not within a tolerance: each step's batch depends only on (seed, rank,
    step), the checkpoint restores the weights and momentum buffers bit for bit, and ddpx sums
    every gradient in a fixed rank order, so both runs execute the same float operations in the
    same order. Any difference is a lost piece of state (a momentum buffer, a shifted data
    stream) that a tolerance would hide.
    """
    flags = ["--use_accelerate_state"] if mode == "accelerate_state" else []
    half = STEPS // 2
    first = accelerate_launch("checkpoint.py", "--output_dir", tmp_path, "--checkpointing_steps",
                              half, *flags, steps=half)
    assert f"saved checkpoint after step {half}" in first
    written = {str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file()}
    assert CHECKPOINT_FILES[mode] <= written, written
    assert not [name for name in written if name.endswith(".tmp")], written

    resumed = accelerate_launch("checkpoint.py", "--output_dir", tmp_path,
                                "--resume_from_checkpoint", "latest", *flags)
    assert re.search(rf"^resumed from .* after step {half}$", resumed, re.MULTILINE), resumed
    assert final_state(resumed) == uninterrupted


@pytest.mark.slow
def test_a_job_killed_mid_save_keeps_the_previous_checkpoint(uninterrupted, tmp_path):
    """SIGKILL of the whole job while rank 0 is inside a save: the previous checkpoint still
    loads, and resuming from it ends exactly where an uninterrupted run ends.

    The save is caught in the act deterministically: the temporary file it writes is made a FIFO,
    so rank 0 blocks opening it (mid-save) while rank 1 waits for it, until the test kills them.
    """
    half = STEPS // 2
    accelerate_launch("checkpoint.py", "--output_dir", tmp_path, "--checkpointing_steps", half,
                      steps=half)
    checkpoint = tmp_path / "checkpoint.pt"
    os.mkfifo(str(checkpoint) + ".tmp")
    segments = shm_segments()
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CPU_CONFIG,
               SCRIPTS / "checkpoint.py", "--steps", STEPS, "--output_dir", tmp_path,
               "--resume_from_checkpoint", "latest", "--checkpointing_steps", half // 2]
    job = subprocess.Popen([str(part) for part in command], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        for line in job.stdout:
            if line.startswith(f"step {half:4d}"):
                break
        time.sleep(3)  # the next save comes a few milliseconds later, and blocks
        assert job.poll() is None, "the job finished instead of blocking in its save"
    finally:
        kill_job(job, str(tmp_path))
        job.stdout.close()
    assert job.returncode != 0
    assert not job_processes(str(tmp_path)), "processes of the killed job are still running"
    assert torch.load(checkpoint, map_location="cpu")["step"] == half
    assert not left_in_shm(segments)

    os.unlink(str(checkpoint) + ".tmp")
    resumed = accelerate_launch("checkpoint.py", "--output_dir", tmp_path,
                                "--resume_from_checkpoint", "latest")
    assert final_state(resumed) == uninterrupted


@pytest.mark.slow
def test_thirty_consecutive_runs_exit_cleanly():
    """gloo jobs used to abort at interpreter exit now and then ("terminate called without an
    active exception"); `run` fails on that line and on any non-zero exit."""
    for _ in range(30):
        accelerate_launch("basic.py", steps=5)
