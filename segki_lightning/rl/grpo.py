"""GRPO as a LightningModule (names and defaults follow TRL's ``GRPOConfig``)."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from .advantages import group_advantages
from .base import RLModule
from .config import GRPOConfig
from .losses import Totals, grpo_loss, token_mean
from .rewards import WeightedReward


class GRPOModule(RLModule):
    """Rollout ``num_generations`` completions per prompt, score them, and take one clipped policy-gradient
    step on group-normalised advantages (on-policy: the old log-probs are the current ones, detached), in
    micro-batches of ``micro_batch_size`` rows.

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
        adv = group_advantages(s.rewards, g, cfg.scale_rewards)                       # [N]
        mask = ro.completion_mask
        if cfg.mask_truncated_completions:
            mask = mask * (ro.completion_ids == self.eos_token_id).any(1)[:, None].long()
        totals = Totals.of(mask)

        def loss_fn(rows: slice) -> tuple[Tensor, dict[str, Tensor]]:
            sc = self.scores(self.policy, ro, rows)                                   # [n, T] each
            ref_logp = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp = self.scores(self.reference, ro, rows).logp
            loss, stats = grpo_loss(sc.logp, sc.logp.detach(), ref_logp, adv[rows], mask[rows], cfg, totals)
            stats["entropy"] = token_mean(sc.entropy.detach(), mask[rows].float(), totals)
            return loss, stats

        loss, total, stats = self.accumulate(len(ro), loss_fn)
        self.log_common(s, total, len(batch["prompt"]), **stats)
        return loss
