"""What the benchmark's modules share: the peers, the dtype each engine, hook and method sends
in, and the helpers that the ranks of every mode run alike."""

import contextlib
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddpx._ext import extension
from ddpx.backend import backend_of

# The other projects' CPU all-reduces, which "x vs best peer" reads every engine against.
PEERS = ("gloo", "mpi", "deepspeed")
WIRE = {
    "gloo": None,
    "mpi": None,
    "deepspeed": None,
    "copy": None,
    "ddpx": None,
    "ddpx-arena": None,
    "ddpx-fp16": "fp16",
    "ddpx-bf16": "bf16",
    "ddpx-int8": "int8",
    "ddpx-int4": "int4",
    "ddpx-oneshot": None,
    "ddpx-timed": None,
    "ddpx-wide": None,
    "ddpx-narrow": None,
    "ddpx-shared": None,
    "default": None,
    "none": None,
    "backend": None,
    "backend-mem": None,
    "fp16": "fp16",
    "bf16": "bf16",
    # Low-rank factors in float32: not a rounding of the gradients (train gives them no tolerance).
    "powersgd-r1": None,
    "powersgd-r4": None,
    "torch-fp16": "fp16",
    "torch-bf16": "bf16",
}
# Block-scaled int8 (int4): each value rounded to within half a step of max|block| / 127 (/ 7).
UNIT_ROUNDOFF = {None: 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8, "int8": 2.0**-7,
                 "int4": 2.0**-3}
# Set by ddpx-bench for the ranks it starts with mpirun: their temporary folder (the FileStore's).
MPI_WORKDIR = "DDPX_BENCH_MPI_WORKDIR"


def use_threads(threads: int | None) -> None:
    """The environment of the ranks this process starts: `threads` each for torch, OpenMP
    (DeepSpeed's op) and ddpx; None: as a launcher that sets none leaves it (mp.spawn)."""
    for name in ("OMP_NUM_THREADS", "DDPX_THREADS"):
        if threads is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(threads)


def threads_line(machine: dict) -> str:
    """The report header's words for the ranks' threads."""
    threads = machine["threads_per_rank"]
    if threads == "default":
        return (f"torch's default threads per rank (OMP_NUM_THREADS unset; rank 0 ran "
                f"{machine['rank_threads']} after ddpx started)")
    return f"{threads} thread{'' if threads == 1 else 's'} per rank"


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def environment(**values: str):
    """Set these environment variables for the `with` block only."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def mpirun_path() -> str | None:
    # This Python's own bin first: a virtual environment's is on PATH only when activated.
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    return shutil.which("mpirun", path=path)


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        say(message)


def node_count() -> int:
    """How many nodes the ranks are on, by the launcher's GROUP_RANK as ddpx finds them."""
    group_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(group_ranks, os.environ.get("GROUP_RANK", "0"))
    return len(set(group_ranks))


def add_if_it_works(
    engines: dict, name: str, engine, left_out: dict, fails=(NotImplementedError,)
) -> None:
    """Add `engine` to `engines` if it reduces a small tensor here; else say why in `left_out`.

    `fails`: what it raises where it cannot work (NotImplementedError: a ddpx compression not built
    yet). Every rank probes alike, so they agree on what is left out.
    """
    try:
        engine(torch.ones(8))
    except fails as exc:
        left_out[name] = str(exc).splitlines()[0]
        return
    engines[name] = engine


