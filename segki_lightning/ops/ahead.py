"""L2 warm-up one op ahead inside a decode step.

At one row a decode step is a chain of ~8 small kernels per layer, each streaming 4-17 MB of weights (0.8B) and
paying its own ramp and tail, during which DRAM idles. Under :func:`warm_ahead` every weighted op of the step (the
projections with their weights, the GDN recurrence with its state) is an entry: the schedule keeps the entries of
the previous pass through the step, and when entry k is about to launch it forks a side branch off the current
stream that asks L2 for entry k+1's first bytes (``segki::l2_prefetch``), so the op after reads them from L2
rather than DRAM. Inside a CUDA-graph capture the branch becomes parallel nodes that depend on the op before
entry k; the branch joins the stream when the step ends. A prefetch writes nothing, so no result changes;
a pass whose entries differ from the previous pass's warms nothing where they differ.

``SEGKI_L2_AHEAD`` sets the MiB warmed per entry (0: off); the engine reads it when it is built.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from .extension import has_native

MIB = 2**20
DEFAULT_MIB = 0   # off until measured


def ahead_bytes() -> int:
    """Bytes warmed per entry: ``SEGKI_L2_AHEAD`` MiB (checked with the other switches), else the default."""
    raw = os.environ.get("SEGKI_L2_AHEAD")
    return (int(raw) if raw is not None and raw.isdigit() else DEFAULT_MIB) * MIB


class Ahead:
    """The warm-up schedule of one decode step (one per captured batch size: the entries differ by rows)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.last: list[tuple[Tensor, ...]] = []      # entries of the previous pass, in launch order
        self.entries: list[tuple[Tensor, ...]] = []   # entries of this pass so far
        self.side: torch.cuda.Stream | None = None
        self.forked = False
        self.issued = 0                               # prefetch launches so far (tests and logs read it)

    def before(self, tensors: tuple[Tensor, ...]) -> None:
        """Entry ``k`` (``tensors``) is about to launch: warm what entry ``k + 1`` read in the previous pass."""
        k = len(self.entries)
        self.entries.append(tensors)
        if k + 1 < len(self.last) and _same(self.last[k], tensors):
            self._warm(self.last[k + 1])

    def _warm(self, tensors: tuple[Tensor, ...]) -> None:
        budget = self.max_bytes
        for t in tensors:
            if budget < 16 or not (t.is_cuda and t.is_contiguous() and has_native("l2_prefetch")):
                continue
            current = torch.cuda.current_stream(t.device)
            if self.side is None:
                self.side = torch.cuda.Stream(t.device)
            self.side.wait_stream(current)          # after the op before entry k: beside entry k
            with torch.cuda.stream(self.side):
                torch.ops.segki.l2_prefetch(t, budget)
            self.forked = True
            self.issued += 1
            budget -= t.numel() * t.element_size()

    def finish(self) -> None:
        """End of a pass: join the side branch, keep this pass's entries for the next."""
        if self.forked:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)
            self.forked = False
        self.last, self.entries = self.entries, []


def _same(a: tuple[Tensor, ...], b: tuple[Tensor, ...]) -> bool:
    return len(a) == len(b) and all(x.data_ptr() == y.data_ptr() and x.shape == y.shape for x, y in zip(a, b))


_active: Ahead | None = None


@contextlib.contextmanager
def warm_ahead(schedule: Ahead | None) -> Iterator[None]:
    """Run one pass of a decode step under ``schedule`` (None: nothing warmed)."""
    global _active
    outer, _active = _active, schedule
    try:
        yield
    finally:
        _active = outer
        if schedule is not None:
            schedule.finish()


def before(*tensors: Tensor | None) -> None:
    """Called by each weighted op of :mod:`segki_lightning.ops` with what it reads most of."""
    if _active is not None:
        _active.before(tuple(t for t in tensors if t is not None))
