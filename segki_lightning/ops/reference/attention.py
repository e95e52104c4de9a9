"""Decode attention: one query token per row against a KV cache whose valid prefix length differs per row,
and the prologue that gets the token there (q/k norms, rotary embedding, cache write)."""
from __future__ import annotations

import torch
from torch import Tensor

from .norm import rms_norm


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding in the rotate-half form on the first ``R = cos.shape[-1]`` features of each head
    (partial rotary leaves the rest as is), with the op order and dtype roundings of transformers'
    ``apply_rotary_pos_emb``: ``x [B, H, D]``, ``cos/sin [B, R]`` -> ``[B, H, D]``."""
    r = cos.shape[-1]
    c, s = cos[:, None], sin[:, None]                                         # [B, 1, R]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], dim=-1)
    return torch.cat([rot * c + half * s, rest], dim=-1)


def attention_prologue(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, q_norm_w: Tensor | None,
                       k_norm_w: Tensor | None, k_cache: Tensor, v_cache: Tensor, positions: Tensor, eps: float,
                       unit_offset: bool, gated: bool) -> Tensor:
    """Everything between the QKV projection and decode attention for one new token per row.

    Args:
        q: ``[B, Hq*D]``, or ``[B, Hq*2D]`` when ``gated`` (per head: D query features, then D gate
            features -- Qwen3.5's gated attention; the gate is read later by :func:`decode_attention`).
        k, v: ``[B, Hkv*D]``.
        cos, sin: ``[B, R]`` rotary tables at each row's position (``R <= D``, even).
        q_norm_w, k_norm_w: per-head RMSNorm weights ``[D]`` (both or neither), in the form ``unit_offset``.
        k_cache, v_cache: ``[B, Hkv, S, D]``; row b's normed, rotated key and its value are written at
            ``positions[b]`` (in place).
    Returns:
        The normed, rotated query ``[B, Hq, D]``.
    """
    bsz, hkv, d = k_cache.shape[0], k_cache.shape[1], k_cache.shape[3]
    q = q.view(bsz, -1, 2 * d)[..., :d] if gated else q.view(bsz, -1, d)      # [B, Hq, D]
    k = k.view(bsz, hkv, d)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps, unit_offset), rms_norm(k, k_norm_w, eps, unit_offset)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    write_token(k_cache, v_cache, k, v.view(bsz, hkv, d), positions)
    return q.contiguous()


def decode_attention_step(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, q_norm_w: Tensor | None,
                          k_norm_w: Tensor | None, k_cache: Tensor, v_cache: Tensor, positions: Tensor,
                          lengths: Tensor, eps: float, unit_offset: bool, gated: bool, scale: float) -> Tensor:
    """The attention of one decode step from the projections: :func:`attention_prologue` (arguments as there),
    then :func:`decode_attention` over ``[0, lengths[b])`` with, when ``gated``, the second half of each query
    head's columns of ``q`` as the gate. Returns ``[B, Hq, D]``."""
    query = attention_prologue(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions, eps, unit_offset,
                               gated)                                                          # [B, Hq, D]
    bsz, hq, d = query.shape
    gate = q.view(bsz, hq, 2 * d)[..., d:] if gated else None                                   # [B, Hq, D]
    return decode_attention(query, k_cache, v_cache, lengths, scale, gate)


def write_token(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    """Row b's key and value ``[B, Hkv, D]`` into ``k_cache/v_cache [B, Hkv, S, D]`` at ``positions[b]``."""
    rows = torch.arange(k_cache.shape[0], device=k_cache.device)
    k_cache[rows, :, positions] = k.to(k_cache.dtype)
    v_cache[rows, :, positions] = v.to(v_cache.dtype)


def valid_mask(lengths: Tensor, max_seq: int, dtype: torch.dtype) -> Tensor:
    """Additive 4-D mask ``[B, 1, 1, S]`` (0 on ``[0, lengths[b])``, -inf after) for plain attention."""
    keep = torch.arange(max_seq, device=lengths.device)[None, :] < lengths[:, None]
    return torch.zeros(keep.shape, dtype=dtype, device=lengths.device).masked_fill(~keep, float("-inf"))[:, None, None]


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float,
                     gate: Tensor | None = None) -> Tensor:
    """Softmax attention of one query per row over cache positions ``[0, lengths[b])``.

    Args:
        q: ``[B, Hq, D]`` queries (the current token, already written to the cache).
        k_cache, v_cache: ``[B, Hkv, S, D]``; ``Hq % Hkv == 0`` (GQA: query head ``h`` reads KV head
            ``h // (Hq // Hkv)``).
        lengths: ``[B]`` integer, ``1 <= lengths[b] <= S``; positions at and after it are never read.
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        gate: optional ``[B, Hq, D]`` (any strides): the output is multiplied by ``sigmoid(gate)``, each
            rounded to ``q.dtype`` first, as Qwen3.5's gated attention does after the attention function.
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
    out = out.reshape(bsz, hq, d).to(q.dtype)
    return out if gate is None else out * torch.sigmoid(gate)
