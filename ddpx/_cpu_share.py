"""A rank's share of the CPUs it may run on, and the threads its engine takes from it
(docs/design.md, "A rank's cores")."""

from __future__ import annotations

from ddpx import settings
from ddpx._process_wide import lower_torch_threads

__all__ = ["use_cpu_share"]

# Threads per rank that move a large call's data; None: the rank's share of its CPUs.
_THREADS = settings.auto_or_positive_int("DDPX_THREADS")


def use_cpu_share(engine, index: int, rank_cpus: list[frozenset[int]]) -> None:
    """Gives the engine DDPX_THREADS threads, or local rank ``index``'s share of the CPUs it may
    run on (``rank_cpus``, by local rank): them divided among the node's ranks that may run on
    any of them (all of the node's, unbound; none but itself, each bound to its own cores).
    torch's intra-op threads come down to that share too (``lower_torch_threads``)."""
    mine = rank_cpus[index]
    sharing = sum(1 for cpus in rank_cpus if cpus & mine)
    share = max(1, len(mine) // sharing)
    engine.threads = _THREADS if _THREADS is not None else share
    lower_torch_threads(share, sharing, len(mine), say=index == 0)
