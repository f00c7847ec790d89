"""compression="int8" and "int4": block-scaled integers between nodes, uncompressed within one,
with error feedback. Two nodes of two ranks on this machine (run_nodes) hold the sums to a
float32 reference of the same rounding, bit for bit; the error feedback to its promise (what the
roundings lose is sent later, so the sum over many steps stays one rounding from the exact sum);
a resumed run to an uninterrupted one's bits; and the bytes across to a quarter (an eighth) of
float32's. Three nodes (the second rounding, kept by the piece's owner) run under -m slow."""

import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import left_in_shm, run_nodes, run_ranks, shm_segments

BLOCK = 64  # kBlock, csrc/kernels/quantize.h
SMALLEST = 2.0**-100  # kBlockSmallest: a block below it travels as zeros
LEVELS = {"int8": 127, "int4": 7}  # each way from zero
VALUE_BYTES = {"int8": 1, "int4": 0.5}


def dequantized(v: torch.Tensor, levels: int) -> torch.Tensor:
    """The engine's rounding of float32 v to block-scaled integers of ``levels`` each way,
    dequantized, in plain torch: the same float32 operations (a division, a multiply, a round to
    nearest even, a multiply), so the same bits."""
    out = torch.empty_like(v)
    zero = torch.zeros((), dtype=torch.float32)
    for lo in range(0, v.numel(), BLOCK):
        block = v[lo:lo + BLOCK]
        largest = block.abs().max()
        tiny = largest < SMALLEST
        inverse, scale = (zero, zero) if tiny else (levels / largest, largest / levels)
        out[lo:lo + BLOCK] = torch.round(block * inverse) * scale
    return out


def rank_data(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank)) * (rank + 1)


