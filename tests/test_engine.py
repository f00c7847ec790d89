"""ddpx.all_reduce on real ranks (one process each, gloo for set-up): values against a float64
reference, the same bits on every rank and under both reduction schedules (one-shot and
two-phase, forced with small blocks), groups, compression, bad input, dead and silent peers, and
the asynchronous path."""

import os
import random
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks

# Small blocks put every schedule on small tensors: one-shot up to 16 KiB, two-phase above, and
# several blocks (and partial last blocks) from 64 KiB on.
SMALL_BLOCKS = {"DDPX_BLOCK_KB": "64", "DDPX_ONE_SHOT_KB": "16"}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SIZES = [0, 1, 3, 17, 4095, 4096, 4097, 16383, 16385, 65537, 262147, 2_100_003]
# Relative half-ulp of each dtype: the one rounding of the float32 sum into the result's dtype.
HALF_ULP = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8,
            torch.float16: 2.0**-11}


def rank_input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return (torch.randn(n, generator=g, dtype=torch.float64) * (rank + 1)).to(dtype)


def assert_close_to_sum(out: torch.Tensor, inputs: list[torch.Tensor], scale: float = 1.0):
    """Within float32 summation error of the exact float64 sum: (world-1) additions of at most
    2^-24 relative error each on the running sum (bounded by the sum of magnitudes), plus the
    final rounding into out's dtype; float64 data is summed in float64."""
    terms = [x.double() * scale for x in inputs]
    exact = sum(terms)
    magnitude = sum(t.abs() for t in terms)
    acc_eps = 2.0**-53 if out.dtype == torch.float64 else 2.0**-24
    bound = (len(inputs) - 1) * acc_eps * magnitude + HALF_ULP[out.dtype] * exact.abs() + 1e-300
    err = (out.double() - exact).abs()
    worst = (err - bound).argmax() if err.numel() else None
    assert (err <= bound).all(), f"error {err[worst].item()} > bound {bound[worst].item()}"


