"""Decode attention as a transformers attention implementation (``"segki_decode"``): the model's own
attention code projects, normalises, applies RoPE and writes the cache; this function then reads only each
row's valid prefix through :func:`segki_lightning.ops.decode_attention`. No mask is built for it."""
from __future__ import annotations

from contextlib import contextmanager

from torch import Tensor, nn

from .. import ops

NAME = "segki_decode"


def segki_decode_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                           scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """``query [B, Hq, 1, D]``, ``key/value [B, Hkv, S, D]`` (the static cache) -> ``([B, 1, Hq, D], None)``.
    Valid lengths come in as ``segki_lengths [B]`` (tokens in cache including the current one)."""
    lengths = kwargs["segki_lengths"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ops.decode_attention(query[:, :, 0].contiguous(), key, value, lengths, scale)   # [B, Hq, D]
    return out[:, None], None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segki_decode_attention)


@contextmanager
def attention_implementation(model: nn.Module, name: str | None):
    """Temporarily switch the attention implementation every submodule config reads (None: keep)."""
    if name is None:
        yield
        return
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and hasattr(c, "_attn_implementation")}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]

