"""`ddpx-bench converge`: the loss of one learnable task trained from the same model on the same
data with each comm hook, the hooks taking turns step by step; each final loss beside that of DDP's
default (float32), and whether every rank ended with the same parameters.

A few minutes on 2 cores at the defaults (4 ranks, the 2M-parameter MLP, 200 steps of each hook).

    ddpx-bench converge --json bench_out/converge.json --plot bench_out/converge.png
    ddpx-bench converge --world_sizes 2 --params 50K --steps 20 --comm_hooks default,bf16,ddpx
    ddpx-bench converge --link 1gbit --json bench_out/converge-link.json
    ddpx-bench converge --link 1gbit --model gpt --plot bench_out/converge-gpt.png

In detail: for each --comm_hooks entry (the hooks of `ddpx-bench train`, `powersgd` for both
PowerSGD ranks; by default DDP's default, torch's bf16 and PowerSGD hooks, ddpx's float32, bf16,
int8 and int4, and `none`), a DDP copy of the same initial model (--seed) makes --steps optimizer
steps, each on a batch that depends only on the seed, the rank and the step, so every hook sees
the same batches in the same order:

- --model mlp (ddpx_bench.models.MLP of --params parameters): regression, mean squared error, onto
  a fixed random teacher, two Linear layers with a ReLU between (made from --seed), whose outputs
  are centred and scaled to unit variance (so the loss starts near 1). The inputs are standard
  normal in an 8-dimensional subspace of the MLP's width, fixed with the teacher: on inputs that
  fill every dimension the MLP learns next to nothing in 200 steps, and a curve that does not
  fall tells the hooks apart in nothing.
- --model gpt (ddpx_bench.models.GPT): next-token prediction on sequences of its context from a
  fixed random sparse Markov chain over its vocabulary (made from --seed): each token is followed by
  one of 4 successors of its own with probabilities 0.4, 0.3, 0.2 and 0.1, so the loss starts near
  ln(vocab) (9.01) and can fall to the chain's entropy, 1.28.

The optimizer is Adam (--optimizer adam, the default): SGD with momentum 0.9 (--optimizer sgd)
moves the 6-layer MLP, whose layers at PyTorch's default initialization each shrink the signal, off
its first loss only after about half of 200 steps at its best learning rate, where Adam's
per-parameter step sizes start it at once; and transformers are trained with Adam. Its learning
rate falls from --lr toward 0 along half a cosine (--lr_schedule cosine, the default), as training
runs end: at a constant rate (--lr_schedule constant) the parameters still wander with each small
batch at the last step, and two hooks that sum the same gradients in another order (DDP's default
and ddpx's float32) end up to 3% apart in held-out loss; annealed, 0.2% (docs/benchmarks.md). Each
step's loss is the mean over the ranks of each rank's loss (one all-reduce of every step's losses
after the run, outside the steps). Reported per hook: the first loss, the final loss (the mean over
the last 10 steps), the held-out loss (the final parameters' mean loss on 64 batches per rank that
no step trained on, the same batches for every hook) and its distance from default's in percent,
and whether every rank's final parameters are the same bits; --plot draws every hook's loss curve
on one log axis per world size. Each step's loss is of its own small batch, which moves it 2-5%
between hooks that train alike; the held-out loss compares the hooks' models on one set of data.
`none` communicates nothing, each rank stepping with its own gradients: not a way to train, shown
as the curve of no communication. A hook other than `none` whose ranks end with different
parameters makes the run exit with status 1 after the table.
"""

import functools
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ddpx_bench.common import node_count, progress, same_on_all_ranks, steps_in_turns
from ddpx_bench.mode import Mode, choices_option, count, node_options, positive
from ddpx_bench.models import GPT, MLP
from ddpx_bench.report import format_table, save_figure, tcp_line, world_size_panels
from ddpx_bench.train import COMM_HOOKS, HOOK_SHORTHANDS, check_step, hooked_models

# The hooks the issue compares, --comm_hooks' default as typed.
DEFAULT_HOOKS = ("default", "bf16", "powersgd", "ddpx", "ddpx-bf16", "ddpx-int8", "ddpx-int4",
                 "none")
