"""The nodes of a multi-node job as Linux network namespaces on one machine, joined by links
shaped to a rate, so that ddpx's hierarchical all-reduce crosses a real (if simulated) network.

Each node is a namespace with one interface and an address on a private /24: two nodes are
joined by a veth pair, three or more through a Linux bridge in a namespace of its own, so
nothing is made in the host's namespace. Every link is shaped in both directions with tbf,
which limits the rate only: this kernel has no netem, so no delay or loss is added. Each node
runs the TCP congestion control it is given (cubic, Linux's default, unless told otherwise),
whatever the host's own default, which the namespaces would inherit. One torchrun
per namespace makes one ddpx node each (ddpx tells nodes apart by torchrun's GROUP_RANK, since
the namespaces share the host name, /dev/shm and the file system). Needs root and iproute2.

On exit every process in the namespaces is killed and the namespaces are deleted (their links
with them); a testbed whose creator died without that is removed by the next one made.

Example::
    >>> with Testbed(2, rate="1gbit") as bed:
    ...     print(bed.measure_tcp() / 1e9, "Gbit/s")
    ...     jobs = bed.torchrun(["train.py"], nproc_per_node=2)
    ...     outputs = bed.communicate(jobs, timeout=300)
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ddpx_bench.processes import die_with_parent

__all__ = ["INTERFACE_VARIABLE", "Node", "Testbed", "bits_per_second", "unavailable"]

_PREFIX = "ddpx-"
_OURS = re.compile(rf"^{_PREFIX}(\d+)-")  # the creator's pid
_serial = itertools.count()
_PROC_TCP = Path("/proc/sys/net/ipv4")
# Set by Testbed.torchrun for every rank it starts: the name of its node's interface, whose
# counters (/sys/class/net/<name>/statistics/) are the node's traffic on the link.
INTERFACE_VARIABLE = "DDPX_TESTBED_INTERFACE"

_RECEIVE = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
buffer = memoryview(bytearray(1 << 20))
conn.recv_into(buffer)  # the clock starts at the first byte, not at the sender's start-up
start, received = time.monotonic(), 0
while n := conn.recv_into(buffer):
    received += n
print(received * 8 / (time.monotonic() - start))
"""