def random_input(seed: int, rank: int, numel: int, normal: bool = False) -> torch.Tensor:
    """Rank `rank`'s input: uniform in [-1, 1), or standard normal."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    if normal:
        return torch.randn(numel, generator=generator)
    return torch.rand(numel, generator=generator) * 2 - 1


def timed_in_turns(engines: dict, tensor: torch.Tensor, args,
                   cell: str) -> tuple[dict, dict, dict]:
    """Time each of `engines` (name -> a call on `tensor`), the engines taking turns sample by
    sample so that they share the machine's conditions: name -> this rank's --iters samples
    (slowest_rank_stats makes them the slowest rank's), name -> calls per sample, and name ->
    how busy the machine's cores were through its samples (cpu_share).

    A sample is the mean time per call of a batch of calls begun right after a barrier; an
    engine's batches are sized, by the slowest rank's mean over --warmup calls, so that its samples
    last --min_time seconds together.
    """
    per_call = {
        name: _seconds_per_call(engine, tensor, args.warmup) for name, engine in engines.items()
    }
    calls = {name: max(1, round(args.min_time / args.iters / per_call[name])) for name in engines}
    expected = sum(max(args.min_time, args.iters * seconds) for seconds in per_call.values())
    progress(f"{cell}: timing, about {expected:.1f} s")
    samples = {name: [] for name in engines}
    ticks = {name: [0, 0, 0] for name in engines}
    for _ in range(args.iters):
        for name, engine in engines.items():
            before = cpu_ticks()
            samples[name].append(_timed_batch(engine, tensor, calls[name]))
            after = cpu_ticks()
            ticks[name] = [t + b - a for t, a, b in zip(ticks[name], before, after, strict=True)]
    return samples, calls, {name: cpu_share(*spent) for name, spent in ticks.items()}


def cpu_ticks() -> tuple[int, int, int]:
    """The machine's CPU time so far, in clock ticks summed over its cores, from /proc/stat's
    first line: (all, busy, in softirq), all without the time the hypervisor stole. Busy is all
    but idle and I/O wait; softirq is where the kernel's network stack runs (TCP, veth, bridge,
    tbf). Zeros where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            user, nice, system, idle, iowait, irq, softirq, steal = (
                int(field) for field in stat.readline().split()[1:9])
    except OSError:
        return 0, 0, 0
    busy = user + nice + system + irq + softirq
    return busy + idle + iowait, busy, softirq


# Whose a rank's thread is, by its name (the 15 characters Linux keeps): ddpx names its threads
# "ddpx ..." (csrc/common/thread_name.h), gloo its transport's gloo_... and pt_gloo_...; the rest
# are the rank's own (its main thread, torch's and OpenMP's).
THREAD_KINDS = ("rank", "ddpx", "gloo")


def _thread_kind(name: str) -> str:
    if name.startswith("ddpx "):
        return "ddpx"
    return "gloo" if name.startswith(("gloo", "pt_gloo")) else "rank"


def thread_times() -> dict[int, tuple[str, int]]:
    """This process's threads so far: thread id -> (its kind of THREAD_KINDS, its nanoseconds on
    a core, the kernel's for it included), from /proc/self/task/<tid>/schedstat; empty where
    there is none."""
    times = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm, \
                    open(f"/proc/self/task/{tid}/schedstat") as schedstat:
                times[int(tid)] = (_thread_kind(comm.read().strip()),
                                   int(schedstat.read().split()[0]))
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return times


def thread_seconds(before: dict, after: dict) -> list[float]:
    """The CPU seconds each kind of THREAD_KINDS spent between two thread_times: a thread that
    began in between counts from zero, one that ended in between is left out."""
    spent = dict.fromkeys(THREAD_KINDS, 0)
    for tid, (kind, ns) in after.items():
        spent[kind] += ns - before.get(tid, (kind, 0))[1]
    return [spent[kind] / 1e9 for kind in THREAD_KINDS]


def cpu_share(all_ticks: int, busy: int, softirq: int) -> dict:
    """How busy the cores were: busy and softirq time as fractions of all of it (None: no
    ticks, as without /proc/stat). A fraction near 1 means the cores, not the link or memory,
    were the limit; /proc/stat counts in 10 ms ticks, so it is good to a few percent only
    over batches that last 100 ms or more."""
    if not all_ticks:
        return {"cpu_busy": None, "cpu_softirq": None}
    return {"cpu_busy": busy / all_ticks, "cpu_softirq": softirq / all_ticks}


