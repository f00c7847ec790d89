"""ddpx in PyTorch Lightning, as its users write it: ``DDPStrategy(process_group_backend="ddpx")``
and the fused hook as a callback (Lightning's ``ddp_comm_hook`` is for CUDA models only), each on
2 CPU processes with the environment torchrun gives them, against Lightning's default DDP on
gloo: the same final weights, and ddpx really on the path. And a FusedHookState made before any
process group exists, as ``DDPStrategy(ddp_comm_state=...)`` makes it, binds when DDP first calls
the hook."""

import importlib
import sys
from importlib.util import find_spec

import pytest
import torch

from distributed import fork_job, run_ranks

# Lightning's import takes 6 s of a core: its jobs import it, this process need not.
pytestmark = pytest.mark.skipif(find_spec("lightning") is None, reason="needs lightning")

JOB = '''
import gc
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy

import ddpx

modes, out = sys.argv[1].split(","), sys.argv[2]


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 4))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


# Each mode trains a fresh model in turn; the first fit's group serves the next ones.
for mode in modes:
    torch.manual_seed(0)
    model = Net()
    data = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=data),
                                             torch.randn(64, 4, generator=data))
    quiet = dict(accelerator="cpu", devices=2, max_steps=5, logger=False,
                 enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)
    # The README's lines, as written there.
    if mode == "backend":
        trainer = L.Trainer(**quiet, strategy=DDPStrategy(process_group_backend="ddpx"))
    elif mode == "callback":
        trainer = L.Trainer(**quiet, strategy=DDPStrategy(),
                            callbacks=[ddpx.lightning.FusedHook()])
    else:
        trainer = L.Trainer(**quiet, strategy=DDPStrategy())
    trainer.fit(model, torch.utils.data.DataLoader(dataset, batch_size=8))
    hook = next((c for c in trainer.callbacks if isinstance(c, ddpx.lightning.FusedHook)), None)
    if trainer.global_rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "backend": dist.get_backend(),
                    "routes": ddpx.backend_of().routes() if mode == "backend" else None,
                    "hook": type(hook.state.engine).__name__ if hook is not None else None},
                   f"{out}/{mode}.pt")
    # The DDP model goes, then the group: a gloo group alive at interpreter exit can abort the
    # process ("terminate called without an active exception": gloo's thread frees a tensor of
    # Python's).
    del trainer, model, hook
    gc.collect()
dist.destroy_process_group()
'''


def train(modes: str, tmp_path, source: str = JOB) -> dict:
    """The job ``source`` run once on 2 ranks with torchrun's environment (forked:
    distributed.fork_job) for ``modes`` (comma-separated, trained one after the other in the
    same ranks); what rank 0 saved, by mode, after checking that no rank failed or aborted."""
    codes, logs = fork_job(source, tmp_path, 2, argv=(modes, tmp_path))
    assert codes == [0, 0] and "terminate called" not in logs, logs
    return {mode: torch.load(tmp_path / f"{mode}.pt") for mode in modes.split(",")}


@pytest.fixture(scope="module")
def gloo_runs(tmp_path_factory):
    """Lightning's default DDP and the fused hook callback on it: one launch, two fits."""
    return train("default,callback", tmp_path_factory.mktemp("gloo"))


@pytest.fixture(scope="module")
def default(gloo_runs):
    return gloo_runs["default"]


def assert_same_weights(result: dict, reference: dict) -> None:
    # 2 ranks: a + b is the same float32 sum whichever path adds it, so the bits match.
    for mine, theirs in zip(result["params"], reference["params"], strict=True):
        assert torch.equal(mine, theirs)


TRAINER_MODULES = {"lightning": ("lightning", "pip install lightning"),
                   "transformers": ("transformers", "pip install transformers")}


def reach_trainer_modules(rank: int, world: int) -> str:
    """What a rank forked before ddpx's import prints (each line: module, then its name or its
    error): rank 0 reaching each trainer module without their libraries; rank 1 and 2, with
    them, after ``import ddpx`` alone, ``ddpx.lightning`` and ``ddpx.transformers``."""
    if rank == 0:
        for package, _ in TRAINER_MODULES.values():
            sys.modules[package] = None  # as where it is not installed
    ddpx = importlib.import_module("ddpx")
    modules = list(TRAINER_MODULES) if rank == 0 else [list(TRAINER_MODULES)[rank - 1]]
    lines = ""
    for module in modules:
        try:
            lines += f"{module} {getattr(ddpx, module).__name__}\n"
        except ImportError as error:
            lines += f"{module} {type(error).__name__}: {error}\n"
    return lines


@pytest.fixture(scope="module")
def trainer_modules() -> tuple[str, str]:
    """What ranks forked from a server that imported torch, and neither ddpx nor the trainers'
    libraries, print (reach_trainer_modules): the libraries' imports (6 s of a core for
    Lightning's) on two of them at once."""
    missing, *found = run_ranks(reach_trainer_modules, 1 + len(TRAINER_MODULES))
    return "".join(found), missing


@pytest.mark.parametrize("module", sorted(TRAINER_MODULES))
def test_import_ddpx_is_enough_for_its_trainer_modules(module, trainer_modules):
    """``ddpx.lightning`` and the others after ``import ddpx`` alone, as the README writes them;
    without the library they need, an error that says what to install."""
    package, install = TRAINER_MODULES[module]
    found, missing = trainer_modules
    assert f"{module} ddpx.{module}\n" in found, found
    assert (f"{module} ModuleNotFoundError: ddpx.{module} needs {package}, which is not "
            f"installed: {install}\n") in missing, missing


