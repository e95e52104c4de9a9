"""The Gated DeltaNet's causal depthwise conv, one token per row: shared by the GDN decode step and the input
projection that runs it in its epilogue (``gdn_in_proj_conv``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gdn_conv_step(qkv: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Tensor | None) -> Tensor:
    """One causal depthwise-conv token per row: ``qkv [B, C]`` appended to ``conv_state [B, C, W]`` (shifted
    left IN PLACE), returns ``SiLU(window . conv_weight [C, W] + conv_bias)`` as ``[B, C]`` in ``qkv.dtype``."""
    window = torch.cat([conv_state[:, :, 1:], qkv[:, :, None].to(conv_state.dtype)], dim=-1)   # [B, C, W]
    conv_state.copy_(window)
    mixed = (window.float() * conv_weight.float()).sum(-1)                                      # [B, C]
    if conv_bias is not None:
        mixed = mixed + conv_bias.float()
    return F.silu(mixed).to(qkv.dtype)
