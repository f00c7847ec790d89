"""`ddpx-bench collectives`: the torch.distributed collectives on the gloo world and on a group of
the same ranks with ddpx's backend (the all-reduce also by ddpx.all_reduce), each checked against
a reference, then timed in turns, cell by cell; the calls ddpx's backend served by its engine and
by gloo (its routes()).

At least a minute on 2 cores (54 engines and cells of --min_time 1 s each).

    ddpx-bench collectives --json bench_out/collectives.json --plot bench_out/collectives.png
    ddpx-bench collectives --world_sizes 2 --sizes 4K,64K --iters 3 --min_time 0.05
    ddpx-bench collectives --collectives all_reduce,all_gather,reduce_scatter,barrier

In detail: each of --collectives called through torch.distributed, on the gloo world and on a
group of the same ranks with ddpx's backend (`import ddpx` registers it: dist.new_group(ranks,
backend="ddpx")), in the same processes, for float32 inputs of each of --sizes (default
64K,1M,25M) on each of --world_sizes: `all_reduce` (an in-place sum; also by ddpx.all_reduce, the
engine's own API, as a third engine), `all_gather_into_tensor` and `all_gather` (the list form;
every rank's input of `size` bytes, an output of world size x size), `reduce_scatter_tensor` and
`reduce_scatter` (the list form; an input of `size` bytes, an output of size / world size, left
out where the input does not split evenly), `broadcast` (from rank 0), `barrier` (no data: one
cell per world size), `all_to_all_single` and `all_to_all`, and `send_recv` (each rank isends its
input to the next rank and irecvs the previous rank's, as a pipeline's stages do; on 2 ranks an
exchange), `gather` (every rank's input to rank 0) and `scatter` (rank 0's input in world size
parts, one to each rank). The default is all_reduce,all_gather_into_tensor,reduce_scatter_tensor,
broadcast. all_gather_into_tensor and reduce_scatter_tensor are called as all_gather_single and
reduce_scatter_single where torch has those (the same calls, without a deprecation warning). In
each cell (world size, collective, size), as for allreduce:
  - each engine runs it once on random inputs, and every rank's result is compared with the
    reference: a float64 sum for all_reduce and the reduce_scatters (within allreduce's
    tolerance; ddpx's all-reduces must also give every rank the same bits), the inputs themselves,
    bit for bit, for the gathers and broadcast; for the barrier, the last rank enters it 10 ms
    late and no rank may leave it before. A wrong result stops the run with exit status 1;
  - then the engines take turns timing it on zero-filled inputs, --iters samples each, a sample
    the slowest rank's mean time per call in a batch begun right after a barrier.
Reported per cell: each engine's median in ms; gloo/ddpx = gloo's median / ddpx's (bigger: ddpx
faster); ddpx/ddpx.all_reduce = the ddpx backend's median / ddpx.all_reduce's (bigger: the engine's
own API faster); and which path served the ddpx backend's calls of the cell, from its routes()
(`engine`, `gloo`, or both with their counts); the JSON holds p10-p90 and the counts. A footer
says what the sizes mean, the notes the path (describe()) of the ddpx backend and of
ddpx.all_reduce. Where ddpx registers no backend, the ddpx column is left out with a note.
"""

import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

import ddpx
from ddpx.engine import engine_for
from ddpx_bench.common import (
    UNIT_ROUNDOFF,
    add_if_it_works,
    ddpx_group,
    engine_rows,
    format_size,
    node_count,
    progress,
    random_input,
    routes_since,
    same_on_all_ranks,
    served_by,
    timed_in_turns,
)
from ddpx_bench.mode import Mode, choices_option, node_options, size_list, timing_options
from ddpx_bench.report import (
    PER_CALL,
    format_ms,
    format_ratio,
    format_served,
    format_table,
    pyplot,
    runs_line,
    save_figure,
)

