"""Every DDPX_* environment variable ddpx reads, its default and its meaning, in one place.

ddpx reads them when it is imported (the build-time ones when it is built). ``describe()`` lists
them with the values in effect; the README's settings table is this list. Not among them: the
tests' own ``DDPX_TEST_*`` variables, such as ``DDPX_TEST_NUMA_NODES`` (ddpx/_numa.py), which
fakes the machine's NUMA nodes for tests and is no user's setting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["SETTINGS", "auto_or_positive_int", "describe", "flag", "optional_positive_int",
           "positive_int", "value"]


@dataclass(frozen=True)
class Setting:
    name: str
    default: str | None  # None: unset
    meaning: str


SETTINGS = (
    Setting("DDPX_BLOCK_KB", "256", "one rank's block of a step in shared memory"),
    Setting("DDPX_WIDE_KB", "4096",
            "a wide block (`engine.schedule = \"wide\"` or `\"timed\"`, docs/under-load.md)"),
    Setting("DDPX_ONE_SHOT_KB", "32",
            "messages up to this size are summed whole by every rank, larger ones a slice each"),
    Setting("DDPX_CROSS_CHUNK_KB", "4096",
            "across nodes: how much of a message crosses per chunk of the pipeline (its first two "
            "and last two chunks: a quarter and a half of it)"),
    Setting("DDPX_CROSS_LANES", "1",
            "across nodes: lanes (pairs of process groups) the chunks take turns on"),
    Setting("DDPX_SHM_MB", None,
            "the most of /dev/shm one group's segment may take, in MiB (unset: it fits in half "
            "of what is free); `1` shows the fallback a small /dev/shm gets"),
    Setting("DDPX_COMM_MEMORY", "1",
            "`0`: DDP's buckets stay in ordinary memory. Otherwise they lie in ddpx's arena, "
            "where all-reduces copy nothing in or out: on a ddpx group DDP allocates them there "
            "(ddpx sets DDP_DISABLE_COMM_MEM=0 where the user has not and no GPU is visible), "
            "and ddpx's fused hook on any other group moves each there when it first meets it"),
    Setting("DDPX_THREADS", "auto",
            "threads per rank that move a large call's data; `auto`: the rank's share of the "
            "CPUs it may run on (divided among the local ranks that may run there too), which "
            "is also torch's intra-op threads where OMP_NUM_THREADS is unset"),
    Setting("DDPX_STRICT", None, "`1`: raise instead of falling back to the process group"),
    Setting("DDPX_CACHE_DIR", "~/.cache/ddpx", "where a build at first use goes"),
    Setting("DDPX_SKIP_CUDA", None, "`1`: build without the CUDA kernels"),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}


def value(name: str) -> str | None:
    """The variable's value in this process's environment, or its default."""
    return os.environ.get(name, _BY_NAME[name].default)


def positive_int(name: str) -> int:
    """A size in KiB or a count: a whole number of 1 or more."""
    text = value(name)
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"ddpx: {name}={text!r} is not a whole number of 1 or more; unset it for "
                         f"the default, {_BY_NAME[name].default}")
    return number


def optional_positive_int(name: str) -> int | None:
    """``positive_int``, or None where the variable is unset and has no default."""
    return None if value(name) is None else positive_int(name)


def auto_or_positive_int(name: str) -> int | None:
    """``positive_int``, or None where the variable says ``auto``."""
    return None if value(name) == "auto" else positive_int(name)


def flag(name: str) -> bool:
    return value(name) == "1"


def describe() -> str:
    """One line per setting: its value in effect, whether that is the default, and its meaning."""
    lines = []
    for setting in SETTINGS:
        now = value(setting.name)
        source = "set" if setting.name in os.environ else "default"
        lines.append(f"{setting.name}={'' if now is None else now} ({source}): {setting.meaning}")
    return "\n".join(lines)
