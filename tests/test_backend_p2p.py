"""Point-to-point on the ddpx backend, through the node's shared-memory rings: send/recv,
isend/irecv, batch_isend_irecv and recv from any source move the bytes gloo moves (messages of
no bytes, of odd sizes, of several rings, every dtype), in the patterns that need more than a
queue (tags received out of order, every pair at once, a send while the peer is in a
collective); a recv of the wrong size or one nobody answers is an error that leaves the group
usable."""

import time

import pytest
import torch

from distributed import payload

# The rings hold 2 MiB per pair at 2 and 3 ranks: the large messages take several.
LARGE = 1_100_000


def _exchange(rank, world, on_ddpx):
    import torch.distributed as dist

    from ddpx import backend_of

    results = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # Blocking send/recv both ways between ranks 0 and 1, sizes from nothing to several rings.
    for n in (0, 1, 17, 4097, LARGE):
        if rank in (0, 1):
            other = 1 - rank
            got = torch.empty(n)
            if rank == 0:
                dist.send(payload(0, 1, n), 1)
                dist.recv(got, 1)
            else:
                dist.recv(got, 0)
                dist.send(payload(1, 0, n), 0)
            results[("send/recv", n)] = got
            assert torch.equal(got, payload(other, rank, n)), n
    # An isend/irecv ring in every dtype.
    for dtype in (torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex64):
        got = torch.empty(3001, dtype=dtype)
        works = [dist.isend(payload(rank, nxt, 3001, dtype), nxt), dist.irecv(got, prv)]
        for work in works:
            work.wait()
        results[("ring", str(dtype))] = got
    # Every pair at once, each message larger than a ring: no pair may wait for another.
    gots = {peer: torch.empty(LARGE) for peer in range(world) if peer != rank}
    ops = [op for peer in gots for op in (dist.P2POp(dist.isend, payload(rank, peer, LARGE), peer),
                                          dist.P2POp(dist.irecv, gots[peer], peer))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for peer, got in gots.items():
        results[("batch", peer)] = got
    # Tags received in the other order than sent: the first message waits aside.
    if rank == 0:
        works = [dist.isend(payload(0, 1, LARGE, tag=1), 1, tag=1),
                 dist.isend(payload(0, 1, 5, tag=2), 1, tag=2)]
        for work in works:
            work.wait()
    elif rank == 1:
        second, first = torch.empty(5), torch.empty(LARGE)
        dist.recv(second, 0, tag=2)
        dist.recv(first, 0, tag=1)
        results["tags"] = (first, second)
    # recv from any source at the last rank: each message says whose it is.
    dist.barrier()
    if rank == world - 1:
        for _ in range(world - 1):
            got = torch.empty(33)
            src = dist.recv(got)
            results[("any", src)] = got
    else:
        dist.send(payload(rank, world - 1, 33), world - 1)
    dist.barrier()
    if on_ddpx:
        # Strided tensors on either end: gloo takes contiguous ones only.
        if rank == 0:
            dist.send(payload(0, 1, 600).view(20, 30).t(), 1)
        elif rank == 1:
            got = torch.empty(20, 30).t()
            dist.recv(got, 0)
            results["strided"] = got.contiguous()
        results["routes"] = backend_of().routes()
    return results


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_point_to_point_moves_what_gloo_moves(world, rank_pool):
    ddpx = rank_pool(world, backend="ddpx").run(_exchange, True)
    gloo = rank_pool(world, backend="gloo").run(_exchange, False)
    for rank in range(world):
        mine, theirs = ddpx[rank], gloo[rank]
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == mine[key].dtype and torch.equal(value, mine[key]), key
        prv = (rank - 1) % world
        for dtype in (torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.complex64):
            assert torch.equal(mine[("ring", str(dtype))], payload(prv, rank, 3001, dtype))
        for peer in range(world):
            if peer != rank:
                assert torch.equal(mine[("batch", peer)], payload(peer, rank, LARGE)), peer
        if rank == 1:
            first, second = mine["tags"]
            assert torch.equal(first, payload(0, 1, LARGE, tag=1))
            assert torch.equal(second, payload(0, 1, 5, tag=2))
            assert torch.equal(mine["strided"], payload(0, 1, 600).view(20, 30).t())
        if rank == world - 1:
            for src in range(world - 1):
                assert torch.equal(mine[("any", src)], payload(src, rank, 33)), src
        routes = mine["routes"]
        assert routes["send"]["gloo"] == 0 and routes["recv"]["gloo"] == 0, routes
        assert routes["send"]["engine"] > 0 and routes["recv"]["engine"] > 0, routes


def _send_during_a_collective(rank, world):
    import torch.distributed as dist

    # Rank 0's all-reduce waits for rank 1, which first waits for rank 0's send: the send must
    # not queue behind the all-reduce.
    total = torch.full((1000,), float(rank + 1))
    got = torch.empty(70_000)
    if rank == 0:
        pending = dist.all_reduce(total, async_op=True)
        dist.send(payload(0, 1, 70_000), 1)
        pending.wait()
    else:
        dist.recv(got, 0)
        dist.all_reduce(total)
        assert torch.equal(got, payload(0, 1, 70_000))
    return total


def test_a_send_does_not_wait_behind_a_collective(rank_pool):
    totals = rank_pool(2, backend="ddpx").run(_send_during_a_collective, timeout=60)
    for total in totals:
        assert torch.equal(total, torch.full((1000,), 3.0))


def _wrong_size_then_usable(rank, world):
    import torch.distributed as dist

    error = None
    if rank == 0:
        dist.send(torch.ones(100), 1)
    else:
        try:
            dist.recv(torch.empty(50), 0)
        except RuntimeError as e:
            error = str(e)
    got = torch.empty(LARGE)
    works = [dist.isend(payload(rank, 1 - rank, LARGE), 1 - rank), dist.irecv(got, 1 - rank)]
    for work in works:
        work.wait()
    return error, torch.equal(got, payload(1 - rank, rank, LARGE))


def test_a_recv_of_the_wrong_size_raises_and_the_pair_goes_on(rank_pool):
    (sent, ok0), (error, ok1) = rank_pool(2, backend="ddpx").run(_wrong_size_then_usable)
    assert sent is None
    assert error is not None and "rank 1 received 400 bytes from rank 0 (tag 0) into a tensor " \
        "of 200 bytes" in error, error
    assert ok0 and ok1


def _unanswered_then_usable(rank, world):
    import torch.distributed as dist

    error, took = None, None
    if rank == 1:
        start = time.monotonic()
        try:
            dist.recv(torch.empty(10), 0, tag=7)
        except RuntimeError as e:
            error, took = str(e), time.monotonic() - start
    else:
        time.sleep(3)  # not in the barrier meanwhile: it would time out too
    dist.barrier()
    got = torch.empty(10)
    works = [dist.isend(payload(rank, 1 - rank, 10), 1 - rank), dist.irecv(got, 1 - rank)]
    for work in works:
        work.wait()
    return error, took, torch.equal(got, payload(1 - rank, rank, 10))


def test_a_recv_nobody_answers_times_out_and_the_group_goes_on(rank_pool):
    """The group's timeout (2 s here) bounds a receive; one that ends before any byte arrived
    leaves the pair usable."""
    results = rank_pool(2, backend="ddpx", group_timeout=2).run(_unanswered_then_usable,
                                                                timeout=60)
    error, took, ok = results[1]
    assert error is not None and "rank 1 timed out after 2 s waiting to receive 40 bytes " \
        "(tag 7) from rank 0" in error, error
    assert 2 <= took < 10, took
    assert results[0][0] is None and results[0][2] and ok