def reference_sum(n: int, levels: int, world: int = 4, local: int = 2) -> torch.Tensor:
    """Two nodes of `local` ranks, a tensor of one block of the node (n <= the block): each local
    rank's slice of its node's float32 sum (whole 64-byte lines) rounds on its own, and the two
    nodes' dequantized slices add in node order."""
    size = -(-n // (local * 16)) * 16
    node_sums = [sum(rank_data(r, n) for r in range(node * local, (node + 1) * local))
                 for node in range(world // local)]
    total = torch.empty(n)
    for me in range(local):
        lo, hi = min(n, me * size), min(n, (me + 1) * size)
        total[lo:hi] = (dequantized(node_sums[0][lo:hi], levels)
                        + dequantized(node_sums[1][lo:hi], levels))
    return total


def quantized_job(tmp):
    """Each rank's results for int8 and int4: sums (through the engine, no feedback), the bytes
    they put across, and a DDP run whose gradients are the same every step."""
    import ddpx
    from ddpx.engine import engine_for

    rank = dist.get_rank()
    engine = engine_for()
    out = {"nodes": engine.nodes}
    wires = {"int8": torch.int8, "int4": torch.int4}
    for name, wire in [("float32", None), *wires.items()]:
        before = engine.cross_node_bytes
        engine.run(torch.ones(1_000_000), 1.0, wire, "bytes")
        out[f"bytes-{name}"] = engine.cross_node_bytes - before
    out["left_by_all_reduce"] = engine.cross_node_times["calls_left_in_flight"]

    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                  torch.nn.Linear(256, 64))
        return DDP(net, bucket_cap_mb=0.02)

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank))

    def gradients(ddp, steps):
        """The gradients of each step, on the same data and parameters (nothing steps)."""
        seen = []
        for _ in range(steps):
            ddp.zero_grad()
            ddp(x).square().mean().backward()
            seen.append(torch.cat([p.grad.flatten() for p in ddp.parameters()]))
        return seen

    exact = gradients(model(), 1)[0]
    out["exact"] = exact.tolist()
    for name, wire in wires.items():
        mine = out[name] = {}
        for n in (3000, 257, 1):
            t = rank_data(rank, n)
            engine.run(t, 1.0, wire, f"{name} sum")
            mine[f"sum-{n}"] = t.tolist()
        hooked = model()
        state = ddpx.register_fused_hook(hooked, compression=name)
        left_before = state.engine.cross_node_times["calls_left_in_flight"]
        steps = gradients(hooked, 40)
        mine["left_in_flight"] = state.engine.cross_node_times["calls_left_in_flight"] - left_before
        # A gradient that stops (a unit that dies): its residual alone is rounded again and
        # again, 254x (int4: 14x) smaller each step, until it is too small for a scale; it must
        # stay finite.
        torch.manual_seed(1)
        dying = DDP(torch.nn.Linear(64, 64), bucket_cap_mb=0.02)
        ddpx.register_fused_hook(dying, compression=name)
        finite = []
        for step in range(40):
            dying.zero_grad()
            (dying(x).square().mean() * (1.0 if step == 0 else 0.0)).backward()
            finite.append(all(bool(p.grad.isfinite().all()) for p in dying.parameters()))
        mine["dying_finite"] = all(finite)
        mine["buckets"] = len(state.state_dict()["buckets"])
        # Gradient accumulation: under no_sync the hook is not called and the residuals wait.
        before = [b["residual"].clone() for b in state.state_dict()["buckets"]]
        with hooked.no_sync():
            hooked(x).square().mean().backward()
        after = [b["residual"] for b in state.state_dict()["buckets"]]
        mine["no_sync_kept"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        mine["residual_nonzero"] = any(bool(b.abs().max() > 0) for b in after)
        mine["first"] = steps[0].tolist()
        mine["summed"] = torch.stack(steps).sum(0).tolist()
        mine["digest"] = [float(s.double().sum()) for s in steps]
    return out


def resume_job(tmp):
    """Trains 6 steps straight, and 3 + 3 with a checkpoint between (model, optimizer, the
    hook's state, each rank its own file), the second half a new DDP model as a resumed job
    makes one, in int8 and in int4; and 6 straight with the optimizer stepping each bucket in
    flight."""
    import ddpx

    rank = dist.get_rank()
    data = [torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * rank + s))
            for s in range(6)]

    def start(compression="int8", in_flight=False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                  torch.nn.Linear(128, 64))
        ddp = DDP(net, bucket_cap_mb=0.02)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        state = ddpx.register_fused_hook(ddp, compression=compression,
                                         optimizer=optimizer if in_flight else None)
        return ddp, state, optimizer

    def train(ddp, optimizer, steps):
        for s in steps:
            optimizer.zero_grad()
            ddp(data[s]).square().mean().backward()
            optimizer.step()

    def stopped_and_resumed(compression):
        first, state, optimizer = start(compression)
        train(first, optimizer, range(3))
        path = Path(tmp) / f"hook_{compression}_rank{rank}.pt"
        torch.save({"model": first.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "hook": state.state_dict()}, path)
        dist.barrier()
        resumed, state, optimizer = start(compression)
        saved = torch.load(path, map_location="cpu")
        resumed.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        train(resumed, optimizer, range(3, 6))
        return resumed, state, saved

    straight, _, optimizer = start()
    train(straight, optimizer, range(6))
    in_flight, _, optimizer = start(in_flight=True)
    train(in_flight, optimizer, range(6))
    straight_int4, _, optimizer = start("int4")
    train(straight_int4, optimizer, range(6))
    resumed_int4, _, _ = stopped_and_resumed("int4")
    resumed, state, saved = stopped_and_resumed("int8")
    fresh, _, optimizer = start()  # the same resume without the hook's state
    fresh.module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    train(fresh, optimizer, range(3, 6))
    flat = {name: torch.cat([p.detach().flatten() for p in m.parameters()]).tolist()
            for name, m in (("straight", straight), ("resumed", resumed), ("fresh", fresh),
                            ("in flight", in_flight), ("int4 straight", straight_int4),
                            ("int4 resumed", resumed_int4))}
    try:
        state.load_state_dict({**saved["hook"], "rank": (rank + 1) % 4})
        flat["wrong rank"] = "no error"
    except ValueError as error:
        flat["wrong rank"] = str(error)
    flat["buckets"] = len(saved["hook"]["buckets"])
    return flat


