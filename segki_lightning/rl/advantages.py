"""Advantages: GRPO's group-normalised rewards (or GDPO's, each reward function normalised before the sum), RLOO's
leave-one-out baseline, REINFORCE++-baseline's batch-whitened group baseline, PPO's generalised advantage
estimation and whitening."""
from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group: int, scale: str, batch_std: Tensor | None = None) -> Tensor:
    """``[N]`` rewards (prompt-major groups of ``group``) -> advantages ``r - mean_group``, divided by the
    group's or the batch's std (+1e-4) unless ``scale == "none"``. ``batch_std``: the std over the whole batch
    of every rank (default: over these rows)."""
    r = rewards.view(-1, group)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + 1e-4)
    elif scale == "batch":
        adv = adv / ((rewards.std() if batch_std is None else batch_std) + 1e-4)
    return adv.reshape(-1)


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The standard deviation of the non-NaN values (Bessel-corrected; NaN where fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = count / (count - 1)   # (Bessel's; computed first: the rounding of TRL's nanstd)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True) * torch.where(
        count > 1, correction, torch.full_like(correction, float("nan")))
    out = var.sqrt()
    return out if keepdim or dim is None else out.squeeze(dim)


def gdpo_advantages(per_function: Tensor, weights: Tensor, group: int) -> Tensor:
    """``[N, F]`` rewards of F functions (NaN where one does not apply) -> advantages as TRL's
    ``multi_objective_aggregation="normalize_then_sum"`` (GDPO) forms them: each function normalized within its
    groups of ``group`` (``(r - mean) / (std + 1e-4)``, NaN-aware), summed with ``weights [F]``, then
    ``(s - mean) / (std + 1e-4)`` over the batch of every rank. A row no function applies to gets 0 and stays out
    of the batch statistics."""
    from .dist import gather_rows

    n, f = per_function.shape
    grouped = per_function.view(-1, group, f)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if group > 1 else torch.zeros_like(mean_k)
    summed = torch.nansum(((grouped - mean_k) / (std_k + 1e-4)).view(n, f) * weights[None], dim=1)   # [N]
    summed[torch.isnan(per_function).all(1)] = float("nan")
    every = gather_rows(summed)
    std = nanstd(every) if every.numel() > 1 else summed.new_zeros(())
    return torch.nan_to_num((summed - torch.nanmean(every)) / (std + 1e-4), nan=0.0)


def rloo_advantages(rewards: Tensor, group: int) -> Tensor:
    """``[N]`` rewards -> ``r_i - mean of the other G - 1 rewards of its group`` (TRL's RLOOTrainer,
    ``normalize_advantages=False``): ``G / (G - 1) x (r_i - group mean)``, an unbiased baseline."""
    r = rewards.view(-1, group)
    return (r - (r.sum(1, keepdim=True) - r) / (group - 1)).reshape(-1)


def reinforce_pp_advantages(rewards: Tensor, group: int, lengths: Tensor) -> Tensor:
    """``[N]`` rewards -> REINFORCE++-baseline's advantages: ``r - group mean``, put on every completion token and
    whitened over all tokens of the batch (every rank's) as verl's ``masked_whiten`` does: ``(a_i - mu) /
    sqrt(var + 1e-8)``, ``mu`` and ``var`` the token-weighted mean and unbiased variance (each row counts its
    ``lengths`` tokens; Bessel's correction over the token count)."""
    from .dist import gather_rows

    a = (rewards.view(-1, group) - rewards.view(-1, group).mean(1, keepdim=True)).reshape(-1)
    a_all, w_all = gather_rows(a), gather_rows(lengths.to(a.dtype))
    total = w_all.sum().clamp_min(1)
    mean = (a_all * w_all).sum() / total
    var = (((a_all - mean) ** 2) * w_all).sum() / total * (total / (total - 1).clamp_min(1))
    return (a - mean) * torch.rsqrt(var + 1e-8)


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float) -> Tensor:
    """``[N, T]`` 1.0 on the tokens whose entropy is in the top ``quantile`` of the batch's (all ranks')
    masked-in tokens, else 0 (TRL's ``top_entropy_quantile``; 1.0 keeps every token)."""
    from .dist import gather_rows

    values = gather_rows(entropy[mask.bool()].float())
    if values.numel() == 0:
        return mask.float()
    threshold = torch.quantile(values, 1.0 - quantile)
    return ((entropy >= threshold) & mask.bool()).float()


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """``(x - mean) / std`` over the tokens where ``mask`` is 1 (TRL's PPO: the variance with Bessel's correction,
    ``+1e-8`` under the root); ``shift_mean=False`` adds the mean back (TRL's ``whiten_rewards``)."""
    m = mask.float()
    n = m.sum().clamp_min(1)
    mean = (x * m).sum() / n
    var = (((x - mean) ** 2) * m).sum() / n * (n / (n - 1).clamp_min(1))
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out if shift_mean else out + mean


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