def fingerprint(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def battery(rank, world):
    import ddpx

    prints = {}
    for dtype in DTYPES:
        for n in SIZES:
            inputs = [rank_input(r, n, dtype) for r in range(world)]
            out = inputs[rank].clone()
            assert ddpx.all_reduce(out) is out
            assert_close_to_sum(out, inputs)
            prints[(str(dtype), n)] = fingerprint(out)
    ints = [torch.randint(-1000, 1000, (70_001,), generator=torch.Generator().manual_seed(r))
            .float() for r in range(world)]
    out = ints[rank].clone()
    ddpx.all_reduce(out)
    assert torch.equal(out, sum(ints)), "integer-valued float32 sums must be exact"
    avg = [rank_input(r, 5000, torch.float32) for r in range(world)]
    out = avg[rank].clone()
    ddpx.all_reduce(out, average=True)
    assert_close_to_sum(out, avg, scale=1.0 / world)
    prints["average"] = fingerprint(out)
    return prints


@pytest.mark.parametrize("world,env", [(2, {}), (2, SMALL_BLOCKS), (3, SMALL_BLOCKS),
                                       pytest.param(4, SMALL_BLOCKS, marks=pytest.mark.slow)])
def test_values_and_identical_bits_on_every_rank(world, env):
    prints = run_ranks(battery, world, env=env)
    for other in prints[1:]:
        assert other == prints[0]


def compression(rank, world):
    import ddpx

    prints = {}
    for mode, wire in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        for n in (5, 4097, 100_003):
            inputs = [rank_input(r, n, torch.float32) for r in range(world)]
            out = inputs[rank].clone()
            ddpx.all_reduce(out, average=True, compression=mode)
            assert out.dtype == torch.float32
            # Each input is rounded once to the wire dtype (after the 1/world scale), then summed
            # in float32, in shared memory too; the result stays float32.
            wired = [(x * (1.0 / world)).to(wire).float() for x in inputs]
            assert_close_to_sum(out, wired)
            prints[(mode, n)] = fingerprint(out)
    return prints


@pytest.mark.parametrize("world,env", [(2, {}), (3, SMALL_BLOCKS)])
def test_compression_rounds_inputs_once_and_sums_in_float32(world, env):
    prints = run_ranks(compression, world, env=env)
    assert all(p == prints[0] for p in prints)


def disagreement(rank, world):
    import ddpx

    with pytest.raises(RuntimeError, match="ranks disagree") as info:
        ddpx.all_reduce(torch.ones(100 + rank))
    message = str(info.value)
    if rank == 0:
        bad = torch.ones(64)[::2]
        with pytest.raises(ValueError, match="not contiguous"):
            ddpx.all_reduce(bad)
    else:
        with pytest.raises(RuntimeError, match="rank 0 rejected its input"):
            ddpx.all_reduce(torch.ones(32))
    refused = []
    with pytest.raises(ValueError, match="int64") as info:
        ddpx.all_reduce(torch.ones(8, dtype=torch.int64))
    refused.append(str(info.value))
    with pytest.raises(ValueError, match="float64 and cannot travel as bfloat16") as info:
        ddpx.all_reduce(torch.ones(8, dtype=torch.float64), compression="bf16")
    refused.append(str(info.value))
    with pytest.raises(ValueError, match="compression='int8'"):
        ddpx.all_reduce(torch.ones(8), compression="int8")
    # The engine's refusals read as the Python errors they are: no C++ frames or source paths.
    for text in refused + [message]:
        assert text.startswith("ddpx: ") and ".cpp" not in text and "Exception raised" not in text
    # Every failed call above was a failed call on every rank: the engine is still in step.
    out = torch.full((1000,), float(rank))
    ddpx.all_reduce(out)
    assert torch.equal(out, torch.full((1000,), float(sum(range(world)))))
    return message


def test_disagreeing_and_bad_calls_fail_on_every_rank_and_keep_the_engine_in_step():
    messages = run_ranks(disagreement, 2)
    assert all("100 float32" in m and "101 float32" in m for m in messages)


def groups(rank, world):
    import torch.distributed as dist

    import ddpx

    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine, other = (low, high) if rank < 2 else (high, low)
    out = torch.full((10_000,), float(rank + 1))
    ddpx.all_reduce(out, group=mine)
    expected = 3.0 if rank < 2 else 7.0
    assert torch.equal(out, torch.full((10_000,), expected))
    with pytest.raises(ValueError, match="not a member"):
        ddpx.all_reduce(out, group=other)
    out = torch.full((10,), 1.0)
    ddpx.all_reduce(out)
    assert torch.equal(out, torch.full((10,), 4.0))


def test_groups_reduce_independently():
    run_ranks(groups, 4)


def asynchronous(rank, world):
    from ddpx.engine import engine_for

    engine = engine_for(None)
    out = torch.full((100_000,), float(rank + 1))
    if rank == 1:
        time.sleep(1.0)
    future = engine.run_async(out, 1.0, None, "async test")
    done_on_return = future.done()
    assert future.wait() is out or torch.equal(future.wait(), out)
    assert torch.equal(out, torch.full((100_000,), 3.0))
    return done_on_return


def test_run_async_returns_before_the_reduction():
    done_on_return = run_ranks(asynchronous, 2)
    assert done_on_return[0] is False, "rank 0's future cannot be done while rank 1 sleeps"


def silent_peer(rank, world):
    from ddpx.engine import engine_for

    engine = engine_for(None, timeout=timedelta(seconds=1))
    if rank == 1:
        time.sleep(4)
        return None
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError,
                       match=r"rank 0 timed out after 1 s .* rank\(s\) 1 .*test call"):
        engine.run(torch.ones(10), 1.0, None, "test call")
    return time.monotonic() - start


def test_a_silent_peer_times_out_with_its_rank_named():
    elapsed = run_ranks(silent_peer, 2)[0]
    assert elapsed < 3.5


def dead_peer(rank, world):
    import os

    from ddpx.engine import engine_for

    engine = engine_for(None)
    if rank == 1:
        os._exit(0)
    with pytest.raises(dist.DistBackendError, match=r"rank 1 \(pid \d+\) exited"):
        engine.run(torch.ones(10), 1.0, None, "test call")
    with pytest.raises(dist.DistBackendError, match="unusable"):
        engine.run(torch.ones(10), 1.0, None, "next call")


