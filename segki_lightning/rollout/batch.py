"""The result of a rollout: prompts, completions, masks and log-probs, rows ordered prompt-major."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists right-aligned in one batch: ``ids [N, P]`` (``pad`` before each sequence) and
    ``mask [N, P]`` (1 on real tokens), P the longest length; CPU tensors."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[j, width - len(s):] = 1
    return ids, mask


@dataclass
class RolloutStats:
    PARTS = ("setup", "prefill", "decode", "collect")   # the ``<part>_s`` fields, in the order they happen

    prefill_s: float = 0.0       # wall seconds of all prefills
    decode_s: float = 0.0        # wall seconds of the decode loop
    setup_s: float = 0.0         # wall seconds before the prefill: checks, packing, graph captures, buffer resets
    collect_s: float = 0.0       # wall seconds after the decode loop: the batch's tensors and token count
    tokens: int = 0              # generated tokens (completion_mask.sum())
    steps: int = 0               # decode steps run (<= max_new_tokens - 1 a turn)
    turns: int = 0               # turns run (1 for ``generate``; ``generate_turns``: up to its max_turns)
    respond_s: float = 0.0       # wall seconds in the caller's ``respond`` (tools, environments) between turns
    observation_tokens: int = 0  # tokens appended by ``respond`` (masked out of the loss: ``tool_mask`` 0)
    observations_cut: int = 0    # observations cut to the row's remaining token budget
    path: str = ""               # "graph+native", "eager+reference", ...

    @property
    def tokens_per_s(self) -> float:
        total = self.prefill_s + self.decode_s
        return self.tokens / total if total > 0 else 0.0


@dataclass
class RolloutBatch:
    """N = len(prompts) * n rows; row r belongs to prompt ``r // n``; P = longest prompt; T = max_new_tokens."""

    prompt_ids: torch.Tensor        # [N, P] int64, left-padded with pad_token_id
    prompt_mask: torch.Tensor       # [N, P] int64, 1 on prompt tokens
    completion_ids: torch.Tensor    # [N, T] int64, pad after a row's EOS
    completion_mask: torch.Tensor   # [N, T] int64, 1 for generated tokens up to and including EOS
    logprobs: torch.Tensor          # [N, T] fp32, log_softmax(logits / T)[token] (T = 1 for greedy); 0 on pad
    prompt_index: torch.Tensor      # [N] int64, r // n
    stats: RolloutStats = field(default_factory=RolloutStats)
    stopped: torch.Tensor | None = None   # [N] bool: ended by a stop string (set by the RL modules' stop_strings)
    # [N, T] int64 (multi-turn only, TRL's name): 1 on the model's own tokens, 0 on tokens appended between turns
    # (tool results, environment observations), which completion_mask counts as part of the sequence
    tool_mask: torch.Tensor | None = None
    turns: torch.Tensor | None = None     # [N] int64 (multi-turn only): turns each row ran

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def model_mask(self) -> torch.Tensor:
        """``[N, T]`` 1 on the model's own tokens: ``completion_mask`` less appended tool results/observations
        (what losses, log-prob comparisons and token counts use)."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask
