"""Reward functions ``(prompts, completions, **columns) -> list[float]`` and their weighted sum.

Columns are the dataset's other fields (e.g. ``answer``), passed by name to every reward function.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

RewardFn = Callable[..., list[float]]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    """The last number in ``text`` (the usual final-answer convention of math tasks)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


class ExactMatch:
    """1.0 when the last number of the completion equals the ``answer`` column, else 0.0."""

    def __init__(self, column: str = "answer"):
        self.column = column
        self.__name__ = "exact_match"

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float]:
        answers = columns[self.column]
        return [float(last_number(c) is not None and float(last_number(c)) == float(a))
                for c, a in zip(completions, answers)]


class FormatRegex:
    """1.0 when the whole completion matches ``pattern`` (stripped), else 0.0."""

    def __init__(self, pattern: str = r"-?\d+"):
        self.pattern = re.compile(pattern)
        self.__name__ = "format"

    def __call__(self, prompts, completions, **columns) -> list[float]:
        return [float(self.pattern.fullmatch(c.strip()) is not None) for c in completions]


class LengthPenalty:
    """``-min(1, max(0, len - target) / target)``: 0 up to ``target`` characters, down to -1 at twice it."""

    def __init__(self, target: int = 32):
        if target < 1:
            raise ValueError(f"target must be >= 1, got {target}")
        self.target = target
        self.__name__ = "length_penalty"

    def __call__(self, prompts, completions, **columns) -> list[float]:
        return [-min(1.0, max(0, len(c) - self.target) / self.target) for c in completions]


@dataclass
class WeightedReward:
    """A reward function with its weight; ``name`` labels its logged mean."""

    fn: RewardFn
    weight: float = 1.0
    name: str | None = None

    @property
    def label(self) -> str:
        return self.name or getattr(self.fn, "__name__", type(self.fn).__name__)


def score(rewards: Sequence[WeightedReward], prompts, completions, columns) -> tuple[list[float], dict[str, float]]:
    """Weighted total per completion, and the mean of each reward function (for logging)."""
    total = [0.0] * len(completions)
    means = {}
    for r in rewards:
        values = r.fn(prompts, completions, **columns)
        if len(values) != len(completions):
            raise ValueError(f"reward {r.label} returned {len(values)} values for {len(completions)} completions")
        means[r.label] = sum(values) / max(len(values), 1)
        total = [t + r.weight * v for t, v in zip(total, values)]
    return total, means
