"""The interpreter's garbage-collection pauses inside each training step, timed.

A training pass issues thousands of kernels from Python and, at small micro-batches, the GPU waits on that issue: a
collection of the oldest generation (it walks every tracked object: the model's modules, the tokenizer, the
dataset, the logged completions) lands in the step's time whole. ``time/gc_s`` (the pauses' sum) and
``time/gc_full`` (how many walked the oldest generation) say how much of a step that was, so a slow step can be
told from a slow kernel."""
from __future__ import annotations

import gc
import time


class GcClock:
    """Sums the pauses of every collection between :meth:`start` and :meth:`stop`; :meth:`take` reads and resets."""

    def __init__(self) -> None:
        self.seconds, self.full = 0.0, 0
        self._began: float | None = None
        self._frozen = False

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self.full += info.get("generation") == 2
            self._began = None

    def start(self, freeze: bool = False) -> None:
        """Time collections from now on; ``freeze``: first collect, then move every object alive now (the model,
        the tokenizer, the dataset, the imported libraries) out of the collector's walks (:func:`gc.freeze`), so a
        full collection walks only what training made since. Reference counting still frees them."""
        if self._on_collect not in gc.callbacks:
            gc.callbacks.append(self._on_collect)
        if freeze and not self._frozen:
            gc.collect()
            gc.freeze()
            self._frozen = True

    def stop(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)
        if self._frozen:
            gc.unfreeze()
            self._frozen = False

    def take(self) -> tuple[float, int]:
        """The pauses' seconds and the full collections since the last call."""
        got = self.seconds, self.full
        self.seconds, self.full = 0.0, 0
        return got
