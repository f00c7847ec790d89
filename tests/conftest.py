"""Fixtures shared by the test modules."""

import pytest

from distributed import RankPool


@pytest.fixture(scope="module")
def rank_pool():
    """``rank_pool(world_size, backend=..., env=..., group_timeout=...)``: a RankPool with those
    settings, started once and shared by the module's tests that ask for the same ones (spawning
    ranks and their group costs seconds per rank on 2 cores). One pool lives at a time: asking
    for other settings closes the last one, and the module's end closes it, so no idle ranks
    share the cores with the next module's processes."""
    live = {}

    def pool(world_size: int, backend: str = "gloo", env: dict | None = None,
             group_timeout: float | None = None) -> RankPool:
        key = (world_size, backend, tuple(sorted((env or {}).items())), group_timeout)
        if key not in live:
            for other in live.values():
                other.close()
            live.clear()
            live[key] = RankPool(world_size, backend, env, group_timeout)
        return live[key]

    yield pool
    for other in live.values():
        other.close()
