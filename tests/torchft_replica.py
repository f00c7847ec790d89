"""One replica of a torchft job, as tests/test_torchft.py launches it: a small MLP in torchft's
DistributedDataParallel (ddpx.torchft's, whose hook survives a failed step), its gradients
averaged over the quorum's replicas by ``--pg`` (ddpx's ProcessGroupDdpx or torchft's
ProcessGroupGloo), a torchft Manager with its own store:

    python tests/torchft_replica.py --pg ddpx --replica 0 --lighthouse http://localhost:29510 \
        --out /tmp/run

Each step appends a line to OUT/replica<R>.<pid>.jsonl (its time, the step it reached, whether it
committed and with how many replicas), as does each configure() of the process group (when it
began, how long it took, for how many replicas, and the threads and ddpx segments of the process
after it). Once OUT/stop names a step, the replica trains up to it, writes its parameters (and
for ddpx, how its last group served the calls) to OUT/params<R>.json and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torchft
from torch.distributed import TCPStore
from torchft import Manager
from torchft.process_group import ProcessGroupGloo

import ddpx.torchft

# The replica's timeouts: long enough for a set-up on a loaded 2-core machine, short enough that a
# replica left waiting on a survivor (gloo's may be) gives up within the test's time. The quorum's
# is longer: a survivor asking for a quorum while the other waits out the first would otherwise
# time out too, and torchft raises that.
TIMEOUT = timedelta(seconds=10)
QUORUM_TIMEOUT = 3 * TIMEOUT


def ddpx_mappings() -> int:
    """How many ddpx segments this process maps: one per live ddpx group."""
    with open("/proc/self/maps") as maps:
        return len({line.split()[-1] for line in maps
                    if "ddpx" in line and not line.rstrip().endswith(".so")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pg", choices=["ddpx", "gloo"], required=True)
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--min_replicas", type=int, default=2)
    parser.add_argument("--compute", type=float, default=0.02, help="seconds a step computes")
    parser.add_argument("--ddp", choices=["ddpx", "torchft"], default="ddpx",
                        help="whose DistributedDataParallel: ddpx.torchft's or torchft's own")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    pg = (ddpx.torchft.ProcessGroupDdpx(TIMEOUT) if args.pg == "ddpx"
          else ProcessGroupGloo(TIMEOUT))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)

    def state_dict() -> dict:
        return {"model": net.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas, replica_id=f"replica_{args.replica}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=args.lighthouse, hostname="localhost", timeout=TIMEOUT,
                      quorum_timeout=QUORUM_TIMEOUT, connect_timeout=TIMEOUT)
    wrapper = ddpx.torchft if args.ddp == "ddpx" else torchft
    # 4 KB buckets: 3 of them, so that a step's later buckets follow a failed one.
    model = wrapper.DistributedDataParallel(manager, net, bucket_cap_mb=0.004)
    log_file = open(args.out / f"replica{args.replica}.{os.getpid()}.jsonl", "a", buffering=1)
    lock = threading.Lock()

    def log(**entry) -> None:  # from the training loop and from the Manager's quorum thread
        with lock:
            log_file.write(json.dumps(entry) + "\n")

    configure = pg.configure

    def timed_configure(*args, **kwargs) -> None:
        start = time.time()
        try:
            configure(*args, **kwargs)
        finally:
            log(time=start, configure=time.time() - start, world_size=args[3],
                threads=len(os.listdir("/proc/self/task")), mapped=ddpx_mappings())

    pg.configure = timed_configure
    stop_file, stop_at = args.out / "stop", None
    while stop_at is None or manager.current_step() < stop_at:
        if stop_at is None and stop_file.exists():
            stop_at = int(stop_file.read_text())  # written whole: renamed into place
        manager.start_quorum()
        optimizer.zero_grad()
        time.sleep(args.compute)  # the rest of a step's compute, while the quorum forms
        # Each replica its own batch, the same at a step whoever computes it.
        data = torch.Generator().manual_seed(manager.current_step() * 100 + args.replica)
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 8, generator=data)
        torch.nn.functional.mse_loss(model(x), y).backward()
        committed = manager.should_commit()
        if committed:
            optimizer.step()
        log(time=time.time(), step=manager.current_step(), committed=committed,
            replicas=manager.num_participants())
    backend = pg.parent._get_backend(torch.device("cpu"))  # the last quorum's
    (args.out / f"params{args.replica}.json").write_text(json.dumps(
        {"step": manager.current_step(),
         "params": [p.detach().flatten().tolist() for p in net.parameters()],
         "routes": backend.routes() if args.pg == "ddpx" else None,
         "engine": type(backend.engine).__name__ if args.pg == "ddpx" else None}))
    manager.shutdown(wait=False)
    pg.shutdown()


if __name__ == "__main__":
    main()
