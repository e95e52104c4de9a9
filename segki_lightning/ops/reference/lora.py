"""LoRA paths of a projection group added to its base outputs: the reference of ``segki::lora_add``.

Shapes: ``x [..., K]``; member i: ``outs[i] [..., N_i]`` (x's dtype), ``a[i] [r_i, K]``, ``b[i] [N_i, r_i]`` (fp32 or
x's dtype), ``scales[i]`` a float. The roundings are peft's (``lora.Linear.forward``): x cast to the adapters'
dtype, each product in that dtype, the path scaled in it, the base output promoted to it for the add and the sum
rounded back to the output's dtype. What the op can finish after that, as the unfused ops would: for one member a
``residual [..., N_0]`` added (``out + residual`` in x's dtype), for two (gate, up) ``silu_mul`` of the two. With
``norm_w`` x is the input of the RMSNorm before the projections: the paths read ``rms_norm(x)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor

from .linear import silu_mul
from .norm import rms_norm


def lora_add(x: Tensor, outs: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], scales: Sequence[float],
             residual: Tensor | None = None, silu: bool = False, norm_w: Tensor | None = None,
             norm_eps: float = 0.0, norm_unit_offset: bool = False) -> list[Tensor]:
    """``outs[i] + scales[i] * (x @ a[i]^T) @ b[i]^T`` for each member, each in ``outs[i]``'s dtype; with
    ``residual`` (one member) that plus ``residual``; with ``silu`` (two members) ``[silu_mul(gate, up)]``."""
    if norm_w is not None:
        x = rms_norm(x, norm_w, norm_eps, norm_unit_offset)
    res = [(out + F.linear(F.linear(x.to(ai.dtype), ai), bi) * s).to(out.dtype)
           for out, ai, bi, s in zip(outs, a, b, scales)]
    if silu:
        return [silu_mul(*res)]
    return [res[0] + residual] if residual is not None else res