def _seconds_per_call(engine, tensor: torch.Tensor, calls: int) -> float:
    """The slowest rank's mean over `calls` calls: the same on every rank, so they plan alike."""
    seconds = torch.tensor([_timed_batch(engine, tensor, calls)])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def _timed_batch(engine, tensor: torch.Tensor, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        engine(tensor)
    return (time.perf_counter() - start) / calls


def steps_in_turns(steps: dict, indices: range, cell: str, device: torch.device | None = None,
                   traffic: "LinkTraffic | None" = None, cpu: dict | None = None) -> dict:
    """Steps `indices` of each of `steps` (name -> a call that makes step `index` of its model),
    the models taking turns step by step so that they share the machine's conditions: name ->
    this rank's seconds for each step (slowest_rank_stats makes them the slowest rank's). A step
    begins after a barrier; on a GPU `device`, it is timed from idle to done on the device.
    `traffic` (link_traffic's, on the testbed) counts the node's bytes through each step; `cpu`,
    where given, gets name -> for each step, the machine's cpu_ticks spent in it, up to the
    barrier that ends it on every rank, and then this rank's thread_seconds through it."""
    samples = {name: [] for name in steps}
    started = time.perf_counter()
    for index in indices:
        if index % 5 == 0 or index == indices.start:
            progress(
                f"{cell}: step {index + 1}/{indices.stop} of each of {', '.join(steps)}; "
                f"{time.perf_counter() - started:.0f} s elapsed"
            )
        for name, step in steps.items():
            samples[name].append(_timed_step(step, index, device, traffic, cpu, name))
    return samples


def _timed_step(step, index: int, device: torch.device | None, traffic: "LinkTraffic | None",
                cpu: dict | None, name: str) -> float:
    _synchronize(device)
    if dist.get_world_size() > 1:
        dist.barrier()
    before = traffic.counters() if traffic is not None else None
    ticks = cpu_ticks() if cpu is not None else None
    threads = thread_times() if cpu is not None else None
    start = time.perf_counter()
    step(index)
    _synchronize(device)
    seconds = time.perf_counter() - start
    if (traffic is not None or cpu is not None) and dist.get_world_size() > 1:
        # Past this barrier every rank has finished the step, so every byte of it has been
        # received, hence sent: the counters hold the whole step (and two barriers' few bytes).
        dist.barrier()
    if traffic is not None:
        traffic.add(name, before, traffic.counters())
    if cpu is not None:
        spent = [b - a for a, b in zip(ticks, cpu_ticks(), strict=True)]
        cpu.setdefault(name, []).append([*spent, *thread_seconds(threads, thread_times())])
    return seconds


class LinkTraffic:
    """The bytes a node of ddpx-bench's testbed sent and received through its interface in each
    step of each model: its counters (/sys/class/net/<interface>/statistics/, which a process in
    the node's namespace sees as that namespace's), read by the node's local rank 0 alone (they
    count every rank of the node, headers and ACKs included); made by link_traffic."""

    def __init__(self, interface: str | None):
        self.interface = interface  # None: a rank that reads nothing
        self.steps: dict[str, list[tuple[int, int]]] = {}

    def counters(self) -> tuple[int, int] | None:
        """The node's bytes (sent, received) so far; None on a rank that does not read them."""
        if self.interface is None:
            return None
        statistics = Path("/sys/class/net", self.interface, "statistics")
        return tuple(int((statistics / f"{way}_bytes").read_text()) for way in ("tx", "rx"))

    def add(self, name: str, before: tuple[int, int] | None,
            after: tuple[int, int] | None) -> None:
        if before is not None:
            self.steps.setdefault(name, []).append(
                (after[0] - before[0], after[1] - before[1]))

    def per_step(self, name: str, first: int = 0) -> dict:
        """The bytes a node sent (`link_bytes_per_step`) and received (`link_rx_bytes_per_step`)
        per step of model `name` from step `first` on: the mean over those steps and over the
        nodes. Collective: every rank calls it, in the same order of names."""
        mine = None
        if self.interface is not None:
            steps = self.steps.get(name, [])[first:]
            mine = (sum(tx for tx, _ in steps), sum(rx for _, rx in steps), len(steps))
        nodes = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, mine)
        nodes = [node for node in nodes if node is not None]
        node_steps = sum(count for _, _, count in nodes)
        if not node_steps:
            return {"link_bytes_per_step": None, "link_rx_bytes_per_step": None}
        return {"link_bytes_per_step": sum(tx for tx, _, _ in nodes) / node_steps,
                "link_rx_bytes_per_step": sum(rx for _, rx, _ in nodes) / node_steps}