def test_a_dead_peer_is_an_error_not_a_hang():
    with pytest.raises(AssertionError, match="only ranks \\[0\\] of 2 reported"):
        run_ranks(dead_peer, 2, timeout=60)


def test_needs_an_initialized_process_group():
    import ddpx

    with pytest.raises(RuntimeError, match="init_process_group"):
        ddpx.all_reduce(torch.ones(2))


@pytest.mark.slow  # 16 s; a 1 GiB call runs by default (test_thousands_of_small_calls...)
def test_a_tensor_over_2_gib():
    run_ranks(huge, 2, timeout=600)


def huge(rank, world):
    import ddpx

    n = (1 << 31) // 4 + 1000
    out = torch.full((n,), float(rank + 1))
    ddpx.all_reduce(out)
    assert bool((out == 3.0).all())


def load(rank, world):
    import torch.distributed as dist

    import ddpx

    total = sum(range(1, world + 1))
    for i in range(2000):
        out = torch.full((1000,), float(rank + 1 + i % 7))
        ddpx.all_reduce(out)
        assert bool((out == total + world * (i % 7)).all()), f"small all-reduce {i}"
        if i % 50 == 0:
            check = torch.tensor([float(rank)])
            dist.all_reduce(check)
            assert check.item() == sum(range(world))
            dist.barrier()
    big = torch.full(((1 << 30) // 4,), float(rank + 1))
    ddpx.all_reduce(big)
    assert bool((big == total).all()), "1 GiB all-reduce"
    dist.barrier()


def test_thousands_of_small_calls_and_a_1gib_call_between_process_group_collectives():
    run_ranks(load, 4, timeout=300)


def schedules(rank, world):
    import ddpx
    from ddpx.engine import engine_for

    engine = engine_for(None)
    assert engine.one_shot_bytes == 32 * 1024 and engine.schedule == "auto"
    fixed = {"one-shot": ("narrow", 4096), "narrow": ("narrow", 32), "wide": ("wide", 32),
             "shared": ("shared", 32)}
    results = {}
    for name, (steps, one_shot_kb) in fixed.items():
        engine.schedule, engine.one_shot_bytes = steps, one_shot_kb * 1024
        for n in (8191, 262147, 1_000_003):
            out = rank_input(rank, n, torch.float32)
            ddpx.all_reduce(out)
            results[(name, n)] = fingerprint(out)
    engine.schedule, engine.one_shot_bytes = "timed", 4096 * 1024
    # Enough calls of each size for local rank 0 to try all three schedules twice, then retry.
    for call in range(24):
        for n in (8191, 262147, 1_000_003):
            out = rank_input(rank, n, torch.float32)
            ddpx.all_reduce(out)
            results[("timed", n, call)] = fingerprint(out)
    chosen = {"always_one_shot_bytes": engine.always_one_shot_bytes,
              "one_shot_sizes": engine.one_shot_sizes, "wide_sizes": engine.wide_sizes}
    return chosen, results


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_one_shot_narrow_wide_and_timed_give_the_same_bits_and_agree(world):
    """One-shot and two-phase (narrow or wide) sum every element in rank order in float32, so
    each gives the same bits, whichever local rank 0 picks call by call as it times them; every
    rank applies its choice, and reports it the same on every rank."""
    runs = run_ranks(schedules, world)
    chosen, results = runs[0]
    # Timed steps send up to 32 KiB one-shot always and time the sizes above, although
    # one_shot_bytes is 4 MiB.
    assert chosen["always_one_shot_bytes"] == 32 * 1024, chosen
    for other in runs[1:]:
        assert other == runs[0]
    for (name, n, *_), value in results.items():
        assert value == results[("one-shot", n)], (name, n)


def _runs_of(schedule: str, ran: list[str]) -> list[int]:
    """The lengths of the runs of consecutive calls that ran `schedule`."""
    runs, length = [], 0
    for name in ran + [""]:
        if name == schedule:
            length += 1
        elif length:
            runs.append(length)
            length = 0
    return runs


@pytest.mark.parametrize("faster, slower", [("shared", "narrow"), ("narrow", "shared")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_keeps_to_the_schedule_timed_faster(faster, slower, seed):
    """Idle, local rank 0 times narrow steps against shared blocks per size class (which is
    faster depends on the machine's cross-process copies) and keeps to the faster, trying the
    other in runs of a few calls. Times as a 2-vCPU Xeon measured 1 MB (shared calls 0.06-0.18
    ms as the ranks split the blocks, narrow 0.17-0.21): the faster's average crosses 1.5x the
    other's now and then, and a choice applies two calls after it is made; both together once
    made the choice alternate call after call, half the calls the slower."""
    from ddpx._ext import extension

    rng = random.Random(seed)
    times = {faster: [rng.choice([0.057, 0.086, 0.09, 0.117, 0.18]) for _ in range(1009)],
             slower: [rng.choice([0.165, 0.17, 0.19, 0.21]) for _ in range(1013)]}
    ran = extension().schedule_choices("auto", 1 << 20, times, 3000)
    assert set(ran) == {faster, slower}, "both were tried"
    settled = ran[20:]
    trials = _runs_of(slower, settled)
    # A trial every 32 calls of the faster at most, each of 3 calls and the one after.
    assert trials and max(trials) <= 5, trials
    assert len(trials) <= len(settled) // 32 + 1, len(trials)
    assert settled.count(faster) >= 0.9 * len(settled), settled[:100]


def test_the_policy_and_the_machine_overrule_the_times():
    from ddpx._ext import extension

    choices = extension().schedule_choices
    narrow_faster = {"narrow": [0.1], "shared": [0.2], "wide": [0.3]}
    # A busy machine goes shared, as does the policy "shared"; neither where a rank cannot
    # reach its peers' memory, nor under "narrow" and "wide". The first two calls run what was
    # agreed before the choice was made.
    assert set(choices("auto", 1 << 20, narrow_faster, 200, busy=[True])[2:]) == {"shared"}
    assert set(choices("shared", 1 << 20, narrow_faster, 200)[2:]) == {"shared"}
    assert set(choices("shared", 1 << 20, narrow_faster, 200, reachable=False)) == {"narrow"}
    assert set(choices("auto", 1 << 20, {"narrow": [0.2], "shared": [0.1]}, 200,
                       reachable=False)) == {"narrow"}
    assert set(choices("narrow", 1 << 20, narrow_faster, 200, busy=[True])) == {"narrow"}
    assert set(choices("wide", 1 << 20, narrow_faster, 200)) == {"wide"}
    # With several threads, local rank 0 sends calls over 1 MiB shared: all its threads claim
    # their blocks; up to 1 MiB the times decide.
    assert set(choices("auto", 2 << 20, narrow_faster, 200, threads=2)[2:]) == {"shared"}
    assert choices("auto", 1 << 20, narrow_faster, 200, threads=2)[20:].count("narrow") >= 150
    # Up to the one-shot bytes, one-shot whatever the times.
    assert set(choices("auto", 32 << 10, narrow_faster, 50, busy=[True])) == {"one-shot"}
    # Timed tries every schedule that fits the size and keeps to the fastest.
    timed = choices("timed", 1 << 20, {"narrow": [0.2], "wide": [0.3], "shared": [0.1]}, 400)
    assert set(timed) == {"narrow", "wide", "shared"}
    assert timed[40:].count("shared") >= 0.85 * len(timed[40:])


WIDE_STEPS = {**SMALL_BLOCKS, "DDPX_WIDE_KB": "256"}


def steps_battery(rank, world):
    import ddpx
    from ddpx.engine import engine_for

    engine = engine_for()
    with pytest.raises(ValueError, match="'narrow', 'wide' or 'timed', got 'fast'"):
        engine.schedule = "fast"
    prints, chosen = {}, {}
    for steps in ("narrow", "wide", "timed", "shared"):
        engine.schedule = steps
        for dtype, compression in ((torch.float32, None), (torch.bfloat16, None),
                                   (torch.float32, "bf16"), (torch.float64, None)):
            for n in (16385, 65537, 200_003, 1_000_003):
                inputs = [rank_input(r, n, dtype) for r in range(world)]
                # Timed: enough calls of each size for rank 0 to try both widths and pick.
                for _ in range(6 if steps == "timed" else 1):
                    out = inputs[rank].clone()
                    ddpx.all_reduce(out, compression=compression)
                if compression is None:
                    assert_close_to_sum(out, inputs)
                prints[(steps, str(dtype), compression, n)] = fingerprint(out)
        chosen[steps] = {"block_bytes": engine.block_bytes, "wide_bytes": engine.wide_bytes,
                         "wide_sizes": engine.wide_sizes,
                         "always_one_shot_bytes": engine.always_one_shot_bytes,
                         "shared_now": engine.shared_now}
    return prints, chosen


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_narrow_wide_timed_and_shared_steps_give_the_same_bits_and_agree(world):
    """Narrow (64 KiB) and wide (256 KiB) steps, and blocks any rank sums for all in their
    tensors, sum every element in rank order in float32, so each gives the same bits; with timed
    steps, local rank 0's choice is every rank's."""
    runs = run_ranks(steps_battery, world, env=WIDE_STEPS)
    prints, chosen = runs[0]
    for key, value in prints.items():
        if key[0] != "narrow":
            assert value == prints[("narrow", *key[1:])], key
    timed = chosen["timed"]
    assert (timed["block_bytes"], timed["wide_bytes"]) == (64 * 1024, 256 * 1024), timed
    assert chosen["wide"]["wide_sizes"] == "over 64 KiB", chosen["wide"]
    assert chosen["shared"]["always_one_shot_bytes"] == 16 * 1024, chosen["shared"]
    assert chosen["shared"]["shared_now"], chosen["shared"]
    assert not chosen["narrow"]["shared_now"], chosen["narrow"]
    for other in runs[1:]:
        assert other == runs[0]


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                         (torch.bfloat16, torch.bfloat16), ("fp16", torch.float16),
                                         ("float16", torch.float16), (torch.float16, torch.float16),
                                         ("int8", torch.int8), (torch.int8, torch.int8),
                                         ("int4", torch.int4), (torch.int4, torch.int4),
                                         (None, None)])
def test_compression_takes_torchs_names_and_dtypes_too(name, dtype):
    from ddpx.engine import wire_dtype

    assert wire_dtype(name) is dtype


@pytest.mark.parametrize("name", ["int2", torch.float32, "bf-16"])
def test_an_unknown_compression_names_the_ones_there_are(name):
    from ddpx.engine import wire_dtype

    with pytest.raises(ValueError, match=r"is not one of None, 'bf16' .*'int8'.*'int4'"):
        wire_dtype(name)


def one_rank_never_calls(rank, world):
    import time

    import ddpx

    if rank == 1:
        time.sleep(6)  # past rank 0's store timeout, then leaves without a ddpx call
        return None
    with pytest.raises(RuntimeError) as info:
        ddpx.all_reduce(torch.ones(8))
    return str(info.value)


def test_a_rank_that_never_makes_its_first_call_is_named_within_the_timeout():
    message = run_ranks(one_rank_never_calls, 2, group_timeout=3)[0]
    assert message.startswith("ddpx: rank 1 did not join the set-up of this group's "
                              "shared-memory engine (Timeout waiting for key"), message
    assert message.endswith("look at why rank 1 has not got there"), message


@pytest.mark.parametrize("name, text", [("DDPX_BLOCK_KB", "abc"), ("DDPX_CROSS_LANES", "0")])
def test_a_bad_setting_stops_the_import_naming_it_and_its_default(name, text):
    done = subprocess.run([sys.executable, "-c", "import ddpx"], capture_output=True, text=True,
                          env={**os.environ, name: text}, timeout=120)
    assert done.returncode != 0
    default = {"DDPX_BLOCK_KB": "256", "DDPX_CROSS_LANES": "1"}[name]
    assert (f"ValueError: ddpx: {name}='{text}' is not a whole number of 1 or more; unset it for "
            f"the default, {default}") in done.stderr, done.stderr
