"""Pieces of a decoder layer made of the other references: the spec of the native ops that fuse them."""
from __future__ import annotations

from torch import Tensor

from .linear import gated_mlp_front, linear
from .norm import add_rms_norm


def mlp_block(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, unit_offset: bool, w_gate: Tensor,
              w_up: Tensor, w_down: Tensor, barrier: Tensor | None = None) -> Tensor:
    """The MLP half of a pre-norm decoder layer after its mixer: ``r = residual + x``, then
    ``r + down(silu(gate(n)) * up(n))`` with ``n = RMSNorm(r)``. ``x, residual [..., H]``, ``w_gate, w_up [I, H]``,
    ``w_down [H, I]`` -> ``[..., H]``. ``barrier`` (two int32 on the device) is the native kernel's grid-barrier
    state; unused here."""
    normed, new_residual = add_rms_norm(x, residual, norm_weight, eps, unit_offset)
    return linear(gated_mlp_front(normed, w_gate, w_up), w_down, None, new_residual)
