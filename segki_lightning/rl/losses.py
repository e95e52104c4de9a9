"""Policy and value losses on ``[n, T]`` per-token tensors of one micro-batch, normalised by the WHOLE step's
batch (:class:`Totals`), so the losses and gradients of the micro-batches add up to the full batch's."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import GRPOConfig, PPOConfig


@dataclass(frozen=True)
class Totals:
    """Denominators of one optimizer step's batch: ``rows`` rows and ``tokens`` loss tokens (mask 1)."""

    rows: int
    tokens: float

    @classmethod
    def of(cls, mask: Tensor) -> "Totals":
        return cls(rows=mask.shape[0], tokens=max(float(mask.sum()), 1.0))


def token_mean(x: Tensor, mask: Tensor, totals: Totals) -> Tensor:
    """This micro-batch's share of the batch's token mean of ``x``."""
    return (x * mask).sum() / totals.tokens


def aggregate(per_token: Tensor, mask: Tensor, loss_type: str, max_len: int, totals: Totals) -> Tensor:
    """TRL's loss aggregations: ``grpo`` the mean over rows of each row's token mean; ``dr_grpo`` the sum over
    a fixed ``rows x max_completion_length``; ``bnpo``/``dapo`` the token mean over the batch."""
    if loss_type == "grpo":
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / totals.rows
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (totals.rows * max_len)
    return token_mean(per_token, mask, totals)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor,
              cfg: GRPOConfig, totals: Totals | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate (+ ``beta`` x k3 KL to the reference) aggregated per ``cfg.loss_type``; ``[n, T]``
    inputs, ``[n]`` advantages. Stats are this micro-batch's share of the batch's token means."""
    m = mask.float()
    totals = totals or Totals.of(m)
    ratio = torch.exp(logp - old_logp)
    hi = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    a = adv[:, None]
    per_token = -torch.min(ratio * a, ratio.clamp(1 - cfg.epsilon, 1 + hi) * a)
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        per_token = per_token + cfg.beta * kl
    loss = aggregate(per_token, m, cfg.loss_type, cfg.max_completion_length, totals)
    clipped = ((ratio < 1 - cfg.epsilon) & (a < 0)) | ((ratio > 1 + hi) & (a > 0))
    stats = dict(kl=token_mean(kl.detach(), m, totals), clip_ratio=token_mean(clipped.float(), m, totals))
    return loss, stats


def ppo_loss(logp: Tensor, old_logp: Tensor, values: Tensor, old_values: Tensor, adv: Tensor, returns: Tensor,
             mask: Tensor, cfg: PPOConfig, totals: Totals | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate + ``vf_coef`` x clipped value loss, token means over the batch."""
    m = mask.float()
    totals = totals or Totals.of(m)
    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cfg.cliprange, 1 + cfg.cliprange))
    v_clip = old_values + (values - old_values).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    vf = 0.5 * torch.max((values - returns) ** 2, (v_clip - returns) ** 2)
    pg_loss, vf_loss = token_mean(pg, m, totals), token_mean(vf, m, totals)
    clipped = ((ratio - 1).abs() > cfg.cliprange).float()
    return pg_loss + cfg.vf_coef * vf_loss, dict(pg_loss=pg_loss.detach(), vf_loss=vf_loss.detach(),
                                                 clip_ratio=token_mean(clipped, m, totals))
