"""Reward functions, TRL's form: ``f(prompts, completions, completion_ids=..., **columns) -> list[float | None]``,
and their weighted sum.

Columns are the dataset's other fields (e.g. ``answer``), passed by name to every reward function; ``None``
means "does not apply to this completion" and is left out of the weighted sum and the function's mean.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .nonfinite import check_rewards

log = logging.getLogger("segki_lightning")
RewardFn = Callable[..., list]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def text_of(completion: Any) -> str:
    """A completion as text: a string as is; a conversational completion (TRL: a list of messages) its
    messages' contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion)


def column(columns: dict[str, list], name: str, reward: str) -> list:
    if name not in columns:
        raise KeyError(f"reward {reward} needs the dataset column {name!r}; the prompts have {sorted(columns)}: add "
                       f"the column or point the reward at another one")
    return columns[name]


def last_number(text: str) -> str | None:
    """The last number in ``text`` (the usual final-answer convention of math tasks)."""
    found = _NUMBER.findall(text)
    return found[-1] if found else None


class ExactMatch:
    """1.0 when the last number of the completion equals the ``answer`` column, else 0.0."""

    def __init__(self, column: str = "answer"):
        self.column = column
        self.__name__ = "exact_match"

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns) -> list[float]:
        answers = column(columns, self.column, self.__name__)
        found = [last_number(text_of(c)) for c in completions]
        return [float(f is not None and float(f) == float(a)) for f, a in zip(found, answers)]


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _as_number(text: str) -> float | None:
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return float(t)
    except ValueError:
        return None


def final_answer(text: str) -> str | None:
    """A text's final answer: its last ``\\boxed{...}``, else what follows its last ``####`` (GSM8K's form), else
    its last number; None when it has none."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return last_number(text.replace(",", ""))


class MathAnswer:
    """1.0 when the completion's final answer (:func:`final_answer`) equals the reference's -- the ``column``
    value's final answer, so a GSM8K solution ending in ``#### 72`` or a MATH ``\\boxed{}`` both work -- else 0.0.
    Equal as numbers when both parse (commas, ``$`` and a trailing period dropped: ``1,000`` == ``1000.0``), else
    as stripped strings."""

    def __init__(self, column: str = "answer"):
        self.column = column
        self.__name__ = "math_answer"

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **columns) -> list[float]:
        out = []
        for c, ref in zip(completions, column(columns, self.column, self.__name__)):
            got, want = final_answer(text_of(c)), final_answer(str(ref)) or str(ref).strip()
            if got is None:
                out.append(0.0)
                continue
            a, b = _as_number(got), _as_number(want)
            out.append(float(a == b if a is not None and b is not None else got == want))
        return out


class FormatRegex:
    """1.0 when the whole completion matches ``pattern`` (stripped), else 0.0."""

    def __init__(self, pattern: str = r"-?\d+"):
        self.pattern = re.compile(pattern)
        self.__name__ = "format"

    def __call__(self, prompts, completions, **columns) -> list[float]:
        return [float(self.pattern.fullmatch(text_of(c).strip()) is not None) for c in completions]


class LengthPenalty:
    """``-min(1, max(0, len - target) / target)``: 0 up to ``target`` characters, down to -1 at twice it."""

    def __init__(self, target: int = 32):
        if target < 1:
            raise ValueError(f"target must be >= 1, got {target}")
        self.target = target
        self.__name__ = "length_penalty"

    def __call__(self, prompts, completions, **columns) -> list[float]:
        return [-min(1.0, max(0, len(text_of(c)) - self.target) / self.target) for c in completions]


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment (TRL's ``get_soft_overlong_punishment``), on the completion's token count
    ``L``: 0 up to ``max_completion_len - soft_punish_cache``, then falling linearly to -1 at
    ``max_completion_len``, -1 past it. Add it beside the task's rewards (``rewards=[..., {_target_:
    segki_lightning.rl.rewards.SoftOverlongPunishment, max_completion_len: 512, soft_punish_cache: 64}]``)."""

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(f"soft_punish_cache must be in [0, max_completion_len], got {soft_punish_cache} and "
                             f"{max_completion_len}")
        self.max_len, self.cache = max_completion_len, soft_punish_cache
        self.__name__ = "soft_overlong_punishment"

    def __call__(self, prompts, completions, completion_ids: Sequence[Sequence[int]] | None = None,
                 **columns) -> list[float]:
        if completion_ids is None:
            raise ValueError("soft_overlong_punishment needs completion_ids (passed by the GRPO/PPO modules)")
        free = self.max_len - self.cache
        return [0.0 if len(ids) <= free else (free - len(ids)) / self.cache if len(ids) <= self.max_len else -1.0
                for ids in completion_ids]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """TRL's name for :class:`SoftOverlongPunishment`."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


@dataclass
class WeightedReward:
    """A reward function with its weight; ``name`` labels its logged mean (default: the function's name)."""

    fn: RewardFn
    weight: float = 1.0
    name: str | None = None

    @property
    def label(self) -> str:
        return self.name or reward_name(self.fn)


@dataclass(frozen=True)
class TrainerState:
    """What TRL's reward functions read from its ``trainer_state`` keyword: the optimizer steps done, the run's
    ``max_steps`` (-1: none set) and the epoch -- for rewards shaped by training progress."""

    global_step: int
    max_steps: int
    epoch: int


@dataclass
class RewardLogs:
    """What reward functions hand back through TRL's ``log_metric(name, value)`` (scalars, averaged per rollout and
    logged as ``train/<name>`` or ``val/<name>``) and ``log_extra(column, values)`` (a column of the completions
    table, one value per completion)."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    columns: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        self.columns.setdefault(column, []).extend(values)


def reward_name(fn: Any) -> str:
    """What a reward's metric is called: the function's ``__name__`` (through ``functools.partial``), else its
    class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def as_rewards(funcs: Sequence[RewardFn | WeightedReward], weights: Sequence[float] | None = None
               ) -> list[WeightedReward]:
    """Reward functions (TRL's form, ``f(prompts, completions, **kwargs) -> list[float | None]``),
    :class:`WeightedReward` objects, or reward models (a Hub id, a folder or a loaded sequence-classification model:
    :class:`~segki_lightning.rl.reward_model.RewardModel`), with TRL's ``reward_weights`` (default 1.0 each) applied
    to all but the weighted ones."""
    funcs = list(funcs)
    if not funcs:
        raise ValueError("at least one reward function is needed")
    if weights is not None and len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
    out = []
    for i, f in enumerate(funcs):
        if isinstance(f, (str, nn.Module)):   # TRL's: a reward model by Hub id / folder, or loaded
            from .reward_model import RewardModel

            try:
                f = RewardModel(f)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"reward {i}: {err}. A string among the rewards is a reward model's Hub id "
                                        "or folder, as in TRL: give a reward function as the function itself") from None
        if isinstance(f, WeightedReward):
            out.append(f if weights is None else WeightedReward(f.fn, float(weights[i]), f.name))
        elif callable(f):
            out.append(WeightedReward(f, 1.0 if weights is None else float(weights[i])))
        else:
            raise TypeError(f"reward {i} is a {type(f).__name__}, not a callable f(prompts, completions, **kwargs)")
    return out


