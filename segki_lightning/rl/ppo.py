"""PPO for language models as a LightningModule: value head on the policy's last hidden state, per-token
KL penalty to a frozen reference, GAE, whitened advantages, clipped policy and value losses."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .base import RLConfig, RLModule
from .logprobs import completion_logprobs
from .rewards import WeightedReward


@dataclass
class PPOConfig(RLConfig):
    """PPO hyper-parameters (TRL names). ``kl_coef = 0`` builds no reference model."""

    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    kl_coef: float = 0.05
    whiten_advantages: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.float()
    mean = (x * m).sum() / m.sum().clamp_min(1)
    var = (((x - mean) ** 2) * m).sum() / m.sum().clamp_min(1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over ``[N, T]`` token rewards/values (0 after each row's end):
    ``(advantages, returns)``."""
    m = mask.float()
    values, rewards = values * m, rewards * m
    adv = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        nxt = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * nxt - values[:, t]
        last = (delta + gamma * lam * last) * m[:, t]
        adv[:, t] = last
    return adv, adv + values


def ppo_loss(logp: Tensor, old_logp: Tensor, values: Tensor, old_values: Tensor, adv: Tensor, returns: Tensor,
             mask: Tensor, cfg: PPOConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate + ``vf_coef`` * clipped value loss, token means over the batch."""
    m = mask.float()
    denom = m.sum().clamp_min(1)
    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.cliprange, 1 + cfg.cliprange))
    v_clip = old_values + (values - old_values).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    vf = 0.5 * torch.max((values - returns) ** 2, (v_clip - returns) ** 2)
    pg_loss, vf_loss = (pg * m).sum() / denom, (vf * m).sum() / denom
    clipped = ((ratio - 1).abs() > cfg.cliprange).float()
    return pg_loss + cfg.vf_coef * vf_loss, dict(pg_loss=pg_loss.detach(), vf_loss=vf_loss.detach(),
                                                 clip_ratio=(clipped * m).sum() / denom)


class PPOModule(RLModule):
    """One PPO update per rollout. The sequence reward lands on each completion's last token; every token
    also pays ``-kl_coef * (logp - ref_logp)``.

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

    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor:
        cfg = self.cfg
        s = self.rollout_and_score(batch, cfg.num_generations)
        ro = s.batch
        args = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, cfg.temperature)
        logp, values = completion_logprobs(self.policy, *args, value_head=self.value_head)     # [N, T] x2
        mask = ro.completion_mask
        with torch.no_grad():
            kl = torch.zeros_like(logp)
            if self.reference is not None:
                kl = logp.detach() - completion_logprobs(self.reference, *args)
            token_rewards = -cfg.kl_coef * kl
            last = (mask.sum(1) - 1).clamp_min(0)
            token_rewards[torch.arange(len(last), device=last.device), last] += s.rewards
            adv, returns = gae(token_rewards, values.detach(), mask, cfg.gamma, cfg.lam)
            if cfg.whiten_advantages:
                adv = masked_whiten(adv, mask)
        loss, stats = ppo_loss(logp, logp.detach(), values, values.detach(), adv, returns, mask, cfg)
        m = mask.float()
        self.log_common(s, loss, len(batch["prompt"]), kl=(kl * m).sum() / m.sum().clamp_min(1),
                        clip_ratio=stats["clip_ratio"], pg_loss=stats["pg_loss"], vf_loss=stats["vf_loss"],
                        value=(values.detach() * m).sum() / m.sum().clamp_min(1))
        return loss