# The final loss is the mean over this many last steps.
FINAL_STEPS = 10
# Each rank evaluates the final parameters on this many batches of its own that no step drew.
HELD_OUT_BATCHES = 64
# The MLP's inputs span this many dimensions; the chain gives each token this many successors.
INPUT_DIMENSIONS = 8
SUCCESSOR_PROBABILITIES = (0.4, 0.3, 0.2, 0.1)


def bench_converge(args) -> dict:
    left_out, failures = {}, []
    torch.manual_seed(args.seed)
    initial = (GPT if args.model == "gpt" else MLP).with_params(args.params)
    task = (_MarkovChain if args.model == "gpt" else _Teacher)(initial, args.seed)
    batch_size = args.batch_size or (4 if args.model == "gpt" else 16)
    models = hooked_models(initial, args.comm_hooks, left_out,
                           functools.partial(_optimizer, args=args))
    losses = {name: [] for name in models}
    steps_of = {
        name: functools.partial(_step, model, optimizer, task, args, batch_size, losses[name])
        for name, (model, _, optimizer) in models.items()
    }
    steps_in_turns(steps_of, range(args.steps), f"world {dist.get_world_size()}")
    held_out = [_held_out_loss(model.module, task, args.seed, batch_size)
                for model, _, _ in models.values()]
    curves = torch.tensor([losses[name] + [loss] for name, loss in zip(models, held_out,
                                                                        strict=True)],
                          dtype=torch.float64)
    dist.all_reduce(curves)  # the sum over the ranks
    curves /= dist.get_world_size()
    progress("training done; comparing the ranks' parameters")
    nodes = node_count()
    rows = []
    for (name, (model, describe, _)), (*curve, held_out_loss) in zip(
            models.items(), curves.tolist(), strict=True):
        if name == "none":
            describe = "no communication, each rank its own gradients: not a way to train"
        same = same_on_all_ranks(model.module.parameters())
        if not same and name != "none":
            failures.append(f"{name}: parameters differ across ranks")
        rows.append({
            "world_size": dist.get_world_size(),
            "nodes": nodes,
            "hook": name,
            "describe": describe,
            "params": sum(p.numel() for p in initial.parameters()),
            "model": type(initial).__name__,
            "batch_size": batch_size,
            "steps": args.steps,
            "optimizer": args.optimizer,
            "lr": args.lr,
            "lr_schedule": args.lr_schedule,
            "losses": curve,
            "first_loss": curve[0],
            "final_loss": sum(curve[-FINAL_STEPS:]) / len(curve[-FINAL_STEPS:]),
            "held_out_loss": held_out_loss,
            "same_on_all_ranks": same,
            "trains": name != "none",
        })
    default = next((row for row in rows if row["hook"] == "default"), None)
    for row in rows:
        for loss, pct in (("final_loss", "final_vs_default_pct"),
                          ("held_out_loss", "vs_default_pct")):
            row[pct] = 100 * (row[loss] - default[loss]) / default[loss] if default else None
    return {"rows": rows, "left_out": left_out, "notes": [], "failures": failures}


