"""SegKIRolloutMixin: ``self.rollout(prompts, sampling)`` for any LightningModule with a policy model."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rollout import RolloutBatch, RolloutEngine, SamplingConfig


class SegKIRolloutMixin:
    """Adds :meth:`rollout`. Uses the :class:`SegKICallback`'s engine when the trainer has one, otherwise an
    eager engine on the plain forward (built on first use). Expects ``self.policy`` (the Hugging Face model)
    and, to accept strings, ``self.tokenizer``."""

    rollout_max_batch_size: int = 64
    rollout_max_seq_len: int = 2048

    def rollout(self, prompts: Sequence[str] | Sequence[Sequence[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Generate ``sampling.n`` completions per prompt from the current weights (eval mode, no grad); the
        module's training mode is restored afterwards."""
        ids = [self._prompt_ids(p) for p in prompts]
        engine = self._rollout_engine()
        batch = engine.generate(ids, sampling)  # generate() switches to eval/no-grad and back
        cb = self.__dict__.get("_segki_callback")
        if cb is not None:
            cb.record(batch.stats.tokens)
        return batch

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            tok = getattr(self, "tokenizer", None)
            if tok is None:
                raise TypeError("string prompts need self.tokenizer; pass token ids instead")
            return tok(prompt, add_special_tokens=False)["input_ids"]
        return prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)

    def _rollout_engine(self) -> RolloutEngine:
        cb = self.__dict__.get("_segki_callback")
        if cb is not None and cb.engine is not None:
            return cb.engine
        engine = self.__dict__.get("_segki_eager_engine")
        if engine is None:
            engine = RolloutEngine(self.policy, max_batch_size=self.rollout_max_batch_size,
                                   max_seq_len=self.rollout_max_seq_len, use_segki=False, graph_capture=False,
                                   eos_token_id=getattr(self, "eos_token_id", None),
                                   pad_token_id=getattr(self, "pad_token_id", None))
            self.__dict__["_segki_eager_engine"] = engine
        return engine
