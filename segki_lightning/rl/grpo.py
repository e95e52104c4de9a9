"""GRPO as a LightningModule (names and defaults follow TRL's ``GRPOConfig``)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .base import RLConfig, RLModule
from .logprobs import completion_logprobs
from .rewards import WeightedReward

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass
class GRPOConfig(RLConfig):
    """GRPO hyper-parameters (TRL names). ``beta = 0`` builds no reference model."""

    num_generations: int = 8
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {SCALES}, got {self.scale_rewards!r}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: GRPO compares completions within a group")


def group_advantages(rewards: Tensor, group: int, scale: str) -> Tensor:
    """``[N]`` rewards (prompt-major groups of ``group``) -> advantages ``r - mean_group``, divided by the
    group's or the batch's std (+1e-4) unless ``scale == "none"``."""
    r = rewards.view(-1, group)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / (rewards.std() + 1e-4)
    return adv.reshape(-1)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor,
              cfg: GRPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate (+ beta * k3 KL) aggregated per ``cfg.loss_type``; ``[N, T]`` inputs, ``[N]`` adv."""
    ratio = torch.exp(logp - old_logp)
    hi = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    a = adv[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - cfg.epsilon, 1 + hi) * a)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token = per_token + cfg.beta * kl
    m = mask.float()
    if cfg.loss_type == "grpo":
        loss = ((per_token * m).sum(1) / m.sum(1).clamp_min(1)).mean()
    elif cfg.loss_type == "dr_grpo":
        loss = (per_token * m).sum() / (m.shape[0] * cfg.max_completion_length)
    else:  # bnpo, dapo: token-level mean over the batch
        loss = (per_token * m).sum() / m.sum().clamp_min(1)
    clipped = ((ratio < 1 - cfg.epsilon) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))
    stats = dict(kl=(kl * m).sum() / m.sum().clamp_min(1), clip_ratio=(clipped.float() * m).sum() / m.sum().clamp_min(1))
    return loss, stats


class GRPOModule(RLModule):
    """Rollout ``num_generations`` completions per prompt, score them, and take one clipped policy-gradient
    step on group-normalised advantages (on-policy: the old log-probs are the current ones, detached).

    Args:
        policy: a Hugging Face causal LM (trained in place; rollouts use the same weights).
        tokenizer: its tokenizer (prompts are strings).
        rewards: weighted reward functions.
        config: :class:`GRPOConfig`.
    """

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: list[WeightedReward],
                 config: GRPOConfig | None = None):
        super().__init__(policy, tokenizer, rewards, config or GRPOConfig())
        self.reference = None
        if self.cfg.beta > 0:
            self.reference = copy.deepcopy(policy).requires_grad_(False).eval()

    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor:
        cfg, g = self.cfg, self.cfg.num_generations
        s = self.rollout_and_score(batch, g)
        ro = s.batch
        adv = group_advantages(s.rewards, g, cfg.scale_rewards)
        mask = ro.completion_mask
        if cfg.mask_truncated_completions:
            mask = mask * (ro.completion_ids == self.eos_token_id).any(1)[:, None].long()
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, cfg.temperature)
        logp = completion_logprobs(self.policy, *args)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = completion_logprobs(self.reference, *args)
        loss, stats = grpo_loss(logp, logp.detach(), ref_logp, adv, mask, cfg)
        self.log_common(s, loss, len(batch["prompt"]), kl=stats["kl"], clip_ratio=stats["clip_ratio"])
        return loss