def job_source(*jobs) -> str:
    """A job that runs ``jobs`` one after the other in the same ranks; each rank writes what
    each returned, by its name."""
    names = [job.__name__ for job in jobs]
    return textwrap.dedent(f'''
        import json, os, sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        import torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from test_int8 import rank_data
        ''') + "".join(inspect.getsource(job) for job in jobs) + textwrap.dedent(f'''
        dist.init_process_group("gloo")
        out = {{name: globals()[name](sys.argv[1]) for name in {names!r}}}
        with open(os.path.join(sys.argv[1], f"rank{{dist.get_rank()}}.json"), "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
        ''')


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """quantized_job and resume_job, one launch of two nodes: each rank's results by job, and
    ddpx's /dev/shm segments the launch left behind."""
    before = shm_segments()
    results = run_nodes(job_source(quantized_job, resume_job),
                        tmp_path_factory.mktemp("two_nodes"))
    return results, left_in_shm(before)


def assert_feeds_back_its_error(results: list[dict], name: str) -> None:
    """Every rank the same bits; and the same gradient 40 times: without feedback the roundings
    would repeat and add up to 40 times one step's error; with it, what a step loses the next one
    sends, and the sum over every step stays within the last residual (one rounding per node) of
    40 exact gradients."""
    mine = [r[name] for r in results]
    for rank, result in enumerate(mine):
        assert result["digest"] == mine[0]["digest"], f"{name}: rank {rank} holds other bits"
    exact = torch.tensor(results[0]["exact"])
    one_step = (torch.tensor(mine[0]["first"]) - exact).abs().max()
    assert one_step > 0, name  # the rounding rounded something
    drift = (torch.tensor(mine[0]["summed"]) - 40 * exact).abs().max()
    assert drift <= 2 * one_step, (name, drift, one_step)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_across_two_nodes_is_the_reference_rounding_and_feeds_back_its_error(
        two_nodes, name):
    runs, left = two_nodes
    results = [run["quantized_job"] for run in runs]
    assert all(r["nodes"] == 2 for r in results)
    for n in (3000, 257, 1):
        expected = reference_sum(n, LEVELS[name])
        for rank, result in enumerate(results):
            assert torch.equal(torch.tensor(result[name][f"sum-{n}"]), expected), (n, rank)
    # A quarter (an eighth) of float32's bytes, and a float32 scale per 64 values.
    for node in (results[:2], results[2:]):
        fp32 = sum(r["bytes-float32"] for r in node)
        sent = sum(r[f"bytes-{name}"] for r in node)
        assert fp32 == 4_000_000
        values = 1_000_000 * VALUE_BYTES[name]
        assert values < sent <= values + 1_000_000 * 4 / BLOCK + 64, sent
    for result in results:
        # Every bucket but a backward's last returns with its chunks still crossing (the next
        # one follows them onto the link); a plain all-reduce returns with its sum. DDP's first
        # step has one bucket, of every parameter: the 39 after have the saved buckets.
        mine = result[name]
        assert mine["no_sync_kept"] and mine["residual_nonzero"], mine
        assert mine["dying_finite"], "a stopped gradient's residual turned into NaN"
        assert result["left_by_all_reduce"] == 0
        assert mine["left_in_flight"] == 39 * (mine["buckets"] - 1) > 0, mine
    assert_feeds_back_its_error(results, name)
    assert not left, left


def test_int8_and_int4_resume_with_the_same_bits_as_a_run_that_never_stopped(two_nodes):
    results = [run["resume_job"] for run in two_nodes[0]]
    for rank, result in enumerate(results):
        assert result["buckets"] >= 2
        assert result["resumed"] == result["straight"], f"rank {rank}: resumed run differs"
        # Buckets stepped as they come back over the link, some while the next ones cross.
        assert result["in flight"] == result["straight"], f"rank {rank}: steps in flight differ"
        # Without the residuals the run goes on with other bits: the state is what carries them.
        assert result["fresh"] != result["straight"]
        assert "load the file this rank saved" in result["wrong rank"], result["wrong rank"]
        assert result["straight"] == results[0]["straight"]
        assert result["int4 resumed"] == result["int4 straight"], f"rank {rank}: int4 differs"
        assert result["int4 straight"] != result["straight"]  # int4 rounded otherwise


