"""RMSNorm family. Two weight forms exist in Hugging Face models and both are kept bit-compatible:

- ``unit_offset=False`` (Llama, Qwen3): ``w * to_dtype(x * rsqrt(mean(x^2) + eps))``
- ``unit_offset=True`` (Qwen3.5, Gemma): ``to_dtype(x * rsqrt(mean(x^2) + eps) * (1 + w))``; the ``1 + w``
  is computed from the live parameter on every call.
Statistics are always fp32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _normalize(x: Tensor, eps: float) -> Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor:
    """``x [..., H]``, ``weight [H]`` -> ``[..., H]``."""
    normed = _normalize(x, eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, unit_offset: bool
) -> tuple[Tensor, Tensor]:
    """Residual add then RMSNorm: ``x, residual [..., H]`` -> ``(normed [..., H], new_residual [..., H])``
    with ``new_residual = residual + x`` (in the activations' dtype, as the unfused model adds)."""
    new_residual = residual + x
    return rms_norm(new_residual, weight, eps, unit_offset), new_residual


def sum_segments(sums: Tensor) -> Tensor:
    """Segments' fp32 sums ``[S, ...]`` added in order from the first, as the native kernels add them (the skinny
    product's sum kernel, add_rms_norm_sums): ``[...]`` fp32."""
    total = sums[0]
    for part in sums[1:]:
        total = total + part
    return total


def add_rms_norm_sums(
    sums: Tensor, residual: Tensor, weight: Tensor, eps: float, unit_offset: bool
) -> tuple[Tensor, Tensor]:
    """:func:`add_rms_norm` of x given as fp32 sums ``[S, ..., H]`` (a projection's segments of K): added in order
    from the first, then rounded to the residual's dtype, as the projection's own epilogue would."""
    return add_rms_norm(sum_segments(sums).to(residual.dtype), residual, weight, eps, unit_offset)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gated-DeltaNet output norm: ``to_dtype(w * to_dtype(rmsnorm(x)) * silu(z))``; ``x, z [..., D]``,
    ``weight [D]`` -> ``[..., D]``."""
    normed = weight * _normalize(x, eps).to(x.dtype)
    return (normed * F.silu(z.float())).to(x.dtype)
