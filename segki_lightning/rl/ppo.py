"""PPO for language models as a LightningModule: value head on the policy's last hidden state, per-token
KL penalty to a frozen reference, GAE, whitened advantages, clipped policy and value losses."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from .advantages import gae, masked_whiten
from .base import RLModule
from .config import PPOConfig
from .losses import Totals, ppo_loss, token_mean
from .rewards import WeightedReward
from .update import micro_batches


class PPOModule(RLModule):
    """One PPO update per rollout. The sequence reward lands on each completion's last token; every token
    also pays ``-kl_coef * (logp - ref_logp)``. As in TRL, a no-grad pass (in micro-batches) first gives the
    old log-probs, values and reference log-probs of every row, from which the advantages are computed over
    the whole batch; then the update runs in micro-batches of ``micro_batch_size`` rows.

    Args:
        policy: a Hugging Face causal LM; the value head reads its last hidden state.
        tokenizer, rewards: as for :class:`~segki_lightning.rl.GRPOModule`.
        config: :class:`PPOConfig`.
    """

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: list[WeightedReward],
                 config: PPOConfig | None = None):
        super().__init__(policy, tokenizer, rewards, config or PPOConfig())
        hidden = policy.get_input_embeddings().embedding_dim
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.reference = None
        if self.cfg.kl_coef > 0:
            self.reference = copy.deepcopy(policy).requires_grad_(False).eval()

    @torch.no_grad()
    def old_scores(self, ro) -> tuple[Tensor, Tensor, Tensor]:
        """``old_logp``, ``old_values``, ``kl`` (to the reference) ``[N, T]`` of every row, micro-batched."""
        logp, values, kl = [], [], []
        for rows in micro_batches(len(ro), self.cfg.micro_batch_size):
            sc = self.scores(self.policy, ro, rows, self.value_head)
            logp.append(sc.logp)
            values.append(sc.values)
            ref = self.scores(self.reference, ro, rows).logp if self.reference is not None else sc.logp
            kl.append(sc.logp - ref)
        return torch.cat(logp), torch.cat(values), torch.cat(kl)

    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor:
        cfg = self.cfg
        s = self.rollout_and_score(batch, cfg.num_generations)
        ro = s.batch
        mask = ro.completion_mask
        m = mask.float()
        old_logp, old_values, kl = self.old_scores(ro)                                  # [N, T] each
        token_rewards = -cfg.kl_coef * kl
        last = (mask.sum(1) - 1).clamp_min(0)
        token_rewards[torch.arange(len(last), device=last.device), last] += s.rewards
        adv, returns = gae(token_rewards, old_values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = masked_whiten(adv, mask)
        totals = Totals.of(mask)

        def loss_fn(rows: slice) -> tuple[Tensor, dict[str, Tensor]]:
            sc = self.scores(self.policy, ro, rows, self.value_head)
            loss, stats = ppo_loss(sc.logp, old_logp[rows], sc.values, old_values[rows], adv[rows], returns[rows],
                                   mask[rows], cfg, totals)
            stats["entropy"] = token_mean(sc.entropy.detach(), m[rows], totals)
            return loss, stats

        loss, total, stats = self.accumulate(len(ro), loss_fn)
        self.log_common(s, total, len(batch["prompt"]), kl=(kl * m).sum() / m.sum().clamp_min(1),
                        value=(old_values * m).sum() / m.sum().clamp_min(1), **stats)
        return loss