def _numbers(label: str, values: Sequence[Any]) -> list[float]:
    """A reward function's values as floats, ``None`` as NaN (TRL's "does not apply"). A string, another
    non-number or a NaN of the function's own is an error naming it (a NaN would otherwise pass silently as
    "does not apply"); +-inf is checked with the other non-finite values (:func:`check_rewards`)."""
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
            continue
        if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
            raise TypeError(f"reward {label} returned {v!r} ({type(v).__name__}) for completion {i}: return a number "
                            "(or None where the reward does not apply) per completion")
        f = float(v)
        if math.isnan(f):
            raise ValueError(f"reward {label} returned NaN for completion {i}: return None where the reward does "
                             "not apply, a number otherwise")
        out.append(f)
    return out


def is_async(fn: Any) -> bool:
    """An ``async def`` reward function (or an object whose ``__call__`` is one, or a partial of either)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


_LOOP: asyncio.AbstractEventLoop | None = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop on a thread of its own for the async reward functions of every step (TRL's): a client they
    keep between calls stays on its loop, and it runs under a caller that has a loop of its own (a notebook)."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
        threading.Thread(target=_LOOP.run_forever, name="segki-async-rewards", daemon=True).start()
    return _LOOP


def reward_table(rewards: Sequence[WeightedReward], prompts: Sequence[Any], completions: Sequence[Any],
                 columns: dict[str, list], **extra: Any) -> list[list[float]]:
    """Each reward function's values, ``[F][N]`` floats with ``None`` (the function does not apply to that row) as
    NaN, checked as TRL's contract asks: one float or ``None`` per completion; +-inf raises
    :class:`~segki_lightning.rl.nonfinite.NonFiniteError`. ``extra`` (e.g. ``completion_ids``) is passed by keyword
    next to the dataset's columns. The ``async def`` functions run together (``asyncio.gather``, as TRL runs them)
    after the others, one after another."""
    n = len(completions)
    args, kwargs = (prompts, completions), {**extra, **columns}
    waiting = [i for i, r in enumerate(rewards) if is_async(r.fn)]
    outputs: dict[int, Any] = {i: r.fn(*args, **kwargs) for i, r in enumerate(rewards) if i not in waiting}
    if waiting:
        async def together():
            return await asyncio.gather(*(rewards[i].fn(*args, **kwargs) for i in waiting))

        outputs.update(zip(waiting, asyncio.run_coroutine_threadsafe(together(), _event_loop()).result()))
    table = []
    for i, r in enumerate(rewards):
        values = outputs[i]
        if values is None or len(values) != n:
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward {r.label} returned {got} for {n} completions: return one float (or None) "
                             "per completion")
        table.append(_numbers(r.label, values))
    check_rewards(table, [r.label for r in rewards])
    return table


def summarize(rewards: Sequence[WeightedReward], table: list[list[float]]) -> tuple[list[float], dict[str, float]]:
    """The weighted total per completion and the mean of each function over the rows it applies to (TRL's
    semantics: ``None`` is left out of both); a row no function applies to scores 0, with a warning."""
    means = {}
    for r, values in zip(rewards, table):
        kept = [v for v in values if not math.isnan(v)]
        means[r.label] = sum(kept) / len(kept) if kept else math.nan
    total = []
    for row in zip(*table):
        kept = [r.weight * v for r, v in zip(rewards, row) if not math.isnan(v)]
        total.append(sum(kept))
    if any(all(math.isnan(v) for v in row) for row in zip(*table)):
        log.warning("segki: every reward function returned None for some completions; they score 0")
    return total, means


def score(rewards: Sequence[WeightedReward], prompts: Sequence[Any], completions: Sequence[Any],
          columns: dict[str, list], **extra: Any) -> tuple[list[float], dict[str, float]]:
    """Weighted total per completion and the mean of each reward function (for logging): :func:`summarize` of
    :func:`reward_table`."""
    return summarize(rewards, reward_table(rewards, prompts, completions, columns, **extra))
