"""Logits processors of the decode loop beyond temperature / top-k / top-p (which the fused sampler applies):
transformers' repetition penalty and min-p, with per-row settings, inside the captured decode step
(:func:`segki_lightning.ops.process_logits`: two native launches on CUDA, the torch reference elsewhere). Each runs
only when on (a penalty of 1 or a min-p of 0 is not run).

The penalty reads a ``[B, V]`` bool mask of the tokens each row has seen (its prompt, then every token it draws
or is fed), set at the prefill and one scatter a step: transformers penalises each id of ``input_ids`` once,
which is what a mask holds. The sampler then draws from the processed logits, while the recorded log-probs stay
the model's own (``log_softmax(logits / T)``, from the raw logits' log-sum-exp): what the trainer's log-prob pass
computes, so that the sampler/trainer correction compares like with like (vLLM's raw log-probs likewise)."""
from __future__ import annotations

import torch
from torch import Tensor


def mark_seen(seen: Tensor, seqs: list[list[int]]) -> None:
    """Rows ``[0, len(seqs))`` of ``seen [B, V]`` become the tokens of ``seqs`` (their prompts), nothing else."""
    width = max(map(len, seqs))
    ids = torch.tensor([q + q[:1] * (width - len(q)) for q in seqs], device=seen.device)   # [R, W] (repeats: no-ops)
    seen[:len(seqs)].zero_().scatter_(1, ids, True)


def remember(seen: Tensor, tok: Tensor, running: Tensor, anchor: Tensor) -> None:
    """Each running row's token ``tok [B]`` into ``seen``; a finished row (its draw is not part of its sequence)
    writes its ``anchor`` (a token of its prompt, already marked) instead."""
    seen.scatter_(1, torch.where(running, tok, anchor)[:, None], True)


def raw_logprob(logits: Tensor, tokens: Tensor, temperature: Tensor, lse: Tensor) -> Tensor:
    """``[B]`` ``log_softmax(logits / T)`` of the chosen tokens from the raw logits and their log-sum-exp ``lse``
    (T = 1 for greedy rows); a half logit over an fp32 T is computed in fp32, as the reference sampler does."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return logits.gather(1, tokens[:, None])[:, 0].float() / t - lse
