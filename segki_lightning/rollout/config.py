"""What to generate: sampling settings, checked up front with messages that say what to change."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of one ``RolloutEngine.generate`` call.

    Attributes:
        max_new_tokens: completion length T (rows that hit EOS earlier are padded).
        temperature: ``0.0`` is greedy; otherwise logits are divided by it.
        top_k: keep the k most likely tokens; ``0`` = off.
        top_p: nucleus mass in ``(0, 1]``; ``1.0`` = off.
        min_p: drop tokens below ``min_p`` x the most likely one's probability (after temperature); ``0`` = off.
        repetition_penalty: transformers' penalty on every token already in the row (prompt and completion);
            ``1`` = off.
        n: samples per prompt (GRPO's group size); the prompt is prefilled once and its state replicated.
        seed: makes sampling reproducible (row r draws from the stream ``(seed, r)``).
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 means off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:   # (False for NaN too)
            raise ValueError(f"top_p must be in (0, 1] (1 means off), got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n (samples per prompt) must be >= 1, got {self.n}")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1) (0 means off), got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 (1 means off), got {self.repetition_penalty}")

    @property
    def processors(self) -> tuple[bool, bool]:
        """Which of :mod:`~segki_lightning.rollout.processors` the decode loop runs: (repetition penalty, min-p);
        each setting its own captured graph."""
        return self.repetition_penalty != 1.0, self.min_p > 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
