"""Smoke test of the benchmark, ddpx-bench (ddpx_bench): every mode end to end on 2 spawned ranks
(accuracy: 2 and 3), tiny sizes; the peers (mpi, deepspeed) where installed; the --load processes,
which end with it; its console entry.

It checks what the benchmark reports and writes, never how fast anything is.
"""

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpx_bench.converge import _learning_rate, held_out_seed, step_seed, task_seed
from ddpx_bench.processes import alive, left_in_shm, shm_segments

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "ddpx_bench"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOCUMENT_KEYS = {"mode", "date", "command", "machine", "settings", "rows", "left_out"}
MACHINE_KEYS = {"cpu", "cores", "threads_per_rank", "torch", "ddpx"}


def missing_peers() -> list[str]:
    """What the mpi and deepspeed engines need that is not installed here."""
    bin_and_path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    missing = [name for name in ("mpi4py", "deepspeed") if importlib.util.find_spec(name) is None]
    return missing + ([] if shutil.which("mpirun", path=bin_and_path) else ["mpirun"])


def still_alive(pids: list[int], seconds: float = 5.0) -> list[int]:
    """Those of `pids` still alive after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def mentioning(text: str) -> list[int]:
    """The processes whose command line contains `text`."""
    pids = [int(path.name) for path in Path("/proc").glob("[0-9]*")]
    return [pid for pid in pids if alive(pid) and text in " ".join(command_line(pid))]


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ddpx_built() -> bool:
    try:
        import ddpx
    except ImportError:
        return False
    return hasattr(ddpx, "all_reduce")


def ddpx_backend_registered() -> bool:
    """Whether `import ddpx` registers the torch.distributed backend "ddpx"."""
    if not ddpx_built():
        return False
    import torch.distributed as dist

    return "ddpx" in dist.Backend.backend_list


def run_bench(tmp_path: Path, *args: str, world_sizes: str = "2") -> tuple[dict, str]:
    """Run ddpx-bench on `world_sizes` ranks as a user would; its JSON document and stdout."""
    json_path, png_path = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    command = [*BENCH, *args, "--world_sizes", world_sizes]
    command += ["--json", str(json_path), "--plot", str(png_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert png_path.read_bytes().startswith(PNG_SIGNATURE)
    document = json.loads(json_path.read_text())
    assert DOCUMENT_KEYS <= set(document)
    assert MACHINE_KEYS <= set(document["machine"])
    threads = args[args.index("--threads") + 1] if "--threads" in args else "1"
    assert document["machine"]["threads_per_rank"] == (int(threads) if threads.isdigit()
                                                       else threads)
    assert document["failures"] == []
    assert len({"timing", "errors", "loss"} & set(document)) == 1
    if ddpx_built():
        assert "unavailable" not in document["machine"]["ddpx"]
    return document, done.stdout


def check_measured(requested: list[str], measured: list[str], left_out: dict) -> None:
    """Every requested engine or hook is measured or left out with a reason; ddpx when built."""
    assert sorted(measured + list(left_out)) == sorted(requested)
    assert all(left_out.values())
    if ddpx_built():
        assert "ddpx" in measured


def check_times(row: dict) -> None:
    assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]


def check_allreduce_row(row: dict, gloo: dict, copy: dict | None = None) -> None:
    """An allreduce row beside gloo's of its cell, gloo the only peer, and copy's where it ran:
    its figures agree with its times, and its sum was within the tolerance. copy's own row is
    the floor: timed, neither checked nor ranked."""
    check_times(row)
    assert row["gb_per_s"] == pytest.approx(row["size_bytes"] / row["median_ms"] / 1e6)
    if row["engine"] == "copy":
        assert row["max_abs_error"] is row["tolerance"] is None
        assert row["x_vs_gloo"] is row["x_vs_best_peer"] is row["x_floor"] is None
        return
    assert 0 <= row["max_abs_error"] <= row["tolerance"]
    assert row["x_vs_gloo"] == pytest.approx(gloo["median_ms"] / row["median_ms"])
    assert row["best_peer"] == "gloo"
    assert row["x_vs_best_peer"] == pytest.approx(row["x_vs_gloo"])
    if copy is None:
        assert row["x_floor"] is None
    else:
        assert row["x_floor"] == pytest.approx(row["median_ms"] / copy["median_ms"])
    if row["cpu_busy"] is not None:  # None: samples shorter than /proc/stat's 10 ms tick
        assert 0 <= row["cpu_softirq"] <= row["cpu_busy"] <= 1


def test_allreduce(tmp_path):
    """(With 2 threads a rank: test_allreduce_gives_every_rank_its_threads_and_says_so's run.)"""
    engines = ["gloo", "ddpx", "ddpx-arena", "ddpx-fp16", "ddpx-bf16", "copy", "ddpx-oneshot",
               "ddpx-wide", "ddpx-timed"]
    sizes = [4096, 1024 * 1024]  # 1 MiB: four narrow steps or one wide one
    options = "--sizes 4K,1M --iters 3 --min_time 0.05 --warmup 1 --threads 2".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--engines", ",".join(engines))
    check_threads(document, stdout, "2")

    measured = list(dict.fromkeys(row["engine"] for row in document["rows"]))
    check_measured(engines, measured, document["left_out"])
    rows = {(row["size_bytes"], row["engine"]): row for row in document["rows"]}
    assert sorted(rows) == sorted((size, engine) for size in sizes for engine in measured)
    for (size, _), row in rows.items():
        assert row["world_size"] == 2
        check_allreduce_row(row, rows[size, "gloo"], rows[size, "copy"])
    # gloo the only peer: no "x vs best peer" beside "x vs gloo"; copy a floor, not an engine.
    assert "x vs gloo" in stdout and "x vs best peer" not in stdout and "/ floor" in stdout
    assert "copy floor: not an all-reduce" in stdout
    if ddpx_built():
        assert re.search(r"note: ddpx on 2 ranks: .*one-shot up to 32 KiB", stdout), stdout
        # Measured on tensors in ddpx's arena, every call zero-copy (or the run had stopped).
        assert "ddpx-arena" in measured, document["left_out"]
        assert re.search(r"note: ddpx on 2 ranks: .* [1-9][0-9]* zero-copy all-reduces", stdout)
    assert "load: none (idle)" in stdout
    assert document["settings"]["load"] == 0 and document["settings"]["load_pids"] == []
    assert sum(line.split()[:1] == ["2"] for line in stdout.splitlines()) == len(rows)


# --threads 2 is test_allreduce's run, checked there.
@pytest.mark.parametrize("threads", [pytest.param("default", marks=pytest.mark.slow)])
def test_allreduce_gives_every_rank_its_threads_and_says_so(tmp_path, threads):
    options = "--sizes 2M --iters 3 --min_time 0.05 --warmup 1 --engines gloo,ddpx,copy".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--threads", threads)
    check_threads(document, stdout, threads)


def check_threads(document: dict, stdout: str, threads: str) -> None:
    """The run gave every rank the threads `threads` asks for, and said so."""
    header = stdout.splitlines()[0]
    if threads == "2":
        assert document["machine"]["rank_threads"] == 2
        assert ", 2 threads per rank, torch" in header, header
        want = 2
    else:
        # mp.spawn's ranks with no OMP_NUM_THREADS: ddpx lowers torch's to each rank's share.
        want = max(1, len(os.sched_getaffinity(0)) // 2)
        assert document["machine"]["rank_threads"] == want
        assert (f"torch's default threads per rank (OMP_NUM_THREADS unset; rank 0 ran {want} "
                "after ddpx started)") in header, header
    if ddpx_built():
        assert re.search(rf"note: ddpx on 2 ranks: .*, {want} threads? per rank", stdout), stdout


# What `ddpx-bench allreduce --quick` promises: 2 ranks, DDP's bucket sizes, what every install has.
QUICK_SIZES = [64 * 1024, 1024 * 1024, 25 * 1024 * 1024]
QUICK_ENGINES = ["gloo", "ddpx", "copy"]
QUICK_HEADER = ("quick mode: one launch, whose times another launch can change severalfold "
                "(--runs N: the median of N); --quick is --world_sizes 2 --sizes 64K,1M,25M "
                "--engines gloo,ddpx,copy --iters 10 --min_time 0.3 (options given win); the full "
                "run: ")
# Set for a run's processes, which keep it whoever adopts them.
RUN_MARK = "DDPX_TEST_BENCH_RUN"


def run_quick(tmp_path: Path, *options: str) -> tuple[dict, list[str], list[str]]:
    """Run `ddpx-bench allreduce --quick` with `options` as a user would: its JSON document, the
    lines of its stdout and the command of the full run. Checks that it left no process running
    and none of ddpx's segments in /dev/shm."""
    json_path = tmp_path / "quick.json"
    command = ["allreduce", "--quick", *options, "--json", str(json_path)]
    segments_before = shm_segments()
    done = subprocess.run([*BENCH, *command], capture_output=True, text=True, timeout=300,
                          env={**os.environ, RUN_MARK: str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert still_alive(carrying(RUN_MARK, str(tmp_path))) == []
    assert not left_in_shm(segments_before)
    full_run = ["ddpx-bench", *(arg for arg in command if arg != "--quick")]
    return json.loads(json_path.read_text()), done.stdout.splitlines(), full_run



def carrying(variable: str, value: str) -> list[int]:
    """The live processes whose environment sets `variable` to `value`."""
    entry = f"{variable}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def test_allreduce_quick_measures_what_it_promises_and_says_it_was_quick(tmp_path):
    document, lines, full_run = run_quick(tmp_path)

    assert lines[1] == QUICK_HEADER + shlex.join(full_run)
    assert document["settings"]["quick"] is True and "runs" not in document  # one launch
    measured = list(dict.fromkeys(row["engine"] for row in document["rows"]))
    check_measured(QUICK_ENGINES, measured, document["left_out"])
    rows = {(row["world_size"], row["size_bytes"], row["engine"]): row for row in document["rows"]}
    assert list(rows) == [(2, size, engine) for size in QUICK_SIZES for engine in measured]
    for (_, size, _), row in rows.items():
        assert row["samples"] == 10
        check_allreduce_row(row, rows[2, size, "gloo"], rows[2, size, "copy"])
    table = [line.split() for line in lines if line.split()[:1] == ["2"]]
    assert [row[:3] for row in table] == [["2", size, engine] for size in ("64K", "1M", "25M")
                                          for engine in measured]
    # gloo the only peer: no column repeats "x vs gloo"; the copy floor's row ranks nothing.
    header = next(line for line in lines if line.lstrip().startswith("world"))
    assert "x vs gloo" in header and "best peer" not in header, header
    assert all(row[3] == "floor" and row[7:9] == ["-", "-"]  # x vs gloo, / floor
               for row in table if row[2] == "copy"), table


@pytest.mark.slow  # a launch; test_quick_is_its_options_and_an_option_given_beside_it_wins
def test_allreduce_quick_takes_the_options_given_beside_it(tmp_path):
    document, lines, full_run = run_quick(tmp_path, "--sizes", "4K", "--iters", "3")

    assert lines[1] == QUICK_HEADER + shlex.join(full_run)
    assert full_run[:5] == ["ddpx-bench", "allreduce", "--sizes", "4K", "--iters"]
    measured = list(dict.fromkeys(row["engine"] for row in document["rows"]))
    check_measured(QUICK_ENGINES, measured, document["left_out"])  # --quick's engines still
    rows = {(row["world_size"], row["size_bytes"], row["engine"]): row for row in document["rows"]}
    assert list(rows) == [(2, 4096, engine) for engine in measured]
    for row in rows.values():
        assert row["samples"] == 3
        check_allreduce_row(row, rows[2, 4096, "gloo"], rows[2, 4096, "copy"])


def test_quick_is_its_options_and_an_option_given_beside_it_wins(capsys):
    from ddpx_bench import cli
    from ddpx_bench.mode import MODES

    quick = MODES["allreduce"].quick_options.split()

    def settings(*argv: str) -> dict:
        return {key: value for key, value in vars(cli.parse_args(["allreduce", *argv])).items()
                if key != "quick"}

    assert settings("--quick") == settings(*quick)
    promised = {"world_sizes": [2], "sizes": QUICK_SIZES, "engines": QUICK_ENGINES, "runs": 1}
    assert {key: settings("--quick")[key] for key in promised} == promised
    # Before --quick or after it, a given option wins; the rest are --quick's.
    given = ["--sizes", "4K", "--quick", "--world_sizes", "3", "--min_time", "2"]
    assert settings(*given) == settings(*quick, "--sizes", "4K", "--world_sizes", "3",
                                        "--min_time", "2")
    assert settings(*given)["sizes"] == [4096] and settings(*given)["iters"] == 10
    # Without it, the full run's defaults.
    assert settings()["world_sizes"] == [2, 4] and settings()["iters"] == 20
    assert cli.parse_args(["allreduce"]).quick is False

    with pytest.raises(SystemExit):
        cli.parse_args(["allreduce", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"--quick a first answer, in under a minute on 2 cores: {' '.join(quick)}" in help_text


def test_collectives(tmp_path):
    collectives = ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                   "all_gather", "reduce_scatter", "barrier", "send_recv", "gather", "scatter"]
    sizes = [4096, 64 * 1024]
    options = "--sizes 4K,64K --iters 2 --min_time 0.02 --warmup 1".split()
    document, stdout = run_bench(tmp_path, "collectives", *options,
                                 "--collectives", ",".join(collectives))

    engines = ["gloo", "ddpx"] if ddpx_backend_registered() else ["gloo"]
    if not ddpx_backend_registered():
        assert "registers no torch.distributed backend" in document["left_out"]["ddpx"]
    fused = ["ddpx.all_reduce"] if ddpx_built() else []
    rows = {(row["collective"], row["size_bytes"], row["engine"]): row for row in document["rows"]}
    # The barrier moves no data: one cell, without a size.
    cells = [(c, size) for c in collectives for size in ([None] if c == "barrier" else sizes)]
    assert sorted(rows, key=str) == sorted(
        ((c, size, engine) for c, size in cells
         for engine in engines + (fused if c == "all_reduce" else [])), key=str)
    for (collective, size, engine), row in rows.items():
        assert row["world_size"] == 2
        check_times(row)
        gloo = rows[collective, size, "gloo"]
        assert row["x_vs_gloo"] == pytest.approx(gloo["median_ms"] / row["median_ms"])
        if collective == "barrier":
            assert row["check"] == "barrier" and row["output_bytes"] is None
        else:
            expected_output = {"all_gather_into_tensor": 2 * size, "all_gather": 2 * size,
                               "reduce_scatter_tensor": size // 2, "reduce_scatter": size // 2,
                               "gather": 2 * size, "scatter": size // 2}
            assert row["output_bytes"] == expected_output.get(collective, size)
            assert 0 <= row["max_abs_error"] <= row["tolerance"]
            if row["check"] == "exact":
                assert row["max_abs_error"] == 0
        if engine == "ddpx":
            # Served by ddpx's shared-memory engine, not its gloo fallback.
            assert row["served_by"]["engine"] > 0, row["routes"]
        else:
            assert row["routes"] is row["served_by"] is None
        if collective == "all_reduce" and engine != "gloo":
            assert row["ranks_identical"]
        if engine == "ddpx.all_reduce" and "ddpx" in engines:
            ddpx_ms = rows[collective, size, "ddpx"]["median_ms"]
            assert row["x_vs_ddpx"] == pytest.approx(ddpx_ms / row["median_ms"])
    assert "gloo ms" in stdout and "ddpx.all_reduce ms" in stdout and "gloo/ddpx" in stdout
    assert "output world x size" in stdout and "output size / world" in stdout
    if "ddpx" in engines:
        assert re.search(r"note: ddpx backend on 2 ranks: ", stdout), stdout
    table = [line for line in stdout.splitlines() if line.split()[:1] == ["2"]]
    assert len(table) == len(cells)
    assert all(line.split()[1] == collective for line, (collective, _) in zip(table, cells,
                                                                               strict=True))


@pytest.mark.skipif(bool(missing_peers()), reason=f"needs {', '.join(missing_peers())}: "
                    'pip install -e ".[peers]"')
def test_allreduce_beside_the_peers_mpi_and_deepspeed(tmp_path):
    engines, sizes = ["gloo", "ddpx", "mpi", "deepspeed"], [4096, 256 * 1024]
    options = "--sizes 4K,256K --iters 2 --min_time 0.05 --warmup 1".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--engines", ",".join(engines))

    measured = list(dict.fromkeys(row["engine"] for row in document["rows"]))
    check_measured(engines, measured, document["left_out"])
    assert {"gloo", "mpi", "deepspeed"} <= set(measured)
    rows = {(row["size_bytes"], row["engine"]): row for row in document["rows"]}
    for size in sizes:
        peers = {name: rows[size, name]["median_ms"] for name in ("gloo", "mpi", "deepspeed")}
        best = min(peers, key=peers.get)
        for engine in measured:
            row = rows[size, engine]
            check_times(row)
            assert 0 <= row["max_abs_error"] <= row["tolerance"]
            assert row["best_peer"] == best
            assert row["x_vs_best_peer"] == pytest.approx(peers[best] / row["median_ms"])
    assert "x vs best peer" in stdout and "the fastest of gloo, mpi, deepspeed" in stdout
    # mpirun and its ranks carry the run's arguments, which name tmp_path: none is left.
    assert mentioning(str(tmp_path)) == []
    assert not list(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*_ddpx-bench-*"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pins and reaps the Linux way")
def test_load_runs_one_process_per_core_and_ends_with_the_run(tmp_path):
    options = "--sizes 4K --iters 2 --min_time 0.2 --warmup 1 --engines gloo --load 1".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options)

    # A spinning process on every core: the CPU column sees the cores busy throughout.
    assert document["rows"][0]["cpu_busy"] > 0.9, document["rows"]
    cores = len(os.sched_getaffinity(0))
    pids = document["settings"]["load_pids"]
    assert document["settings"]["load"] == 1 and len(pids) == len(set(pids)) == cores
    assert still_alive(pids, seconds=0) == []  # ddpx-bench stopped them before it exited
    assert f"load: 1 CPU-bound process per core ({cores} in all)" in stdout


@pytest.mark.skipif(not ddpx_built(), reason="needs ddpx's extension")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds 2 ranks to 2 cores")
def test_runs_are_fresh_launches_summed_up_by_median_and_worst(tmp_path):
    options = "--sizes 4K --iters 2 --min_time 0.05 --warmup 1 --engines gloo,ddpx".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--runs", "3", "--bind", "core")

    runs = document["runs"]
    assert len(runs) == 3 and document["settings"]["bind"] == "core"
    for row in document["rows"]:
        same = [r for run in runs for r in run["rows"] if r["engine"] == row["engine"]]
        medians = [r["median_ms"] for r in same]
        assert row["runs"] == 3
        assert row["median_ms"] == statistics.median(medians)
        assert row["worst_median_ms"] == max(medians)
        assert row["worst_x_vs_gloo"] == min(r["x_vs_gloo"] for r in same)
    # Each launch's ddpx engine saw its rank bound apart from its peer, as the note says.
    assert "ranks bound to a core each" in stdout and "worst x gloo" in stdout
    assert "(this rank is bound apart from its peers)" in stdout
    assert not list(Path("/dev/shm").glob("ddpx-*"))


@pytest.mark.slow
@pytest.mark.skipif(not ddpx_backend_registered(), reason="needs ddpx's backend")
def test_collectives_over_runs_give_the_median_and_the_worst(tmp_path):
    options = "--sizes 4K --iters 2 --min_time 0.02 --warmup 1 --collectives send_recv".split()
    document, stdout = run_bench(tmp_path, "collectives", *options, "--runs", "2")

    runs = document["runs"]
    assert len(runs) == 2
    for row in document["rows"]:
        same = [r for run in runs for r in run["rows"] if r["engine"] == row["engine"]]
        assert row["runs"] == 2
        assert row["median_ms"] == statistics.median(r["median_ms"] for r in same)
        assert row["worst_median_ms"] == max(r["median_ms"] for r in same)
        assert row["worst_x_vs_gloo"] == min(r["x_vs_gloo"] for r in same)
    assert "worst gloo/ddpx" in stdout and "2 fresh launches" in stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_load_and_ranks_die_with_a_killed_bench(tmp_path):
    command = [*BENCH, "allreduce", "--world_sizes", "2", "--sizes", "4K",
               "--engines", "gloo", "--iters", "50", "--min_time", "60", "--load", "1"]
    # A killed ddpx-bench cannot remove its temporary folder: have it made in tmp_path.
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        for line in bench.stderr:  # the ranks time under the load: mid-run
            if "timing" in line:
                break
        started = children(bench.pid)
        load = [pid for pid in started if command_line(pid)[1:] == ["-c", "while True: pass"]]
        pinned = [os.sched_getaffinity(pid) for pid in load]
        assert all(len(cores) == 1 for cores in pinned)
        assert sorted(core for cores in pinned for core in cores) == sorted(os.sched_getaffinity(0))
        assert len(started) > len(load)  # the ranks
        bench.kill()
        bench.wait()
        assert still_alive(started) == []
    finally:
        bench.kill()
        bench.wait()
        bench.stderr.close()


@pytest.mark.slow
@pytest.mark.skipif(not ddpx_built(), reason="needs ddpx's extension")
def test_allreduce_on_two_simulated_nodes_counts_the_bytes_between_them(tmp_path):
    options = "--sizes 64K --iters 2 --min_time 0.05 --warmup 1 --nodes 2".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--engines",
                                 "gloo,ddpx,ddpx-bf16,ddpx-arena", world_sizes="4")

    rows = {row["engine"]: row for row in document["rows"]}
    # ddpx-arena ran every call zero-copy within each node, or the run would have stopped.
    assert sorted(rows) == ["ddpx", "ddpx-arena", "ddpx-bf16", "gloo"], document["left_out"]
    assert all(row["nodes"] == 2 for row in rows.values())
    assert rows["gloo"]["inter_node_bytes"] is None
    # Each node sends its float32 sum across once; compressed, in 2-byte elements (padded by at
    # most one element per rank).
    for engine in ("ddpx", "ddpx-arena"):
        assert rows[engine]["inter_node_bytes"] == 2 * 64 * 1024, engine
    assert 64 * 1024 <= rows["ddpx-bf16"]["inter_node_bytes"] <= 64 * 1024 + 4 * 4
    assert "inter-node MB/call" in stdout and "4 ranks on 2" in stdout


def testbed_unavailable() -> str | None:
    from ddpx_bench import testbed

    return testbed.unavailable()


@pytest.mark.slow  # 35 s; tests/test_network.py covers the testbed by default
@pytest.mark.skipif(not ddpx_built() or testbed_unavailable() is not None,
                    reason=f"needs ddpx and network namespaces ({testbed_unavailable()})")
def test_allreduce_on_a_shaped_link_reports_its_bound_and_the_cost_model(tmp_path):
    from ddpx_bench import costmodel

    options = "--sizes 1M --iters 2 --min_time 0.05 --warmup 1 --link none,100mbit".split()
    document, stdout = run_bench(tmp_path, "allreduce", *options, "--engines",
                                 "gloo,ddpx,ddpx-bf16", world_sizes="4")

    rows = {(row["link"], row["engine"]): row for row in document["rows"]}
    assert sorted(rows) == [(link, engine) for link in ("100mbit", "none")
                            for engine in ("ddpx", "ddpx-bf16", "gloo")]
    assert all(row["nodes"] == 2 for row in rows.values())
    for engine, wire_bytes in (("gloo", 4), ("ddpx", 4), ("ddpx-bf16", 2)):
        shaped, unshaped = rows["100mbit", engine], rows["none", engine]
        # 2 nodes: each sends the whole message once, in the wire dtype.
        bound = (1 << 20) * wire_bytes / 4 * 8 / 100e6 * 1e3
        assert shaped["bound_ms"] == pytest.approx(bound)
        assert shaped["x_bound"] == pytest.approx(shaped["median_ms"] / bound)
        assert 0 < shaped["tcp_bits_per_s"] < 100e6 < unshaped["tcp_bits_per_s"]
        assert "bound_ms" not in unshaped and "model_ms" not in unshaped
        if engine == "gloo":
            assert "model_ms" not in shaped
            continue
        model = costmodel.hierarchical_ms(1 << 20, 2, shaped["tcp_bits_per_s"],
                                          unshaped["median_ms"], chunks=1, wire_bytes=wire_bytes)
        assert shaped["model_ms"] == pytest.approx(model)
    assert "bound ms" in stdout and "x model" in stdout and "one TCP stream carried" in stdout
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout.split() if ns.startswith("ddpx-")]


@pytest.mark.slow  # 20 s
@pytest.mark.skipif(not ddpx_built() or testbed_unavailable() is not None,
                    reason=f"needs ddpx and network namespaces ({testbed_unavailable()})")
def test_train_on_a_shaped_link_counts_what_each_hook_sends(tmp_path):
    options = "--params 400K --steps 2 --warmup 2 --batch_size 4 --link 1gbit".split()
    document, stdout = run_bench(tmp_path, "train", *options, "--comm_hooks",
                                 "default,powersgd,ddpx,ddpx-bf16,none", world_sizes="4")

    rows = {row["hook"]: row for row in document["rows"]}
    assert list(rows) == ["default", "powersgd-r1", "powersgd-r4", "ddpx", "ddpx-bf16", "none"]
    gradients = 4 * rows["ddpx"]["params"]
    fp32 = rows["ddpx"]["link_bytes_per_step"]
    for row in rows.values():
        assert row["bytes_vs_fp32"] == pytest.approx(row["link_bytes_per_step"] / fp32)
    # ddpx: each node sends its float32 sum across once (and the packets' headers, the ACKs);
    # bf16 half that; gloo's ring 2(N-1)/N of the gradients on each node's one edge across.
    assert gradients <= fp32 <= 1.1 * gradients
    assert rows["ddpx-bf16"]["bytes_vs_fp32"] == pytest.approx(0.5, rel=0.05)
    assert rows["default"]["bytes_vs_fp32"] == pytest.approx(1.5, rel=0.05)
    assert (rows["powersgd-r1"]["link_bytes_per_step"] < rows["powersgd-r4"]["link_bytes_per_step"]
            < 0.2 * gradients)
    assert rows["none"]["link_bytes_per_step"] < 0.01 * gradients  # the barriers'
    assert "link MB/step" in stdout and "bytes vs fp32" in stdout and "S/R ms" in stdout
    # The link's floor: a node's bytes at tbf's 1 Gbit/s; the least step: none's first bucket,
    # then those bytes, said beside the step measured, both against none's step.
    floor = rows["none"]
    for hook, row in rows.items():
        assert row["link_floor_ms"] == pytest.approx(row["link_bytes_per_step"] * 8e3 / 1e9)
        assert row["least_step_ms"] == pytest.approx(floor["first_bucket_ms"]
                                                     + row["link_floor_ms"])
        if hook != "none":
            least = row["least_step_ms"] / floor["median_ms"]
            measured = row["median_ms"] / floor["median_ms"]
            assert f"  {hook} at 1gbit: {floor['first_bucket_ms']:.0f} + " \
                f"{row['link_floor_ms']:.0f} = {row['least_step_ms']:.0f} ms = {least:.2f}x " \
                f"none's step; measured {measured:.2f}x" in stdout, stdout


@pytest.mark.skipif(not ddpx_built() or testbed_unavailable() is not None,
                    reason=f"needs ddpx and network namespaces ({testbed_unavailable()})")
def test_a_killed_bench_on_the_testbed_takes_its_torchruns_and_ranks_with_it(tmp_path):
    """ddpx-bench SIGKILLed mid-run on a shaped link cannot close its testbed: every process
    in its namespaces (the torchruns, their ranks) dies with it all the same, and the next
    testbed made removes the namespaces."""
    from ddpx_bench import testbed

    command = [*BENCH, "train", "--params", "400K", "--steps", "100000", "--comm_hooks", "none",
               "--link", "1gbit", "--world_sizes", "4"]
    bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    prefix = f"ddpx-{bench.pid}-"
    try:
        said, deadline = b"", time.monotonic() + 180
        while b"TCP carries" not in said:  # the testbed is up: its torchruns start
            left = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([bench.stderr], [], [], left)
            more = os.read(bench.stderr.fileno(), 1 << 16) if ready else b""
            assert more, f"ddpx-bench ended, or said nothing for 180 s: {said[-2000:]!r}"
            said += more
        deadline = time.monotonic() + 120
        while True:  # until every rank has spent 5 s of a core: importing, then training
            namespaces = [ns for ns in testbed._namespaces() if ns.startswith(prefix)]
            inside = [pid for ns in namespaces for pid in testbed._pids(ns)]
            ranks = [pid for pid in inside if command_line(pid)[1:4] == ["-u", "-m", "ddpx_bench"]]
            if (len(ranks) == 4 and min(map(cpu_seconds, ranks)) > 5) or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(namespaces) == 2 and len(ranks) == 4, (namespaces, inside)
        bench.kill()
        bench.wait()
        assert still_alive(inside, seconds=10) == []
    finally:
        bench.kill()
        bench.wait()
        bench.stderr.close()
        with testbed.Testbed(2, None):
            left = [ns for ns in testbed._namespaces() if ns.startswith(prefix)]
    assert left == []


def test_collectives_link_bound_is_the_bytes_a_node_must_carry():
    from ddpx_bench.collectives import bytes_across

    size = 1 << 20

    def row(collective, nodes=2, world_size=4):
        return {"collective": collective, "size_bytes": size, "nodes": nodes,
                "world_size": world_size}

    assert bytes_across(row("all_reduce")) == size  # 2(N-1)/N of the input
    assert bytes_across(row("all_reduce", nodes=3, world_size=6)) == 4 * size // 3
    assert bytes_across(row("all_gather_into_tensor")) == 2 * size  # the other node's 2 inputs
    assert bytes_across(row("all_gather", nodes=3, world_size=6)) == 4 * size
    assert bytes_across(row("reduce_scatter_tensor")) == size // 2  # the other node's 2 parts
    assert bytes_across(row("broadcast")) == size
    # 2 ranks a node, each sending half its input to the other node's ranks.
    assert bytes_across(row("all_to_all")) == size
    assert bytes_across(row("all_to_all_single", nodes=3, world_size=6)) == 4 * size // 3
    assert bytes_across(row("gather")) == 2 * size  # the other node's 2 inputs to rank 0
    assert bytes_across(row("scatter")) == size // 2  # rank 0's parts for the other node
    assert bytes_across(row("send_recv")) is None
    assert bytes_across(row("all_reduce", nodes=1, world_size=2)) is None
    assert bytes_across({**row("barrier"), "size_bytes": None}) is None


@pytest.mark.slow  # 60 s
@pytest.mark.skipif(not ddpx_built() or testbed_unavailable() is not None,
                    reason=f"needs ddpx and network namespaces ({testbed_unavailable()})")
def test_collectives_on_a_shaped_link_run_on_the_engine_and_report_their_bound(tmp_path):
    from ddpx_bench.collectives import bytes_across

    collectives = ["all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"]
    options = "--sizes 256K --iters 2 --min_time 0.05 --warmup 1 --link 100mbit".split()
    document, stdout = run_bench(tmp_path, "collectives", *options, "--collectives",
                                 ",".join(collectives), world_sizes="4")

    rows = {(row["collective"], row["engine"]): row for row in document["rows"]}
    assert sorted(rows) == sorted((c, e) for c in collectives for e in ("ddpx", "gloo"))
    for (collective, engine), row in rows.items():
        assert row["nodes"] == 2 and row["link"] == "100mbit"
        if collective == "barrier":
            assert "bound_ms" not in row
        else:
            assert row["bound_ms"] == pytest.approx(bytes_across(row) * 8 / 100e6 * 1e3)
            assert row["x_bound"] == pytest.approx(row["median_ms"] / row["bound_ms"])
            assert 0 <= row["max_abs_error"] <= row["tolerance"]
        if engine == "ddpx":
            # Across nodes too, every call on the engine and none through gloo.
            assert row["served_by"]["engine"] > 0 and row["served_by"]["gloo"] == 0, row["routes"]
    assert "bound ms" in stdout and "ddpx/bound" in stdout
    assert not [ns for ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout.split() if ns.startswith("ddpx-")]


def test_the_cores_check_plans_what_the_issue_asks_in_commands_the_tool_takes(monkeypatch):
    """tools/cores_check.sh, the run for a machine of many cores: 2, 4 and 8 ranks with cores /
    ranks threads each, every engine, then the DDP step; each command as the tool parses it."""
    from ddpx_bench.cli import parse_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    plan = subprocess.run(["bash", str(ROOT / "tools" / "cores_check.sh")], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, CORES_CHECK_PLAN="1"),
                          check=True).stdout.splitlines()
    cores = len(os.sched_getaffinity(0))
    parsed = [parse_args(shlex.split(line)[1:]) for line in plan]
    assert [(a.mode, a.world_sizes, a.threads) for a in parsed] == [
        ("allreduce", [2], max(1, cores // 2)), ("allreduce", [4], max(1, cores // 4)),
        ("allreduce", [8], max(1, cores // 8)), ("train", [2], max(1, cores // 2))]
    for args in parsed[:3]:
        assert args.engines == ["gloo", "ddpx", "ddpx-arena", "mpi", "deepspeed", "copy"]
        assert args.sizes[0] == 64 << 10 and args.sizes[-1] == 100 << 20
    assert all(str(args.json).startswith("cores_out/") for args in parsed)


@pytest.mark.parametrize("options, message", [
    ("--world_sizes 4 --nodes 3", "ddpx-bench: --nodes 3 does not divide world size 4 evenly"),
    ("--link 1gbit --load 1", "ddpx-bench: --load with --link"),
    ("--link 1gbit --runs 2", "ddpx-bench: --runs launches the ranks afresh"),
])
def test_options_that_cannot_run_together_are_refused(options, message, capsys):
    """In cli.parse_args, which main calls first (the console entry's test and the missing
    numpy's run it as a user does)."""
    from ddpx_bench import cli

    with pytest.raises(SystemExit) as info:
        cli.parse_args(["allreduce", *options.split()])
    assert info.value.code == 2  # refused as argparse refuses a usage, before anything runs
    assert message in capsys.readouterr().err


def test_a_missing_numpy_is_refused_with_the_extra_that_installs_it():
    """ddpx needs no numpy, the benchmark does: torch.distributed's object collectives use it."""
    done = subprocess.run([sys.executable, "-c", "import sys; sys.modules['numpy'] = None; "
                           "from ddpx_bench import cli; cli.main(['allreduce'])"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.endswith('pip install "ddpx[bench]"\n'), done.stderr


@pytest.fixture(scope="module")
def help_run() -> subprocess.CompletedProcess:
    """`ddpx-bench --help`, run once for the tests of what it prints."""
    return subprocess.run([*BENCH, "--help"], capture_output=True, text=True, timeout=60)


def test_help_lists_the_six_modes(help_run):
    done = help_run
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: ddpx-bench ")
    assert "{allreduce,collectives,train,converge,fsdp,accuracy}" in done.stdout
    for mode in ("allreduce", "collectives", "train", "converge", "fsdp", "accuracy"):
        assert f"ddpx-bench {mode} --json" in done.stdout  # the examples after the options


def test_modes_lists_every_mode_file_and_each_has_a_short_help(capsys):
    """A mode is its file's MODE and its name in MODES: a file with a MODE that MODES lacks would
    never run."""
    from ddpx_bench import cli
    from ddpx_bench.mode import MODES, Mode

    files = sorted(path.stem for path in (ROOT / "ddpx_bench").glob("*.py")
                   if "\nMODE = " in path.read_text())
    assert sorted(type(mode).__module__ for mode in MODES.values()) == [
        f"ddpx_bench.{file}" for file in files]
    for name, mode in MODES.items():
        assert isinstance(mode, Mode) and mode.name == name
        with pytest.raises(SystemExit) as info:
            cli.parse_args([name, "--help"])
        assert info.value.code == 0
        help_text = capsys.readouterr().out
        assert help_text.startswith(f"usage: ddpx-bench {name} ")
        assert mode.description in help_text and "--world_sizes" in help_text
        assert len(help_text.splitlines()) < 80


def test_help_is_short_and_the_cli_leaves_the_testbed_unloaded(help_run):
    done = help_run
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) < 40
    probe = ("import sys, ddpx_bench.cli, ddpx_bench.launch; "
             "print('ddpx_bench.testbed' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=True)
    assert loaded.stdout.strip() == "False"


def test_the_console_entry_is_the_clis_main():
    """pyproject.toml's `ddpx-bench` entry, and the installed one where ddpx is installed, run
    ddpx_bench.cli's main."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from ddpx_bench import cli

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["ddpx-bench"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main
    for entry in importlib.metadata.entry_points(group="console_scripts", name="ddpx-bench"):
        assert entry.load() is cli.main


def test_train(tmp_path):
    typed = ["default", "fp16", "bf16", "powersgd", "ddpx", "ddpx-bf16", "ddpx-int8", "ddpx-int4",
             "ddpx+step", "backend", "backend-mem", "none"]
    hooks = [*typed[:3], "powersgd-r1", "powersgd-r4", *typed[4:]]
    # 400K parameters: two buckets once DDP has rebuilt them, whose PowerSGD all-reduces race on
    # gloo unless a bucket waits for the one before; PowerSGD compresses the last two steps.
    options = "--params 400K --steps 3 --warmup 1 --batch_size 4".split()
    trace = tmp_path / "trace.json"
    document, stdout = run_bench(tmp_path, "train", *options, "--comm_hooks", ",".join(typed),
                                 "--trace", str(trace))

    rows = {row["hook"]: row for row in document["rows"]}
    check_measured(hooks, list(rows), document["left_out"])
    # torch's bf16 hook on gloo, which DDP refuses by the hook's name without NCCL.
    assert {"default", "fp16", "bf16", "powersgd-r1", "powersgd-r4", "none"} <= set(rows)
    assert list(rows) == [hook for hook in hooks if hook in rows]  # in the order typed
    for row in rows.values():
        assert row["world_size"] == 2
        check_times(row)
        assert row["x_vs_default"] == pytest.approx(rows["default"]["median_ms"] / row["median_ms"])
        assert "link_bytes_per_step" not in row  # off the testbed
        if row["hook"] == "none":  # the floor: timed, not checked
            assert "ranks_identical" not in row and "max_abs_diff" not in row
            # Each rank's first bucket comes within its step: so does the slowest's median.
            assert 0 < row["first_bucket_ms"] <= row["median_ms"]
            continue
        assert "first_bucket_ms" not in row
        assert row["ranks_identical"]
        if row["hook"].startswith("powersgd"):  # not a rounding: a |diff|, no tolerance
            assert row["max_abs_diff"] > 0 and row["tolerance"] is None
            continue
        assert 0 <= row["max_abs_diff"] <= row["tolerance"]
    assert rows["default"]["max_abs_diff"] == 0
    # On one node optimizer= leaves the step after backward: the same bits.
    assert rows["ddpx+step"]["max_abs_diff"] == rows["ddpx"]["max_abs_diff"]
    assert "the optimizer steps after backward (one node" in rows["ddpx+step"]["describe"]
    if "ddpx-int8" in document["left_out"]:  # until ddpx has the compression
        assert "compression='int8'" in document["left_out"]["ddpx-int8"]
    assert "x vs default" in stdout and "link MB/step" not in stdout
    # The machine's cores through each hook's steps (/proc/stat's 10 ms ticks: none at all in
    # steps this short is possible): a fraction busy, of which softirq is a part.
    assert all(row["cpu_busy"] is None or 0 <= row["cpu_softirq"] <= row["cpu_busy"] <= 1
               for row in rows.values()), [(r["cpu_busy"], r["cpu_softirq"]) for r in rows.values()]
    assert re.search(r" powersgd-r1 .* - +\d+/\d+ +\d+ +torch powerSGD_hook, rank 1,",
                     stdout), stdout
    # Each step's CPU on every rank's threads, by whose: the ranks' own run every step.
    for row in rows.values():
        parts = [row[f"cpu_{kind}_ms"] for kind in ("rank", "ddpx", "gloo")]
        assert row["cpu_rank_ms"] > 0 and min(parts) >= 0, row
        assert row["cpu_ms"] == pytest.approx(sum(parts)), row
        assert re.search(rf"^  {re.escape(row['hook'])}: \d+ ms = \d+\.\d\dx none's: the ranks' "
                         rf"own threads \d+, ddpx's \d+, gloo's \d+$", stdout, re.M), stdout
    if ddpx_backend_registered():
        # DDP's own all-reduce on ddpx's backend: its buckets in ordinary memory, none of its
        # all-reduces zero-copy; in ddpx's arena, some (the first on a new bucket maps it).
        assert rows["backend"]["zero_copy_calls"] == 0 < rows["backend"]["all_reduces"]
        mem = rows["backend-mem"]
        assert 0 < mem["zero_copy_calls"] <= mem["all_reduces"] == rows["backend"]["all_reduces"]
        assert re.search(r" backend-mem .* arena .* of \d+ all-reduces zero-copy", stdout), stdout
    # --trace: every rank's traced step of each hook, ddpx's with its hook's ranges.
    for path in (trace, tmp_path / "trace.rank1.json"):
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        steps = {e["name"].removeprefix("ddpx-bench step: "): e for e in events
                 if e["name"].startswith("ddpx-bench step: ")}
        assert sorted(steps) == sorted(rows), (path, sorted(steps))
        for hook in ("ddpx", "ddpx+step"):
            step = steps[hook]
            assert any(e["name"] == "ddpx::fused_hook"
                       and step["ts"] <= e["ts"] <= step["ts"] + step["dur"] for e in events), hook


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux's /proc")
def test_thread_seconds_count_a_threads_cpu_under_whose_it_is_by_its_name():
    """A thread named as ddpx names its threads spends its CPU under ddpx's, as much of it as
    the thread's own clock (time.thread_time, the same count) says; the kinds follow the names."""
    import ctypes
    import threading

    from ddpx_bench import common

    assert [common._thread_kind(name) for name in (
        "ddpx engine", "ddpx link", "gloo_tcp_loop", "pt_gloo_runloop", "python3", "ddpxish")] == [
        "ddpx", "ddpx", "gloo", "gloo", "rank", "rank"]
    burnt, done, release = {}, threading.Event(), threading.Event()

    def burn():
        ctypes.CDLL(None).prctl(15, b"ddpx burner", 0, 0, 0)  # PR_SET_NAME
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        burnt["s"] = time.thread_time()
        done.set()
        release.wait()

    before = common.thread_times()
    burner = threading.Thread(target=burn)
    burner.start()
    done.wait(timeout=60)
    after = common.thread_times()
    release.set()
    burner.join()
    rank, ddpx, _ = common.thread_seconds(before, after)
    # From the thread's start to its event: its naming before the clock, its set() after it.
    assert burnt["s"] <= ddpx <= burnt["s"] + 0.05, (burnt, ddpx)
    assert rank >= 0


def test_powersgd_stands_for_both_ranks_where_it_is_typed():
    from ddpx_bench import cli

    def hooks(mode: str, *argv: str) -> list[str]:
        return cli.parse_args([mode, *argv]).comm_hooks

    assert hooks("train", "--comm_hooks", "default,powersgd,none") == [
        "default", "powersgd-r1", "powersgd-r4", "none"]
    assert hooks("train", "--comm_hooks", "powersgd-r4,powersgd") == ["powersgd-r4", "powersgd-r1"]
    assert hooks("train", "--comm_hooks", "ddpx,steps") == [
        "ddpx", "ddpx+step", "ddpx-bf16+step", "ddpx-int8+step", "ddpx-int4+step"]
    assert hooks("converge") == ["default", "bf16", "powersgd-r1", "powersgd-r4", "ddpx",
                                 "ddpx-bf16", "ddpx-int8", "ddpx-int4", "none"]
    assert {"powersgd-r1", "powersgd-r4", "ddpx-int8", "ddpx-int4"} <= set(hooks("train"))
    with pytest.raises(SystemExit):
        cli.parse_args(["train", "--comm_hooks", "powersgd-r2"])


def test_converge(tmp_path):
    typed = ["default", "bf16", "powersgd", "ddpx", "none"]
    hooks = ["default", "bf16", "powersgd-r1", "powersgd-r4", "ddpx", "none"]
    document, stdout = run_bench(tmp_path, "converge", "--params", "50K", "--steps", "20",
                                 "--comm_hooks", ",".join(typed))

    assert "loss" in document
    rows = {row["hook"]: row for row in document["rows"]}
    check_measured(hooks, list(rows), document["left_out"])
    assert {"default", "bf16", "powersgd-r1", "powersgd-r4", "none"} <= set(rows)
    default = rows["default"]
    assert default["final_loss"] < default["first_loss"]  # it learns
    for row in rows.values():
        assert row["world_size"] == 2 and row["steps"] == 20 and len(row["losses"]) == 20
        # The same model on the same first batches: the same first loss, whatever the hook.
        assert row["first_loss"] == row["losses"][0] == default["first_loss"]
        assert row["final_loss"] == pytest.approx(statistics.mean(row["losses"][-10:]))
        assert row["final_vs_default_pct"] == pytest.approx(
            100 * (row["final_loss"] - default["final_loss"]) / default["final_loss"])
        assert row["vs_default_pct"] == pytest.approx(
            100 * (row["held_out_loss"] - default["held_out_loss"]) / default["held_out_loss"])
        # Each rank of `none` steps with its own gradients, on its own data.
        assert row["same_on_all_ranks"] is row["trains"] is (row["hook"] != "none")
    assert default["vs_default_pct"] == 0
    assert default["held_out_loss"] < default["first_loss"]  # it learns what it did not see
    assert default["lr_schedule"] == "cosine"
    # ddpx's float32 hook sums in another order: 20 steps of Adam on it end a rounding apart.
    assert abs(rows["ddpx"]["vs_default_pct"]) < 0.1
    assert "final loss" in stdout and "held-out loss" in stdout and "vs default %" in stdout
    assert re.search(r" none .* no +no communication.*: not a way to train", stdout), stdout


def test_converge_draws_its_task_steps_and_held_out_batches_from_streams_of_their_own():
    """No two of the converge run's streams share a seed: the task's, each rank's at each step
    and its held-out one, for the seeds, ranks and steps runs use, and at the largest that
    step_seed's bound covers."""
    seeds, ranks, steps = (0, 1, 2, 2**20 - 1), (0, 1, 3, 2**20 - 1), (0, 1, 199, 2**20 - 1)
    drawn = [step_seed(seed, rank, index) for seed in seeds for rank in ranks for index in steps]
    drawn += [task_seed(seed) for seed in seeds]
    drawn += [held_out_seed(seed, rank) for seed in seeds for rank in ranks]
    assert len(set(drawn)) == len(drawn)
    assert max(step_seed(seed, rank, index) for seed in seeds for rank in ranks
               for index in steps) < 2**61 <= min(task_seed(seed) for seed in seeds)
    assert max(drawn) < 2**63  # torch.Generator.manual_seed takes it as it is


def test_converge_learning_rate():
    cosine = argparse.Namespace(lr=1e-3, steps=200, lr_schedule="cosine")
    assert [_learning_rate(cosine, i) for i in (0, 50, 100)] == pytest.approx(
        [1e-3, 1e-3 * (1 + math.sqrt(0.5)) / 2, 5e-4])
    assert 0 < _learning_rate(cosine, 199) < 1e-6  # the last step still moves, a little
    # torch's own schedule, stepped once after each step, gives the same rates.
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200)
    for index in range(200):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(_learning_rate(cosine, index))
        optimizer.step()
        schedule.step()
    constant = argparse.Namespace(lr=1e-3, steps=200, lr_schedule="constant")
    assert {_learning_rate(constant, i) for i in range(200)} == {1e-3}


@pytest.mark.slow
def test_fsdp(tmp_path):
    precisions = ["fp32", "bf16"]
    options = "--params 20K --layers 2 --heads 2 --batch_size 2 --seq_len 8 --steps 2 --warmup 1"
    document, stdout = run_bench(tmp_path, "fsdp", *options.split(),
                                 "--precisions", ",".join(precisions))

    engines = ["gloo", "ddpx", "ddpx-mem"] if ddpx_backend_registered() else ["gloo"]
    if not ddpx_backend_registered():
        assert "registers no torch.distributed backend" in document["left_out"]["ddpx"]
        assert "registers no torch.distributed backend" in document["left_out"]["ddpx-mem"]
    rows = {(row["precision"], row["engine"]): row for row in document["rows"]}
    assert sorted(rows) == sorted((p, engine) for p in precisions for engine in engines)
    for (precision, engine), row in rows.items():
        assert row["world_size"] == 2 and row["steps"] == 2 and row["warmup"] == 1
        assert 0 < row["params"] <= 40_000 and row["d_model"] % 16 == 0
        check_times(row)
        gloo = rows[precision, "gloo"]
        assert row["x_vs_gloo"] == pytest.approx(gloo["median_ms"] / row["median_ms"])
        if engine == "gloo":
            assert row["routes"] is row["served_by"] is row["check"] is row["comm_memory"] is None
            continue
        # FSDP2's buffers from the group's backend, ddpx's arena, for ddpx-mem only.
        assert row["comm_memory"] is (engine == "ddpx-mem")
        # Checked against the gloo model after the warm-up: 2 ranks average alike, so the same
        # bits are expected but only the tolerance is required.
        if precision == "fp32":
            assert row["check"] == "max_abs_diff"
            assert 0 <= row["max_abs_diff"] <= row["tolerance"]
        else:
            assert row["check"] == "update_cosine"
            assert row["update_cosine"] >= row["tolerance"]
        # FSDP's all-gathers and reduce-scatters, and the check's gathers: all on ddpx's
        # shared-memory engine, none through its gloo fallback.
        assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= set(row["routes"])
        assert row["served_by"]["engine"] > 0 and row["served_by"]["gloo"] == 0, row["routes"]
        assert all(paths["gloo"] == 0 for paths in row["routes"].values()), row["routes"]
    assert "ms/step" in stdout and "x vs gloo" in stdout and "params vs gloo" in stdout
    table = [line.split() for line in stdout.splitlines() if line.split()[:1] == ["2"]]
    assert [line[1:3] for line in table] == [[p, engine] for p in precisions for engine in engines]
    if "ddpx" in engines:
        assert re.search(r"note: ddpx backend on 2 ranks: ", stdout), stdout
        assert re.search(r"note: ddpx-mem: FSDP2's buffers from ddpx's arena, which holds [1-9]",
                         stdout), stdout
        assert all(line[-1] == "engine" for line in table if line[2] != "gloo"), table


@pytest.mark.slow  # 17 s
def test_accuracy(tmp_path):
    methods = ["default", "torch-fp16", "torch-bf16", "ddpx", "ddpx-fp16", "ddpx-bf16"]
    document, stdout = run_bench(tmp_path, "accuracy", "--size", "2K", world_sizes="2,3")

    assert "errors" in document
    rows = {(row["world_size"], row["method"]): row for row in document["rows"]}
    measured = list(dict.fromkeys(method for _, method in rows))
    check_measured(methods, measured, document["left_out"])
    assert sorted(rows) == sorted((ws, method) for ws in (2, 3) for method in measured)
    for (world_size, method), row in rows.items():
        assert row["elements"] == 2000
        for stat in ("max", "mean"):
            error = row[f"{stat}_abs_error"]
            assert 0 <= error < 0.1
            # A float32 result may hit the float64 reference; one rounded to a wire dtype cannot.
            if row["wire"] != "fp32":
                assert error > 0
        assert row["mean_abs_error"] <= row["max_abs_error"]
        if method.startswith("ddpx"):
            assert row["ranks_identical"]
        torch_row = rows.get((world_size, f"torch-{row['wire']}"))
        if method.startswith("ddpx-") and torch_row:
            for stat in ("max", "mean"):
                ratio = row[f"{stat}_abs_error"] / torch_row[f"{stat}_abs_error"]
                assert row[f"{stat}_vs_torch"] == pytest.approx(ratio)
                if world_size == 3:
                    assert ratio <= 1
        else:
            assert row["max_vs_torch"] is row["mean_vs_torch"] is None
    assert "mean vs torch" in stdout
    assert sum(line.split()[:1] in (["2"], ["3"]) for line in stdout.splitlines()) == len(rows)


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, capsys):
    from ddpx_bench import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as info:
        cli.parse_args(["allreduce", "--plot", "out.png"])
    assert info.value.code == 2
    assert "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert cli.parse_args(["allreduce"]).plot is None