class _Teacher:
    """The MLP's task: regression onto a fixed random two-layer ReLU network's outputs, centred
    and scaled to unit variance, on standard normal inputs in a fixed INPUT_DIMENSIONS-dimensional
    subspace."""

    def __init__(self, mlp: MLP, seed: int):
        width = mlp.width
        generator = torch.Generator().manual_seed(task_seed(seed))
        self.basis = torch.randn(INPUT_DIMENSIONS, width, generator=generator)
        self.basis /= math.sqrt(INPUT_DIMENSIONS)  # inputs of unit variance
        self.layers = [
            (torch.randn(width, width, generator=generator) / math.sqrt(width),
             torch.randn(width, generator=generator) / math.sqrt(width))
            for _ in range(2)
        ]
        probe = self._raw(self.inputs(generator, 4096))
        self.mean = probe.mean(0)
        self.scale = 1 / (probe - self.mean).std()

    def inputs(self, generator: torch.Generator, rows: int) -> torch.Tensor:
        return torch.randn(rows, INPUT_DIMENSIONS, generator=generator) @ self.basis

    def _raw(self, x: torch.Tensor) -> torch.Tensor:
        (w1, b1), (w2, b2) = self.layers
        return torch.relu(x @ w1 + b1) @ w2 + b2

    def batch(self, generator: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.inputs(generator, rows)
        return x, (self._raw(x) - self.mean) * self.scale

    @staticmethod
    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, target = batch
        return (model(x) - target).square().mean()


class _MarkovChain:
    """The GPT's task: next-token prediction on sequences of its context from a fixed random
    Markov chain over its vocabulary, each token followed by one of its own few successors with
    SUCCESSOR_PROBABILITIES; the first token uniform."""

    def __init__(self, gpt: GPT, seed: int):
        generator = torch.Generator().manual_seed(task_seed(seed))
        self.vocab, self.context = gpt.vocab, gpt.context
        self.successors = torch.randint(self.vocab, (self.vocab, len(SUCCESSOR_PROBABILITIES)),
                                        generator=generator)
        self.probabilities = torch.tensor(SUCCESSOR_PROBABILITIES)

    def batch(self, generator: torch.Generator, rows: int) -> torch.Tensor:
        ids = torch.empty(rows, self.context, dtype=torch.long)
        ids[:, 0] = torch.randint(self.vocab, (rows,), generator=generator)
        choices = torch.multinomial(self.probabilities, rows * (self.context - 1),
                                    replacement=True, generator=generator)
        choices = choices.view(rows, self.context - 1)
        for position in range(self.context - 1):
            ids[:, position + 1] = self.successors[ids[:, position], choices[:, position]]
        return ids

    @staticmethod
    def loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return GPT.next_token_loss(model(ids), ids)


def _optimizer(model: torch.nn.Module, args) -> torch.optim.Optimizer:
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=args.lr)


def _learning_rate(args, index: int) -> float:
    """Step `index`'s learning rate: --lr throughout, or (cosine) from --lr at the first step
    along half a cosine that reaches 0 one step after the last, as torch's CosineAnnealingLR
    with T_max of the run's steps."""
    if args.lr_schedule == "constant":
        return args.lr
    return args.lr * 0.5 * (1 + math.cos(math.pi * index / args.steps))


def _step(model, optimizer: torch.optim.Optimizer, task, args, batch_size: int,
          losses: list[float], index: int) -> None:
    """Step `index` of `model` on this rank's batch of that step, the same for every hook."""
    generator = torch.Generator().manual_seed(step_seed(args.seed, dist.get_rank(), index))
    batch = task.batch(generator, batch_size)
    for group in optimizer.param_groups:
        group["lr"] = _learning_rate(args, index)
    optimizer.zero_grad()
    loss = task.loss(model, batch)
    loss.backward()
    optimizer.step()
    check_step(model, index)
    losses.append(loss.item())


def step_seed(seed: int, rank: int, index: int) -> int:
    """The seed of the stream rank `rank` draws its batch of step `index` from: below 2**61 for
    seeds, ranks and steps under 2**20, so below task_seed's and held_out_seed's."""
    return (seed * 1_000_003 + rank) * 1_000_003 + index


def task_seed(seed: int) -> int:
    """The seed of the stream the task (the teacher, the chain) is made from."""
    return 2**61 + seed


def held_out_seed(seed: int, rank: int) -> int:
    """The seed of the stream rank `rank` draws its held-out batches from."""
    return 2**62 + seed * 1_000_003 + rank


def _held_out_loss(module: torch.nn.Module, task, seed: int, batch_size: int) -> float:
    """This rank's mean loss of `module` over HELD_OUT_BATCHES batches from a stream of its own
    (held_out_seed), which no step's seed reaches."""
    generator = torch.Generator().manual_seed(held_out_seed(seed, dist.get_rank()))
    with torch.no_grad():
        return sum(task.loss(module, task.batch(generator, batch_size)).item()
                   for _ in range(HELD_OUT_BATCHES)) / HELD_OUT_BATCHES


