"""Logits processors of the decode loop beyond temperature / top-k / top-p (which the fused sampler applies):
transformers' repetition penalty and min-p, on ``[B, V]`` logits with per-row settings, as device tensor ops only
(they run inside the captured decode graph). Off (penalty 1, min_p 0) they are not run at all."""
from __future__ import annotations

import torch
from torch import Tensor


def process_logits(logits: Tensor, seen: Tensor | None, penalty: Tensor, min_p: Tensor, temperature: Tensor
                   ) -> Tensor:
    """``[B, V]`` fp32 logits after transformers' ``RepetitionPenaltyLogitsProcessor`` (every token in ``seen
    [B, V]`` -- the row's prompt and completion so far -- divided by ``penalty`` where positive, multiplied where
    negative) and ``MinPLogitsWarper`` (after temperature: tokens whose probability is below ``min_p`` times the
    row's largest set to -inf; ``min_p = 0`` keeps all). ``penalty, min_p, temperature [B]`` fp32; temperature 0
    (greedy) scales by 1."""
    x = logits.float()
    if seen is not None:
        p = penalty[:, None]
        x = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    scaled = x / t
    floor = scaled.max(-1, keepdim=True).values + torch.log(min_p)[:, None]   # log 0 = -inf: nothing dropped
    return x.masked_fill(scaled < floor, float("-inf"))


def raw_logprob(logits: Tensor, tokens: Tensor, temperature: Tensor) -> Tensor:
    """``[B]`` ``log_softmax(logits / T)`` of the chosen tokens, from the model's own logits (T = 1 for greedy
    rows): what the trainer's log-prob pass computes, so that the sampler/trainer correction compares like with
    like when processors change the sampling distribution (vLLM's raw log-probs likewise)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    return torch.log_softmax(logits.float() / t, dim=-1).gather(-1, tokens[:, None])[:, 0]