def link_traffic() -> LinkTraffic | None:
    """A LinkTraffic where every rank runs on ddpx-bench's testbed (which names each rank's
    node's interface in its environment), counting on each node's local rank 0; else None.
    Collective."""
    from ddpx_bench.testbed import INTERFACE_VARIABLE  # a few names: nothing is set up

    interface = os.environ.get(INTERFACE_VARIABLE)
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, interface is not None)
    if not all(everywhere):
        return None
    return LinkTraffic(interface if os.environ.get("LOCAL_RANK", "0") == "0" else None)


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest_rank_stats(seconds: list[float]) -> dict:
    samples = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    p10, median, p90 = torch.quantile(
        samples * 1e3, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    )
    return {"median_ms": median.item(), "p10_ms": p10.item(), "p90_ms": p90.item()}


def engine_rows(cell: dict, samples: dict, figures) -> list[dict]:
    """A row per engine of a cell, in the order of `samples` (name -> this rank's samples in
    seconds): the cell's keys, the engine's name, the slowest rank's statistics of its samples
    (slowest_rank_stats) and `figures(name)`, what else the mode measured of that engine."""
    return [{**cell, "engine": name, **slowest_rank_stats(seconds), **figures(name)}
            for name, seconds in samples.items()]


def same_on_all_ranks(tensors) -> bool:
    digest = hashlib.sha256()
    for p in tensors:
        digest.update(p.detach().numpy().tobytes())
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest.hexdigest())
    return len(set(digests)) == 1


def format_size(size: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size}B"


def ddpx_group(left_out: dict):
    """A group of every rank with ddpx's torch.distributed backend beside the gloo world, and its
    CPU backend; (None, None), and why in `left_out`, where this ddpx registers no backend."""
    if "ddpx" not in dist.Backend.backend_list:
        left_out["ddpx"] = "this build of ddpx registers no torch.distributed backend 'ddpx'"
        return None, None
    group = dist.new_group(list(range(dist.get_world_size())), backend="ddpx")
    return group, backend_of(group)


def routes_since(before: dict, after: dict) -> dict:
    """The calls served since `before`, of routes() {collective: {"engine": n, "gloo": m}}: those
    that changed only."""
    since = {}
    for collective, counts in after.items():
        earlier = before.get(collective, {})
        changed = {path: count - earlier.get(path, 0) for path, count in counts.items()}
        if any(changed.values()):
            since[collective] = changed
    return since


def served_by(routes: dict) -> dict:
    """The calls of `routes` by path, over the collectives: {"engine": n, "gloo": m}."""
    totals = {"engine": 0, "gloo": 0}
    for counts in routes.values():
        for path, count in counts.items():
            totals[path] = totals.get(path, 0) + count
    return totals


def why_no_comm_memory(backend) -> str:
    """Why `backend` (a ddpx group's) allocates no communication memory from ddpx's arena on some
    rank, or "" where it does on every rank: the same on every rank. Collective."""
    why_not = ""
    if not backend.supports_tensor_alloc(torch.device("cpu")):
        why_not = ("ddpx's backend allocates no tensors here: "
                   + (extension().arena_usage()["why_not"]
                      or "its ranks share no memory (it runs on gloo)"))
    reasons = [""] * dist.get_world_size()
    dist.all_gather_object(reasons, why_not)
    return next((why for why in reasons if why), "")