def test_lightning_on_the_ddpx_backend(default, tmp_path):
    result = train("backend", tmp_path)["backend"]
    assert default["backend"] == "gloo" and result["backend"] == "ddpx"
    assert_same_weights(result, default)
    # DDP's gradient all-reduces (5 steps) and Lightning's broadcasts ran on the engine.
    assert result["routes"]["all_reduce"]["engine"] >= 5, result["routes"]
    assert result["routes"]["broadcast"]["engine"] > 0, result["routes"]
    assert all(paths["gloo"] == 0 for paths in result["routes"].values()), result["routes"]


def test_lightning_with_the_fused_hook_callback(default, gloo_runs):
    result = gloo_runs["callback"]
    assert result["hook"] == "ShmEngine", result["hook"]
    assert_same_weights(result, default)


LAZY_JOB = '''
import gc
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpx

modes, out = sys.argv[1].split(","), sys.argv[2]
state = ddpx.FusedHookState()  # no process group yet
dist.init_process_group("gloo")
for mode in modes:  # the hooked model first, while the state is still unbound
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)))
    if mode == "lazy":
        model.register_comm_hook(state, ddpx.fused_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    if dist.get_rank() == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "local_ranks": state.engine.local_ranks if mode == "lazy" else None},
                   f"{out}/{mode}.pt")
    del model, optimizer
    gc.collect()
dist.destroy_process_group()
'''


def test_a_hook_state_made_before_the_process_group_binds_at_the_first_bucket(tmp_path):
    runs = train("lazy,default", tmp_path, LAZY_JOB)  # one launch: the hook, then DDP's own
    result, reference = runs["lazy"], runs["default"]
    assert result["local_ranks"] == 2, result["local_ranks"]
    assert_same_weights(result, reference)


HF_JOB = '''
import gc
import sys

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import ddpx

modes, out = sys.argv[1].split(","), sys.argv[2]
if modes != ["default"]:
    dist.init_process_group("ddpx")  # before the TrainingArguments: Accelerate uses it


class Data(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 100, (64, 12), generator=g)
        self.labels = torch.randint(0, 3, (64,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def routes() -> dict:
    return ddpx.backend_of().routes() if modes != ["default"] else {}


# Each mode trains a fresh model in turn, on the same group; its routes are the calls since the
# last mode's (the first's: all the process made).
after = {}
for mode in modes:
    before = after
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=16,
                        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=f"{out}/{mode}.d", max_steps=5,
                             per_device_train_batch_size=8, learning_rate=0.1, optim="sgd",
                             lr_scheduler_type="constant", report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True,
                             ddp_backend="gloo" if mode == "default" else None, seed=0,
                             data_seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Data())
    if mode == "hook":
        trainer.add_callback(ddpx.transformers.FusedHook(trainer))  # as the README writes it
    trainer.train()
    hook = next((c for c in trainer.callback_handler.callbacks
                 if isinstance(c, ddpx.transformers.FusedHook)), None)
    after = routes()
    if dist.get_rank() == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "backend": dist.get_backend(),
                    "routes": {name: {path: calls - before.get(name, {}).get(path, 0)
                                      for path, calls in paths.items()}
                               for name, paths in after.items()} if after else None,
                    "hook": type(hook.state.engine).__name__ if hook is not None else None},
                   f"{out}/{mode}.pt")
    del trainer, model, hook
    gc.collect()
dist.destroy_process_group()
'''


@pytest.fixture(scope="module")
def hf_default(tmp_path_factory):
    pytest.importorskip("transformers")
    return train("default", tmp_path_factory.mktemp("hf-default"), HF_JOB)["default"]


@pytest.fixture(scope="module")
def hf_ddpx_runs(hf_default, tmp_path_factory):
    """The Trainer on ddpx's backend, then with the fused hook: one launch, two trainings."""
    return train("backend,hook", tmp_path_factory.mktemp("hf-ddpx"), HF_JOB)


@pytest.fixture(scope="module")
def hf_backend(hf_ddpx_runs):
    return hf_ddpx_runs["backend"]


def test_hf_trainer_on_the_ddpx_backend(hf_default, hf_backend):
    """A BERT classifier (from a config) trained 5 steps by the Trainer on 2 CPU processes:
    on ddpx's backend, the bits of the Trainer on gloo, and every collective on the engine."""
    assert hf_default["backend"] == "gloo" and hf_backend["backend"] == "ddpx"
    assert_same_weights(hf_backend, hf_default)
    assert hf_backend["routes"]["all_reduce"]["engine"] >= 5, hf_backend["routes"]
    assert all(paths["gloo"] == 0 for paths in hf_backend["routes"].values()), hf_backend["routes"]


def test_hf_trainer_with_the_fused_hook(hf_default, hf_backend, hf_ddpx_runs):
    result = hf_ddpx_runs["hook"]
    assert result["hook"] == "ShmEngine", result["hook"]
    assert_same_weights(result, hf_default)
    # The 5 steps' gradient buckets (one each) went through the hook, not the backend.
    assert (result["routes"]["all_reduce"]["engine"]
            == hf_backend["routes"]["all_reduce"]["engine"] - 5), result["routes"]