COLLECTIVES = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "all_to_all_single",
    "all_to_all",
    "send_recv",
    "gather",
    "scatter",
)
DEFAULT_COLLECTIVES = COLLECTIVES[:4]
# ddpx's own all-reduce, beside torch.distributed.all_reduce on ddpx's group.
FUSED = "ddpx.all_reduce"
# The collectives whose result is a sum (checked against a float64 one, within a tolerance); the
# others' are copies of the inputs (checked for exact equality).
SUMS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter")
# The collectives that split each rank's input into one part per rank.
SPLIT = ("reduce_scatter_tensor", "reduce_scatter", "all_to_all_single", "all_to_all", "scatter")
# How long the last rank waits before it enters the barrier that is checked: no rank may leave it
# before.
BARRIER_DELAY_S = 0.01
# torch.distributed's names for the single-tensor forms where it has them (torch 2.10+): the same
# calls as all_gather_into_tensor and reduce_scatter_tensor, without their deprecation warning.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def bench_collectives(args) -> dict:
    left_out, notes = {}, []
    world_size, nodes = dist.get_world_size(), node_count()
    group, backend = ddpx_group(left_out)
    engines = {"gloo": None, **({"ddpx": group} if group is not None else {})}
    fused = {}
    if "all_reduce" in args.collectives:
        add_if_it_works(fused, FUSED, ddpx.all_reduce, left_out)
    cells = []
    for collective in args.collectives:
        for size in [None] if collective == "barrier" else args.sizes:
            if collective in SPLIT and size // 4 % world_size:
                left_out[f"{collective} of {format_size(size)} on {world_size} ranks"] = (
                    "its float32 input does not split evenly over the ranks"
                )
                continue
            cells.append((collective, size))
    rows, started = [], time.perf_counter()
    for index, (collective, size) in enumerate(cells):
        cell_engines = {**engines, **(fused if collective == "all_reduce" else {})}
        cell = (
            f"world {world_size}, {collective}"
            + ("" if size is None else f" of {format_size(size)}")
            + f" (cell {index + 1}/{len(cells)})"
        )
        progress(
            f"{cell}: checking {', '.join(cell_engines)}; "
            f"{time.perf_counter() - started:.0f} s elapsed"
        )
        rows += _bench_cell(collective, size, cell_engines, backend, args, cell, nodes)
    # Which path serves ddpx's group, and ddpx.all_reduce's (the world's engine), in this run.
    if backend is not None:
        notes.append(f"ddpx backend on {world_size} ranks: {backend.describe()}")
    if fused:
        notes.append(f"{FUSED} on {world_size} ranks: {engine_for().describe()}")
    return {"rows": rows, "left_out": left_out, "notes": notes, "failures": []}


