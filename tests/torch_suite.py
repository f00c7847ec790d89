"""PyTorch's own distributed test suite on ddpx: the CPU tests torch runs against gloo
(torch.testing._internal.distributed.distributed_test), spawned as torch's
test/distributed/test_distributed_spawn.py spawns them, with every process group the suite makes
as gloo made on ddpx instead.

Not collected by default; tests/test_torch_suite.py runs it in a fresh interpreter per world
size, because the suite reads BACKEND and WORLD_SIZE when it is imported:

    BACKEND=gloo WORLD_SIZE=2 python -m pytest tests/torch_suite.py -p no:cacheprovider
"""

import os
import sys

import torch.distributed.distributed_c10d as c10d

if os.environ.get("BACKEND") != "gloo" or "WORLD_SIZE" not in os.environ:
    sys.exit("tests/torch_suite.py runs with BACKEND=gloo and WORLD_SIZE set")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

import ddpx  # noqa: E402,F401  registers the backend

_make_group = c10d._new_process_group_helper


def _on_ddpx(backend):
    """The backend a group the suite makes as gloo is made on: ddpx, CPU only or beside
    another device's backend."""
    spec = str(backend)
    if spec == "gloo":
        return "ddpx"
    return spec.replace("cpu:gloo", "cpu:ddpx")


def _new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, *args,
                              **kwargs):
    return _make_group(group_size, group_rank, global_ranks_in_group,
                       c10d.Backend(_on_ddpx(backend)), *args, **kwargs)


c10d._new_process_group_helper = _new_process_group_helper


class TestDdpxAsGloo(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
