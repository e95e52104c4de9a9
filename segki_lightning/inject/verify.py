"""Verification of replacements: the relative error and tolerance every check uses, and the decode probe
of the ``attention`` segment -- one token step of the fused path against the module's original forward on
the same small random cache. The structure match cannot see the RoPE form, the scaling or what the gate
does; this probe does, so a model that differs there keeps its own forward."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops.reference import valid_mask, write_token
from .forwards import AttentionSpec

_ROWS, _SLOTS = 2, 8


def relative_error(got: Tensor, want: Tensor) -> float:
    """``||got - want|| / ||want||`` in fp32."""
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def tolerance(dtype: torch.dtype) -> float:
    """Largest relative error a verified replacement may show: fp32 reordering, or one half-precision rounding."""
    return 1e-4 if dtype == torch.float32 else 3e-2


class _ProbeCache:
    """Two rows of keys/values with the current token at ``positions``. It offers both the transformers
    ``update`` that the original forward calls and the ``segki_attention_state`` the fused path reads."""

    def __init__(self, keys: Tensor, values: Tensor, positions: Tensor):
        self.keys, self.values, self.positions = keys, values, positions

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        write_token(self.keys, self.values, key_states[:, :, 0], value_states[:, :, 0], self.positions)
        return self.keys, self.values

    def segki_attention_state(self, layer_idx: int):
        return self.keys, self.values, self.positions, (self.positions + 1).int()


def attention_decode_error(m: nn.Module, s: AttentionSpec, rope_tables: tuple[Tensor, Tensor]) -> float | None:
    """Largest relative error (output, written keys, written values) of the installed forward's decode
    path against ``s.original_forward``, or None when within tolerance. ``rope_tables``: cos/sin
    ``[*, T, R]`` as the model passed them to this module (one position is reused for both rows)."""
    w = m.o_proj.weight
    dev, dtype = w.device, w.dtype
    hkv = m.k_proj.out_features // s.head_dim
    gen = torch.Generator(device=dev).manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(dtype)

    x = rand(_ROWS, 1, m.q_proj.in_features)
    keys, values = rand(_ROWS, hkv, _SLOTS, s.head_dim), rand(_ROWS, hkv, _SLOTS, s.head_dim)
    positions = torch.tensor([2, _SLOTS - 1], device=dev)
    tables = tuple(t[:1, -1:].expand(_ROWS, 1, t.shape[-1]).contiguous() for t in rope_tables)
    mask = valid_mask(positions + 1, _SLOTS, dtype)                                           # [B, 1, 1, S]
    cache_arg = "cache" if "cache" in s.signature.parameters else "past_key_values"
    ours = _ProbeCache(keys.clone(), values.clone(), positions)
    theirs = _ProbeCache(keys.clone(), values.clone(), positions)
    with torch.no_grad():
        got = m(x, position_embeddings=tables, attention_mask=None, **{cache_arg: ours})[0]
        want = s.original_forward(x, position_embeddings=tables, attention_mask=mask, **{cache_arg: theirs})[0]
    err = max(relative_error(got, want), relative_error(ours.keys, theirs.keys),
              relative_error(ours.values, theirs.values))
    return None if err < tolerance(dtype) else err
