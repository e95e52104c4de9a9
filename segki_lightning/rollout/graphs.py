"""CUDA-graph capture shared by the decode step and the prefill buckets: warm-up on a side stream, then one
capture, and the parameter addresses a graph was captured on (a graph reads the Parameters' storage in place,
so a change of storage means a recapture)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def parameter_ptrs(model: nn.Module) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n."""
    b = 1
    while b < n:
        b *= 2
    return b


def capture(fn: Callable[[], object], warmups: int, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` run ``warmups`` times on a side stream (lazy inits, autotuning, library handles, the allocator),
    then captured; returns the graph and the captured call's output (its tensors are the graph's outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    torch.cuda.synchronize()
    return graph, out
