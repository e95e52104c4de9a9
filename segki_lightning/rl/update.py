"""One optimizer step over a set of rollout rows, in micro-batches.

Each micro-batch's loss is already normalised by the whole step's batch (:class:`~segki_lightning.rl.losses.Totals`),
so the gradients accumulated over the micro-batches equal the whole batch's. All micro-batches but the last are
back-propagated here; the last one's loss is returned for Lightning's own backward, so gradient clipping,
``accumulate_grad_batches``, precision plugins and DDP's gradient all-reduce act once per step, on the sum.
(Under DDP the backward passes made inside ``training_step`` run before DDP prepares its reducer, so they
accumulate locally, like ``no_sync``; the final backward all-reduces the accumulated gradients.)"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

LossFn = Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]


def micro_batches(rows: Tensor, size: int | None) -> list[Tensor]:
    """Consecutive pieces of the row indices ``rows`` of at most ``size`` rows (all of them when None)."""
    size = len(rows) if size is None else max(1, size)
    return list(rows.split(size))


def accumulate(rows: Tensor, size: int | None, loss_fn: LossFn, backward: Callable[[Tensor], None]
               ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Run ``loss_fn`` on each micro-batch of ``rows``; ``backward`` all but the last loss.

    Returns ``(last_loss, total_loss, stats)``: the last micro-batch's loss, still attached to its graph (the
    caller's backward), the step's loss summed over micro-batches (detached, for logging), and each stat summed
    over micro-batches (stats are shares of batch means, so the sums are the batch's) -- or, for names ending in
    ``_max``, their maximum."""
    parts = micro_batches(rows, size)
    total: Tensor | None = None
    stats: dict[str, Tensor] = {}
    loss: Tensor | None = None
    for i, part in enumerate(parts):
        loss, got = loss_fn(part)
        total = loss.detach() if total is None else total + loss.detach()
        for k, v in got.items():
            v = v.detach()
            stats[k] = v if k not in stats else (torch.maximum(stats[k], v) if k.endswith("_max") else stats[k] + v)
        if i < len(parts) - 1:
            backward(loss)
            loss = None  # frees this micro-batch's graph before the next forward
    return loss, total, stats
