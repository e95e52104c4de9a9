"""One optimizer step over a rollout's rows, in micro-batches.

Each micro-batch's loss is already normalised by the whole batch (:class:`~segki_lightning.rl.losses.Totals`),
so the gradients accumulated over the micro-batches equal the whole batch's. All micro-batches but the last are
back-propagated here; the last one's loss is returned for Lightning's own backward, so gradient clipping,
``accumulate_grad_batches``, precision plugins and DDP's gradient all-reduce act once per step, on the sum.
(Under DDP the backward passes made inside ``training_step`` run before DDP prepares its reducer, so they
accumulate locally, like ``no_sync``; the final backward all-reduces the accumulated gradients.)"""
from __future__ import annotations

from typing import Callable

from torch import Tensor

LossFn = Callable[[slice], tuple[Tensor, dict[str, Tensor]]]


def micro_batches(rows: int, size: int | None) -> list[slice]:
    """Consecutive row slices of at most ``size`` rows (one slice of all rows when ``size`` is None)."""
    size = rows if size is None else max(1, min(size, rows))
    return [slice(s, min(s + size, rows)) for s in range(0, rows, size)]


def accumulate(rows: int, size: int | None, loss_fn: LossFn, backward: Callable[[Tensor], None]
               ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Run ``loss_fn`` on each micro-batch; ``backward`` all but the last loss.

    Returns ``(last_loss, total_loss, stats)``: the last micro-batch's loss, still attached to its graph (the
    caller's backward), the step's loss summed over micro-batches (detached, for logging), and each stat
    summed over micro-batches (stats are shares of batch means, so the sums are the batch's)."""
    parts = micro_batches(rows, size)
    total: Tensor | None = None
    stats: dict[str, Tensor] = {}
    loss: Tensor | None = None
    for i, rows_i in enumerate(parts):
        loss, part = loss_fn(rows_i)
        total = loss.detach() if total is None else total + loss.detach()
        for k, v in part.items():
            stats[k] = v.detach() if k not in stats else stats[k] + v.detach()
        if i < len(parts) - 1:
            backward(loss)
            loss = None  # frees this micro-batch's graph before the next forward
    return loss, total, stats
