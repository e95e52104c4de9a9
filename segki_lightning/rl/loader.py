"""A prompt DataLoader whose place inside an epoch is part of Lightning's checkpoint.

Lightning restarts a plain DataLoader from its first batch when it resumes mid-epoch, so a resumed RL run
would see other prompts than the uninterrupted one. This loader records, per epoch, the state of its shuffle
generator at the epoch's start and how many batches it has handed out; on resume it rewinds the generator
and skips those batches, so the run continues with exactly the prompts it would have had."""
from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader


class ResumableLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (Lightning saves and restores both)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._epoch_start: torch.Tensor | None = None   # shuffle-generator state when the epoch began
        self._yielded = 0                                # batches handed out in this epoch
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator:
        resume, self._resume = self._resume, None
        if self.generator is not None:
            if resume and resume.get("epoch_start") is not None:
                self.generator.set_state(resume["epoch_start"])
            self._epoch_start = self.generator.get_state().clone()
        it = super().__iter__()
        self._yielded = 0
        for _ in range(resume["yielded"] if resume else 0):
            next(it)
            self._yielded += 1
        for batch in it:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self._yielded, "epoch_start": self._epoch_start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)
