"""Decode attention: one query token per row against a KV cache whose valid prefix length differs per row."""
from __future__ import annotations

import torch
from torch import Tensor


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float) -> Tensor:
    """Softmax attention of one query per row over cache positions ``[0, lengths[b])``.

    Args:
        q: ``[B, Hq, D]`` queries (the current token, already written to the cache).
        k_cache, v_cache: ``[B, Hkv, S, D]``; ``Hq % Hkv == 0`` (GQA: query head ``h`` reads KV head
            ``h // (Hq // Hkv)``).
        lengths: ``[B]`` integer, ``1 <= lengths[b] <= S``; positions at and after it are never read.
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
    Returns:
        ``[B, Hq, D]`` in ``q.dtype``; softmax and accumulation in fp32.
    """
    bsz, hq, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    valid = torch.arange(s, device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [B, S]
    unread = ~valid[:, None, :, None]                                          # never let stale data in
    k = k_cache.float().masked_fill(unread, 0.0)                              # [B, Hkv, S, D]
    v = v_cache.float().masked_fill(unread, 0.0)
    qf = q.float().view(bsz, hkv, group, d)                                   # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bhsd->bhgs", qf, k) * scale                   # [B, Hkv, G, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v)                           # [B, Hkv, G, D]
    return out.reshape(bsz, hq, d).to(q.dtype)
