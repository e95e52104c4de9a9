"""Packed sequences for training (padding-free batches): several rows laid end to end in one sequence
``[1, M, ...]`` with ``cu_seqlens [R + 1]`` (int, the rows' start offsets and the total, as flash-attention takes
them). Each op treats every row as if it ran alone, from zero state: the Gated-DeltaNet chunk rule (fla's varlen
kernels on CUDA, else the torch rule), its causal depthwise conv, and causal softmax attention (PyTorch's varlen
flash attention where it runs, else SDPA). Where no varlen kernel runs (CPU), the rows go through the torch op as
one right-padded batch ``[R, L]`` (L the longest row): both ops are causal, so a row's tokens never see the zeros
after them, and one call replaces R calls of ~50 small ops each (the main job's update took 0.44 s a step when it
looped over the rows, 0.095 s batched). All differentiable."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import gdn_chunk as _gdn
from . import train_fused
from .reference import gdn_chunked


def gdn_chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """The gated delta rule with q/k L2-norm from a zero state for each row: ``q, k [B, T, Hk, Dk]``, ``v [B, T, Hv,
    Dv]``, ``g`` (fp32 log-decay), ``beta [B, T, Hv]`` -> ``[B, T, Hv, Dv]``; packed rows with ``cu_seqlens``
    (``B = 1``). flash-linear-attention's chunked kernels on CUDA where they train here
    (:func:`~segki_lightning.ops.gdn_chunk.training_path`; without gradients wherever fla runs), else
    transformers' chunked torch rule, row by row when packed."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
    if q.is_cuda and _gdn.fla_runs(needs_grad):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k = train_fused.l2norm(q), train_fused.l2norm(k)   # in-kernel, fla's norm compiles per token count
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                        use_qk_l2norm_in_kernel=False, cu_seqlens=cu_seqlens)
        return out
    if cu_seqlens is None:
        return gdn_chunked(q, k, v, g, beta)
    index, rows, longest = _padded_index(cu_seqlens, q.device)
    out = gdn_chunked(*(_to_padded(t[0], index, rows, longest) for t in (q, k, v, g, beta)))   # [R, L, Hv, Dv]
    return out.flatten(0, 1).index_select(0, index)[None]                                    # [1, M, Hv, Dv]


def causal_conv_silu(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor | None = None) -> Tensor:
    """``SiLU(depthwise causal conv)`` of ``x [B, T, C]`` with ``weight [C, 1, W]`` -> ``[B, T, C]`` in x's dtype, each
    row from zeros (transformers' Gated-DeltaNet conv). Packed rows (``cu_seqlens``, ``B = 1``) are spread apart by
    ``W - 1`` zeros, so that no row's window reaches into the row before it, and gathered back after the conv.
    Training passes: fla's varlen conv (:mod:`.train_fused`) where it runs."""
    if train_fused.active(x, weight, bias):
        return train_fused.causal_conv_silu(x, weight, bias, cu_seqlens)
    gap = weight.shape[-1] - 1
    if cu_seqlens is not None and gap > 0:
        dest = _spread(cu_seqlens, gap, x.device)                                               # [M]
        width = x.shape[1] + gap * (len(cu_seqlens) - 1)
        spread = x.new_zeros(1, width, x.shape[2]).index_copy(1, dest, x)                        # [1, M + gap R, C]
        return causal_conv_silu(spread, weight, bias).index_select(1, dest)
    t = x.shape[1]
    y = F.conv1d(x.transpose(1, 2).to(weight.dtype), weight, bias, padding=gap, groups=x.shape[-1])[..., :t]
    return F.silu(y).to(x.dtype).transpose(1, 2)                                                 # [B, T, C]


_LAYOUTS: list = [None, {}]   # the last cu_seqlens tensor and the index tensors derived from it: every layer of a
                              # pass shares them (as fla keys its chunk plans on the tensor)


def _layout(cu_seqlens: Tensor, key: object, make: Callable[[], Any]) -> Any:
    """``make()``, computed once per ``cu_seqlens`` tensor and ``key``."""
    if _LAYOUTS[0] is not cu_seqlens:
        _LAYOUTS[:] = [cu_seqlens, {}]
    if key not in _LAYOUTS[1]:
        _LAYOUTS[1][key] = make()
    return _LAYOUTS[1][key]


def _row_of(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """Each packed token's row ``[M]`` (one host sync, once per ``cu_seqlens``)."""
    return _layout(cu_seqlens, ("row_of", device), lambda: torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=device), (cu_seqlens[1:] - cu_seqlens[:-1]).to(device)))


def _padded_index(cu_seqlens: Tensor, device: torch.device) -> tuple[Tensor, int, int]:
    """Where each packed token sits in a right-padded batch ``[R, L]`` flattened (``index [M]``), with R and the
    longest row L."""
    def make() -> tuple[Tensor, int, int]:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        rows, row_of = len(cu) - 1, _row_of(cu_seqlens, device)                               # [M]
        longest = int((cu[1:] - cu[:-1]).max()) if rows else 0
        pos = torch.arange(len(row_of), device=device) - cu[:-1][row_of]                        # [M]
        return row_of * longest + pos, rows, longest
    return _layout(cu_seqlens, ("padded", device), make)


def _to_padded(x: Tensor, index: Tensor, rows: int, longest: int) -> Tensor:
    """Packed ``x [M, ...]`` -> ``[R, L, ...]``, zeros after each row's tokens (differentiable)."""
    flat = x.new_zeros(rows * longest, *x.shape[1:]).index_copy(0, index, x)
    return flat.view(rows, longest, *x.shape[1:])


def _spread(cu_seqlens: Tensor, gap: int, device: torch.device) -> Tensor:
    """Where each packed token goes when ``gap`` zeros precede every row ``[M]``."""
    return _layout(cu_seqlens, ("spread", gap, device), lambda: torch.arange(
        int(cu_seqlens[-1]), device=device) + gap * (_row_of(cu_seqlens, device) + 1))


@cache
def _varlen_kwargs() -> dict[str, str] | None:
    """How this PyTorch's ``varlen_attn`` says causal and GQA (its signature moved between 2.10 and 2.12); None
    where it does not exist."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return {"causal": "window_size" if "window_size" in params else "is_causal" if "is_causal" in params else "",
            "scale": "scale" if "scale" in params else "", "gqa": "enable_gqa" if "enable_gqa" in params else ""}


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, scale: float) -> Tensor:
    """Causal softmax attention of each packed row alone: ``q [M, Hq, D]``, ``k, v [M, Hkv, D]`` (``Hq % Hkv == 0``)
    -> ``[M, Hq, D]``. PyTorch's varlen flash attention on CUDA for bf16/fp16 where this PyTorch has it; else SDPA
    (causal) row by row."""
    kw = _varlen_kwargs()
    if kw is not None and kw["causal"] and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        from torch.nn.attention.varlen import varlen_attn

        extra = {kw["causal"]: (-1, 0) if kw["causal"] == "window_size" else True}
        if kw["scale"]:
            extra["scale"] = scale
        else:
            q = q * (scale * q.shape[-1] ** 0.5)   # the default scale is D ** -0.5
        if kw["gqa"]:
            extra["enable_gqa"] = True
        elif k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        cu = cu_seqlens.to(torch.int32)
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)
    index, rows, longest = _padded_index(cu_seqlens, q.device)
    qs, ks, vs = (_to_padded(t, index, rows, longest).transpose(1, 2) for t in (q, k, v))        # [R, H, L, D]
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])
    return o.transpose(1, 2).flatten(0, 1).index_select(0, index)                                # [M, Hq, D]
