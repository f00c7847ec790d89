"""ddpx.record: a failed rank's error as its launcher's root cause, the first rank to fail first
(the end to end run under torchrun: tests/tooling/test_readme.py and tests/test_scripts.py)."""

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import ddpx


def test_the_first_rank_to_fail_is_the_root_cause_though_a_later_one_has_a_lower_rank(
        tmp_path, monkeypatch):
    """Rank 1 fails, then rank 0 (on what rank 1's exit broke), within one second: torchrun
    sees both at once and lists them by rank, and orders them by their error files' whole
    seconds. With torch's own record rank 0 was the root cause; here rank 1 is."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True)  # the launcher's
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                        "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    error_files = {rank: tmp_path / str(rank) / "error.json" for rank in (0, 1)}
    for rank in (1, 0):
        error_files[rank].parent.mkdir()
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_files[rank]))

        @ddpx.record
        def main(rank=rank):
            raise RuntimeError(f"rank {rank} failed")

        with pytest.raises(RuntimeError, match=f"rank {rank} failed"):
            main()
    failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1,
                                     error_file=str(error_files[rank])) for rank in (0, 1)}
    rank, failure = ChildFailedError("job.py", failures).get_first_failure()
    assert rank == 1 and failure.message["message"] == "RuntimeError: rank 1 failed"
    assert failures[0].timestamp > failures[1].timestamp
