"""A failed rank's error as its launcher's root cause: torch's elastic error record, with the
first rank to fail first."""

import json
import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
from torch.distributed.elastic.multiprocessing.errors import record as _torch_record

__all__ = ["record"]

# How long a failing rank tries to reach its launcher's store to learn whether it failed first.
_STORE_TIMEOUT = timedelta(seconds=5)


def record(fn):
    """Decorate a rank's entry point (its ``main``) so that under torchrun, or ``accelerate
    launch`` on several processes, an exception it raises becomes the job's root cause in the
    launcher's report, traceback and all. torch's
    ``torch.distributed.elastic.multiprocessing.errors.record`` does that, and this is it, with
    one difference: of the ranks that fail, the first names the root cause.

    torch orders the failures by their time in whole seconds, and between equal ones takes the
    lowest rank: when rank 1 raises and rank 0 then fails on the connection rank 1 closed, both
    within one second, torch's record names rank 0's "Connection closed by peer". Here each
    failing rank counts itself in the launcher's store, and a rank that was not the first
    stamps its error one second later, so the first one's comes first.

    Example::

        @ddpx.record
        def main():
            dist.init_process_group("gloo")
            ...
    """
    return _torch_record(fn, error_handler=_FirstFailureFirst())


class _FirstFailureFirst(ErrorHandler):
    """torch's ErrorHandler, which stamps the error file of a rank that failed after another
    one second later than it failed."""

    def record_exception(self, e: BaseException) -> None:
        super().record_exception(e)
        path = self._get_error_file_path()
        if not path or not os.path.exists(path) or _failed_before() == 0:
            return
        with open(path) as f:
            error = json.load(f)
        extra = error["message"]["extraInfo"]
        extra["timestamp"] = str(int(extra["timestamp"]) + 1)
        with open(path, "w") as f:
            json.dump(error, f)


def _failed_before() -> int:
    """How many ranks of this launch failed before this one, counted in the launcher's store
    (torchrun's, where its workers' MASTER_ADDR and MASTER_PORT point); 0 where it cannot be
    reached, which leaves torch's order."""
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=_STORE_TIMEOUT)
        attempt = f"{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ['TORCHELASTIC_RESTART_COUNT']}"
        return store.add(f"ddpx/failed/{attempt}", 1) - 1
    except (KeyError, ValueError, RuntimeError):
        return 0
