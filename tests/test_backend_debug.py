"""The ddpx backend where torch's debugging and pipeline tools meet it: sequence numbers under
TORCH_DISTRIBUTED_DEBUG=DETAIL (and the mismatched calls its checks catch), a future on every
work (point-to-point and coalesced, as batch_isend_irecv makes them), compared with gloo."""

import pytest
import torch

from distributed import run_ranks

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _sequence_numbers(rank, world):
    import torch.distributed as dist

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    seen = [backend._get_sequence_number_for_group()]
    t = torch.ones(3)
    dist.all_reduce(t)
    seen.append(backend._get_sequence_number_for_group())
    dist.broadcast(t, 0)
    dist.barrier()
    seen.append(backend._get_sequence_number_for_group())
    if rank == 0:
        dist.send(t, 1)
    elif rank == 1:
        dist.recv(t, 0)
    seen.append(backend._get_sequence_number_for_group())
    group = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(t, group=group)
        seen.append(group._get_backend(torch.device("cpu"))._get_sequence_number_for_group())
    return seen


@pytest.mark.parametrize("env", [pytest.param({}, marks=pytest.mark.slow), DETAIL],
                         ids=["plain", "debug-detail"])
def test_sequence_numbers_count_calls_as_gloo_does(env):
    """One per call of the backend, p2p included, the same numbers as gloo's, and groups made
    under DETAIL (where torch wraps the backend and needs the numbers)."""
    ddpx = run_ranks(_sequence_numbers, 3, backend="ddpx", env=env)
    gloo = run_ranks(_sequence_numbers, 3, backend="gloo", env=env)
    assert ddpx == gloo
    assert ddpx[0] == [0, 1, 3, 4, 1]


def _mismatched(rank, world):
    import torch.distributed as dist

    t = torch.ones(4 if rank == 0 else 5)
    try:
        dist.all_reduce(t)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_debug_detail_catches_mismatched_calls():
    """Rank 0 all-reduces 4 elements, rank 1 five: DETAIL's fingerprint check names the
    mismatch on every rank before the engine sees the call."""
    for message in run_ranks(_mismatched, 2, backend="ddpx", env=DETAIL):
        assert "Detected mismatch between collectives" in message, message


def _point_to_point_futures(rank, world):
    import torch.distributed as dist

    peer = 1 - rank
    sent = torch.arange(6, dtype=torch.float32) + 10 * rank
    got = torch.zeros(6)
    ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, got, peer)]
    works = dist.batch_isend_irecv(ops)
    for work in works:
        work.get_future().wait()
    batched = got.clone()

    got.zero_()
    work = dist.isend(sent, peer) if rank == 0 else dist.irecv(got, peer)
    values = work.get_future().wait()
    return batched.tolist(), got.tolist(), [v.tolist() for v in values]


def test_point_to_point_works_have_futures():
    """batch_isend_irecv (torch coalesces it) and a single isend/irecv: each work's future
    completes with the work's tensors (gloo's send and receive works have no future)."""
    results = run_ranks(_point_to_point_futures, 2, backend="ddpx")
    for rank, (batched, single, values) in enumerate(results):
        peer_values = [v + 10.0 * (1 - rank) for v in range(6)]
        assert batched == peer_values
        if rank == 0:
            assert single == [0.0] * 6 and values == [[v + 0.0 for v in range(6)]]
        else:
            assert single == peer_values and values == [peer_values]


def _call_timeout(rank, world):
    import time
    from datetime import timedelta

    import torch.distributed as dist

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    t = torch.ones(8)
    if rank == 0:
        opts = dist.AllreduceOptions()
        opts.timeout = timedelta(seconds=0.5)
        start = time.monotonic()
        try:
            backend.allreduce([t], opts).wait()
            return "no error", None
        except RuntimeError as error:
            return str(error), time.monotonic() - start
    time.sleep(3)  # late to the call: rank 0's own timeout ends its wait
    try:
        dist.all_reduce(t)
        return "no error", None
    except RuntimeError as error:
        return str(error), None


def test_a_call_s_own_timeout_bounds_its_waits():
    """AllreduceOptions.timeout (0.5 s) ends rank 0's wait for a peer 3 s late, long before
    the group's 60 s; the late peer then gets an error, not a hang."""
    (first, waited), (second, _) = run_ranks(_call_timeout, 2, backend="ddpx", group_timeout=60)
    assert "rank 0 timed out after 0.5 s waiting for rank(s) 1" in first, first
    assert waited < 30, waited
    assert second != "no error"


def _backend_of(rank, world):
    import torch.distributed as dist

    import ddpx

    t = torch.ones(4)
    dist.all_reduce(t)
    pair = dist.new_group([0, 1], backend="ddpx")
    gloo = dist.new_group([0, 1], backend="gloo")
    out = {name: (backend.engine.local_ranks if backend.engine else None, backend.why_not)
           for name, backend in (("world", ddpx.backend_of()), ("pair", ddpx.backend_of(pair)))}
    out["routes"] = ddpx.backend_of().routes()["all_reduce"]
    try:
        ddpx.backend_of(gloo)
    except ValueError as error:
        out["gloo"] = str(error)
    return out


@pytest.mark.parametrize("env", [{}, DETAIL], ids=["plain", "debug-detail"])
def test_backend_of_reaches_a_groups_ddpx_backend_and_refuses_a_gloo_group(env):
    for out in run_ranks(_backend_of, 2, backend="ddpx", env=env):
        assert out["world"] == out["pair"] == (2, ""), out  # (local ranks, why_not)
        assert out["routes"]["engine"] >= 1 and out["routes"]["gloo"] == 0, out
        assert out["gloo"] == ("ddpx: this group's CPU tensors go to 'gloo', not to ddpx: make the "
                               "group with init_process_group('ddpx') or "
                               "new_group(..., backend='ddpx')"), out
