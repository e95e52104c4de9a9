"""Static hybrid cache: KV buffers for full-attention layers, conv + recurrent state for Gated-DeltaNet
layers, allocated once for (max_batch_size, max_seq_len) with per-row lengths on the device.

It speaks the parts of transformers' cache interface the decode forward uses (``update`` for attention
layers; ``get_conv_state`` / ``get_recurrent_state`` / ``update_recurrent_state`` / ``is_recording_past``
for Gated-DeltaNet layers), and ``segki_attention_state`` / ``segki_gdn_states`` for the fused steps. Row b
holds its tokens at positions ``[0, lengths[b])``; a decode step writes the new token at ``lengths[b]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..ops.reference import write_token


@dataclass
class LayerLayout:
    kind: str            # "attention" | "gdn"
    shape_a: tuple       # attention: (Hkv, D);  gdn: (C, W) conv state
    shape_b: tuple = ()  # gdn: (Hv, Dk, Dv) recurrent state


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list: the first ModuleList whose entries hold a token mixer."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and all(
                hasattr(layer, "self_attn") or hasattr(layer, "linear_attn") for layer in m):
            return m
    raise ValueError("no decoder layer list found (layers with `self_attn` or `linear_attn`)")


def layer_layouts(model: nn.Module) -> list[LayerLayout]:
    """Per layer index, what the cache must hold, read off the modules' structure."""
    layouts = []
    for layer in decoder_layers(model):
        if hasattr(layer, "linear_attn"):
            g = layer.linear_attn
            layouts.append(LayerLayout("gdn", (g.conv1d.in_channels, g.conv1d.kernel_size[0]),
                                       (g.num_v_heads, g.head_k_dim, g.head_v_dim)))
        else:
            a = layer.self_attn
            hkv = a.k_proj.out_features // a.head_dim
            layouts.append(LayerLayout("attention", (hkv, a.head_dim)))
    return layouts


class StaticHybridCache:
    """Buffers for ``max_batch`` rows; :meth:`rows` gives a view over the first n rows (a bucket)."""

    def __init__(self, layouts: list[LayerLayout], max_batch: int, max_seq: int, dtype: torch.dtype,
                 device: torch.device, _views: dict | None = None):
        self.layouts, self.max_batch, self.max_seq = layouts, max_batch, max_seq
        if _views is not None:
            self.__dict__.update(_views)
            return
        self.keys, self.values, self.conv, self.recurrent = {}, {}, {}, {}
        for i, lay in enumerate(layouts):
            if lay.kind == "attention":
                hkv, d = lay.shape_a
                self.keys[i] = torch.zeros(max_batch, hkv, max_seq, d, dtype=dtype, device=device)
                self.values[i] = torch.zeros_like(self.keys[i])
            else:
                self.conv[i] = torch.zeros(max_batch, *lay.shape_a, dtype=dtype, device=device)
                self.recurrent[i] = torch.zeros(max_batch, *lay.shape_b, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(max_batch, dtype=torch.long, device=device)     # tokens in cache
        self.attn_lengths = torch.zeros(max_batch, dtype=torch.int32, device=device)  # + the current token

    def rows(self, n: int) -> "StaticHybridCache":
        """A cache over rows ``[0, n)`` sharing this one's storage."""
        views = {k: {i: t[:n] for i, t in getattr(self, k).items()} for k in ("keys", "values", "conv", "recurrent")}
        views.update(lengths=self.lengths[:n], attn_lengths=self.attn_lengths[:n])
        return StaticHybridCache(self.layouts, n, self.max_seq, None, None, _views=views)

    def nbytes(self) -> int:
        ts = [*self.keys.values(), *self.values.values(), *self.conv.values(), *self.recurrent.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    # ---- filling from a prefill (a transformers DynamicCache of a left-padded prompt batch)
    def load_prompts(self, hf_cache, src: Tensor, rows: Tensor, pads: Tensor, lengths: Tensor) -> None:
        """Row ``rows[k]`` gets prompt ``src[k]`` of the prefill batch (``pads[k]`` left-padding positions,
        ``lengths[k]`` tokens) at positions ``[0, lengths[k])``; all ``[N]`` int64 on the device, one copy
        per buffer. Positions past a row's length are left undefined: a decode step writes the row's next
        token at its length and reads below it only."""
        for i, lay in enumerate(self.layouts):
            if lay.kind == "attention":
                k, v = hf_cache.layers[i].keys, hf_cache.layers[i].values                   # [R, Hkv, W, D]
                w = min(k.shape[2], self.max_seq)
                at = (torch.arange(w, device=src.device)[None] + pads[:, None]).clamp_max(k.shape[2] - 1)
                at = at[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])          # [N, Hkv, w, D]
                self.keys[i][:, :, :w].index_copy_(0, rows, k.index_select(0, src).gather(2, at))
                self.values[i][:, :, :w].index_copy_(0, rows, v.index_select(0, src).gather(2, at))
            else:
                self.conv[i].index_copy_(0, rows, hf_cache.get_conv_state(i).index_select(0, src))
                rec = hf_cache.get_recurrent_state(i).index_select(0, src)
                self.recurrent[i].index_copy_(0, rows, rec.to(self.recurrent[i].dtype))
        self.lengths.index_copy_(0, rows, lengths)

    # ---- transformers cache interface (decode: one token per row)
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """Write ``[B, Hkv, 1, D]`` at each row's length; return the full ``[B, Hkv, S, D]`` buffers."""
        k, v = self.keys[layer_idx], self.values[layer_idx]
        write_token(k, v, key_states[:, :, 0], value_states[:, :, 0], self.lengths)
        return k, v

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.conv[layer_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor:
        return self.recurrent[layer_idx]

    def update_recurrent_state(self, state: Tensor, layer_idx: int, *args, **kwargs) -> Tensor:
        self.recurrent[layer_idx].copy_(state)
        return self.recurrent[layer_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def segki_attention_state(self, layer_idx: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For the fused attention decode: key and value buffers ``[B, Hkv, S, D]``, where this step's token
        goes (``lengths [B]`` int64) and how many tokens attention reads (``attn_lengths [B]`` int32)."""
        return self.keys[layer_idx], self.values[layer_idx], self.lengths, self.attn_lengths

    def segki_gdn_states(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        return self.conv[layer_idx], self.recurrent[layer_idx]
