"""Rollout reuse: one scored rollout serves several optimizer steps (GRPO's ``num_iterations x
steps_per_generation``, PPO's ``num_ppo_epochs x num_mini_batches``). The buffer holds the rollout, the
per-row tensors every step reads (advantages, old log-probs, ...) and the row indices of each step; each
``training_step`` takes the next indices, and a new rollout is made when none are left."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .base import Scored


@dataclass
class RolloutBuffer:
    scored: "Scored"
    data: dict[str, Tensor]                             # per-row tensors, [N, ...] each
    schedule: list[Tensor] = field(default_factory=list)  # row indices of each remaining optimizer step

    def __bool__(self) -> bool:
        return bool(self.schedule)

    def next_rows(self) -> Tensor:
        return self.schedule.pop(0)


def schedule(rows: int, parts: int, passes: int, reshuffle: bool, generator: torch.Generator,
             device: torch.device) -> list[Tensor]:
    """Row indices of ``passes x parts`` optimizer steps over ``rows`` rows: each pass splits a permutation into
    ``parts`` near-equal slices (``reshuffle``: a fresh permutation per pass, PPO's epochs; else one permutation
    for all passes, GRPO's iterations). One part and one pass keep the rows in order."""
    if parts > rows:
        raise ValueError(f"cannot split {rows} rollout rows into {parts} optimizer steps: lower "
                         "steps_per_generation / num_mini_batches or generate more rows per step")
    out: list[Tensor] = []
    perm = torch.arange(rows) if parts == 1 and passes == 1 else torch.randperm(rows, generator=generator)
    for p in range(passes):
        if reshuffle and p > 0:
            perm = torch.randperm(rows, generator=generator)
        out.extend(s.to(device) for s in perm.tensor_split(parts))
    return out
