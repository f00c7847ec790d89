"""Every change ddpx makes to the whole process, one function each.

docs/design.md ("What ddpx changes in your process") lists them, says when each is made, and why
neither is undone. Anything else ddpx does stays within its own groups and engines.
"""

from __future__ import annotations

import logging
import os

import torch

from ddpx import settings

__all__ = ["lower_torch_threads", "turn_on_ddp_comm_memory"]

logger = logging.getLogger("ddpx")
_told_threads = False


def turn_on_ddp_comm_memory(backend, size: int) -> None:
    """Sets DDP_DISABLE_COMM_MEM=0, which makes DDP allocate its buckets through ``backend``, in
    ddpx's arena, unless the user chose (DDP_DISABLE_COMM_MEM, DDPX_COMM_MEMORY=0). torch reads
    the variable for every process group, NCCL's too, so ddpx sets it only where no GPU is
    visible."""
    if (size > 1 and settings.flag("DDPX_COMM_MEMORY") and "DDP_DISABLE_COMM_MEM" not in os.environ
            and backend.supports_tensor_alloc(torch.device("cpu"))
            and not torch.cuda.is_available()):
        os.environ["DDP_DISABLE_COMM_MEM"] = "0"


def lower_torch_threads(share: int, sharing: int, cpus: int, say: bool) -> None:
    """Brings torch's intra-op threads down to ``share`` where OMP_NUM_THREADS is unset (mp.spawn
    sets nothing) and torch runs more, as torchrun and Accelerate set them for their launches: a
    pool of every CPU in each of the ``sharing`` ranks on these ``cpus`` oversubscribes the node,
    and its workers spin after each op on the cores the ranks' communication needs
    (docs/design.md, "A rank's cores"). The first rank to ``say`` so says it, once."""
    global _told_threads
    pool = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or pool <= share:
        return
    torch.set_num_threads(share)
    if not _told_threads and say:
        _told_threads = True
        logger.warning(
            "ddpx: OMP_NUM_THREADS is unset and torch ran %d intra-op threads per rank, with %d "
            "ranks on these %d CPUs: ddpx set torch.set_num_threads(%d), each rank's share. Set "
            "OMP_NUM_THREADS to choose another number.", pool, sharing, cpus, share)
