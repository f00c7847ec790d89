"""PyTorch's own gloo tests (test/distributed/test_c10d_gloo.py) on ddpx: every group the file
makes as gloo, and every ProcessGroupGloo it builds, made on ddpx instead.

The file and the test_c10d_common.py it imports are not in the torch wheel: DDPX_TORCH_TESTS names
a directory that holds both, copied from PyTorch's test/distributed/ at a version that matches the
installed torch (never into this repository). Not collected by default; from the repository root:

    DDPX_TORCH_TESTS=/path/to/torch-tests python -m pytest tests/torch_gloo_suite.py \\
        -p no:cacheprovider -o addopts= -q --junitxml=gloo-on-ddpx.xml

    DDPX_GLOO_SUITE_ON=gloo DDPX_TORCH_TESTS=...   # the same tests on gloo itself, unpatched

What it patches, in the pytest process and in every rank the tests spawn (each imports this module,
because the file's test classes are declared again here, as subclasses):

- ``c10d._new_process_group_helper``: a group asked for as "gloo" (init_process_group, new_group)
  is made as "ddpx"; "cpu:gloo" in a device map becomes "cpu:ddpx".
- ``torch.distributed.ProcessGroupGloo`` (the file's ``c10d.ProcessGroupGloo`` and
  ``dist.ProcessGroupGloo``): ``ProcessGroupGloo(store, rank, size, opts_or_timeout)`` returns a
  ddpx backend made by ddpx.backend's own factory for a group of those ranks. Gloo's options are
  ignored but for their timeout. Every other attribute (``_Options``, ``create_device``) is gloo's.
  torch's own modules keep the real class.

DDPX_GLOO_SUITE_WORLD_SIZE (default 2) is the world size of the classes that take torch's default
of 4 (ProcessGroupGlooTest and its lazy-init variant); the others keep their own: 2 for DDP and
CommTest, 1 for the dispatched-collectives tests, 4 for LargeCommTest.
"""

import os
import sys
import types
import unittest

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal import common_distributed

if not os.environ.get("DDPX_TORCH_TESTS"):
    sys.exit("tests/torch_gloo_suite.py: set DDPX_TORCH_TESTS to the directory holding PyTorch's "
             "test_c10d_gloo.py and test_c10d_common.py")
ON = os.environ.get("DDPX_GLOO_SUITE_ON", "ddpx")
if ON not in ("ddpx", "gloo"):
    sys.exit(f"tests/torch_gloo_suite.py: DDPX_GLOO_SUITE_ON is 'ddpx' or 'gloo', not {ON!r}")
WORLD_SIZE = int(os.environ.get("DDPX_GLOO_SUITE_WORLD_SIZE", "2"))

sys.path.insert(0, os.environ["DDPX_TORCH_TESTS"])
import test_c10d_gloo  # noqa: E402

if ON == "ddpx":
    import ddpx  # noqa: F401  registers the backend
    from ddpx.backend import _create_backend

    _make_group = c10d._new_process_group_helper
    _Gloo = dist.ProcessGroupGloo

    def _on_ddpx(backend):
        spec = str(backend)
        return "ddpx" if spec == "gloo" else spec.replace("cpu:gloo", "cpu:ddpx")

    def _new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend,
                                  *args, **kwargs):
        return _make_group(group_size, group_rank, global_ranks_in_group,
                           c10d.Backend(_on_ddpx(backend)), *args, **kwargs)

    class _GlooAttributes(type):
        def __getattr__(cls, name):
            return getattr(_Gloo, name)

    class ProcessGroupGlooOnDdpx(metaclass=_GlooAttributes):
        """ProcessGroupGloo(store, rank, size, opts_or_timeout), made as a ddpx backend."""

        def __new__(cls, store, rank, size, opts_or_timeout=None):
            timeout = getattr(opts_or_timeout, "_timeout", opts_or_timeout)
            options = types.SimpleNamespace(
                store=store, group_rank=rank, group_size=size, global_ranks_in_group=[],
                timeout=c10d.default_pg_timeout if timeout is None else timeout)
            return _create_backend(options, None)

    c10d._new_process_group_helper = _new_process_group_helper
    dist.ProcessGroupGloo = ProcessGroupGlooOnDdpx
    if hasattr(test_c10d_gloo, "ProcessGroupGloo"):
        test_c10d_gloo.ProcessGroupGloo = ProcessGroupGlooOnDdpx


def _declared_here(cls):
    """The test class as a subclass in this module, at WORLD_SIZE if it takes torch's default."""
    body = {"__module__": __name__}
    if getattr(cls, "world_size", None) is common_distributed.MultiProcessTestCase.world_size:
        body["world_size"] = property(lambda self: WORLD_SIZE)
    return type(cls.__name__, (cls,), body)


for _name, _cls in list(vars(test_c10d_gloo).items()):
    if (isinstance(_cls, type) and issubclass(_cls, unittest.TestCase)
            and _cls.__module__ == test_c10d_gloo.__name__):
        globals()[_name] = _declared_here(_cls)
del _name, _cls
