"""Data-parallel training through PyTorch's own engine (torchrun + DistributedDataParallel).

`torchrun --nproc-per-node=K -m aiayn train ...` sets RANK, WORLD_SIZE and LOCAL_RANK;
the trainer then joins the process group (gloo on CPU, NCCL on CUDA), each rank reads its
own shard of every epoch (batching.token_batches), gradients are averaged by DDP, and only
rank 0 writes checkpoints and logs. Multi-node runs use torchrun's rendezvous flags
(`--nnodes`, `--rdzv-backend=c10d`, `--rdzv-endpoint=HOST:PORT`) with the run directory on
a filesystem every node sees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

#: Seconds a collective may wait for the other ranks before the job fails (default 30 min).
TIMEOUT_ENV = "AIAYN_DIST_TIMEOUT_S"


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job; a single process is rank 0 of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def all_sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum over ranks (float64, so token counts stay exact)."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def any_each(self, flags: list[bool], device: torch.device) -> list[bool]:
        """Each flag True on every rank if it is True on one, in one collective: stop and
        save decisions are taken together."""
        if not self.active:
            return flags
        t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(x) for x in t.tolist()]

    def same_on_all(self, value: float, device: torch.device) -> bool:
        """Whether every rank holds exactly this value (a cross-rank consistency check)."""
        if not self.active:
            return True
        t = torch.tensor([value, -value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t[0].item() == -t[1].item() == value

    def barrier(self) -> None:
        if self.active:
            dist.barrier()


def init_from_env(device: str) -> tuple[DistContext, str]:
    """Join the torchrun job described by the environment, if there is one.

    Returns:
        The context and the device this rank uses ("cuda" becomes "cuda:LOCAL_RANK").
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext(), device
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    is_cuda = torch.device(device).type == "cuda"
    if is_cuda:
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # A rank that hangs (RELIABILITY D6) makes the others' collectives time out and
        # raise, so torchrun ends the job instead of waiting for ever.
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "1800")))
        # After `torchrun --max-restarts` restarts the ranks, keys of the failed attempt
        # (the old ranks' addresses) can still be in torchrun's store, and a new rank that
        # reads one connects to a dead port; a prefix per attempt keeps them apart.
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend="nccl" if is_cuda else "gloo",
            timeout=timeout,
            store=dist.PrefixStore(f"aiayn/attempt_{attempt}", store),
            rank=rank,
            world_size=world_size,
        )
    return DistContext(rank, world_size, local_rank), device


def data_parallel(model: nn.Module, ctx: DistContext, device: torch.device) -> nn.Module:
    """What the forward pass goes through: under torchrun, DDP around `model` (it averages
    the gradients over the ranks); alone, the model itself. Checkpoints hold the plain
    model either way, so they do not depend on the world size."""
    if not ctx.active:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def shutdown() -> None:
    """Leave the process group (after the last collective)."""
    if dist.is_initialized():
        dist.destroy_process_group()
