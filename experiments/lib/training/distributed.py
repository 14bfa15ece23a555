"""torchrun support: one process per device, DistributedDataParallel, rank 0 does the I/O.

    torchrun --standalone --nproc_per_node 2 -m experiments.train_base hydra.run.dir=outputs/run1
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint host:29500 -m experiments.train_drafter ...

Without torchrun (no WORLD_SIZE in the environment, or WORLD_SIZE=1) everything here is a no-op and a
run is the plain single-process one. Backend: nccl when the processes drive CUDA devices, gloo on CPU.

The data are sharded by rank without a sampler: the batch of step s is drawn whole from a generator seeded
with (seed, s), as in a single process, and rank r keeps rows r, r + world, ... (`shard`). So batch_size is
the global batch, the shards are disjoint, and the recipe does not depend on the number of processes.

Every process reads the same run directory (resume, caches): with several nodes it must be on a shared
filesystem. Only rank 0 writes checkpoints, metrics and logs, and only after it writes a cache (token or
feature cache) do the other ranks open it (`main_first`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "Dist",
    "init_distributed",
    "close_distributed",
    "shard",
    "take_rows",
    "batch_rows",
    "main_first",
    "broadcast_float",
    "broadcast_text",
    "all_mean",
    "gather_text",
    "wrap",
]


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: must be an integer (set by torchrun)") from None


def init_distributed(device: torch.device) -> tuple[Dist, torch.device]:
    """Join the process group torchrun describes in the environment; (Dist, this process's device)."""
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Dist(), device
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(rank=rank, world=world, local_rank=local_rank), device


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def take_rows(batch: Any, rows: slice) -> Any:
    """Rows of a batch: a tensor (B, ...) or a dataclass of them (a FeatureBatch), every field alike."""
    if torch.is_tensor(batch):
        return batch[rows]
    if is_dataclass(batch):
        return replace(
            batch,
            **{
                f.name: take_rows(getattr(batch, f.name), rows)
                for f in fields(batch)
                if getattr(batch, f.name) is not None
            },
        )
    raise TypeError(f"cannot take rows of a batch of type {type(batch).__name__}")


def batch_rows(batch: Any) -> int:
    """B of a batch: a tensor (B, ...) or a dataclass whose tensor fields all lead with B."""
    if torch.is_tensor(batch):
        return batch.shape[0]
    return next(getattr(batch, f.name).shape[0] for f in fields(batch) if torch.is_tensor(getattr(batch, f.name)))


def shard(batch: Any, ctx: Dist) -> Any:
    """This rank's rows r, r + world, ... of a global batch (disjoint across ranks, together all of it)."""
    return take_rows(batch, slice(ctx.rank, None, ctx.world)) if ctx.active else batch


@contextlib.contextmanager
def main_first(ctx: Dist) -> Iterator[None]:
    """Rank 0 runs the block first (it writes a cache), the others run it after (they find the cache)."""
    if ctx.active and not ctx.main:
        dist.barrier()
    yield
    if ctx.active and ctx.main:
        dist.barrier()


def broadcast_float(value: float, ctx: Dist, device: torch.device) -> float:
    """Rank 0's value on every rank (wall time: ranks must agree on the schedule and on when to stop)."""
    if not ctx.active:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def broadcast_text(text: str, ctx: Dist, device: torch.device) -> str:
    """Rank 0's string on every rank, as bytes in a tensor (no pickling)."""
    if not ctx.active:
        return text
    data = torch.tensor(list(text.encode()) if ctx.main else [], dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], device=device)
    dist.broadcast(size, src=0)
    if not ctx.main:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    return bytes(data.tolist()).decode()


def gather_text(text: str, ctx: Dist, device: torch.device, *, width: int = 64) -> list[str]:
    """Every rank's (short, ASCII) string, on every rank: e.g. each replica's weight fingerprint."""
    if not ctx.active:
        return [text]
    raw = text.encode()[:width].ljust(width)
    mine = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    every = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(every, mine)
    return [bytes(t.tolist()).decode().rstrip() for t in every]


def all_mean(values: dict[str, float], ctx: Dist, device: torch.device) -> dict[str, float]:
    """Mean of each metric over the ranks (each rank averaged its own equal-sized shard)."""
    if not ctx.active or not values:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, (t / ctx.world).tolist()))


class LossModule(nn.Module):
    """`loss_fn(model, batch) -> (loss, metrics)` as a module whose forward DDP can wrap.

    DistributedDataParallel averages gradients through hooks it prepares in its own forward; drafter losses
    call several methods of the drafter (and read a frozen base held outside, so DDP never sees the base's
    parameters), hence the loss itself is the forward."""

    def __init__(self, model: nn.Module, loss_fn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> tuple[Tensor, dict[str, float]]:
        return self.loss_fn(self.model, batch)


def wrap(model: nn.Module, loss_fn, ctx: Dist, device: torch.device, *, find_unused: bool = False) -> nn.Module:
    """The module the loop calls for a loss: DDP around LossModule when distributed, LossModule otherwise."""
    module = LossModule(model, loss_fn)
    if not ctx.active:
        return module
    ids = [device.index] if device.type == "cuda" else None
    # find_unused: a model may leave some parameters out of a given loss (a drafter's head whose targets
    # fall outside the window); DDP must then not wait for their gradients, at the cost of a graph traversal
    return nn.parallel.DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused)