def _call(collective: str, engine: str, group, numel: int):
    """The call that the engine `engine` makes of `collective` over `group` with `numel` float32
    elements per rank: a function of this rank's input that returns the result (a list of
    tensors for all_gather, None for the barrier). The output buffers are made here, once: the
    timed calls reuse them."""
    world_size = dist.get_world_size()
    if engine == FUSED:
        return ddpx.all_reduce
    if collective == "all_reduce":
        def call(tensor):
            dist.all_reduce(tensor, group=group)
            return tensor
    elif collective == "broadcast":
        def call(tensor):
            dist.broadcast(tensor, src=0, group=group)  # the groups span every rank: 0 is 0
            return tensor
    elif collective == "all_gather_into_tensor":
        output = torch.empty(world_size * numel)

        def call(tensor):
            _ALL_GATHER_SINGLE(output, tensor, group=group)
            return output
    elif collective == "all_gather":
        outputs = [torch.empty(numel) for _ in range(world_size)]

        def call(tensor):
            dist.all_gather(outputs, tensor, group=group)
            return outputs
    elif collective == "reduce_scatter_tensor":
        output = torch.empty(numel // world_size)

        def call(tensor):
            _REDUCE_SCATTER_SINGLE(output, tensor, group=group)
            return output
    elif collective == "reduce_scatter":
        output, chunks = torch.empty(numel // world_size), _Chunks(world_size)

        def call(tensor):
            dist.reduce_scatter(output, chunks(tensor), group=group)
            return output
    elif collective == "all_to_all_single":
        output = torch.empty(numel)

        def call(tensor):
            dist.all_to_all_single(output, tensor, group=group)
            return output
    elif collective == "all_to_all":
        outputs = [torch.empty(numel // world_size) for _ in range(world_size)]
        chunks = _Chunks(world_size)

        def call(tensor):
            dist.all_to_all(outputs, chunks(tensor), group=group)
            return outputs
    elif collective == "send_recv":
        output = torch.empty(numel)
        rank = dist.get_rank()

        def call(tensor):
            works = [dist.isend(tensor, (rank + 1) % world_size, group=group),
                     dist.irecv(output, (rank - 1) % world_size, group=group)]
            for work in works:
                work.wait()
            return output
    elif collective == "gather":
        outputs = [torch.empty(numel) for _ in range(world_size)]
        root = dist.get_rank() == 0

        def call(tensor):
            dist.gather(tensor, outputs if root else None, dst=0, group=group)
            return outputs if root else tensor
    elif collective == "scatter":
        output, chunks = torch.empty(numel // world_size), _Chunks(world_size)
        root = dist.get_rank() == 0

        def call(tensor):
            dist.scatter(output, chunks(tensor) if root else None, src=0, group=group)
            return output
    elif collective == "barrier":
        def call(tensor):
            dist.barrier(group=group)
    else:
        raise ValueError(f"internal: unknown collective {collective}")
    return call


class _Chunks:
    """The list form's input: a tensor's `parts` equal views, made once per tensor, so that the
    timed calls do not make them again."""

    def __init__(self, parts: int):
        self.parts, self.tensor, self.chunks = parts, None, []

    def __call__(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        if tensor is not self.tensor:
            self.tensor, self.chunks = tensor, list(tensor.chunk(self.parts))
        return self.chunks


def _bench_cell(collective: str, size: int | None, engines: dict, backend, args, cell: str,
                nodes: int) -> list[dict]:
    world_size = dist.get_world_size()
    numel = 0 if size is None else size // 4
    calls = {name: _call(collective, name, group, numel) for name, group in engines.items()}
    served_before = backend.routes() if "ddpx" in engines else None
    checks = _check_engines(collective, size, calls, args.seed, nodes)
    samples, per_sample, _ = timed_in_turns(calls, torch.zeros(numel), args, cell)
    routes = routes_since(served_before, backend.routes()) if "ddpx" in engines else None
    output_bytes = {
        "all_gather_into_tensor": world_size * numel * 4,
        "all_gather": world_size * numel * 4,
        "reduce_scatter_tensor": numel // world_size * 4,
        "reduce_scatter": numel // world_size * 4,
        "gather": world_size * numel * 4,  # rank 0's
        "scatter": numel // world_size * 4,
        "barrier": None,
    }.get(collective, size)
    cell_keys = {"world_size": world_size, "nodes": nodes, "collective": collective,
                 "size_bytes": size, "output_bytes": output_bytes}
    rows = engine_rows(cell_keys, samples, lambda name: {
        "calls_per_sample": per_sample[name],
        "samples": args.iters,
        **checks[name],
        # This rank's calls of the cell (check, sizing and timed) that ddpx's backend ran on its
        # engine and through gloo: its routes() before and after.
        "routes": routes if name == "ddpx" else None,
        "served_by": served_by(routes) if name == "ddpx" else None,
    })
    medians = {row["engine"]: row["median_ms"] for row in rows}
    for row in rows:
        row["x_vs_gloo"] = medians["gloo"] / row["median_ms"]
        row["x_vs_ddpx"] = medians["ddpx"] / row["median_ms"] if "ddpx" in medians else None
    return rows


def _check_engines(collective: str, size: int | None, calls: dict, seed: int,
                   nodes: int) -> dict:
    """Run the collective once on random inputs with each engine and compare every rank's result
    with the reference: within a float64 sum's tolerance for the sums, bit for bit for the
    copies; raise on every rank if any is off."""
    if collective == "barrier":
        return {name: _check_barrier(name, call, nodes) for name, call in calls.items()}
    world_size, rank, numel = dist.get_world_size(), dist.get_rank(), size // 4
    inputs = [random_input(seed, other, numel) for other in range(world_size)]
    if collective in SUMS:
        expected = torch.zeros(numel, dtype=torch.float64)
        for tensor in inputs:
            expected += tensor
        if collective != "all_reduce":
            expected = expected.chunk(world_size)[rank]
        # As for ddpx-bench allreduce: inputs in [-1, 1), world_size + 1 roundings of at most
        # u * world_size each.
        tolerance = (world_size + 1) * UNIT_ROUNDOFF[None] * world_size
    elif collective.startswith("all_to_all"):
        expected = torch.cat([tensor.chunk(world_size)[rank] for tensor in inputs]).double()
        tolerance = 0.0
    elif collective == "send_recv":
        expected = inputs[(rank - 1) % world_size].double()
        tolerance = 0.0
    elif collective == "gather":
        # Every input reaches rank 0; the others' stay as they were.
        expected = (torch.cat(inputs) if rank == 0 else inputs[rank]).double()
        tolerance = 0.0
    elif collective == "scatter":
        expected = inputs[0].chunk(world_size)[rank].double()
        tolerance = 0.0
    else:
        gathered = collective.startswith("all_gather")
        expected = (torch.cat(inputs) if gathered else inputs[0]).double()
        tolerance = 0.0
    checks = {}
    for name, call in calls.items():
        result = call(inputs[rank].clone())
        if isinstance(result, list):
            result = torch.cat(result)
        if result.shape == expected.shape:
            error = (result.double() - expected).abs().max().item()
        else:
            error = math.inf
        error = torch.tensor([error]).nan_to_num(nan=math.inf)
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
        if not error.item() <= tolerance:
            bound = f"tolerance {tolerance:.3g}" if tolerance else "0 (exact)"
            raise RuntimeError(
                f"{name} returned a wrong result for {collective} of {format_size(size)} on "
                f"{world_size} ranks: max abs error {error.item():.3g} > {bound}"
            )
        checks[name] = {
            "check": "sum" if collective in SUMS else "exact",
            "max_abs_error": error.item(),
            "tolerance": tolerance,
        }
        if collective == "all_reduce":
            # ddpx sums in rank order: every rank gets the same bits.
            checks[name]["ranks_identical"] = same_on_all_ranks([result])
            if name != "gloo" and not checks[name]["ranks_identical"]:
                raise RuntimeError(
                    f"{name}'s all_reduce of {format_size(size)} on {world_size} ranks gave the "
                    "ranks different bits"
                )
    return checks


def _check_barrier(name: str, call, nodes: int) -> dict:
    """The last rank enters the barrier BARRIER_DELAY_S late: raise on every rank if any left it
    before the last one entered (one machine's monotonic clock, so one node only)."""
    unchecked = {"check": None, "max_abs_error": None, "tolerance": None}
    if nodes > 1:
        return unchecked
    world_size, rank = dist.get_world_size(), dist.get_rank()
    last = world_size - 1
    dist.barrier()
    if rank == last:
        time.sleep(BARRIER_DELAY_S)
    entered = time.monotonic()
    call(None)
    left = time.monotonic()
    # The last rank's entry and, negated, the earliest exit.
    times = torch.tensor([entered if rank == last else -math.inf, -left], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    early = times[0].item() + times[1].item()
    if early > 0:
        raise RuntimeError(
            f"{name}'s barrier on {world_size} ranks let a rank leave {early * 1e3:.3f} ms before "
            f"rank {last} entered it"
        )
    return {**unchecked, "check": "barrier"}


LINK_LEGEND = [
    "link: the rate between the nodes (network namespaces); bound: the bytes a node's link must "
    "carry (bytes_across) at that rate; gloo/bound, ddpx/bound: median / bound"
]


def bytes_across(row: dict) -> int | None:
    """The bytes a node's link must carry in one direction for the row's call between its N
    nodes (L ranks each), at the least: an all-reduce 2(N-1)/N of the input; an all-gather the
    other nodes' (N-1)L inputs; a reduce-scatter the node's sums of the parts of the other nodes'
    ranks, (N-1)/N of the input; a broadcast the input once; an all-to-all the parts of the
    node's L ranks for the other nodes' ranks, (N-1)/N of each input; a gather the other nodes'
    (N-1)L inputs into rank 0's node; a scatter (N-1)/N of rank 0's input out of its node. None
    where no bytes bound it."""
    size, nodes = row["size_bytes"], row["nodes"]
    if size is None or nodes < 2:
        return None
    ranks = row["world_size"] // nodes
    return {
        "all_reduce": 2 * (nodes - 1) * size // nodes,
        "all_gather_into_tensor": (nodes - 1) * ranks * size,
        "all_gather": (nodes - 1) * ranks * size,
        "reduce_scatter_tensor": (nodes - 1) * size // nodes,
        "reduce_scatter": (nodes - 1) * size // nodes,
        "broadcast": size,
        "all_to_all_single": ranks * (nodes - 1) * size // nodes,
        "all_to_all": ranks * (nodes - 1) * size // nodes,
        "gather": (nodes - 1) * ranks * size,
        "scatter": (nodes - 1) * size // nodes,
    }.get(row["collective"])


class Collectives(Mode):
    name = "collectives"
    help = "time the torch.distributed collectives on gloo and on ddpx's backend"
    measured = {"timing": PER_CALL}
    cell_keys = ("world_size", "collective", "size_bytes", "engine")
    bigger_is_better = ("x_vs_gloo", "x_vs_ddpx")

    def add_arguments(self, parser):
        parser.add_argument(
            "--sizes",
            type=size_list,
            default="64K,1M,25M",
            help="comma-separated sizes of each rank's input in bytes, K/M/G suffixes "
            "(default 64K,1M,25M)",
        )
        choices_option(parser, "--collectives", COLLECTIVES, default=DEFAULT_COLLECTIVES)
        timing_options(parser)
        node_options(parser)

    def run(self, args):
        return bench_collectives(args)

    def add_link_figures(self, rows):
        """Each row's bound on its shaped link (bound_ms; none for the barrier and send_recv),
        and its time against it."""
        from ddpx_bench.testbed import bits_per_second  # only where --link ran

        for row in rows:
            sent = bytes_across(row) if row["link"] != "none" else None
            if sent is not None:
                row["bound_ms"] = sent * 8 / bits_per_second(row["link"]) * 1e3
                row["x_bound"] = row["median_ms"] / row["bound_ms"]

    def table(self, rows: list[dict]) -> list[str]:
        """One line per cell (world size, collective, size): each engine's median side by side; over
        several runs, ddpx's worst launch beside them."""
        runs = rows[0].get("runs")
        # A cell's engines by name: gloo, ddpx, FUSED (None where one did not run).
        cells = {}
        for row in rows:
            key = (row.get("link"), row["world_size"], row["collective"], row["size_bytes"])
            cells.setdefault(key, dict.fromkeys(("gloo", "ddpx", FUSED)))[row["engine"]] = row
        linked = any(row.get("link") for row in rows)
        bound = [
            ("bound ms", ">9", lambda cell: format_ms(cell["gloo"].get("bound_ms"))),
            ("gloo/bound", ">10", lambda cell: format_ratio(cell["gloo"].get("x_bound"))),
            ("ddpx/bound", ">10",
             lambda cell: format_ratio(cell["ddpx"] and cell["ddpx"].get("x_bound"))),
        ]
        worst = [
            ("worst ddpx ms", ">13",
             lambda cell: format_ms(cell["ddpx"] and cell["ddpx"]["worst_median_ms"])),
            ("worst gloo/ddpx", ">15",
             lambda cell: format_ratio(cell["ddpx"] and cell["ddpx"]["worst_x_vs_gloo"])),
        ]
        lines = format_table([
            *([("link", ">7", lambda cell: cell["gloo"]["link"])] if linked else []),
            ("ranks", ">5", lambda cell: cell["gloo"]["world_size"]),
            ("collective", "<22", lambda cell: cell["gloo"]["collective"]),
            ("size", ">6", lambda cell: "-" if cell["gloo"]["size_bytes"] is None
             else format_size(cell["gloo"]["size_bytes"])),
            ("gloo ms", ">9", lambda cell: format_ms(cell["gloo"]["median_ms"])),
            ("ddpx ms", ">9", lambda cell: format_ms(cell["ddpx"] and cell["ddpx"]["median_ms"])),
            (FUSED + " ms", ">18",
             lambda cell: format_ms(cell[FUSED] and cell[FUSED]["median_ms"])),
            ("gloo/ddpx", ">9",
             lambda cell: format_ratio(cell["ddpx"] and cell["ddpx"]["x_vs_gloo"])),
            ("ddpx/" + FUSED, ">20",
             lambda cell: format_ratio(cell[FUSED] and cell[FUSED]["x_vs_ddpx"])),
            *(bound if linked else []),
            *(worst if runs else []),
            ("ddpx served by", "", lambda cell: format_served(cell["ddpx"])),
        ], list(cells.values()))
        lines += [
            "size: bytes of each rank's float32 input; all_gather and all_gather_into_tensor "
            "output world x size, reduce_scatter and reduce_scatter_tensor output size / world; "
            "broadcast from rank 0; barrier: no data; send_recv: each rank sends its input to the "
            "next rank and receives the previous rank's; gather: every input to rank 0; scatter: "
            "rank 0's input, size / world to each rank",
            *(LINK_LEGEND if linked else []),
            "ms: median per call; gloo/ddpx: gloo's median / ddpx's (above 1: ddpx is faster); "
            "ddpx/ddpx.all_reduce: ddpx's / ddpx.all_reduce's (above 1: ddpx.all_reduce is faster)",
            "ddpx served by: the ddpx backend's routes(), the calls of the cell (check, sizing, "
            "timed) on its engine and through gloo",
            *([runs_line(runs, "gloo/ddpx")] if runs else []),
        ]
        return lines

    def plot(self, rows: list[dict], path: Path) -> None:
        """Median time against size, log-log, per collective: a line per engine and world size; the
        barrier's against the world size."""
        plt = pyplot()
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
                sizes = sorted({row["size_bytes"] for row in rows
                                if row["collective"] == collective})
                ax.set(xscale="log", yscale="log", title=collective,
                       xlabel="bytes of each rank's input")
                ax.set_xticks(sizes, [format_size(size) for size in sizes])
                ax.minorticks_off()
            ax.set_ylabel("ms per call (median, p10-p90)")
            ax.grid(True, alpha=0.3)
            ax.legend()
        for ax in list(axes.flat)[len(collectives):]:
            ax.set_visible(False)
        save_figure(figure, path)


MODE = Collectives()
