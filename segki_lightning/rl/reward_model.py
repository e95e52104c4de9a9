"""A learned reward model as a reward function, as TRL's ``GRPOTrainer`` scores with one: a sequence-classification
model (``AutoModelForSequenceClassification``, one label) reads each prompt + completion -- a conversation rendered
whole by the reward model's own chat template, plain text concatenated -- tokenized without special tokens and
padded on the right, and its first logit is the reward. The model is frozen, in eval mode, outside the
LightningModule's parameters (not trained, not checkpointed); the module moves it to its own device when training
starts."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class RewardModel:
    """A reward function ``f(prompts, completions, **kwargs) -> list[float]`` backed by a sequence-classification
    model.

    Args:
        model: a Hub id or a local folder (loaded with ``num_labels=1``, no remote code), or a loaded
            ``PreTrainedModel``.
        tokenizer: its tokenizer (default: the one saved with the model); a missing pad token is its EOS.
        revision: a Hub id's branch, tag or commit.
        dtype: ``auto`` (the checkpoint's own) or a torch dtype name, for a model given by name.
        batch_size: completions scored per forward (None: all at once, as TRL does).
        chat_template_kwargs: passed to the chat template (None: the module's ``chat_template_kwargs``).
        name: the label of its logged mean (default: the model id's last part, TRL's).

    Example (a recipe): ``rewards=[{_target_: segki_lightning.rl.RewardModel, model: org/reward-model}]``
    """

    def __init__(self, model: str | nn.Module, tokenizer: Any = None, revision: str | None = None,
                 dtype: str = "auto", batch_size: int | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None, name: str | None = None):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from .model import DTYPES, resolve_checkpoint

        if batch_size is not None and batch_size < 1:
            raise ValueError(f"RewardModel batch_size must be >= 1 (or None: all at once), got {batch_size}")
        if isinstance(model, str):
            if dtype != "auto" and dtype not in DTYPES:
                raise ValueError(f"RewardModel dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
            folder = resolve_checkpoint(model, revision, setting="RewardModel model",
                                        revision_setting="RewardModel revision")
            ident, model = model, AutoModelForSequenceClassification.from_pretrained(
                folder, num_labels=1, dtype=dtype if dtype == "auto" else DTYPES[dtype], trust_remote_code=False,
                local_files_only=True)
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
        else:
            ident = getattr(model.config, "_name_or_path", "") or type(model).__name__
            if tokenizer is None:   # TRL's: the tokenizer saved with the model it was loaded from
                if not getattr(model.config, "_name_or_path", ""):
                    raise ValueError("RewardModel of a model built in memory needs its tokenizer: "
                                     "RewardModel(model, tokenizer)")
                tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path, trust_remote_code=False)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id   # the model pools at the last token before padding
        self.model = model.requires_grad_(False).eval()
        self.tokenizer, self.batch_size, self.chat_template_kwargs = tokenizer, batch_size, chat_template_kwargs
        self.__name__ = name or str(ident).rstrip("/").split("/")[-1]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def to(self, device: torch.device | str) -> RewardModel:
        self.model.to(device)
        return self

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What the model reads: each conversation (prompt messages + completion messages) through its chat template,
        or prompt + completion as text."""
        from ..lightning.mixin import is_conversation

        if is_conversation(prompts[0]):
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"reward model {self.__name__}: conversational prompts are read through its chat "
                                 "template, and its tokenizer has none: give RewardModel(model, tokenizer=...) one "
                                 "that has it")
            kwargs = self.chat_template_kwargs or {}
            return [self.tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **kwargs)
                    for p, c in zip(prompts, completions, strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        texts, device = self.texts(prompts, completions), self.device
        step = self.batch_size or len(texts)
        out: list[float] = []
        for i in range(0, len(texts), step):
            batch = self.tokenizer(texts[i:i + step], return_tensors="pt", padding=True, padding_side="right",
                                   add_special_tokens=False).to(device)
            out += self.model(**batch).logits[:, 0].float().tolist()                 # [b]
        return out
