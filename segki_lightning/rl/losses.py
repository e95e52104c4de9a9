"""Policy and value losses on ``[n, T]`` per-token tensors of one micro-batch, normalised by the WHOLE step's
batch (:class:`Totals`), so the losses and gradients of the micro-batches add up to the full batch's.

Each GRPO formula is TRL's ``GRPOTrainer._compute_loss`` (1.x) written out: the clipped surrogate (DAPO's
asymmetric ``epsilon_high``, two-sided ``delta``), GSPO's sequence-level ratio, CISPO's truncated and
detached IS weight on the log-prob, SAPO's soft sigmoid gate, VESPO's gamma weight of the sequence ratio, LUSPO's
length-scaled sequence loss, the k3 KL (optionally IS-weighted), the entropy bonus."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import GRPOConfig, PPOConfig
from .dist import global_sum, world


@dataclass(frozen=True)
class Totals:
    """Denominators of one optimizer step's batch: ``rows`` rows and ``tokens`` loss tokens on this rank;
    ``global_tokens``: loss tokens over all ranks divided by the number of ranks (what dapo divides by, so that
    DDP's gradient average gives the global token mean)."""

    rows: int
    tokens: float
    global_tokens: float

    @classmethod
    def of(cls, mask: Tensor) -> "Totals":
        local = mask.float().sum()
        return cls(rows=mask.shape[0], tokens=max(float(local), 1.0),
                   global_tokens=max(float(global_sum(local)) / world(), 1.0 / world()))


def token_mean(x: Tensor, mask: Tensor, totals: Totals) -> Tensor:
    """This micro-batch's share of the batch's token mean of ``x`` (this rank's tokens)."""
    return (x * mask).sum() / totals.tokens


def aggregate(per_token: Tensor, mask: Tensor, loss_type: str, max_len: int, totals: Totals) -> Tensor:
    """TRL's loss aggregations: ``grpo``/``sapo`` the mean over rows of each row's token mean; ``dr_grpo`` the
    sum over a fixed ``rows x max_completion_length``; ``bnpo`` this rank's token mean; ``dapo``/``cispo`` the
    token mean over all ranks; ``luspo`` each row's loss summed over its tokens (its sequence loss times its
    length), averaged over the rows."""
    if loss_type == "luspo":
        return (per_token * mask).sum() / totals.rows
    if loss_type in ("grpo", "sapo"):
        return ((per_token * mask).sum(1) / mask.sum(1).clamp_min(1)).sum() / totals.rows
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (totals.rows * max_len)
    if loss_type == "bnpo":
        return (per_token * mask).sum() / totals.tokens
    return (per_token * mask).sum() / totals.global_tokens


def sapo_gate(ratio: Tensor, temperature: float) -> Tensor:
    """SAPO's soft gate ``4/tau * sigmoid(tau (r - 1))``: gradient weight 1 at r = 1, decaying smoothly."""
    return torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature


@torch.no_grad()
def vespo_weight(log_ratio: Tensor, mask: Tensor, adv: Tensor, cfg: GRPOConfig,
                 sampler_ratio: Tensor | None = None) -> Tensor:
    """VESPO's ``[n, 1]`` gradient scale ``phi(w) = e^lam w^k e^(-lam w)`` (``phi(1) = 1``) of the sequence ratio
    ``w = prod pi/pi_old`` (times the sampler correction's per-token ratios), ``k, lam`` by the advantage's sign;
    in log space, clamped as TRL's ``get_gamma_weights``, detached."""
    floor = math.log(1e-8)
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)                    # [n, 1]
    if sampler_ratio is not None:
        seq = seq + (torch.log(sampler_ratio.expand_as(mask)).clamp(floor, 20.0) * mask).sum(-1, keepdim=True)
    log_w = seq.clamp(floor, 20.0)
    pos = adv[:, None] >= 0
    k = torch.where(pos, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = torch.where(pos, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def entropy_bonus(entropy: Tensor, mask: Tensor, loss_type: str, totals: Totals) -> Tensor:
    """This micro-batch's share of the step's mean per-token entropy, as TRL adds ``-entropy_coef x`` it: over
    every rank's tokens for the globally normalised losses (``dapo``, ``cispo``, ``vespo``), this rank's token
    mean otherwise."""
    if loss_type in ("dapo", "cispo", "vespo"):
        return (entropy * mask).sum() / totals.global_tokens
    return token_mean(entropy, mask, totals)


def off_policy_mask(adv: Tensor, logp: Tensor, sampler_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's ``off_policy_mask_threshold``), ``[n, 1]``: 0 drops a
    completion from the policy term, where its advantage ``adv [n]`` is negative AND the mean over its tokens of
    ``sampler_logp - logp`` (the sampler's log-probs against the current policy's, detached: ``[n, T]``) exceeds
    ``threshold``; 1 keeps it."""
    m = mask.float()
    kl = ((sampler_logp - logp.detach()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1)   # [n, 1]
    return ((adv[:, None] >= 0) | (kl <= threshold)).to(m.dtype)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, adv: Tensor, mask: Tensor,
              cfg: GRPOConfig, totals: Totals | None = None, weights: Tensor | None = None,
              sampler_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO-family loss of ``[n, T]`` log-probs (current, old, reference), ``[n]`` advantages, ``mask``.

    ``weights`` (``[n, T]`` or ``[n, 1]``) multiply the policy term per token: importance-sampling weights and
    the high-entropy token mask. ``loss_type=vespo`` takes the sampler correction as ``sampler_ratio`` instead
    (folded into its sequence weight, as TRL does). Stats are this micro-batch's share of the batch's token means:
    ``clip_ratio`` (``/low``, ``/high``) and ``kl``."""
    m = mask.float()
    totals = totals or Totals.of(m)
    log_ratio = logp - old_logp                                                   # [n, T]
    if cfg.importance_sampling_level == "sequence":   # GSPO: the length-normalised sequence ratio
        log_ratio = (log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)   # [n, 1]
    coef = torch.exp(log_ratio)
    lo, hi = cfg.epsilon, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    a = adv[:, None]
    if cfg.loss_type == "cispo":
        per_token = -coef.clamp(max=hi).detach() * a * logp
        low, high = torch.zeros_like(coef, dtype=torch.bool), (coef > hi) & (a > 0)
    elif cfg.loss_type == "sapo":
        gate = torch.where(a > 0, sapo_gate(coef, cfg.sapo_temperature_pos), sapo_gate(coef, cfg.sapo_temperature_neg))
        per_token = -gate * a
        low = high = torch.zeros_like(coef, dtype=torch.bool)
    elif cfg.loss_type == "vespo":   # the token-level log ratio, whatever importance_sampling_level says
        per_token = -vespo_weight(logp - old_logp, m, adv, cfg, sampler_ratio) * a * logp
        low = high = torch.zeros_like(per_token, dtype=torch.bool)
    else:
        clipped = coef.clamp(1 - lo, 1 + hi)
        unclipped = coef.clamp(max=cfg.delta) if cfg.delta is not None else coef
        per_token = -torch.min(unclipped * a, clipped * a)
        low, high = (coef < 1 - lo) & (a < 0), (coef > 1 + hi) & (a > 0)
    per_token = per_token.expand_as(m)
    if weights is not None:
        per_token = per_token * weights
    kl = torch.zeros_like(m)
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        if cfg.use_bias_correction_kl:
            kl = kl * coef
        per_token = per_token + cfg.beta * kl
    loss = aggregate(per_token, m, cfg.loss_type, cfg.max_completion_length, totals)
    low, high = low.expand_as(m).float(), high.expand_as(m).float()
    stats = {"kl": token_mean(kl.detach(), m, totals), "clip_ratio": token_mean(torch.maximum(low, high), m, totals),
             "clip_ratio/low": token_mean(low, m, totals), "clip_ratio/high": token_mean(high, m, totals)}
    return loss, stats


def ppo_loss(logp: Tensor, old_logp: Tensor, values: Tensor, old_values: Tensor, adv: Tensor, returns: Tensor,
             mask: Tensor, cfg: PPOConfig, totals: Totals | None = None, weights: Tensor | None = None
             ) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped surrogate (weighted per token by ``weights``) + ``vf_coef`` x clipped value loss, token means
    over the batch."""
    m = mask.float()
    totals = totals or Totals.of(m)
    ratio = torch.exp(logp - old_logp)
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - cfg.cliprange, 1 + cfg.cliprange)
    pg = torch.max(pg1, pg2)
    if weights is not None:
        pg = pg * weights
    v_clip = old_values + (values - old_values).clamp(-cfg.cliprange_value, cfg.cliprange_value)
    vf1, vf2 = (values - returns) ** 2, (v_clip - returns) ** 2
    pg_loss, vf_loss = token_mean(pg, m, totals), token_mean(0.5 * torch.max(vf1, vf2), m, totals)
    low, high = ((ratio < 1 - cfg.cliprange) & (adv < 0)).float(), ((ratio > 1 + cfg.cliprange) & (adv > 0)).float()
    return pg_loss + cfg.vf_coef * vf_loss, {   # TRL's pg_clipfrac / vf_clipfrac: where the clipped term won
        "pg_loss": pg_loss.detach(), "vf_loss": vf_loss.detach(),
        "clip_ratio": token_mean((pg2 > pg1).float(), m, totals),
        "clip_ratio/low": token_mean(low, m, totals), "clip_ratio/high": token_mean(high, m, totals),
        "vf_clip_ratio": token_mean((vf2 > vf1).float().detach(), m, totals)}
