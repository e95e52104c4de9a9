"""Token selection: greedy, temperature, top-k, top-p, with a counter-based random stream.

Randomness is a pure function of ``(seed, offset, token index)`` (a 32-bit integer hash), so the same
numbers come out on CPU and GPU, in eager mode and inside a CUDA graph, and the native kernel reproduces
them exactly. Sampling uses the Gumbel-max trick: ``argmax(logits / T + Gumbel)`` over the tokens that
survive the top-k then top-p filters is an exact draw from the renormalised softmax.
"""
from __future__ import annotations

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """32-bit avalanche hash of int64 tensors holding values in ``[0, 2^32)``."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seed: Tensor, offset: Tensor, vocab: int) -> Tensor:
    """``seed, offset [B]`` int64 -> ``[B, V]`` fp32 uniforms in ``(0, 1)`` (24-bit resolution)."""
    row = _mix32(_mix32(seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32) ^ _mix32(offset & _MASK32) * 3)
    col = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    h = _mix32(row[:, None] ^ _mix32(col + 0x9E3779B9)[None, :])          # [B, V]
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def _filter_top_k(scaled: Tensor, top_k: Tensor) -> Tensor:
    """Mask (to -inf) everything below each row's k-th largest value; ``top_k <= 0`` keeps all."""
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = torch.sort(scaled, dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])   # [B, 1]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _filter_top_p(scaled: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of the largest values whose mass reaches ``top_p`` (at least one token): the
    boundary value ``v`` has ``mass(> v) < top_p <= mass(>= v)``, and every token equal to it is kept, so the
    result does not depend on how ties are ordered (the native kernel bisects on values the same way)."""
    sorted_logits = torch.sort(scaled, dim=-1, descending=True).values
    probs = torch.softmax(sorted_logits, dim=-1)
    kept = (probs.cumsum(-1) - probs < top_p[:, None]).sum(-1).clamp(min=1)   # [B] a prefix of the sorted row
    boundary = sorted_logits.gather(-1, (kept - 1)[:, None])                    # [B, 1]
    drop = (scaled < boundary) & (top_p[:, None] < 1.0)
    return scaled.masked_fill(drop, float("-inf"))


def sample_tokens(
    logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seed: Tensor, offset: Tensor
) -> tuple[Tensor, Tensor]:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` any float dtype.
        temperature: ``[B]`` fp32; ``0`` means greedy (argmax, lowest index on ties).
        top_k: ``[B]`` int64, ``0`` = off. top_p: ``[B]`` fp32 in ``(0, 1]``, ``1`` = off.
        seed, offset: ``[B]`` int64: the row's random stream and its position in it (the decode step).
    Returns:
        ``(tokens [B] int64, logprobs [B] fp32)``; the log-prob is ``log_softmax(logits / T)`` at the chosen
        token over the full vocabulary, with ``T = 1`` for greedy rows.
    """
    lf = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = lf / temp[:, None]                                                 # [B, V]
    filtered = _filter_top_p(_filter_top_k(scaled, top_k), top_p.float())
    gumbel = -torch.log(-torch.log(uniform_noise(seed, offset, lf.shape[-1])))
    sampled = torch.argmax(filtered + gumbel, dim=-1)
    tokens = torch.where(greedy, torch.argmax(lf, dim=-1), sampled)
    logprobs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs


def process_logits(logits: Tensor, seen: Tensor | None, penalty: Tensor, min_p: Tensor | None,
                   temperature: Tensor) -> tuple[Tensor, Tensor]:
    """The decode loop's logits processors beyond temperature / top-k / top-p (which the sampler applies).

    transformers' ``RepetitionPenaltyLogitsProcessor`` on the tokens ``seen`` marks (divided by ``penalty`` where
    positive, multiplied where negative, in fp32 and rounded back to the logits' dtype, as the model's logits are
    rounded), then ``MinPLogitsWarper`` after temperature: tokens whose probability is below ``min_p`` times the
    row's largest become -inf (``p_j >= min_p p_max  <=>  x_j >= max + T log(min_p)``).

    Args:
        logits: ``[B, V]``. seen: ``[B, V]`` bool (the row's prompt and completion so far), None: no penalty.
        penalty, temperature: ``[B]`` fp32 (temperature 0: greedy, scales by 1). min_p: ``[B]`` fp32 or None.
    Returns:
        ``(processed [B, V]`` in the logits' dtype, ``lse [B]`` fp32: ``logsumexp(logits / T)`` of the raw
        logits), the denominator of the raw log-probs the trainer compares with.
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))             # [B]
    lf = logits.float()
    lse = torch.logsumexp(lf / t[:, None], dim=-1)                                          # [B]
    x = logits
    if seen is not None:
        p = penalty[:, None]
        x = torch.where(seen, torch.where(lf < 0, lf * p, lf / p), lf).to(logits.dtype)
    if min_p is not None:
        floor = x.amax(-1, keepdim=True).float() + (t * torch.log(min_p))[:, None]          # [B, 1]; log 0 = -inf
        x = x.masked_fill(x < floor, float("-inf"))
    return (x.clone() if x is logits else x), lse


def record_tokens(tok: Tensor, lp: Tensor, finished: Tensor, offset: Tensor, token: Tensor, out_tokens: Tensor,
                  out_logprobs: Tensor, out_mask: Tensor, eos: Tensor, pad: int, lengths: Tensor | None = None
                  ) -> None:
    """Write each row's sampled token at its completion index, in place: the decode step's bookkeeping.

    A row already finished records ``pad``, log-prob 0 and mask 0; a row whose recorded token is in ``eos``
    becomes finished. With ``lengths`` (a decode step) the row then advances: ``offset`` and ``lengths`` + 1.

    Args:
        tok: ``[B]`` int64 sampled tokens. lp: ``[B]`` fp32 their log-probs.
        finished: ``[B]`` bool. offset: ``[B]`` int64 completion index (< S). token: ``[B]`` int64 last token.
        out_tokens, out_mask: ``[B, S]`` int64. out_logprobs: ``[B, S]`` fp32.
        eos: ``[E]`` int64 end-of-sequence ids. lengths: ``[B]`` int64 cached tokens per row, or None.
    """
    done = finished
    tok = tok.masked_fill(done, pad)
    col = offset[:, None]
    out_tokens.scatter_(1, col, tok[:, None])
    out_logprobs.scatter_(1, col, lp.float().masked_fill(done, 0.0)[:, None])
    out_mask.scatter_(1, col, (~done).to(out_mask.dtype)[:, None])
    finished.copy_(done | torch.isin(tok, eos))   # (the right side is computed before the copy)
    token.copy_(tok)
    if lengths is not None:
        offset.add_(1)
        lengths.add_(1)
