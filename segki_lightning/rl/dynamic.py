"""DAPO's dynamic sampling: a GRPO batch keeps only the prompt groups whose rewards differ (a group of equal
rewards has zero advantages everywhere: it costs a training pass and teaches nothing), and more prompts are rolled
out until ``prompts_per_step`` informative groups are found or ``max_num_gen_batches`` rollouts were made (verl's
name). Short of that, zero-variance groups fill the batch (they add nothing to the policy gradient and keep its
shape), and the metrics say so.

More prompts come from a second pass over the training prompts (:class:`RefillPrompts`): its own shuffle, its place
checkpointed with the module, so a resumed run draws the same refills."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..rollout import RolloutBatch, RolloutStats


def informative_groups(rewards: Tensor, group: int) -> Tensor:
    """``[G_count]`` bool: groups (``group`` consecutive rows of ``[N]`` rewards) whose rewards are not all equal."""
    r = rewards.view(-1, group)
    return (r != r[:, :1]).any(1)


def take_groups(parts: list[tuple[Any, Tensor]], group: int, pad_token_id: int):
    """One ``Scored`` of the groups ``idx`` of each ``(scored, idx)`` part, in that order: rows re-stacked (prompts
    left-padded to the longest), rewards (total and per function), texts, prompts and the reward functions' logged
    columns with them; reward means weighted by rows; timings and token counts summed over the parts' rollouts."""
    rows = [torch.cat([torch.arange(g * group, (g + 1) * group) for g in idx.tolist()]) if len(idx)
            else torch.zeros(0, dtype=torch.long) for _, idx in parts]
    width = max(s.batch.prompt_ids.shape[1] for s, _ in parts)

    def left(t: Tensor, fill: int) -> Tensor:   # [n, P] -> [n, width], new columns on the left
        return F.pad(t, (width - t.shape[1], 0), value=fill)

    batches = [(s.batch, r.to(s.batch.completion_ids.device)) for (s, _), r in zip(parts, rows)]
    cat = lambda f: torch.cat([f(b, r) for b, r in batches])   # noqa: E731
    n_rows = sum(len(r) for r in rows)
    stats = RolloutStats(**{k: sum(getattr(s.batch.stats, k) for s, _ in parts)
                            for k in ("prefill_s", "decode_s", "setup_s", "collect_s", "tokens", "steps",
                                      "respond_s", "observation_tokens", "observations_cut")},
                         path=parts[0][0].batch.stats.path)
    batch = RolloutBatch(
        prompt_ids=cat(lambda b, r: left(b.prompt_ids[r], pad_token_id)),
        prompt_mask=cat(lambda b, r: left(b.prompt_mask[r], 0)),
        completion_ids=cat(lambda b, r: b.completion_ids[r]), completion_mask=cat(lambda b, r: b.completion_mask[r]),
        logprobs=cat(lambda b, r: b.logprobs[r]),
        prompt_index=torch.arange(n_rows, device=parts[0][0].batch.prompt_index.device) // group, stats=stats,
        stopped=None if parts[0][0].batch.stopped is None else cat(lambda b, r: b.stopped[r]),
        tool_mask=None if parts[0][0].batch.tool_mask is None else cat(lambda b, r: b.tool_mask[r]),
        turns=None if parts[0][0].batch.turns is None else cat(lambda b, r: b.turns[r]))
    weight = [len(r) for r in rows]
    means = {k: sum(w * s.means[k] for w, (s, _) in zip(weight, parts) if w) / max(sum(weight), 1)
             for k in parts[0][0].means}
    first = parts[0][0]
    return replace(first, batch=batch, means=means, rollout_s=sum(s.rollout_s for s, _ in parts),
                   prompts=[s.prompts[i] for (s, _), r in zip(parts, rows) for i in r.tolist()],
                   texts=[s.texts[i] for (s, _), r in zip(parts, rows) for i in r.tolist()],
                   rewards=torch.cat([s.rewards[r.to(s.rewards.device)] for (s, _), r in zip(parts, rows)]),
                   per_function=None if first.per_function is None else
                   torch.cat([s.per_function[r.to(s.per_function.device)] for (s, _), r in zip(parts, rows)]),
                   reward_logs=None if first.reward_logs is None else _reward_logs(parts, rows))


def _reward_logs(parts: list[tuple[Any, Tensor]], rows: list[Tensor]):
    """The reward functions' logs of the groups taken: every rollout's scalars, and each added column's values of
    the rows taken (in their order)."""
    from .rewards import RewardLogs

    logs = RewardLogs()
    for (s, _), r in zip(parts, rows):
        for name, values in s.reward_logs.metrics.items():
            logs.metrics.setdefault(name, []).extend(values)
        for column, values in s.reward_logs.columns.items():
            logs.columns.setdefault(column, []).extend(values[i] for i in r.tolist() if i < len(values))
    return logs


def fill(scored: list, want: int, group: int, pad_token_id: int) -> tuple[Any, dict[str, float]]:
    """From the scored rollouts of one step (the first is the step's own batch), the first ``want`` informative
    groups in drawing order, then zero-variance ones (first drawn first) up to ``want``; and the metrics."""
    good = [informative_groups(s.rewards, group).cpu() for s in scored]
    picked, room = [], want
    for g in good:
        take = g.nonzero().flatten()[:room]
        picked.append(take)
        room -= len(take)
    filled = room
    for i, g in enumerate(good):   # zero-variance groups fill what is left
        take = (~g).nonzero().flatten()[:room]
        picked[i] = torch.cat([picked[i], take])
        room -= len(take)
    n_good, total = sum(int(g.sum()) for g in good), sum(len(g) for g in good)
    metrics = {"rollout/dynamic_sampling/generation_batches": float(len(scored)),
               "rollout/dynamic_sampling/informative_groups": float(n_good),
               "rollout/dynamic_sampling/dropped_groups": float(total - n_good),
               "rollout/dynamic_sampling/filled_groups": float(filled)}
    return take_groups(list(zip(scored, picked)), group, pad_token_id), metrics


class RefillPrompts:
    """Prompt batches for the refills: endless epochs of the training prompts in its own shuffled order (``seed``),
    through a :class:`~segki_lightning.rl.loader.ResumableLoader`, whose place is in :meth:`state_dict`."""

    def __init__(self, dataset, batch_size: int, collate_fn, seed: int):
        from .loader import ResumableLoader

        self.loader = ResumableLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                      collate_fn=collate_fn, generator=torch.Generator().manual_seed(seed))
        self._it = None
        self._pending: dict | None = None   # a loaded place not yet iterated from

    def next(self) -> dict:
        self._pending = None
        for _ in range(2):   # a new epoch when the last one is used up
            if self._it is None:
                self._it = iter(self.loader)
            try:
                return next(self._it)
            except StopIteration:
                self._it = None
        raise RuntimeError("the training prompts give no batch for dynamic sampling's refills")

    def state_dict(self) -> dict:
        return self._pending if self._pending is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it, self._pending = None, dict(state)
