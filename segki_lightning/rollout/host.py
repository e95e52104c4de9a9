"""Reads of device state by the host that do not stall the decode loop: tensors copied to the host behind the work
queued so far (on CUDA a non-blocking copy into pinned memory, an event after it) and read later, while the steps
queued since still run. Reading waits for that copy only (on CPU the copy is made at once)."""
from __future__ import annotations

import torch
from torch import Tensor


class HostCopy:
    """Host copies of ``tensors`` as they will be once the work queued before this call has run."""

    def __init__(self, *tensors: Tensor):
        cuda = tensors[0].is_cuda
        self._values = [t.to("cpu", non_blocking=cuda, copy=True) for t in tensors]   # a copy on CPU too
        self._event = torch.cuda.Event() if cuda else None
        if self._event is not None:
            self._event.record()

    def get(self) -> list[Tensor]:
        """The copies (waiting for them to land where they have not yet)."""
        if self._event is not None:
            self._event.synchronize()
        return self._values
