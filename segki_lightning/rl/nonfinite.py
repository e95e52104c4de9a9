"""Non-finite values stop a step before it changes the weights: an infinite reward, a non-finite loss or gradient
norm raises :class:`NonFiniteError` naming the step and the first such quantity (``algo.on_nonfinite=raise``, the
default), or the step is skipped -- no optimizer update, ``train/nonfinite_skipped`` counts it
(``on_nonfinite=skip_step``, one process only: under DDP/FSDP the ranks would disagree on which steps run)."""
from __future__ import annotations

import math

import torch
from torch import Tensor


class NonFiniteError(RuntimeError):
    """A reward, loss or gradient that is inf or NaN; ``of_rollout``: the rollout itself is unusable (its rewards)."""

    def __init__(self, message: str, of_rollout: bool = False):
        super().__init__(message)
        self.of_rollout = of_rollout


def check_rewards(table: list[list[float]], labels: list[str]) -> None:
    """Raise for a reward function that returned +-inf (NaN and None mean "not applicable", as in TRL)."""
    for label, values in zip(labels, table):
        bad = sum(math.isinf(v) for v in values)
        if bad:
            raise NonFiniteError(f"reward function {label} returned inf for {bad} of {len(values)} completions",
                                 of_rollout=True)


def check(name: str, value: Tensor) -> None:
    """Raise when ``value`` (a scalar or any tensor) holds inf or NaN; one host sync."""
    if not bool(torch.isfinite(value.detach()).all()):
        raise NonFiniteError(f"{name} is not finite ({value.detach().float().flatten()[:4].tolist()})")