def one_node_quantized(rank, world):
    """On one node int8 and int4 send nothing across: the buckets sum as uncompressed float32,
    the same bits as the hook without compression."""
    import ddpx

    from distributed import train_small_ddp

    plain, _ = train_small_ddp(rank, lambda m: ddpx.register_fused_hook(m))
    out = {}
    for name in ("int8", "int4"):
        params, state = train_small_ddp(
            rank, lambda m, name=name: ddpx.register_fused_hook(m, compression=name))
        errors = {}
        try:
            ddpx.all_reduce(torch.ones(4), compression=name)
        except ValueError as error:
            errors["all_reduce"] = str(error)
        hook_state = ddpx.FusedHookState(compression=name)
        model = DDP(torch.nn.Linear(4, 4))
        model.register_comm_hook(hook_state, ddpx.fused_allreduce_hook)
        try:
            model(torch.ones(2, 4)).sum().backward()
        except Exception as error:  # DDP rethrows the hook's error as a RuntimeError
            errors["python hook"] = str(error)
        out[name] = (plain == params, state.describe(), errors,
                     json.dumps(state.state_dict()["compression"], default=str))
    return out


def test_quantized_within_one_node_is_float32_and_refused_where_no_feedback_is_kept():
    for result in run_ranks(one_node_quantized, 2):
        for name in ("int8", "int4"):
            same, describe, errors, compression = result[name]
            assert same, name
            assert f"{name} between nodes" in describe
            assert f"compression='{name}' needs error feedback" in errors["all_reduce"]
            assert "register_fused_hook keeps" in errors["all_reduce"]
            assert f"compression='{name}' keeps error feedback" in errors["python hook"]
            assert compression == f'"torch.{name}"'


@pytest.mark.slow
def test_int8_and_int4_across_three_nodes_keep_every_rank_on_the_same_bits(tmp_path):
    """Among three nodes each piece of the sum is rounded twice, the second time by its owner,
    who keeps that residual: the same bits everywhere, a quarter (an eighth) of the bytes, and no
    drift."""
    results = [run["quantized_job"]
               for run in run_nodes(job_source(quantized_job), tmp_path, nodes=3)]
    assert all(r["nodes"] == 3 for r in results)
    for name in ("int8", "int4"):
        for rank, result in enumerate(results):
            for n in (3000, 257, 1):
                assert result[name][f"sum-{n}"] == results[0][name][f"sum-{n}"], (name, n, rank)
        for node in range(3):
            fp32 = sum(r["bytes-float32"] for r in results[2 * node:2 * node + 2])
            sent = sum(r[f"bytes-{name}"] for r in results[2 * node:2 * node + 2])
            assert sent <= fp32 * (VALUE_BYTES[name] + 4 / BLOCK) / 4 + 256, (name, sent, fp32)
        assert_feeds_back_its_error(results, name)


def two_host_run(tmp_path: Path, output: Path, *flags: str) -> list[str]:
    """scripts/checkpoint.py on two hosts of a testbed, a rank each, with ddpx's int8 hook."""
    from distributed import free_port, run_on_two_hosts

    port = free_port()
    tmp_path.mkdir()
    command = ("torchrun --nnodes 2 --node_rank {node} --nproc_per_node 1 --master_addr 10.0.0.1 "
               f"--master_port {port} scripts/checkpoint.py --comm_hook ddpx-int8 --steps 40 "
               f"--output_dir {output} " + " ".join(flags))
    return run_on_two_hosts([command.format(node=0), command.format(node=1)], tmp_path)


@pytest.mark.slow
def test_the_checkpoint_script_resumes_int8_on_two_hosts_with_the_same_bits(tmp_path):
    """scripts/checkpoint.py as a user runs it across two machines: 40 steps at once, and 20, a
    checkpoint (each rank's hook state beside the model) and a new launch for the other 20."""
    whole = two_host_run(tmp_path / "whole", tmp_path / "whole-out", "--checkpointing_steps",
                         "0")
    assert "int8 between nodes" in whole[0], whole[0]
    first = two_host_run(tmp_path / "first", tmp_path / "out", "--checkpointing_steps", "20",
                         "--steps", "20")
    assert {p.name for p in (tmp_path / "out").glob("hook_state_rank*.pt")} == {
        "hook_state_rank0.pt", "hook_state_rank1.pt"}, first
    resumed = two_host_run(tmp_path / "resumed", tmp_path / "out", "--resume_from_checkpoint",
                           "latest", "--checkpointing_steps", "0")

    def digest(output: str) -> str:
        return re.search(r"^parameter digest (\S+)$", output, re.MULTILINE).group(1)

    assert "resumed from" in resumed[0] and "after step 20" in resumed[0], resumed[0]
    assert digest(resumed[0]) == digest(whole[0]), (resumed[0], whole[0])
