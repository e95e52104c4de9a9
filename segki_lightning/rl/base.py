"""What GRPO and PPO share: rollout + scoring of a prompt batch, the optimizer, step timing and logging."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from ..lightning import SegKIRolloutMixin
from ..rollout import RolloutBatch, SamplingConfig
from .rewards import WeightedReward, score
from .task import decode


@dataclass
class RLConfig:
    """Sampling and optimisation settings every algorithm has (TRL names)."""

    num_generations: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 16
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    log_completions_every: int = 50
    seed: int = 0


@dataclass
class Scored:
    """One scored rollout: rows prompt-major, ``n`` completions per prompt."""

    batch: RolloutBatch
    prompts: list[str]           # [N] the prompt of each row
    texts: list[str]             # [N] decoded completions
    rewards: Tensor              # [N] fp32 weighted reward
    means: dict[str, float]      # mean of each reward function
    rollout_s: float


class RLModule(SegKIRolloutMixin, pl.LightningModule):
    """Base of the RL LightningModules: ``self.policy`` trained in place, rollouts from the same weights."""

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: list[WeightedReward], cfg: Any):
        super().__init__()
        if not rewards:
            raise ValueError("at least one reward function is needed")
        self.policy, self.tokenizer, self.rewards, self.cfg = policy, tokenizer, list(rewards), cfg
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self._step_started = 0.0
        self._last_rollout_s = 0.0

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.cfg.learning_rate, weight_decay=self.cfg.weight_decay)

    def sampling(self, n: int) -> SamplingConfig:
        c = self.cfg
        return SamplingConfig(max_new_tokens=c.max_completion_length, temperature=c.temperature, top_k=c.top_k,
                              top_p=c.top_p, n=n, seed=c.seed + self.global_step)

    def rollout_and_score(self, batch: dict[str, list], n: int) -> Scored:
        t0 = time.perf_counter()
        ro = self.rollout(batch["prompt"], self.sampling(n))
        rollout_s = time.perf_counter() - t0
        self._last_rollout_s = rollout_s
        texts = decode(self.tokenizer, ro.completion_ids, ro.completion_mask)
        columns = {k: [v for v in vals for _ in range(n)] for k, vals in batch.items() if k != "prompt"}
        prompts = [p for p in batch["prompt"] for _ in range(n)]
        total, means = score(self.rewards, prompts, texts, columns)
        rewards = torch.tensor(total, dtype=torch.float32, device=self.device)
        return Scored(ro, prompts, texts, rewards, means, rollout_s)

    def log_common(self, s: Scored, loss: Tensor, n_prompts: int, **extra: Tensor) -> None:
        """The per-step metrics both algorithms report (reduced across ranks; tokens/s summed)."""
        kw = dict(batch_size=n_prompts, sync_dist=True)
        self.log("train/reward", s.rewards.mean(), prog_bar=True, **kw)
        self.log("train/reward_std", s.rewards.std() if len(s.rewards) > 1 else torch.zeros(()), **kw)
        for name, v in s.means.items():
            self.log(f"train/rewards/{name}", v, **kw)
        for name, v in extra.items():
            self.log(f"train/{name}", v, **kw)
        self.log("train/completion_length", s.batch.completion_mask.sum(1).float().mean(), **kw)
        self.log("train/loss", loss.detach(), **kw)
        self.log("rollout/tokens_per_s", s.batch.stats.tokens / max(s.rollout_s, 1e-9), prog_bar=True,
                 batch_size=n_prompts, sync_dist=True, reduce_fx="sum")
        every = getattr(self.cfg, "log_completions_every", 0)
        if every and self.global_step % every == 0:
            self._log_completions([dict(step=self.global_step, prompt=p, completion=c, reward=float(r))
                                   for p, c, r in list(zip(s.prompts, s.texts, s.rewards.tolist()))[:4]])

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Wall time of the whole step (rollout, scoring, forward, backward, optimizer; the GPU's queue
        drained) and the rollout's share of it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        step_s = max(time.perf_counter() - self._step_started, 1e-9)
        kw = dict(batch_size=len(batch["prompt"]), sync_dist=True)
        self.log("rollout/time_share", self._last_rollout_s / step_s, **kw)
        self.log("time/step_s", step_s, **kw)
        self.log("time/rollout_s", self._last_rollout_s, **kw)

    def _log_completions(self, rows: list[dict]) -> None:
        """A few sample completions: a TensorBoard text table when that logger is present, else a JSONL
        file beside the logs (rank zero only)."""
        if self.global_rank != 0:
            return
        for logger in self.loggers:
            exp = getattr(logger, "experiment", None)
            if hasattr(exp, "add_text"):
                table = "\n".join(f"| {r['prompt']} | {r['completion']} | {r['reward']:.2f} |" for r in rows)
                exp.add_text("completions", "| prompt | completion | reward |\n|---|---|---|\n" + table,
                             self.global_step)
            elif getattr(logger, "log_dir", None):
                path = Path(logger.log_dir) / "completions.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                with path.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
