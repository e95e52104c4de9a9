"""PPO for language models as a LightningModule: value head on the policy's last hidden state, per-token
KL penalty to a frozen reference, GAE, whitened advantages, clipped policy and value losses."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .advantages import gae, masked_whiten
from .base import RLModule, ended_rows
from .buffer import RolloutBuffer, schedule
from .config import PPOConfig
from .losses import Totals, ppo_loss, token_mean
from .rewards import WeightedReward


class PPOModule(RLModule):
    """``num_ppo_epochs x num_mini_batches`` PPO updates per rollout (one ``training_step`` each; every epoch a
    fresh shuffle of the rows). The sequence reward lands on each completion's last token; every token also
    pays ``-kl_coef * (logp - ref_logp)``. As in TRL, a no-grad pass (in micro-batches) first gives the old
    log-probs, values and reference log-probs of every row, from which the advantages are computed over the
    whole rollout.

    Args:
        policy: a Hugging Face causal LM; the value head reads its last hidden state.
        tokenizer, rewards: as for :class:`~segki_lightning.rl.GRPOModule`.
        config: :class:`PPOConfig`.
    """

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: list[WeightedReward],
                 config: PPOConfig | None = None, tools: Sequence[Callable] = (),
                 environment_factory: Callable[[], Any] | None = None, tool_call_parser=None):
        if tools or environment_factory is not None:   # GAE over a sequence with gaps is not written yet
            raise ValueError("tools and environment_factory run with algorithm=grpo; PPO rolls out single turns")
        super().__init__(policy, tokenizer, rewards, config or PPOConfig())
        hidden = policy.get_input_embeddings().embedding_dim
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        if self.cfg.kl_coef > 0:
            self.keep_reference()

    def prepare(self, batch: dict[str, list]) -> RolloutBuffer:
        cfg = self.cfg
        s = self.rollout_and_score(batch, cfg.num_generations)
        ro = s.batch
        mask = ro.completion_mask
        old = self.old_scores(ro, self.value_head)                                        # [N, T] each
        ref = self.reference_logp(ro) if self.has_reference else old.logp
        logr = ref - old.logp                                                             # [N, T]
        kl = -logr if cfg.kl_estimator == "k1" else (logr.exp() - 1) - logr   # (TRL's form)
        scores = s.rewards
        if cfg.missing_eos_penalty is not None:
            scores = scores - cfg.missing_eos_penalty * (~ended_rows(ro, self.eos_token_id)).to(scores.dtype)
        token_rewards = -cfg.kl_coef * kl
        last = (mask.sum(1) - 1).clamp_min(0)
        token_rewards[torch.arange(len(last), device=last.device), last] += scores
        if cfg.whiten_rewards:
            token_rewards = masked_whiten(token_rewards, mask, shift_mean=False) * mask
        adv, returns = gae(token_rewards, old.values, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = masked_whiten(adv, mask)
        m = mask.float()
        self.log_dict({"train/kl": (kl * m).sum() / m.sum().clamp_min(1),
                       "train/value": (old.values * m).sum() / m.sum().clamp_min(1)},
                      batch_size=len(batch["prompt"]), sync_dist=True)
        gen = torch.Generator().manual_seed(cfg.seed + self.global_step)
        steps = schedule(len(ro), cfg.num_mini_batches, cfg.num_ppo_epochs, True, gen, mask.device)
        data = dict(mask=mask, adv=adv, returns=returns, old_logp=old.logp, old_values=old.values)
        return RolloutBuffer(s, data, steps)

    def step_loss(self, buf: RolloutBuffer, rows: Tensor, totals: Totals) -> tuple[Tensor, dict[str, Tensor]]:
        d = buf.data
        mask = d["mask"][rows]
        sc = self.scores(self.policy, buf.scored.batch, rows, self.value_head)
        weights, stats = self.corrected(d["old_logp"][rows], buf.scored.batch.logprobs[rows], mask, totals)
        loss, part = ppo_loss(sc.logp, d["old_logp"][rows], sc.values, d["old_values"][rows], d["adv"][rows],
                              d["returns"][rows], mask, self.cfg, totals, weights)
        part["entropy"] = token_mean(sc.entropy.detach(), mask.float(), totals)
        return loss, {**part, **stats}
