"""Early stops of ``RolloutEngine.generate``: every CHECK_EVERY decode steps the engine hands a check the last
``window`` completion tokens of each running row; rows it names finish there, and the decode loop ends once every
row has finished. The exact cut (which token completes the stop string) is the caller's, on the finished batch;
the few tokens a row generates past its stop before the check sees it are the ones it would generate anyway
(each row's draws depend on its own seed and position only)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

CHECK_TOKENS = 16   # decode steps between two checks: the engine's CHECK_EVERY (the first check also sees the
                    # token sampled from the prefill: CHECK_TOKENS + 1 new tokens)


class StopCheck(Protocol):
    """Called with each running row's last ``window`` completion tokens; returns per row whether to finish it."""

    window: int

    def __call__(self, tails: list[list[int]]) -> Sequence[bool]: ...


class StopStrings:
    """Stops a row once its text holds one of ``stops`` (transformers' ``stop_strings``). The window covers the
    tokens new since the last check (one more at the first) and enough before them to hold the longest stop string (a character takes at
    most 4 byte-level tokens); a window's text is a piece of the row's text, so a row never stops where its whole
    text would not."""

    def __init__(self, tokenizer, stops: Sequence[str], new_tokens: int = CHECK_TOKENS):
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.window = new_tokens + 1 + 4 * max(map(len, self.stops))

    def __call__(self, tails: list[list[int]]) -> list[bool]:
        texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
        return [any(s in t for s in self.stops) for t in texts]
