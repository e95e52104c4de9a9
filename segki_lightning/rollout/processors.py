"""Logits processors of the decode loop beyond temperature / top-k / top-p (which the fused sampler applies):
transformers' repetition penalty and min-p, on ``[B, V]`` logits with per-row settings, as device tensor ops only
(they run inside the captured decode graph). Each runs only when on (a penalty of 1 or a min-p of 0 is not run).

Cost per step, ``B`` rows of a ``V``-token vocabulary and ``L`` tokens of history: one copy of the logits in their
own dtype, a gather/scatter over ``[B, L]`` for the penalty (transformers' own form, never a ``[B, V]`` mask), one
max and one masked write for min-p, and one log-sum-exp for the raw log-probs. The processed logits stay in the
model's dtype so that the fused sampler takes them (the penalised values are computed in fp32 and rounded back,
as the model's own logits are rounded)."""
from __future__ import annotations

import torch
from torch import Tensor


def process_logits(logits: Tensor, history: Tensor | None, penalty: Tensor, min_p: Tensor | None,
                   temperature: Tensor) -> Tensor:
    """``[B, V]`` logits (same dtype) after transformers' ``RepetitionPenaltyLogitsProcessor`` (every token listed
    in ``history [B, L]`` -- the row's prompt and completion so far; repeats are harmless -- divided by
    ``penalty [B]`` where positive, multiplied where negative) and ``MinPLogitsWarper`` (after temperature: tokens
    whose probability is below ``min_p [B]`` times the row's largest set to -inf). ``history=None``: no penalty;
    ``min_p=None``: no min-p. ``temperature [B]`` fp32; 0 (greedy) scales by 1."""
    x = logits.clone()
    if history is not None:
        g = x.gather(1, history).float()                                                  # [B, L]
        p = penalty[:, None]
        x.scatter_(1, history, torch.where(g < 0, g * p, g / p).to(x.dtype))
    if min_p is not None:
        # p_j >= min_p * p_max  <=>  x_j / T >= max / T + log(min_p)  <=>  x_j >= max + T log(min_p)
        t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        floor = x.amax(-1, keepdim=True).float() + (t * torch.log(min_p))[:, None]        # [B, 1]; log 0 = -inf
        x.masked_fill_(x < floor, float("-inf"))                                           # x is our copy
    return x


def history_rows(seqs: list[list[int]], width: int, device) -> Tensor:
    """The penalty's ``history`` for rows holding ``seqs``: ``[len(seqs), width]`` token ids, each sequence then
    its first token repeated (already listed: a repeat changes nothing)."""
    return torch.tensor([q + q[:1] * (width - len(q)) for q in seqs], device=device)


def raw_logprob(logits: Tensor, tokens: Tensor, temperature: Tensor) -> Tensor:
    """``[B]`` ``log_softmax(logits / T)`` of the chosen tokens, from the model's own logits (T = 1 for greedy
    rows): what the trainer's log-prob pass computes, so that the sampler/trainer correction compares like with
    like when processors change the sampling distribution (vLLM's raw log-probs likewise)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    chosen = logits.gather(1, tokens[:, None])[:, 0].float() / t                          # [B]
    # a half logit / an fp32 T is computed in fp32 (exact widening, then the division): no fp32 copy first
    return chosen - torch.logsumexp(logits / t[:, None], dim=-1)
