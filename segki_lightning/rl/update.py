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


def micro_batches(rows: Tensor, size: int | None, tokens: int | None = None, lengths: Tensor | None = None,
                  packed: bool = True) -> list[Tensor]:
    """Consecutive pieces of the row indices ``rows``: at most ``size`` rows each (all of them when None) and, with a
    token budget ``tokens``, at most that many tokens each by ``lengths`` (each row's real tokens, ``[len(rows)]``):
    their sum when the rows run ``packed``, else the rows times the longest of them (what a padded micro-batch
    computes). A row longer than the budget is a piece of its own.

    Under a budget the pieces are as many as filling each to the budget gives, but balanced: the smallest budget that
    still needs no more pieces cuts them. Greedy filling leaves a short last piece, and a short micro-batch costs
    nearly a full one's kernel launches (a 0.8B update issues ~7k kernels whatever its tokens)."""
    size = len(rows) if size is None else max(1, size)
    if tokens is None:
        return list(rows.split(size))
    if lengths is None:
        raise ValueError("a token budget needs the rows' lengths")
    ns = lengths.tolist()
    cuts = _cuts(ns, size, tokens, packed)
    lo, hi = 1, tokens       # the smallest budget with no more pieces: their count only falls as the budget grows
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(_cuts(ns, size, mid, packed)) <= len(cuts) else (mid + 1, hi)
    cuts = _cuts(ns, size, lo, packed)
    return [rows[a:b] for a, b in zip(cuts, cuts[1:] + [len(ns)])]


def _cuts(lengths: list[int], size: int, tokens: int, packed: bool) -> list[int]:
    """Where each piece starts when pieces are filled in order up to ``size`` rows and ``tokens`` tokens."""
    cuts, used, longest = [0], 0, 0
    for i, n in enumerate(lengths):
        cost = used + n if packed else (i - cuts[-1] + 1) * max(longest, n)
        if i > cuts[-1] and (cost > tokens or i - cuts[-1] >= size):
            cuts.append(i)
            used, longest = 0, 0
        used, longest = used + n, max(longest, n)
    return cuts


def accumulate(parts: list[Tensor], loss_fn: LossFn, backward: Callable[[Tensor], None]
               ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Run ``loss_fn`` on each micro-batch (row indices, :func:`micro_batches`); ``backward`` all but the last loss.

    Returns ``(last_loss, total_loss, stats)``: the last micro-batch's loss, still attached to its graph (the
    caller's backward), the step's loss summed over micro-batches (detached, for logging), and each stat summed
    over micro-batches (stats are shares of batch means, so the sums are the batch's) -- or, for names ending in
    ``_max``, their maximum."""
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
