"""The processes of a launched job, for the fault harness (faults.py), the benchmark's launches and
the tests: a free port, whether a process runs, a process that dies with its parent, a job's ranks
found by a marker and killed, ddpx's segments in /dev/shm."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

__all__ = ["JOB_MARK", "alive", "die_with_parent", "free_port", "job_processes", "kill_job",
           "left_in_shm", "segment_creator", "shm_segments"]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie does not, nor does a process whose main thread is
    one while its other threads still exit (waitpid cannot reap it yet, so is_alive() says yes)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone, or going (ESRCH while it exits)
        return False


def die_with_parent() -> None:
    """Have Linux kill this process when its parent dies, even by SIGKILL (a Popen's preexec_fn,
    or a rank's first call): nothing a run starts outlives it."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(1)


# Set to a job's marker in the environment of a command run as written (its ranks' command lines
# need not name the marker): how job_processes finds its processes.
JOB_MARK = "DDPX_TEST_JOB"


def job_processes(marker: str) -> list[int]:
    """Pids of live processes (zombies excluded) whose command line contains ``marker``, or
    whose environment sets JOB_MARK to it."""
    mark = f"{JOB_MARK}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            if marker not in cmdline:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
        except OSError:
            continue
        if alive(int(entry)):
            found.append(int(entry))
    return found


def kill_job(launcher: subprocess.Popen, marker: str) -> None:
    """SIGKILLs a launched job: the launcher's session (started with start_new_session), and the
    workers, which torch's launcher starts in sessions of their own and leaves running when it
    is killed; they are found by ``marker``, a string in their command lines. Returns once they
    are gone (or after 10 s)."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        launcher.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for pid in job_processes(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while job_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.1)


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("ddpx-")}


def segment_creator(segment: str) -> int | None:
    """The pid a ddpx segment's name starts with (None if it names none)."""
    pid = segment.split("-")[1]
    return int(pid) if pid.isdigit() else None


def left_in_shm(before: set[str]) -> set[str]:
    """ddpx's segments made since ``before`` by this process or by processes now gone: left
    behind. A live process's are its job's, another test's run beside this one, or another
    job's on a shared machine."""
    return {name for name in shm_segments() - before
            if (creator := segment_creator(name)) in (None, os.getpid()) or not alive(creator)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
