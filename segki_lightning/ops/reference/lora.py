"""LoRA paths of a projection group added to its base outputs: the reference of ``segki::lora_add``.

Shapes: ``x [..., K]``; member i: ``outs[i] [..., N_i]`` (x's dtype), ``a[i] [r_i, K]``, ``b[i] [N_i, r_i]`` (fp32 or
x's dtype), ``scales[i]`` a float. The roundings are peft's (``lora.Linear.forward``): x cast to the adapters'
dtype, each product in that dtype, the path scaled in it, the base output promoted to it for the add and the sum
rounded back to the output's dtype.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor


def lora_add(x: Tensor, outs: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], scales: Sequence[float]
             ) -> list[Tensor]:
    """``outs[i] + scales[i] * (x @ a[i]^T) @ b[i]^T`` for each member, each in ``outs[i]``'s dtype."""
    return [(out + F.linear(F.linear(x.to(ai.dtype), ai), bi) * s).to(out.dtype)
            for out, ai, bi, s in zip(outs, a, b, scales)]