_SEND = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
chunk, end = bytes(1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    conn.sendall(chunk)
conn.close()
"""


@dataclass(frozen=True)
class Node:
    """One node of a testbed: its namespace, its interface there and that interface's address."""

    namespace: str
    interface: str
    address: str


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")


def _ip(*args: str) -> None:
    _run("ip", *args)


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def _kill_all(namespaces: list[str], within: float = 10.0) -> None:
    """SIGKILLs every process in ``namespaces``, again and again (a dying parent may still fork),
    until none is left or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        pids = [pid for ns in namespaces for pid in _pids(ns)]
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _remove(namespaces: list[str]) -> None:
    _kill_all(namespaces)
    for ns in namespaces:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def _remove_stale() -> None:
    """Removes the testbeds of creators that are gone."""
    stale = [ns for ns in _namespaces()
             if (m := _OURS.match(ns)) and not os.path.exists(f"/proc/{m[1]}")]
    _remove(stale)


def bits_per_second(rate: str) -> float:
    """A rate in tc's notation ("100mbit", "1gbit"; SI prefixes, as tc reads them) in bits/s."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate)
    if not m:
        raise ValueError(f"rate={rate!r}: give it as tc does, e.g. '100mbit', '1gbit', '10gbit'")
    return float(m[1]) * 1000 ** " kmgt".index(m[2] or " ")


def _shape(namespace: str, interface: str, rate: str) -> None:
    # The bucket is what a link that idled may send above its rate afterwards: a real link has
    # none, and a big one flatters an engine that leaves the link idle (1 MB let a 25 MiB bf16
    # all-reduce run 15% under its own bound at 1 Gbit/s). 100 us of traffic, but at least 72 KiB:
    # tbf arms a timer each time the bucket runs dry, and one TCP stream at 1 Gbit/s (1514-byte
    # packets) ran it dry 142,713 times per 128 MB with a 64 KiB bucket and 5,599 with 72 KiB, at
    # the same rate (0.954 Gbit/s), for 10 against 1.7 core-seconds of kernel time per GB: with
    # 64 KiB, half of this machine's two cores went to shaping one link.
    burst = max(72 * 1024, int(bits_per_second(rate) / 8 * 100e-6))
    # latency bounds the queue, as a switch port's buffer would: beyond it packets are dropped.
    _run("tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "tbf", "rate", rate,
         "burst", str(burst), "latency", "20ms")


def _set_congestion(namespaces: list[str], congestion: str) -> None:
    # A kernel shared by every node: what one offers, all do. The algorithm sets how a stream
    # starts again after the pauses between a job's calls: on this VM, whose default is BBR,
    # an int8 all-reduce of 25 MiB at 1 Gbit/s took 66-69 ms, against 64-66 with cubic.
    offered = (_PROC_TCP / "tcp_available_congestion_control").read_text().split()
    if congestion not in offered:
        raise ValueError(
            f"congestion={congestion!r}: this kernel's TCP offers {', '.join(offered)}")
    # A namespace may default only to an algorithm the host allows, and a kernel built with BBR as
    # its default allows cubic only once the host's own default has been cubic. The host's list
    # is widened while the namespaces take their setting and then put back, under a lock that
    # keeps testbeds made at once from putting it back under each other.
    allowed_path = _PROC_TCP / "tcp_allowed_congestion_control"
    setting = _PROC_TCP / "tcp_congestion_control"
    with allowed_path.open() as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        allowed = allowed_path.read_text().split()
        widen = congestion not in allowed
        if widen:
            allowed_path.write_text(" ".join([*allowed, congestion]))
        try:
            for namespace in namespaces:
                done = subprocess.run(["ip", "netns", "exec", namespace, "sh", "-c",
                                       f'echo "$1" > {setting} && cat {setting}', "sh",
                                       congestion], capture_output=True, text=True)
                if done.returncode != 0 or done.stdout.strip() != congestion:
                    raise RuntimeError(f"{namespace}: TCP congestion control {congestion!r} not "
                                       f"set: {done.stderr.strip() or done.stdout.strip()}")
        finally:
            if widen:
                allowed_path.write_text(" ".join(allowed))


@functools.cache
def unavailable() -> str | None:
    """Why no testbed can be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{_PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "eth0", "type", "veth", "peer", "name", "eth1")
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
        _shape(probe, "eth0", "1gbit")
    except RuntimeError as error:
        return str(error)
    finally:
        _remove([probe])
    return None


class Testbed:
    """``nodes`` network namespaces joined by links shaped to ``rate`` (tc's notation, e.g.
    "100mbit"; None: unshaped) in both directions. Node k is ``nodes[k]``, with its namespace,
    interface and address; ``master_addr`` is node 0's. Everything it started is killed, and
    everything it made removed, by close() (on leaving a ``with`` block), also when it fails
    half made."""

    def __init__(self, nodes: int, rate: str | None = "1gbit", subnet: str | None = None,
                 congestion: str = "cubic"):
        if nodes < 2:
            raise ValueError(f"a testbed has at least 2 nodes, not {nodes}")
        self.rate = rate
        self.nodes: list[Node] = []
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._ports = itertools.count(29500)
        _remove_stale()
        prefix = f"{_PREFIX}{os.getpid()}-{next(_serial)}"
        # Testbeds reach neither each other nor the host, so any subnet would do; one per
        # creator keeps the addresses of testbeds made side by side apart in their logs. A given
        # one (three numbers: node k is its .k+1) runs a command written for known addresses.
        subnet = subnet or f"10.213.{os.getpid() % 256}"
        try:
            for k in range(nodes):
                ns = f"{prefix}-{k}"
                _ip("netns", "add", ns)
                self._namespaces.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                self.nodes.append(Node(ns, "eth0", f"{subnet}.{k + 1}"))
            _set_congestion([node.namespace for node in self.nodes], congestion)
            if nodes == 2:
                a, b = self.nodes
                _ip("-n", a.namespace, "link", "add", a.interface, "type", "veth", "peer", "name",
                    b.interface, "netns", b.namespace)
            else:
                bridge = f"{prefix}-bridge"
                _ip("netns", "add", bridge)
                self._namespaces.append(bridge)
                _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
                _ip("-n", bridge, "link", "set", "br0", "up")
                for k, node in enumerate(self.nodes):
                    port = f"port{k}"
                    _ip("-n", node.namespace, "link", "add", node.interface, "type", "veth",
                        "peer", "name", port, "netns", bridge)
                    _ip("-n", bridge, "link", "set", port, "master", "br0", "up")
                    if rate is not None:
                        _shape(bridge, port, rate)  # what reaches node k: its ingress
            for node in self.nodes:
                _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev",
                    node.interface)
                _ip("-n", node.namespace, "link", "set", node.interface, "up")
                if rate is not None:
                    _shape(node.namespace, node.interface, rate)
        except BaseException:
            self.close()
            raise

    @property
    def master_addr(self) -> str:
        return self.nodes[0].address

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kills every process in the testbed and deletes its namespaces. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:  # caught before `ip netns exec` entered the namespace
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        _remove(self._namespaces)
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._namespaces.clear()

    def popen(self, node: int, argv: list[str], env: dict | None = None,
              **kwargs) -> subprocess.Popen:
        """Starts ``argv`` in node's namespace, in a session of its own, with this process's
        environment plus ``env``; ``kwargs`` go to Popen. Killed by close(), or by Linux when this
        process dies without closing (`ip netns exec` execs argv, which keeps that)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[node].namespace, *argv],
                                env=dict(os.environ, **(env or {})), start_new_session=True,
                                preexec_fn=die_with_parent, **kwargs)
        self._procs.append(proc)
        return proc

    def torchrun(self, script_args: list[str], nproc_per_node: int, env: dict | None = None,
                 port: int | None = None) -> list[subprocess.Popen]:
        """Starts one torchrun per node (node k: --node_rank k) of ``script_args``, each rank
        talking through its node's interface; their output (stdout and stderr) comes through
        each Popen's stdout, as text; each rank finds its node's interface's name in
        INTERFACE_VARIABLE. ``port``: the master's (default: a fresh one per call)."""
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        port = port if port is not None else next(self._ports)
        procs = []
        for k, node in enumerate(self.nodes):
            argv = [torchrun, "--nnodes", str(len(self.nodes)), "--node_rank", str(k),
                    "--nproc_per_node", str(nproc_per_node), "--master_addr", self.master_addr,
                    "--master_port", str(port), "--monitor-interval=1", *script_args]
            procs.append(self.popen(
                k, argv, env={"GLOO_SOCKET_IFNAME": node.interface,
                              INTERFACE_VARIABLE: node.interface, "OMP_NUM_THREADS": "1",
                              "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        return procs

    def communicate(self, procs: list[subprocess.Popen], timeout: float) -> list[str]:
        """Waits for ``procs`` and returns their outputs, read as they run so that none stalls on
        a full pipe. Past ``timeout`` s kills every process of the testbed and raises
        TimeoutError(message, outputs)."""
        outputs = [""] * len(procs)

        def read(i: int) -> None:
            outputs[i] = procs[i].stdout.read()

        readers = [threading.Thread(target=read, args=(i,), daemon=True)
                   for i in range(len(procs))]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout

        def finished(reader: threading.Thread, proc: subprocess.Popen) -> bool:
            reader.join(max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                return False
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
            return True

        if not all(finished(reader, proc) for reader, proc in zip(readers, procs, strict=True)):
            _kill_all(self._namespaces)
            for reader, proc in zip(readers, procs, strict=True):
                reader.join(10)
                proc.wait(10)
            raise TimeoutError(f"the processes did not finish in {timeout} s", outputs)
        return outputs

    def set_link(self, node: int, up: bool) -> None:
        """Takes node's link up or down: down, nothing crosses it (as if its cable were cut)."""
        n = self.nodes[node]
        _ip("-n", n.namespace, "link", "set", "dev", n.interface, "up" if up else "down")

    def tx_bytes(self, node: int) -> int:
        """Bytes node has sent through its interface so far (all traffic, headers included)."""
        n = self.nodes[node]
        done = subprocess.run(["ip", "netns", "exec", n.namespace, "cat",
                               f"/sys/class/net/{n.interface}/statistics/tx_bytes"],
                              capture_output=True, text=True, check=True)
        return int(done.stdout)

    def measure_tcp(self, seconds: float = 1.0) -> float:
        """The TCP payload rate (bits/s) of one connection from node 1 to node 0: the practical
        ceiling of the link, below ``rate`` by the headers and by what the CPUs can push."""
        receiver = self.popen(0, [sys.executable, "-c", _RECEIVE, self.master_addr],
                              stdout=subprocess.PIPE, text=True)
        port = receiver.stdout.readline().strip()
        if not port:
            raise RuntimeError("the TCP receiver did not start")
        sender = self.popen(1, [sys.executable, "-c", _SEND, self.master_addr, port,
                                str(seconds)])
        if sender.wait(timeout=seconds + 30) != 0:
            raise RuntimeError(f"the TCP sender failed (exit status {sender.returncode})")
        rate, _ = receiver.communicate(timeout=30)
        if receiver.returncode != 0:
            raise RuntimeError(f"the TCP receiver failed (exit status {receiver.returncode})")
        return float(rate)
