"""Projection family: one input row set, one or several ORIGINAL weight matrices (never concatenated).

Shapes: ``x [..., K]``, each weight ``[N_i, K]``, each output ``[..., N_i]`` in ``x.dtype``. Products
accumulate in fp32 (BLAS for bf16/fp16 does); elementwise epilogues run in fp32.

The projections that follow a norm in a decoder layer take it as an optional prologue: with ``norm_w [K]``, x is
first ``rms_norm(x, norm_w, norm_eps, norm_unit_offset)`` (the native ops normalize x on its way into the GEMV).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .norm import rms_norm


def normed_input(x: Tensor, norm_w: Tensor | None, norm_eps: float, norm_unit_offset: bool) -> Tensor:
    """The projection's input after its norm prologue: ``x`` itself when ``norm_w`` is None."""
    return x if norm_w is None else rms_norm(x, norm_w, norm_eps, norm_unit_offset)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """``x @ weight^T (+ bias)``: ``x [..., K]``, ``weight [N, K]`` -> ``[..., N]``; with ``residual [..., N]``,
    ``residual + that`` (the projection rounded to ``x.dtype`` first, as a separate residual add does)."""
    out = F.linear(x, weight, bias)
    return out if residual is None else residual + out


def skinny_linear_sums(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight^T`` as fp32 sums in segments of K, ``[S, ..., N]``: added over S in order, the product before
    its rounding. The reference takes all of K as one segment (the native op plans two or more)."""
    return F.linear(x.float(), weight.float()).unsqueeze(0)


def skinny_linear(x: Tensor, weight: Tensor, residual: Tensor | None = None, gated: bool = False,
                  norm_w: Tensor | None = None, norm_eps: float = 0.0, norm_unit_offset: bool = False) -> Tensor:
    """One product over a (packed) weight ``[R, K]``: :func:`linear` without bias, or with ``gated`` the weight's
    first half of rows as the gate and the second as up, ``silu_mul(x @ gate^T, x @ up^T)`` -> ``[..., R / 2]``.
    With ``norm_w``, x goes through the RMSNorm first (:func:`rms_norm`'s roundings)."""
    x = normed_input(x, norm_w, norm_eps, norm_unit_offset)
    if gated:
        return silu_mul(*F.linear(x, weight).chunk(2, dim=-1))
    return linear(x, weight, None, residual)


def gated_mlp_front(x: Tensor, w_gate: Tensor, w_up: Tensor, norm_w: Tensor | None = None, norm_eps: float = 0.0,
                    norm_unit_offset: bool = False) -> Tensor:
    """``silu(x @ w_gate^T) * (x @ w_up^T)``: ``x [..., K]``, ``w_* [I, K]`` -> ``[..., I]``.

    The gate and up products are combined in fp32 and rounded once to ``x.dtype``.
    """
    x = normed_input(x, norm_w, norm_eps, norm_unit_offset)
    return silu_mul(F.linear(x, w_gate), F.linear(x, w_up))


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` in fp32, rounded once to ``gate.dtype``: the epilogue of :func:`gated_mlp_front`."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def qkv_proj(
    x: Tensor, w_q: Tensor, w_k: Tensor, w_v: Tensor,
    b_q: Tensor | None = None, b_k: Tensor | None = None, b_v: Tensor | None = None,
    norm_w: Tensor | None = None, norm_eps: float = 0.0, norm_unit_offset: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention input projections from three weights: ``x [..., K]`` -> ``q [..., Nq]``, ``k [..., Nk]``,
    ``v [..., Nv]``. Biases are optional and per projection."""
    x = normed_input(x, norm_w, norm_eps, norm_unit_offset)
    return F.linear(x, w_q, b_q), F.linear(x, w_k, b_k), F.linear(x, w_v, b_v)


def gdn_in_proj(
    x: Tensor, w_qkv: Tensor, w_z: Tensor, w_b: Tensor, w_a: Tensor,
    norm_w: Tensor | None = None, norm_eps: float = 0.0, norm_unit_offset: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gated-DeltaNet input projections: ``x [..., K]`` -> ``qkv [..., 2*Hk*Dk + Hv*Dv]``,
    ``z [..., Hv*Dv]``, ``b [..., Hv]``, ``a [..., Hv]``."""
    x = normed_input(x, norm_w, norm_eps, norm_unit_offset)
    return F.linear(x, w_qkv), F.linear(x, w_z), F.linear(x, w_b), F.linear(x, w_a)
