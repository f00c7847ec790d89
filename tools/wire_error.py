"""The error of a 16-bit average under ddpx's wire rule, against the exact (float64) average of the
same inputs, in units of the result dtype's ulp at the exact value (at 2^-6 for smaller values,
where any rounding of the inputs dominates), max and mean over 65536
elements: ddpx.all_reduce(average=True) (the hook's path) and the ddpx backend's ReduceOp.AVG.
Run with PYTHONPATH set to the ddpx checkout to measure."""
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


def run(rank, world, port, out):
    import ddpx

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("ddpx", rank=rank, world_size=world)
    res = {}
    for dtype, bits in MANTISSA.items():
        gen = torch.Generator().manual_seed(1234)
        inputs = [torch.randn(1 << 16, generator=gen).to(dtype) for _ in range(world)]
        exact = torch.stack([x.double() for x in inputs]).sum(0) / world
        unit = torch.pow(2.0, torch.floor(torch.log2(exact.abs().clamp_min(2.0**-6))) - bits)
        for path in ("ddpx.all_reduce", "backend AVG"):
            t = inputs[rank].clone()
            if path == "ddpx.all_reduce":
                ddpx.all_reduce(t, average=True)
            else:
                dist.all_reduce(t, op=dist.ReduceOp.AVG)
            ulps = (t.double() - exact).abs() / unit
            res[f"{str(dtype)[6:]:8s} {path}"] = (float(ulps.max()), float(ulps.mean()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    for world in (2, 3, 4):
        path = f"/tmp/wire_error_{os.getpid()}_{world}.json"
        mp.spawn(run, args=(world, 29600 + world, path), nprocs=world)
        for k, (mx, mean) in json.load(open(path)).items():
            print(f"world {world} {k:26s} max {mx:.3f} ulp, mean {mean:.4f} ulp")
        os.remove(path)
