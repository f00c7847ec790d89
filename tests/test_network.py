"""Nodes as network namespaces joined by rate-shaped links (ddpx_bench.testbed), one torchrun
each, so the hierarchical all-reduce crosses a real link: exact sums on 2 and 3 nodes and DDP
training equal to DDP's own all-reduce; then faults on the wire (the link cut mid-call, a rank
stopped on the other node, a rank that raises instead of calling), each of which must end in a
ddpx error on every rank within the timeout, never a hang."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddpx_bench import testbed

from distributed import job_processes, left_in_shm, shm_segments, train_small_ddp

pytestmark = pytest.mark.skipif(testbed.unavailable() is not None,
                                reason=str(testbed.unavailable()))

SIZES = [0, 1, 1000, 300_000, 1 << 20]  # the last: 4 MiB of float32
# ddpx's timeout in the fault jobs (FusedHookState(timeout=...)): every wait for a peer, in
# shared memory or across the link. Their process group gets minutes: its timeout also bounds
# the start-up, where ranks of 2 busy cores can be seconds apart.
TIMEOUT_S = 10
# What a ddpx error may take after the fault: the timeout, then the job's reaction on 2 busy
# cores (polls, an abort reaching the node's other rank, writing the report).
BOUND_S = TIMEOUT_S + 10
START_S = 90  # torchrun, imports and process groups of up to 6 ranks on 2 cores


def rank_data(rank: int, n: int):
    import torch

    return torch.randn(n, generator=torch.Generator().manual_seed(1_000_003 * rank + n))


PRELUDE = inspect.getsource(rank_data) + textwrap.dedent('''
    import json, os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import ddpx

    folder = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()

    def report(kind, **what):
        """folder/kind.rank, as JSON; written whole (renamed into place) for the test to poll."""
        path = os.path.join(folder, f"{kind}.{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"at": time.time(), **what}, f)
        os.replace(path + ".tmp", path)
''')

REDUCE = PRELUDE + inspect.getsource(train_small_ddp) + textwrap.dedent('''
    import hashlib

    engine = ddpx.FusedHookState().engine
    out, results = {"nodes": engine.nodes}, {}
    for compression in (None, "bf16"):
        for n in json.loads(sys.argv[2]):
            t = rank_data(rank, n)
            ddpx.all_reduce(t, compression=compression)
            out[f"{compression} {n}"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
            results[f"{compression} {n}"] = t
    if rank == 0:
        torch.save(results, os.path.join(folder, "results.pt"))
    out["default"], _ = train_small_ddp(rank)
    out["ddpx"], _ = train_small_ddp(rank, ddpx.register_fused_hook)
    out["cross_node_bytes"] = engine.cross_node_bytes
    report("result", **out)
    dist.destroy_process_group()
''')

# Each rank reports its first ddpx error ("error"), or "no error" if its calls return. Workers
# ignore torchrun's SIGTERM (as in test_faults.py), so that a rank whose node-mate failed first
# still shows what ddpx raised on it.
FAULT = PRELUDE + textwrap.dedent('''
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fault, node, local = sys.argv[2], int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    big = torch.ones(25 << 18)  # 25 MiB
    compression = os.environ.get("COMPRESSION") or None  # bf16: the chunks cross as send/recv
    # The world's engine, which ddpx.all_reduce uses too, with the test's timeout.
    timeout_s = os.environ.get(f"NODE{node}_TIMEOUT_S", os.environ["TIMEOUT_S"])
    state = ddpx.FusedHookState(timeout=timedelta(seconds=float(timeout_s)))
    # cut-gather: the backend's all-gather across nodes instead, on a group with that timeout.
    gathers = (dist.new_group(backend="ddpx", timeout=timedelta(seconds=float(timeout_s)))
               if fault == "cut-gather" else None)
    gathered = torch.empty(world * big.numel()) if gathers is not None else None
    ddpx.all_reduce(big[:1000])  # every rank is in step from here
    report("ready", nodes=state.engine.nodes)
    try:
        if fault in ("cut", "cut-gather"):
            report("loop")
            while True:
                if gathers is None:
                    ddpx.all_reduce(big, compression=compression)
                else:
                    dist.all_gather_into_tensor(gathered, big, group=gathers)
        if fault == "stop" and node == 1 and local == 1:
            report("stopped")
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "raise" and node == 0 and local == 1:
            try:
                raise RuntimeError("injected: this rank fails before its call")
            except RuntimeError as error:
                report("raised", error=str(error))
            # Out of ddpx while the others wait for it (as in an error handler that writes a
            # checkpoint), until they have all reported; then its next call must raise too.
            deadline = time.monotonic() + float(os.environ["BOUND_S"]) + 5
            while (len([r for r in range(world) if os.path.exists(f"{folder}/error.{r}")]) < 3
                   and time.monotonic() < deadline):
                time.sleep(0.1)
        ddpx.all_reduce(big, compression=compression)
        report("error", error="no error")
    except Exception as error:
        report("error", error=f"{type(error).__name__}: {error}")
        if fault == "stop":
            # Stay alive, holding every connection open: a peer must learn of the fault from
            # ddpx (its timeout, or a rank that gave up), not from a closed socket. The test
            # kills the job.
            signal.pause()
        sys.exit(1)
''')


def reports(folder, kind: str) -> dict[int, dict]:
    found = {}
    for path in folder.glob(f"{kind}.*"):
        if path.suffix[1:].isdigit():
            found[int(path.suffix[1:])] = json.loads(path.read_text())
    return found


def wait_for(folder, kind: str, ranks: int, until: float, jobs) -> dict[int, dict]:
    """Polls until ``ranks`` ranks have written ``kind``, every job exited, or ``until`` passed."""
    while (len(found := reports(folder, kind)) < ranks and time.time() < until
           and any(job.poll() is None for job in jobs)):
        time.sleep(0.1)
    return found


def launch(bed: testbed.Testbed, folder, script: str, *args: str,
           env: dict | None = None) -> list[subprocess.Popen]:
    path = folder / "job.py"
    path.write_text(script)
    return bed.torchrun([str(path), str(folder), *args], nproc_per_node=2,
                        env={"TIMEOUT_S": str(TIMEOUT_S), "BOUND_S": str(BOUND_S), **(env or {})})


def ours() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines()
            if line.startswith(f"ddpx-{os.getpid()}-")]


@pytest.fixture(autouse=True)
def nothing_left(tmp_path):
    """After each test: no namespace, /dev/shm segment or process of its job is left."""
    segments = shm_segments()
    yield
    assert not ours(), f"namespaces left: {ours()}"
    assert not left_in_shm(segments), f"left in /dev/shm: {left_in_shm(segments)}"
    assert not job_processes(str(tmp_path)), "processes of the job are still running"


def finish(bed: testbed.Testbed, jobs, timeout: float) -> list[str]:
    try:
        return bed.communicate(jobs, timeout)
    except TimeoutError as error:
        raise AssertionError(f"{error.args[0]}:\n" + "\n".join(error.args[1])) from None


# ---------------------------------------------------------------------------------------------
# Sums and training across the link


def test_every_node_runs_the_tcp_congestion_control_it_is_given_or_none_is_made():
    # A namespace may default only to what the host allows; a host whose kernel defaults to BBR
    # allows cubic only once cubic has been its own default. The testbed widens that list for as
    # long as it takes and puts it back.
    host = [Path("/proc/sys/net/ipv4", name) for name in
            ("tcp_allowed_congestion_control", "tcp_congestion_control")]
    host_before = [path.read_text() for path in host]
    socket_says = ("import socket; print(socket.socket().getsockopt(socket.IPPROTO_TCP, "
                   "socket.TCP_CONGESTION, 16).rstrip(b'\\0').decode())")

    def ours() -> list[str]:
        return [ns for ns in testbed._namespaces() if ns.startswith(f"ddpx-{os.getpid()}-")]

    for congestion in ("cubic", "reno"):
        with testbed.Testbed(2, rate=None, congestion=congestion) as bed:
            for node in bed.nodes:
                new_socket = subprocess.run(
                    ["ip", "netns", "exec", node.namespace, sys.executable, "-c", socket_says],
                    capture_output=True, text=True, check=True)
                assert new_socket.stdout.strip() == congestion
    with pytest.raises(ValueError, match=r"congestion='no-such': this kernel's TCP offers .*reno"):
        testbed.Testbed(2, rate=None, congestion="no-such")
    assert ours() == []
    assert [path.read_text() for path in host] == host_before


@pytest.mark.slow  # network shaping: the multi-node README and docs lines run by default
@pytest.mark.parametrize("nodes", [2, 3])
def test_sums_and_training_across_shaped_links_match_float64_and_ddp(nodes, tmp_path):
    world = 2 * nodes
    with testbed.Testbed(nodes, rate="1gbit") as bed:
        sent_before = [bed.tx_bytes(k) for k in range(nodes)]
        jobs = launch(bed, tmp_path, REDUCE, json.dumps(SIZES))
        logs = finish(bed, jobs, timeout=START_S + 60)
        sent = [bed.tx_bytes(k) - sent_before[k] for k in range(nodes)]
    assert all(job.returncode == 0 for job in jobs), "\n".join(logs)
    results = reports(tmp_path, "result")
    assert sorted(results) == list(range(world)), "\n".join(logs)
    for result in results.values():
        assert result["nodes"] == nodes, result

    # Every rank holds the same bits (rank 0's are checked against float64 below).
    tensors = torch.load(tmp_path / "results.pt")
    for key, tensor in tensors.items():
        digest = hashlib.sha256(tensor.numpy().tobytes()).hexdigest()
        assert all(result[key] == digest for result in results.values()), key
    for n in SIZES:
        inputs = [rank_data(r, n).double() for r in range(world)]
        exact, magnitude = sum(inputs), sum(x.abs() for x in inputs)
        # Any order of summing `world` float32 values errs by at most (world-1)u * sum|x|, with
        # u = 2^-24 (to first order; the inputs are exact in float32).
        error = (tensors[f"None {n}"].double() - exact).abs()
        assert bool((error <= (world - 1) * 2**-24 * magnitude).all()), (n, error.max())
        # bf16 rounds three times, each by at most u = 2^-8 of a value no larger than sum|x|:
        # every rank's input, each node's partial sum before it crosses, and the total once;
        # the float32 additions between add (world-1) 2^-24, well inside the 0.1 to spare.
        error = (tensors[f"bf16 {n}"].double() - exact).abs()
        assert bool((error <= 3.1 * 2**-8 * magnitude).all()), (n, error.max())

    for result in results.values():
        # As in test_multinode.py: only the order of the float32 additions differs from DDP's.
        for mine, default in zip(result["ddpx"], result["default"], strict=True):
            torch.testing.assert_close(torch.tensor(mine), torch.tensor(default), rtol=1e-5,
                                       atol=1e-6)
        assert result["ddpx"] == results[0]["ddpx"], "ranks hold different parameters"

    # The bytes went over the shaped links: each node sent at least its share of every
    # all-reduce (2(N-1)/N of the message, bandwidth-optimally: float32, then bf16), and at
    # least what its engines count as sent to other nodes.
    share = 2 * (nodes - 1) / nodes * sum(SIZES) * (4 + 2)
    for k in range(nodes):
        counted = sum(results[r]["cross_node_bytes"] for r in (2 * k, 2 * k + 1))
        assert counted >= share * 0.999, (k, counted, share)
        assert sent[k] >= counted, (k, sent[k], counted)


# ---------------------------------------------------------------------------------------------
# Faults on the wire


def run_fault(fault: str, rate: str, tmp_path, env: dict | None = None):
    """Runs FAULT's ``fault`` case on 2 nodes; returns (the fault's time, the ranks' errors,
    the nodes' exit statuses, their outputs). Killing the testbed ends the job however far it
    got: a run that hangs shows as missing errors, never as a stuck test."""
    with ThreadPoolExecutor(1) as pool, testbed.Testbed(2, rate=rate) as bed:
        jobs = launch(bed, tmp_path, FAULT, fault, env=env)
        output = pool.submit(finish, bed, jobs, START_S + 2 * BOUND_S)

        def fail(message: str):
            bed.close()
            raise AssertionError(message + "\n" + "\n".join(output.result()))

        ready = wait_for(tmp_path, "ready", 4, time.time() + START_S, jobs)
        if len(ready) < 4:
            fail(f"only ranks {sorted(ready)} started")
        for r, report in ready.items():
            assert report["nodes"] == 2, (r, report)
        if fault.startswith("cut"):
            if len(wait_for(tmp_path, "loop", 4, time.time() + 30, jobs)) < 4:
                fail("the ranks did not all start their loop")
            time.sleep(1.0)  # well inside a 25 MiB call: each takes seconds at 100mbit
            at = time.time()
            bed.set_link(1, False)
        else:
            faulty, kind = {"stop": (3, "stopped"), "raise": (1, "raised")}[fault]
            found = wait_for(tmp_path, kind, 1, time.time() + 30, jobs)
            if faulty not in found:
                fail(f"rank {faulty} did not reach its fault")
            at = found[faulty]["at"]
        survivors = 3 if fault == "stop" else 4
        errors = wait_for(tmp_path, "error", survivors, at + BOUND_S + 5, jobs)
        if len(errors) == survivors and fault != "stop":
            # Ranks exit once they have reported, and then torchrun: on their own, unkilled.
            deadline = time.time() + 15
            while any(job.poll() is None for job in jobs) and time.time() < deadline:
                time.sleep(0.1)
        statuses = [job.poll() for job in jobs]
        bed.close()
        logs = output.result()
    return at, errors, statuses, logs


def assert_ddpx_errors(at: float, errors: dict, ranks, logs) -> None:
    late = {r: f"{errors[r]['at'] - at:.1f} s" for r in errors}
    missing = [r for r in ranks if r not in errors]
    assert not missing, (f"ranks {missing} raised no error within {BOUND_S + 5} s (those that "
                         f"did, after: {late})\n" + "\n".join(logs))
    for r in ranks:
        assert "ddpx" in errors[r]["error"], (r, errors[r]["error"])
        assert errors[r]["at"] - at <= BOUND_S, f"rank {r} raised after {late[r]}: {errors[r]}"


def assert_exited_with_errors(statuses: list, logs: list[str]) -> None:
    """Both torchruns ended by themselves, failed, and name every rank as exiting with status 1
    (its own sys.exit after its error, not a kill)."""
    assert None not in statuses, f"exit statuses {statuses}: still running\n" + "\n".join(logs)
    assert all(status != 0 for status in statuses), statuses
    exits = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*exitcode\s*: (-?\d+)",
                            "\n".join(logs)))
    assert exits == {str(r): "1" for r in range(4)}, f"exit codes by rank: {exits}"


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["", "bf16"])
def test_a_link_cut_mid_call_raises_on_every_rank_of_both_nodes(compression, tmp_path):
    at, errors, statuses, logs = run_fault("cut", "100mbit", tmp_path,
                                           env={"COMPRESSION": compression})
    assert_ddpx_errors(at, errors, range(4), logs)
    assert_exited_with_errors(statuses, logs)


@pytest.mark.slow  # 25 s; the all-reduce's cut above covers the same waits by default
def test_a_link_cut_mid_all_gather_of_the_backend_raises_on_every_rank(tmp_path):
    at, errors, statuses, logs = run_fault("cut-gather", "100mbit", tmp_path)
    assert_ddpx_errors(at, errors, range(4), logs)
    assert all("all_gather_into_tensor" in errors[r]["error"] for r in range(4)), errors
    assert_exited_with_errors(statuses, logs)


@pytest.mark.slow
def test_a_rank_stopped_on_the_other_node_makes_every_other_rank_raise(tmp_path):
    at, errors, _, logs = run_fault("stop", "1gbit", tmp_path)
    assert 3 not in errors, errors[3]  # stopped, then killed
    assert_ddpx_errors(at, errors, (0, 1, 2), logs)


@pytest.mark.slow
def test_a_rank_that_raises_instead_of_calling_fails_its_partner_on_the_other_node(tmp_path):
    at, errors, statuses, logs = run_fault("raise", "1gbit", tmp_path)
    # Rank 1's node-mate (0) waits for it in shared memory, its partner on node 1 (3) across
    # the link, and 2 for 0; rank 1's own next call must raise too, as the others gave up.
    assert_ddpx_errors(at, errors, range(4), logs)
    assert_exited_with_errors(statuses, logs)



@pytest.mark.slow
@pytest.mark.parametrize("compression", ["", "bf16"])
def test_a_rank_that_gives_up_stops_the_other_nodes_before_their_own_timeout(compression,
                                                                            tmp_path):
    # As above, but node 0's ranks would wait 10 minutes: they are in the check across nodes,
    # where nothing local wakes them (compressed, rank 1 in its receive from rank 3 too). Rank
    # 2 gives up at node 1's timeout (rank 3 is stopped) and says so in the job's store; 0 and 1
    # must raise from that, long before their own.
    at, errors, _, logs = run_fault("stop", "1gbit", tmp_path,
                                    env={"NODE0_TIMEOUT_S": "600", "COMPRESSION": compression})
    assert_ddpx_errors(at, errors, (0, 1, 2), logs)
    assert "timed out" in errors[2]["error"], errors[2]
    for r in (0, 1):
        assert "another rank gave up" in errors[r]["error"], errors[r]
        assert "rank 2 timed out" in errors[r]["error"], errors[r]