def _format_loss(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


class Converge(Mode):
    name = "converge"
    help = "train a learnable task with each comm hook: the loss curves"
    measured = {"loss": "the mean over the ranks of each rank's loss at a step; final: the mean "
                        f"over the last {FINAL_STEPS} steps; held-out: the final parameters' "
                        f"mean loss on {HELD_OUT_BATCHES} batches per rank no step trained on"}
    world_sizes = (4,)

    def add_arguments(self, parser):
        choices_option(parser, "--comm_hooks", COMM_HOOKS, shorthands=HOOK_SHORTHANDS,
                       default=[hook for name in DEFAULT_HOOKS
                                for hook in HOOK_SHORTHANDS.get(name, (name,))],
                       said=",".join(DEFAULT_HOOKS))
        parser.add_argument("--params", type=count, default="2M",
                            help="parameters of the model, with K/M suffixes (default 2M; the "
                                 "GPT has its embeddings' 4.2M at least)")
        parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp",
                            help="mlp: regression onto a random teacher; gpt: next-token "
                                 "prediction on a random sparse Markov chain (python -m pydoc "
                                 "ddpx_bench.converge)")
        parser.add_argument("--batch_size", type=positive, default=None,
                            help="rows (mlp) or sequences of 128 tokens (gpt) per rank and step "
                                 "(default 16 rows, 4 sequences)")
        parser.add_argument("--steps", type=positive, default=200, help="steps per hook")
        parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                            help="adam (default), or sgd: SGD with momentum 0.9")
        parser.add_argument("--lr", type=float, default=1e-3,
                            help="learning rate (default 1e-3, Adam's; SGD's is nearer 0.1)")
        parser.add_argument("--lr_schedule", choices=("cosine", "constant"), default="cosine",
                            help="cosine (default): from --lr toward 0 along half a cosine, as "
                                 "training ends; constant: --lr at every step")
        node_options(parser)

    def run(self, args):
        return bench_converge(args)

    def table(self, rows: list[dict]) -> list[str]:
        lines = format_table([
            ("world", ">5", lambda row: row["world_size"]),
            ("hook", "<14", lambda row: row["hook"]),
            ("first loss", ">10", lambda row: _format_loss(row["first_loss"])),
            ("final loss", ">10", lambda row: _format_loss(row["final_loss"])),
            ("held-out loss", ">13", lambda row: _format_loss(row["held_out_loss"])),
            ("vs default %", ">12", lambda row: "-" if row["vs_default_pct"] is None
             else f"{row['vs_default_pct']:+.2f}"),
            ("same on all ranks", "<17", lambda row: "yes" if row["same_on_all_ranks"] else "no"),
            ("path", "", lambda row: row["describe"]),
        ], rows)
        first = rows[0]
        lines.append(
            f"{first['model']} of {first['params']} parameters, batch {first['batch_size']} per "
            f"rank, {first['steps']} steps of {first['optimizer']} at lr {first['lr']:g} "
            f"({first['lr_schedule']}); final "
            f"loss: the mean over the last {FINAL_STEPS} steps; held-out loss: the final "
            f"parameters' on {HELD_OUT_BATCHES} batches per rank that no step trained on; vs "
            "default: the held-out loss's distance from default's"
        )
        if first.get("nodes", 1) > 1:
            lines.append(f"{first['world_size']} ranks on {first['nodes']} nodes")
        if any("link" in row for row in rows):
            lines.append(tcp_line(rows))
        return lines

    def plot(self, rows: list[dict], path: Path) -> None:
        figure, panels = world_size_panels(rows, "loss (mean over the ranks)")
        links = {row.get("link") for row in rows}
        for ax, world_size in panels:
            for row in rows:
                if row["world_size"] != world_size:
                    continue
                label = row["hook"] + (f", link {row['link']}" if len(links) > 1 else "")
                steps = range(1, len(row["losses"]) + 1)
                ax.plot(steps, row["losses"], label=label,
                        linestyle="-" if row["trains"] else ":", linewidth=1)
            ax.set(yscale="log", xlabel="step", title=f"{world_size} ranks")
            ax.legend()
        figure.suptitle(f"{rows[0]['model']} loss by comm hook")
        save_figure(figure, path)


MODE = Converge()
