"""ddpx as the process group torchft reconfigures at each quorum change (``pip install
torchft``; not a dependency of ddpx), in place of torchft's ProcessGroupGloo:

    pg = ddpx.torchft.ProcessGroupDdpx(timeout=timedelta(seconds=30))
    manager = torchft.Manager(pg=pg, min_replica_size=2, load_state_dict=..., state_dict=...)
    model = ddpx.torchft.DistributedDataParallel(manager, model)

The Manager calls ``configure()`` whenever the replicas in the quorum change: it aborts the last
quorum's group and makes a ddpx backend of the new one from the quorum's store, so the replicas
that share a node reduce through shared memory and the others through gloo lanes between the
nodes, as in any ddpx group. A replica that dies mid-step makes its survivors' call raise at once,
naming it ("rank R (pid P) exited ..."); the Manager skips that step and reconfigures.
``DistributedDataParallel`` is torchft's, with a communication hook that survives that failure
(torchft 0.2.0's does not, on any process group). The Manager never shuts its process group down:
``pg.shutdown()`` at the end of training frees the last quorum's. docs/recovery.md has what a
fault costs, and tests/torchft_replica.py is a whole replica.
"""

# No `from __future__ import annotations`: DDP checks the hook's return annotation as an object.
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ddpx import _needs
from ddpx.backend import create_backend

with _needs("torchft"):
    from torchft import ddp as _torchft_ddp
    from torchft.process_group import ProcessGroupWrapper

__all__ = ["DistributedDataParallel", "ProcessGroupDdpx"]


class ProcessGroupDdpx(ProcessGroupWrapper):
    """A torchft process group whose every quorum gets a fresh ddpx backend; ``timeout`` bounds
    each quorum's set-up and each call of its group. ``abort()`` (the Manager's, before each new
    quorum) makes a call still blocked on the old group raise, on every replica of the node, and
    then frees that group's engine thread and segment at once, as ``shutdown()`` does."""

    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store, rank: int, world_size: int) -> ProcessGroup:
        # The replicas' global ranks only name them in errors; where they do not tell the
        # replicas apart (ids without trailing digits), quorum ranks do.
        ranks = self._global_ranks or []
        backend = create_backend(store, rank, world_size, self._timeout,
                                 ranks if len(set(ranks)) == world_size else [])
        group = ProcessGroup(store, rank, world_size)
        group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
        group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        return group

    def abort(self, errored: bool = True) -> None:
        group = self._pg
        super().abort(errored=errored)
        if group is not None:
            group.shutdown()

    def shutdown(self) -> None:
        # torchft's own drops the group and leaves it to the garbage collector.
        group = self._pg
        super().shutdown()
        if group is not None:
            group.shutdown()

    def getBackendName(self) -> str:
        return "torchft-ddpx"


class DistributedDataParallel(_torchft_ddp.DistributedDataParallel):
    """torchft's DistributedDataParallel(manager, module), whose training goes on through a
    failed all-reduce. torchft's own hook (torchft/ddp.py, ``_comm_hook``) reads the Manager's
    future, which is only set when the group's call succeeded: a replica that dies mid-step (the
    call raises, whatever the process group) ends its survivors with an AssertionError, and a
    bucket that the Manager skips because the step has already failed (its _DummyWork) with an
    AttributeError."""

    @staticmethod
    def _comm_hook(manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # The Manager averages the bucket in place, and takes a failure as its own: the step is
        # then not committed (should_commit()), so the bucket's contents no longer matter.
        manager.allreduce(bucket.buffer()).wait()
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
