"""LightningModules for benchmark runs of randomly initialised policies, passed to the recipe as
``module=bench_modules.<Name>`` with this folder on ``PYTHONPATH`` (grpo_gpu.py does so)."""
from __future__ import annotations

import torch

from segki_lightning.rl import GRPOModule


def mixed_lengths(t: int, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` completion lengths drawn uniformly between 10 % and 100 % of ``t`` (mean ~55 %) ``[n]``."""
    return torch.randint(max(1, t // 10), t + 1, (n,), generator=generator)


class MixedLengthGRPO(GRPOModule):
    """GRPO whose completions end at lengths drawn uniformly between 10 % and 100 % of ``max_completion_length``
    (mean ~55 %): random weights never sample EOS, so each row is cut after its rollout -- EOS written at its last
    kept token, the mask and the sampler's log-probs zeroed after it -- and training sees the spread of lengths a
    real run has. The rollout itself still generates every token (its time is that of full-length rows)."""

    def rollout(self, prompts, sampling, stop=None):
        batch = super().rollout(prompts, sampling, stop)
        t = batch.completion_ids.shape[1]
        gen = torch.Generator().manual_seed(1000 + self.global_step)
        ends = mixed_lengths(t, len(batch), gen).to(batch.completion_ids.device)
        cols = torch.arange(t, device=ends.device)[None, :]
        keep = cols < ends[:, None]                                                          # [N, T]
        ids = torch.where(keep, batch.completion_ids, self.pad_token_id)
        batch.completion_ids = torch.where(cols == ends[:, None] - 1, self.eos_token_id, ids)
        batch.completion_mask = batch.completion_mask * keep
        batch.logprobs = batch.logprobs * keep
        return batch
