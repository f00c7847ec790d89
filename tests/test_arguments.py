"""Every argument of every public call: what users pass is taken (a timeout in seconds or as a
timedelta), a bad value raises at the call, naming the argument, and nothing else turns into the
silent process-group fallback: a set-up that fails for a reason that is not one of the documented
fallbacks raises on every rank. And what ``describe()`` says of zero-copy, before and after
steps."""

from datetime import timedelta
from importlib.util import find_spec

import pytest
import torch
from torch import nn

from distributed import run_ranks


def model():
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))


def step(ddp) -> None:
    ddp(torch.randn(4, 8)).square().mean().backward()


def bad_arguments(rank, world):
    import ddpx

    refused = [
        (TypeError, "timeout='10'", lambda: ddpx.register_fused_hook(model(), timeout="10")),
        (TypeError, "timeout=True", lambda: ddpx.register_fused_hook(model(), timeout=True)),
        (ValueError, r"timeout=datetime.timedelta\(0\)",
         lambda: ddpx.register_fused_hook(model(), timeout=timedelta(0))),
        (ValueError, "timeout=-1", lambda: ddpx.register_fused_hook(model(), timeout=-1)),
        (ValueError, "timeout=nan", lambda: ddpx.FusedHookState(timeout=float("nan"))),
        (TypeError, "process_group=5", lambda: ddpx.register_fused_hook(model(), process_group=5)),
        (TypeError, "process_group='world'", lambda: ddpx.FusedHookState("world")),
        (ValueError, "compression='int2'",
         lambda: ddpx.register_fused_hook(model(), compression="int2")),
        (ValueError, "device='gpu'", lambda: ddpx.FusedHookState(device="gpu")),
        (TypeError, "DistributedDataParallel", lambda: ddpx.register_fused_hook(nn.Linear(2, 2))),
        (TypeError, "takes a torch.Tensor", lambda: ddpx.all_reduce([1.0, 2.0])),
        (TypeError, "average='yes'", lambda: ddpx.all_reduce(torch.ones(2), average="yes")),
        (TypeError, "group=0", lambda: ddpx.all_reduce(torch.ones(2), group=0)),
        (ValueError, "compression='fp8'",
         lambda: ddpx.all_reduce(torch.ones(2), compression="fp8")),
        (TypeError, "group=3", lambda: ddpx.backend_of(3)),
        (ValueError, "compression='half'", lambda: ddpx.lightning.FusedHook(compression="half")),
        (TypeError, "trainer=object", lambda: ddpx.transformers.FusedHook(object())),
        (ValueError, "compression='x'",
         lambda: ddpx.transformers.FusedHook(_trainer(), compression="x")),
    ]
    for kind, name, call in refused:
        with pytest.raises(kind, match=name):
            call()
    # What users pass for a timeout is taken: the shared-memory engine serves, with that bound.
    for timeout in (10, 2.5, timedelta(seconds=10)):
        ddp = model()
        state = ddpx.register_fused_hook(ddp, timeout=timeout)
        assert isinstance(state.timeout, timedelta) and state.timeout.total_seconds() > 0
        assert state.describe().startswith("ddpx shared memory"), state.describe()
        step(ddp)
    return True


def _trainer():
    from transformers import Trainer, TrainingArguments

    return Trainer(model=nn.Linear(2, 2), args=TrainingArguments("unused", use_cpu=True,
                                                                  report_to=[]))


@pytest.mark.skipif(not (find_spec("lightning") and find_spec("transformers")),
                    reason="needs lightning and transformers")
def test_bad_arguments_raise_naming_them():
    assert run_ranks(bad_arguments, 2) == [True, True]


def setup_fails_on_rank_1(rank, world):
    import ddpx
    from ddpx import _setup

    if rank == 1:
        def broken(options):
            raise KeyError("a bug in the engine's set-up")

        _setup._make_shm_engine = broken
    with pytest.raises((RuntimeError, KeyError)) as raised:
        ddpx.all_reduce(torch.ones(4))
    return type(raised.value).__name__, str(raised.value)


def test_an_unexpected_set_up_error_raises_on_every_rank_not_a_fallback():
    on_0, on_1 = run_ranks(setup_fails_on_rank_1, 2)
    assert on_1 == ("KeyError", '"a bug in the engine\'s set-up"'), on_1
    assert on_0[0] == "RuntimeError", on_0
    assert on_0[1] == ("ddpx: rank 1 failed to set up the group's shared-memory engine: KeyError: "
                       '"a bug in the engine\'s set-up"'), on_0


def describe_zero_copy(rank, world):
    import ddpx

    said = {}
    ddp = model()
    state = ddpx.register_fused_hook(ddp)
    said["fused, before"] = state.describe()
    step(ddp)
    step(ddp)
    said["fused, after"] = state.describe()
    said["details"] = state.describe(details=True)
    python_hooked = model()
    python_hooked.register_comm_hook(ddpx.FusedHookState(), ddpx.fused_allreduce_hook)
    said["python hook"] = ddpx.FusedHookState().describe()
    return said


def test_describe_answers_zero_copy_first():
    said = run_ranks(describe_zero_copy, 2)[0]
    assert said["fused, before"] == ("ddpx shared memory, 2 ranks a node; no compression; "
                                     "zero-copy: yes (0 calls so far)")
    calls = int(said["fused, after"].rsplit("(", 1)[1].split()[0])
    assert calls >= 1, said["fused, after"]
    first, details = said["details"].split("\n")
    assert first.startswith("ddpx shared memory") and "KiB steps" in details
    assert said["python hook"].endswith(
        "zero-copy: no (this Python hook reduces the buckets where DDP keeps them: "
        "ddpx.register_fused_hook moves them into the arena)"), said["python hook"]
