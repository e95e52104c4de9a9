"""SegKIRolloutMixin: ``self.rollout(prompts, sampling)`` for any LightningModule with a policy model."""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..rollout import RolloutBatch, RolloutEngine, SamplingConfig


def is_conversation(prompt) -> bool:
    """A list of ``{"role": ..., "content": ...}`` messages (TRL's conversational format)."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt)


def render_chat(tokenizer, messages, tools=None, **template_kwargs) -> str:
    """``messages`` through the tokenizer's chat template, ending with the assistant's generation prompt; ``tools``
    (functions) rendered as the template's tool schemas; ``template_kwargs`` (TRL's ``chat_template_kwargs``, e.g.
    ``enable_thinking=False``) passed to the template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat prompts need a tokenizer with a chat template (tokenizer.chat_template is empty): "
                         "set one, or pass prompts as strings")
    return tokenizer.apply_chat_template(list(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=True, **template_kwargs)


class SegKIRolloutMixin:
    """Adds :meth:`rollout`. Uses the :class:`SegKICallback`'s engine when the trainer has one, otherwise an
    eager engine on the plain forward (built on first use). Expects ``self.policy`` (the Hugging Face model)
    and, to accept strings, ``self.tokenizer``."""

    rollout_max_batch_size: int = 64
    rollout_max_seq_len: int = 2048

    def rollout(self, prompts: Sequence, sampling: SamplingConfig, stop=None) -> RolloutBatch:
        """Generate ``sampling.n`` completions per prompt from the current weights (eval mode, no grad); the
        module's training mode is restored afterwards. A prompt is a string, a conversation (list of
        ``{"role", "content"}`` messages, rendered with the chat template) or a list of token ids. ``stop``: the
        engine's early stop (:mod:`~segki_lightning.rollout.stops`)."""
        # generate() switches to eval/no-grad and back
        return self._on_engine(prompts, lambda engine, ids: engine.generate(ids, sampling, stop))

    def rollout_turns(self, prompts: Sequence, sampling: SamplingConfig, respond, max_turns: int) -> RolloutBatch:
        """Multi-turn :meth:`rollout`: :meth:`RolloutEngine.generate_turns` with ``respond`` between turns."""
        return self._on_engine(prompts, lambda engine, ids: engine.generate_turns(ids, sampling, respond, max_turns))

    def _on_engine(self, prompts: Sequence, call) -> RolloutBatch:
        """``call(engine, prompt ids)`` on the rollout engine, with the callback's full weights (FSDP: gathered
        once here) and its token count."""
        ids = [self._prompt_ids(p) for p in prompts]
        engine = self._rollout_engine()
        cb = self.__dict__.get("_segki_callback")
        with cb.full_weights() if cb is not None else contextlib.nullcontext():
            batch = call(engine, ids)
        if cb is not None:
            cb.record(batch.stats.tokens)
        return batch

    def _prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt: ids as given; a string tokenized without special tokens; a conversation (a list
        of ``{"role", "content"}`` messages, TRL's conversational format) rendered with the tokenizer's chat
        template and a generation prompt (and ``self.chat_template_kwargs`` where the module has them), then
        tokenized."""
        if isinstance(prompt, torch.Tensor):
            return prompt.tolist()
        if isinstance(prompt, str) or is_conversation(prompt):
            tok = getattr(self, "tokenizer", None)
            if tok is None:
                raise TypeError("string and chat prompts need self.tokenizer; pass token ids instead")
            if not isinstance(prompt, str):
                prompt = render_chat(tok, prompt, getattr(self, "chat_tools", None),
                                     **(getattr(self, "chat_template_kwargs", None) or {}))
            return tok(prompt, add_special_tokens=False)["input_ids"]
        return list(prompt)

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
