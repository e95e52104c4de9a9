"""Batch statistics over every rank of a data-parallel run (identity in a single process): what TRL takes over
the global batch -- dapo's token count, ``scale_rewards=batch``'s standard deviation -- is computed here."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_sum(x: Tensor) -> Tensor:
    """``x`` summed over ranks (a copy; the input is untouched)."""
    x = x.detach().clone()
    if world() > 1:
        dist.all_reduce(x)
    return x


def gather_rows(x: Tensor) -> Tensor:
    """``[n, ...]`` from every rank concatenated along dim 0 (ranks may hold different ``n``)."""
    if world() == 1:
        return x.detach()
    sizes = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(world())]
    dist.all_gather(sizes, torch.tensor([x.shape[0]], device=x.device))
    top = int(max(s.item() for s in sizes))
    padded = torch.zeros((top, *x.shape[1:]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x.detach()
    parts = [torch.empty_like(padded) for _ in range(world())]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])
