"""A lost rank under torchrun's elastic restarts (ddpx_bench.faults): scripts/checkpoint.py
trains on ddpx's backend and hook under `torchrun --max-restarts`, a random rank is killed at a
random step, and each time torchrun's one restart comes up (the new start never meets the keys
the dead one left in the store: ddpx._meeting.Meeting.open), the script resumes from its latest
checkpoint by itself, and the final parameters equal an uninterrupted run's bit for bit; nothing
is left in /dev/shm or of the job's processes. `-m slow`: ten minutes of faults, SIGKILL and
SIGSTOP, every 30-60 s, where the survivor of a stopped rank names it."""

from __future__ import annotations

import pytest

from ddpx_bench.faults import parse_args, run_faults


def _check(result: dict) -> None:
    faults = result["faults"]
    assert faults and result["came_up"] == len(faults), faults
    assert all(f["restarts"] == 1 for f in faults), faults
    assert all(f["steps_redone"] >= 1 for f in faults), faults
    assert result["exit_code"] == 0 and result["reference_exit_code"] == 0
    assert result["equal"], (result["digest"], result["reference_digest"])
    assert result["left_in_dev_shm"] == [] and result["left_processes"] == []


def test_killed_ranks_restart_and_resume_to_the_same_parameters():
    _check(run_faults(parse_args(["--faults", "2", "--steps", "300", "--checkpoint_every", "50",
                                  "--seed", "1", "--restart_limit", "90"])))


@pytest.mark.slow
def test_ten_minutes_of_killed_and_stopped_ranks():
    # A stopped rank holds its peers until the group's timeout; then torchrun stops it, which
    # takes torchrun's 30 s grace before its SIGKILL.
    result = run_faults(parse_args([
        "--soak_s", "600", "--fault_every", "30,60", "--signals", "kill,stop", "--timeout", "5",
        "--steps", "480000", "--checkpoint_every", "500", "--log_every", "50",
        "--restart_limit", "120"]))
    _check(result)
    assert len(result["faults"]) >= 5  # 8 in docs/recovery.md's run: stops cost 38 s each
    # Every survivor's error names the stopped rank (its flight record's "behind:" line).
    assert all(f["named_by"] == 1 for f in result["faults"] if f["signal"] == "stop")
