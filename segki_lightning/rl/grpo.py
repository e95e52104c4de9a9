"""GRPO as a LightningModule (names and defaults follow TRL's ``GRPOConfig``)."""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..lightning import SegKIRolloutMixin
from ..rollout import SamplingConfig
from .logprobs import completion_logprobs
from .rewards import WeightedReward, score
from .task import decode

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass
class GRPOConfig:
    """GRPO hyper-parameters (TRL names). ``beta = 0`` builds no reference model."""

    num_generations: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 16
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    log_completions_every: int = 50
    seed: int = 0

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


class GRPOModule(SegKIRolloutMixin, pl.LightningModule):
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
        super().__init__()
        self.policy, self.tokenizer, self.rewards = policy, tokenizer, list(rewards)
        self.cfg = config or GRPOConfig()
        if not self.rewards:
            raise ValueError("GRPO needs at least one reward function")
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.reference = None
        if self.cfg.beta > 0:
            self.reference = copy.deepcopy(policy).requires_grad_(False).eval()
        self._step_started = 0.0
        self._last_rollout_s = 0.0
        self._completion_rows: list[dict] = []

    def configure_optimizers(self):
        params = [p for p in self.policy.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Rollout seconds over the whole step (rollout, scoring, forward, backward, optimizer)."""
        step_s = max(time.perf_counter() - self._step_started, 1e-9)
        self.log("rollout/time_share", self._last_rollout_s / step_s, batch_size=len(batch["prompt"]))

    def sampling(self) -> SamplingConfig:
        c = self.cfg
        return SamplingConfig(max_new_tokens=c.max_completion_length, temperature=c.temperature, top_k=c.top_k,
                              top_p=c.top_p, n=c.num_generations, seed=c.seed + self.global_step)

    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor:
        cfg, g = self.cfg, self.cfg.num_generations
        prompts = batch["prompt"]
        t0 = time.perf_counter()
        ro = self.rollout(prompts, self.sampling())
        rollout_s = time.perf_counter() - t0
        texts = decode(self.tokenizer, ro.completion_ids, ro.completion_mask)
        columns = {k: [v for v in vals for _ in range(g)] for k, vals in batch.items() if k != "prompt"}
        rep_prompts = [p for p in prompts for _ in range(g)]
        total, means = score(self.rewards, rep_prompts, texts, columns)
        rewards = torch.tensor(total, dtype=torch.float32, device=self.device)
        adv = group_advantages(rewards, g, cfg.scale_rewards)
        mask = ro.completion_mask
        if cfg.mask_truncated_completions:
            ended = (ro.completion_ids == self.eos_token_id).any(1)
            mask = mask * ended[:, None].long()
        logp = completion_logprobs(self.policy, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                   cfg.temperature)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logp = completion_logprobs(self.reference, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                               ro.completion_mask, cfg.temperature)
        loss, stats = grpo_loss(logp, logp.detach(), ref_logp, adv, mask, cfg)
        self._last_rollout_s = rollout_s
        n = len(prompts)
        self.log("train/reward", rewards.mean(), prog_bar=True, batch_size=n)
        self.log("train/reward_std", rewards.view(-1, g).std(1).mean(), batch_size=n)
        for name, v in means.items():
            self.log(f"train/rewards/{name}", v, batch_size=n)
        self.log("train/kl", stats["kl"], batch_size=n)
        self.log("train/clip_ratio", stats["clip_ratio"], batch_size=n)
        self.log("train/completion_length", ro.completion_mask.sum(1).float().mean(), batch_size=n)
        self.log("train/loss", loss.detach(), batch_size=n)
        self.log("rollout/tokens_per_s", ro.stats.tokens / max(rollout_s, 1e-9), prog_bar=True, batch_size=n)
        if cfg.log_completions_every and self.global_step % cfg.log_completions_every == 0:
            self._completion_rows = [dict(step=self.global_step, prompt=p, completion=c, reward=r)
                                     for p, c, r in list(zip(rep_prompts, texts, total))[:4]]
            self._log_completions()
        return loss

    def _log_completions(self) -> None:
        """A few sample completions: a TensorBoard text table when that logger is present, else a JSONL file
        beside the logs."""
        import json
        from pathlib import Path

        for logger in self.loggers:
            exp = getattr(logger, "experiment", None)
            if hasattr(exp, "add_text"):
                table = "\n".join(f"| {r['prompt']} | {r['completion']} | {r['reward']:.2f} |" for r in self._completion_rows)
                exp.add_text("completions", "| prompt | completion | reward |\n|---|---|---|\n" + table, self.global_step)
            elif getattr(logger, "log_dir", None):
                path = Path(logger.log_dir) / "completions.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    for r in self._completion_rows:
                        f.write(json.dumps(r) + "\n")
