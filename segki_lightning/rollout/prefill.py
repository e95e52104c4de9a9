"""Prompt prefill through the model's own forward, padded to fixed (rows, width) buckets so that each bucket
can be captured once as a CUDA graph and replayed.

A prefill of a few short prompts is launch-bound: on the H200 one 128-token prompt of Qwen3.5-0.8B took
41-47 ms eagerly (Python, kernel launches and flash-linear-attention's launchers over 24 layers), although
its arithmetic takes well under a millisecond. Buckets make the shapes static: groups are left-padded to a
bucketed width (16, 24, 32, 48, 64, ...) and to a power-of-two number of rows (all-pad rows), and the masks
are built from the padding as tensors, without the host reads transformers' mask helpers make. The eager path
pads the same way, so a graph replay computes what the eager forward computes.

Padding leaves each prompt's result what it is alone: attention masks padded keys (a padded query sees
itself only, so no softmax row is empty), Gated DeltaNet zeroes padded inputs (a zero input leaves its state
at zero), and positions count real tokens only.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .batch import left_pad
from .graphs import capture, parameter_ptrs, pow2_bucket

log = logging.getLogger("segki_lightning")
MAX_GRAPH_TOKENS = 8192   # rows x width above this run eagerly: launches no longer dominate, and a graph's
                          # memory pool (kept between rollouts) would grow with the activations
MASKED_KINDS = {"full_attention", "linear_attention"}   # layer types whose masks are built here


def width_bucket(width: int) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, ... (2^k and 1.5 x 2^k) holding ``width``: at most 50 %
    padding, and few distinct graphs."""
    b = 16
    while True:
        for w in (b, b * 3 // 2):
            if w >= width:
                return w
        b *= 2


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``mask [R, W]`` (1 on real tokens) -> ``[R, 1, W, W]``: 0 where query i may see key j (causal, real
    keys; a padded query sees itself), the dtype's minimum elsewhere. Additive, as eager and SDPA take it."""
    w = mask.shape[1]
    pos = torch.arange(w, device=mask.device)
    causal = pos[None, :] <= pos[:, None]                                       # [W(q), W(k)]
    see = (causal[None] & mask[:, None, :].bool()) | (pos[None, :] == pos[:, None])[None]   # [R, W, W]
    out = torch.zeros(see.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~see, torch.finfo(dtype).min)[:, None]


def text_config(model: nn.Module):
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def bucketable(model: nn.Module) -> bool:
    """Whether this module builds the model's prefill masks: SDPA or eager attention (which take an additive
    4D mask) and only full-attention and Gated-DeltaNet layers (no sliding windows)."""
    cfg = text_config(model)
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    attn = getattr(cfg, "_attn_implementation", None)
    return attn in ("sdpa", "eager") and types <= MASKED_KINDS and window is None


@dataclass
class Prefilled:
    """One group's forward: ``logits [R, V]`` at each prompt's last token, the transformers cache of the
    padded batch, and each prompt's left padding within it."""
    logits: Tensor
    cache: object
    pads: list[int]


class Prefiller:
    """Runs prefill groups bucketed (and as CUDA graphs when ``graphs``), or at their own shapes where the
    model's masks are not built here."""

    def __init__(self, model: nn.Module, pad: int, graphs: bool):
        self.model, self.pad = model, pad
        self.bucketed = bucketable(model)
        self.graphs = graphs and self.bucketed
        self.linear = "linear_attention" in set(getattr(text_config(model), "layer_types", None) or [])
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._held: dict[tuple[int, int], tuple] = {}   # (rows, width) -> (graph, ptrs, inputs, output)
        self._pool = None
        self.captures = 0
        self.capture_s = 0.0

    def shape(self, prompts: list[list[int]]) -> tuple[int, int]:
        longest = max(len(p) for p in prompts)
        if not self.bucketed:
            return len(prompts), longest
        return pow2_bucket(len(prompts)), width_bucket(longest)

    def prepare(self, groups: list[list[list[int]]], ptrs: tuple[int, ...] | None = None) -> None:
        """Capture the graphs these groups need (before timing starts, as the decode graph is); ``ptrs``: the
        parameters' addresses when the caller has them."""
        if not self.graphs:
            return
        ptrs = self._ptrs(ptrs)
        for shape in sorted({self.shape(g) for g in groups}):
            if shape[0] * shape[1] > MAX_GRAPH_TOKENS:
                continue
            try:
                self._ensure(shape, ptrs)
            except Exception as exc:   # a forward that cannot be captured still prefills, eagerly: announce it
                log.warning("segki: the prefill forward could not be captured as a CUDA graph (%s); prefilling "
                            "eagerly from now on", exc)
                self.graphs = False
                self.free()
                return

    def __call__(self, prompts: list[list[int]], ptrs: tuple[int, ...] | None = None) -> Prefilled:
        rows, width = self.shape(prompts)
        ids, mask = left_pad(prompts, self.pad)                                   # [g, P] CPU
        pads = [width - len(p) for p in prompts]
        ids = torch.nn.functional.pad(ids, (width - ids.shape[1], 0, 0, rows - len(prompts)), value=self.pad)
        mask = torch.nn.functional.pad(mask, (width - mask.shape[1], 0, 0, rows - len(prompts)))   # [R, W]
        held = self._held.get((rows, width)) if self.graphs and rows * width <= MAX_GRAPH_TOKENS else None
        if held is None or held[1] != self._ptrs(ptrs):
            out = self._forward(ids.to(self.device), mask.to(self.device))
        else:
            graph, _, (s_ids, s_mask), out = held
            s_ids.copy_(ids)
            s_mask.copy_(mask)
            graph.replay()
        return Prefilled(out.logits[:, -1], out.cache, pads)

    def free(self) -> None:
        self._held.clear()
        self._pool = None

    # ------------------------------------------------------------------------------------------ internals
    def _ptrs(self, given: tuple[int, ...] | None) -> tuple[int, ...]:
        """The parameters' addresses: the caller's when it read them for this call, else read here."""
        return parameter_ptrs(self.model) if given is None else given

    def _forward(self, ids: Tensor, mask: Tensor):
        """The model's forward over a padded group ``ids/mask [R, W]``; keeps only the last position's logits."""
        positions = (mask.cumsum(1) - 1).clamp_min(0)                                   # [R, W]
        if self.bucketed:
            full = additive_mask(mask, self.dtype)                                       # [R, 1, W, W]
            attn = {"full_attention": full, "linear_attention": mask} if self.linear else full
        else:
            attn = mask if mask.shape[0] > 1 else None
        return self.model(input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
                          logits_to_keep=1)

    def _ensure(self, shape: tuple[int, int], ptrs: tuple[int, ...]) -> None:
        held = self._held.get(shape)
        if held is not None and held[1] == ptrs:
            return
        t0 = time.perf_counter()
        ids = torch.full(shape, self.pad, dtype=torch.long, device=self.device)
        mask = torch.ones(shape, dtype=torch.long, device=self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()   # shared: each replay's output is read before the next
        graph, out = capture(lambda: self._forward(ids, mask), warmups=1, pool=self._pool)
        self._held[shape] = (graph, ptrs, (ids, mask), out)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        log.info("segki: captured prefill graph for %d rows x %d tokens in %.2f s", *shape, time.perf_counter() - t0)
