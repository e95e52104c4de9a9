"""Rotary tables for the decode step: the cos/sin of every cache position, computed once by the model's own
rotary module, so a captured decode step gathers one row per sequence instead of recomputing them (Qwen3.5's
multi-section rotary is ~12 small kernels per step, a plain one ~7; the gather is 2).

Only for rotary modules whose frequencies do not depend on the sequence (not "dynamic" or "longrope"), and
only for text positions (every section of a multi-section rotary the same), which is what the decode step
passes: the values are then exactly those the module computes.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

SEQUENCE_DEPENDENT = ("dynamic", "longrope")


def rotary_module(model: nn.Module) -> nn.Module | None:
    """The decoder's shared rotary module when a table can stand in for it, else None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    rotary = getattr(decoder, "rotary_emb", None)
    kind = getattr(rotary, "rope_type", None)
    return rotary if isinstance(kind, str) and kind not in SEQUENCE_DEPENDENT else None


class RopeTable:
    """cos/sin ``[S, D]`` of positions ``0..max_seq-1``, in ``dtype``, from ``rotary`` itself."""

    @torch.no_grad()
    def __init__(self, rotary: nn.Module, max_seq: int, dtype: torch.dtype, device: torch.device):
        self.rotary = rotary
        positions = torch.arange(max_seq, device=device)[None]                      # [1, S]
        cos, sin = rotary(torch.empty(0, dtype=dtype, device=device), positions)    # [1, S, D] each
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()               # [S, D]

    def lookup(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """The rotary module's forward for text positions: ``position_ids`` ``[B, T]``, or ``[sections, B, T]``
        with equal sections. Returns cos, sin ``[B, T, D]``."""
        pos = position_ids[0] if position_ids.dim() == 3 else position_ids          # [B, T]
        return self.cos[pos], self.sin[pos]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The rotary module answers from the table inside the block (the decode step, and its capture)."""
        self.rotary.forward = self.lookup
        try:
            yield
        finally:
            del self.rotary.forward
