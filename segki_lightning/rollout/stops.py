"""Early stops of ``RolloutEngine.generate``: every CHECK_EVERY decode steps the engine copies each row's last
``window`` completion tokens to the host without waiting, and hands the running rows' tails to a check while the
next CHECK_EVERY steps decode (the host's tokenizer never stalls the GPU); rows it names finish after that stretch,
and the loop ends once every row has. The exact cut (which token completes the stop string) is the caller's, on
the finished batch; the tokens a row generates past its stop before it finishes are the ones it would generate
anyway (each row's draws depend on its own seed and position only)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .host import HostCopy

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


class Tails:
    """Rows ``[0, n)``'s finished flags and last ``window`` completion tokens (before index ``offset``), copied to
    the host behind the work queued so far (:class:`.host.HostCopy`) and checked later."""

    def __init__(self, st, n: int, window: int):
        cols = st.offset[:n, None] - window + torch.arange(window, device=st.offset.device)   # [N, W]
        self.copy = HostCopy(st.finished[:n], st.out_tokens[:n].gather(1, cols.clamp_min(0)), cols >= 0)

    def stopped(self, stop: StopCheck) -> tuple[list[int], bool]:
        """The running rows ``stop`` names, and whether every row is then finished."""
        finished, tails, keep = self.copy.get()                                  # [N], [N, W], [N, W]
        running = (~finished).nonzero()[:, 0].tolist()
        hit = list(stop([tails[r][keep[r]].tolist() for r in running])) if running else []
        rows = [r for r, h in zip(running, hit) if h]
        return rows, len(rows) == len(running)
