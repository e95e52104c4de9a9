"""A prompt DataLoader whose place inside an epoch is part of Lightning's checkpoint, and which can hand out each
batch several times in a row (one rollout serves several optimizer steps, each a ``training_step``).

Lightning restarts a plain DataLoader from its first batch when it resumes mid-epoch, so a resumed RL run
would see other prompts than the uninterrupted one. This loader records, per epoch, the state of its shuffle
generator at the epoch's start and how many batches it has handed out; on resume it rewinds the generator
and skips those batches, so the run continues with exactly the prompts it would have had. A checkpoint taken
after an epoch's last batch records the next epoch's start instead (nothing to skip), so a resume there neither
replays an empty epoch nor shifts the epoch count. An epoch never pulls past its last batch (a sampler asked for
one more draws its next permutation: the uninterrupted run, whose loop stops at the length, never does)."""
from __future__ import annotations

import itertools
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader


class ResumableLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (Lightning saves and restores both).

    Args:
        repeat: hand out every batch this many times in a row (the optimizer steps of one rollout; only the
            first of them rolls out, the others train on the same rollout -- as TRL's repeat sampler does).
        *args, **kwargs: as for ``DataLoader``.
    """

    def __init__(self, *args: Any, repeat: int = 1, **kwargs: Any):
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        super().__init__(*args, **kwargs)
        self.repeat = repeat
        self._epoch_start: torch.Tensor | None = None   # shuffle-generator state when the epoch began
        self._yielded = 0                                # batches handed out in this epoch (repeats counted)
        self._resume: dict[str, Any] | None = None

    def __len__(self) -> int:
        return super().__len__() * self.repeat

    def __iter__(self) -> Iterator:
        resume, self._resume = self._resume, None
        if self.generator is not None:
            if resume and resume.get("epoch_start") is not None:
                self.generator.set_state(resume["epoch_start"])
            self._epoch_start = self.generator.get_state().clone()
        batches = itertools.islice(super().__iter__(), super().__len__())   # never past the epoch's last batch
        skip = resume["yielded"] if resume else 0
        self._yielded = 0
        for batch in batches:
            for _ in range(self.repeat):
                self._yielded += 1
                if self._yielded > skip:
                    yield batch

    def unyield(self) -> None:
        """Count the last batch handed out as not handed out (its step failed before training on it): a state
        taken now resumes with that batch."""
        if self._yielded < 1:
            raise RuntimeError("no batch has been handed out in this epoch")
        self._yielded -= 1

    def state_dict(self) -> dict[str, Any]:
        if self._yielded >= len(self) and self.generator is not None:   # the epoch is over: the next one's start
            return {"yielded": 0, "epoch_start": self.generator.get_state().clone()}
        return {"yielded": self._yielded, "epoch_start": self._epoch_start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resume = dict(state_dict)
