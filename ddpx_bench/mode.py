"""A benchmark mode of `ddpx-bench` as one object: its options, the work of its ranks, its table
and its plot; and MODES, every mode by name, in the order `ddpx-bench --help` lists them.

A new mode is one file, ddpx_bench/<name>.py: a docstring whose first paragraph says what the
mode measures (its --help shows it, `python -m pydoc ddpx_bench.<name>` the rest), a subclass of
Mode, its instance as the file's MODE, and the file's name added to _FILES below. cli.py,
launch.py and report.py know the modes only through MODES: the options every mode takes, the
spawning, the load, the JSON document and the header of the table stay theirs. The option types
of the command line (sizes, counts, lists of choices) and the options several modes take
(--iters/--min_time/--warmup, --nodes/--link) are here.
"""

import argparse
import importlib
import sys
from pathlib import Path

# The modes' files, in the order --help lists them.
_FILES = ("allreduce", "collectives", "train", "converge", "fsdp", "accuracy")


class Mode:
    """One mode of ddpx-bench. `run` runs on every rank, within the gloo world; the rest runs in
    the process that reports, from the rows of every rank 0's result."""

    name: str
    # One line for ddpx-bench --help's list of modes.
    help: str
    # What the JSON document and the table's header say of the figures: {"timing": how a sample
    # is taken}, {"errors": what an error is measured against} or {"loss": what a loss is}.
    measured: dict
    # --world_sizes' default.
    world_sizes = (2, 4)
    # What names a row's cell across the fresh launches of --runs; None: the mode takes no --runs.
    cell_keys: tuple[str, ...] | None = None
    # The figures of a row where bigger is better (the others, times, are better smaller): the
    # worst run of --runs is the one with the smallest.
    bigger_is_better: tuple[str, ...] = ()
    # What --quick sets, option -> its value as typed on the command line (argparse converts a
    # string default as it would the option), for a first answer in under a minute on 2 cores; an
    # option given beside --quick wins. None: the mode has no --quick.
    quick: dict[str, str] | None = None

    @property
    def description(self) -> str:
        """The first paragraph of the mode's file's docstring."""
        return sys.modules[type(self).__module__].__doc__.partition("\n\n")[0]

    @property
    def quick_options(self) -> str:
        """What --quick stands for, as options on the command line."""
        return " ".join(f"--{option} {value}" for option, value in self.quick.items())

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the mode's own options to its subcommand's `parser`."""

    def prepare(self, args) -> None:
        """Run in the process that starts the ranks, once, before it starts any."""

    def uses_mpirun(self, args) -> bool:
        """Whether the ranks must be started by mpirun (MPI joins only ranks it started)."""
        return False

    def run(self, args) -> dict:
        """Measure on this rank: {"rows", "left_out", "notes", "failures"}, which rank 0's is
        reported."""
        raise NotImplementedError

    def add_link_figures(self, rows: list[dict]) -> None:
        """Add to `rows`, run on the --link rates (each row's "link" and "tcp_bits_per_s"), what
        the links bound."""

    def table(self, rows: list[dict]) -> list[str]:
        """The lines of the table of `rows`, below the report's header."""
        raise NotImplementedError

    def plot(self, rows: list[dict], path: Path) -> None:
        """Draw `rows` into the PNG `path`."""
        raise NotImplementedError


def __getattr__(name: str):
    # MODES is made on first use rather than at import, as each mode's file imports Mode from here.
    if name != "MODES":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    modes = {}
    for file in _FILES:
        mode = importlib.import_module(f"ddpx_bench.{file}").MODE
        modes[mode.name] = mode
    globals()["MODES"] = modes
    return modes


def size_list(text: str) -> list[int]:
    """Comma-separated byte sizes with K/M/G suffixes (powers of 1024), of float32 tensors."""
    sizes = [_suffixed(item, 1024) for item in text.split(",")]
    if any(size <= 0 or size % 4 for size in sizes):
        raise argparse.ArgumentTypeError(
            f"{text}: sizes are positive multiples of 4 bytes (float32)"
        )
    return sizes


def count(text: str) -> int:
    """A count with K/M/G suffixes (powers of 1000)."""
    return _suffixed(text, 1000)


def _suffixed(text: str, base: int) -> int:
    text = text.strip().upper()
    exponent = "KMG".find(text[-1:]) + 1
    return round(float(text[:-1] if exponent else text) * base**exponent)


def non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text}: a count, 0 or more")
    return value


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: a count, 1 or more")
    return value


def threads(text: str) -> int | None:
    """--threads: a count, or None for "default"."""
    return None if text == "default" else positive(text)


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def choices_option(parser: argparse.ArgumentParser, option: str, choices: tuple[str, ...],
                   default: tuple[str, ...] | None = None, said: str | None = None,
                   shorthands: dict[str, tuple[str, ...]] | None = None) -> None:
    """`option`, comma-separated items each one of `choices` (the engines, hooks, methods...
    a mode compares) or of `shorthands` (a name -> the choices it stands for, in place); by
    default `default` (all of them), which --help words as `said` (default: "all", or the
    default's items)."""
    default = list(choices if default is None else default)
    if said is None:
        said = "all" if default == list(choices) else ",".join(default)
    shorthands = shorthands or {}
    stands_for = "".join(f"; {name}: {','.join(items)}" for name, items in shorthands.items())
    parser.add_argument(option, type=_choice_list(choices, shorthands), default=default,
                        help=f"comma-separated, from {','.join(choices)}{stands_for} (default "
                             f"{said})")


def _choice_list(choices, shorthands):
    """A type of comma-separated items, each one of `choices`, or of `shorthands`, each of which
    is replaced by the choices it stands for; an item given twice counts once, where it first
    stands."""

    def parse(text: str) -> list[str]:
        items = text.split(",")
        unknown = sorted(set(items) - set(choices) - set(shorthands))
        if unknown:
            names = ",".join([*choices, *shorthands])
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {names}")
        return list(dict.fromkeys(
            choice for item in items for choice in shorthands.get(item, (item,))))

    return parse


def timing_options(parser: argparse.ArgumentParser) -> None:
    """--iters, --min_time and --warmup of the modes that time batches of calls
    (common.timed_in_turns)."""
    parser.add_argument("--iters", type=int, default=20, help="timed samples per engine and cell")
    parser.add_argument(
        "--min_time",
        type=float,
        default=1.0,
        help="seconds the samples of one engine and cell last at least",
    )
    parser.add_argument(
        "--warmup", type=int, default=3, help="calls per engine and cell that size its batches"
    )


def node_options(parser: argparse.ArgumentParser) -> None:
    """--nodes, --link and --congestion, of the modes that split the ranks into nodes."""
    parser.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="split each world size into this many equal nodes (default 1; 2 with --link)",
    )
    parser.add_argument(
        "--link",
        type=_rate_list,
        default=[],
        help="comma-separated link rates in tc's notation (1gbit,10gbit), or none (unshaped): run "
        "each on --nodes network namespaces joined by a link of that rate (needs root)",
    )
    parser.add_argument(
        "--congestion",
        default="cubic",
        help="the TCP congestion control of --link's nodes (default cubic, Linux's default; "
        "not the host's, which may differ and changes how streams restart between calls)",
    )


def _rate_list(text: str) -> list[str]:
    from ddpx_bench import testbed  # only where --link is given

    rates = text.split(",")
    for rate in rates:
        try:
            if rate != "none":
                testbed.bits_per_second(rate)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return rates
