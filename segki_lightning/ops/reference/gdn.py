"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention): gates, the delta-rule recurrence, and the fused
single-token decode step that the CUDA kernel implements.

Notation: ``Hk, Dk`` key heads and dim, ``Hv, Dv`` value heads and dim (``Hv % Hk == 0``; value head ``h``
reads key head ``h // (Hv // Hk)``), ``C = 2*Hk*Dk + Hv*Dv`` conv channels, ``W`` conv kernel width.
The recurrent state is ``[B, Hv, Dk, Dv]`` fp32.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .conv import gdn_conv_step
from .linear import gdn_in_proj
from .norm import gated_rms_norm


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """``a, b [..., Hv]``, ``A_log, dt_bias [Hv]`` -> ``(g [..., Hv] fp32, beta [..., Hv] in b.dtype)`` with
    ``beta = sigmoid(b)`` and the log-decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus is the
    overflow-safe form, linear above 20)."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (the form flash-linear-attention uses)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: Tensor, num_v_heads: int) -> Tensor:
    """``[..., Hk, D]`` -> ``[..., Hv, D]`` (each key head serves ``Hv // Hk`` consecutive value heads)."""
    rep = num_v_heads // x.shape[-2]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-2)


def gdn_recurrence(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule with q/k L2-norm and ``Dk ** -0.5`` query scaling.

    Args:
        q, k: ``[B, T, Hk, Dk]``; v: ``[B, T, Hv, Dv]``; g, beta: ``[B, T, Hv]``.
        initial_state: ``[B, Hv, Dk, Dv]`` or None (zeros). Not modified.
    Returns:
        ``(out [B, T, Hv, Dv] in v.dtype, final_state [B, Hv, Dk, Dv] fp32)``.
    """
    bsz, t, hv, dv = v.shape
    dk = q.shape[-1]
    q = _expand_heads(l2norm(q.float()), hv) * dk**-0.5                   # [B, T, Hv, Dk]
    k = _expand_heads(l2norm(k.float()), hv)                               # [B, T, Hv, Dk]
    vf, gf, bf = v.float(), g.float(), beta.float()
    if initial_state is None:
        state = q.new_zeros(bsz, hv, dk, dv)
    else:
        state = initial_state.float()
    outs = []
    for i in range(t):
        state = state * gf[:, i].exp()[..., None, None]                       # decay
        kv_mem = (state * k[:, i, ..., None]).sum(-2)                          # [B, Hv, Dv]
        delta = (vf[:, i] - kv_mem) * bf[:, i, :, None]                        # [B, Hv, Dv]
        state = state + k[:, i, ..., None] * delta[..., None, :]               # [B, Hv, Dk, Dv]
        outs.append((state * q[:, i, ..., None]).sum(-2))                      # [B, Hv, Dv]
    return torch.stack(outs, dim=1).to(v.dtype), state


def gdn_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The same rule as :func:`gdn_recurrence` from a zero state, evaluated chunk-parallel (64 tokens at a
    time) by transformers' pure-torch implementation: differentiable and a few hundred kernels per layer
    instead of ~10 per token, so it is what training runs when no fused kernel can do the backward.
    Shapes as :func:`gdn_recurrence`; returns ``out [B, T, Hv, Dv]`` in ``v.dtype``."""
    out, _ = _torch_chunk_rule()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    return out.to(v.dtype)


@functools.cache
def _torch_chunk_rule():
    """transformers' undecorated torch function (its decorator would pick flash-linear-attention when installed)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def gdn_in_proj_conv(
    x: Tensor, w_qkv: Tensor, w_z: Tensor, w_b: Tensor, w_a: Tensor,
    conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
    norm_w: Tensor | None = None, norm_eps: float = 0.0, norm_unit_offset: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`gdn_in_proj` of ``x [B, K]`` (with its optional norm prologue) followed by :func:`gdn_conv_step` on
    its q|k|v: returns ``(mixed [B, C], z, b, a)`` and shifts ``conv_state`` in place (the native op runs the conv
    in the projection's epilogue)."""
    qkv, z, b, a = gdn_in_proj(x, w_qkv, w_z, w_b, w_a, norm_w, norm_eps, norm_unit_offset)
    return gdn_conv_step(qkv, conv_state, conv_weight, conv_bias), z, b, a


def gdn_recurrent_step(
    mixed: Tensor, z: Tensor, b: Tensor, a: Tensor, recurrent_state: Tensor, A_log: Tensor, dt_bias: Tensor,
    norm_weight: Tensor, norm_eps: float, num_k_heads: int, head_k_dim: int, head_v_dim: int,
) -> Tensor:
    """The decode step after the conv: ``mixed [B, C]`` (q|k|v after conv + SiLU), ``z [B, Hv*Dv]``, ``b, a
    [B, Hv]``; updates ``recurrent_state [B, Hv, Dk, Dv]`` (fp32) IN PLACE and returns the gated-RMSNorm'ed
    core output ``[B, Hv*Dv]`` in ``mixed.dtype``, ready for ``out_proj``."""
    bsz = mixed.shape[0]
    key_dim = num_k_heads * head_k_dim
    q, k, v = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    q = q.view(bsz, 1, num_k_heads, head_k_dim)
    k = k.view(bsz, 1, num_k_heads, head_k_dim)
    v = v.view(bsz, 1, -1, head_v_dim)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    out, new_state = gdn_recurrence(q, k, v, g[:, None], beta[:, None], recurrent_state)
    recurrent_state.copy_(new_state)
    z = z.view(bsz, -1, head_v_dim)
    return gated_rms_norm(out[:, 0], z, norm_weight, norm_eps).reshape(bsz, -1)


def gdn_decode_step(
    qkv: Tensor, z: Tensor, b: Tensor, a: Tensor,
    conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None,
    recurrent_state: Tensor, A_log: Tensor, dt_bias: Tensor,
    norm_weight: Tensor, norm_eps: float, num_k_heads: int, head_k_dim: int, head_v_dim: int,
) -> Tensor:
    """One Gated-DeltaNet token per row, after the input projections: :func:`gdn_conv_step` then
    :func:`gdn_recurrent_step`; updates both states IN PLACE.

    Args:
        qkv: ``[B, C]`` projected q|k|v (before the conv); z: ``[B, Hv*Dv]``; b, a: ``[B, Hv]``.
        conv_state: ``[B, C, W]`` the last W conv inputs, shifted left and appended to in place.
        conv_weight: ``[C, W]`` depthwise taps; conv_bias: ``[C]`` or None.
        recurrent_state: ``[B, Hv, Dk, Dv]`` fp32, replaced in place by the updated state.
        A_log, dt_bias: ``[Hv]``; norm_weight: ``[Dv]`` gated-RMSNorm weight; norm_eps its epsilon.
    Returns:
        ``[B, Hv*Dv]`` in ``qkv.dtype``: gated-RMSNorm(core output, z), ready for ``out_proj``.
    """
    mixed = gdn_conv_step(qkv, conv_state, conv_weight, conv_bias)
    return gdn_recurrent_step(mixed, z, b, a, recurrent_state, A_log, dt_bias, norm_weight, norm_eps, num_k_heads,
                              head_k_dim, head_v_dim)
