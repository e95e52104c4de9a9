"""GRPO as a LightningModule (names and defaults follow TRL's ``GRPOConfig``)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .advantages import (gdpo_advantages, group_advantages, high_entropy_mask, reinforce_pp_advantages,
                         rloo_advantages)
from .base import RLModule, ended_rows
from .buffer import RolloutBuffer, schedule
from .config import GRPOConfig
from .dist import gather_rows, global_sum
from .dynamic import RefillPrompts, fill, informative_groups
from .losses import Totals, entropy_bonus, grpo_loss, off_policy_mask, token_mean
from .rewards import WeightedReward


class GRPOModule(RLModule):
    """Roll out ``num_generations`` completions per prompt, score them, and take clipped policy-gradient steps
    on group-normalised advantages: ``num_iterations x steps_per_generation`` optimizer steps per rollout (one
    ``training_step`` each), in micro-batches of ``micro_batch_size`` rows.

    The old log-probs come from one no-grad pass of the trainer's forward before the first update (as in TRL);
    with one step per rollout and every token kept they equal the current ones and that pass is skipped. Each
    token's loss is weighted by the sampler/trainer importance ratio (``importance_sampling_*``).

    Args:
        policy: a Hugging Face causal LM (trained in place; rollouts use the same weights).
        tokenizer: its tokenizer (prompts are strings).
        rewards: weighted reward functions.
        config: :class:`GRPOConfig`.
    """

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: list[WeightedReward],
                 config: GRPOConfig | None = None, tools: Sequence[Callable] = (),
                 environment_factory: Callable[[], Any] | None = None,
                 tool_call_parser: Callable[[str], list[dict]] | None = None):
        super().__init__(policy, tokenizer, rewards, config or GRPOConfig(), tools, environment_factory,
                         tool_call_parser)
        if self.cfg.beta > 0:
            self.keep_reference()
        if self.cfg.sync_ref_model and self.peft_model is not None:
            raise ValueError("sync_ref_model=True with a LoRA policy: its reference is the base with the adapters "
                             "off, not a model to move (as in TRL); set sync_ref_model=False")
        self.entropy = AdaptiveEntropy(self.cfg)         # the entropy bonus's coefficient (TRL's adaptive control)
        self._refill: RefillPrompts | None = None       # dynamic sampling's refill prompts, built on first use
        self._refill_state: dict | None = None          # their place, from a checkpoint

    def prepare(self, batch: dict[str, list]) -> RolloutBuffer:
        cfg, g = self.cfg, self.cfg.num_generations
        self.check_generation_batch(len(batch["prompt"]))
        s = self.rollout_and_score(batch, g)
        if cfg.dynamic_sampling:
            s = self.dynamically_sampled(s, len(batch["prompt"]))
        ro = s.batch
        data = {"mask": ro.model_mask}                               # [N, T] the model's tokens (tool results 0)
        if cfg.mask_truncated_completions:
            data["mask"] = data["mask"] * ended_rows(ro, self.eos_token_id)[:, None].long()
        data["adv"] = self.advantages(s.rewards, data["mask"], s.per_function)                 # [N]
        if cfg.steps_per_rollout > 1 or cfg.top_entropy_quantile < 1.0:
            old = self.old_scores(ro)
            data["old_logp"] = old.logp
            if cfg.top_entropy_quantile < 1.0:
                data["token_weight"] = high_entropy_mask(old.entropy, data["mask"], cfg.top_entropy_quantile)
        if self.has_reference:
            data["ref_logp"] = self.reference_logp(ro)
        gen = torch.Generator().manual_seed(cfg.seed + self.global_step)
        steps = schedule(len(ro), cfg.steps_per_generation, cfg.num_iterations, False, gen, ro.completion_ids.device)
        return RolloutBuffer(s, data, steps)

    def check_generation_batch(self, prompts: int) -> None:
        """TRL's ``generation_batch_size`` (completions of one rollout, all processes) against what the loader
        gives: ``prompts`` a step on each of the processes, ``num_generations`` each; one error naming the keys,
        before any step."""
        want, world = self.cfg.generation_batch_size, self.trainer.world_size if self._trainer is not None else 1
        have = prompts * self.cfg.num_generations * world
        if want is None or want == have:
            return
        per_rank = want / (self.cfg.num_generations * world)
        fix = (f"task.prompts_per_step={int(per_rank)}" if per_rank.is_integer() else
               f"a generation_batch_size divisible by num_generations x processes = {self.cfg.num_generations * world}")
        raise ValueError(f"algo.generation_batch_size={want} completions a rollout, but the loader gives {prompts} "
                         f"prompts a step x num_generations={self.cfg.num_generations} x {world} process(es) = {have}: "
                         f"set {fix}, or leave generation_batch_size null")

    def dynamically_sampled(self, first, want: int):
        """DAPO's dynamic sampling (:mod:`.dynamic`): more rollouts of refill prompts until ``want`` groups have
        rewards that differ or ``max_num_gen_batches`` rollouts were made; the batch of ``want`` groups."""
        g, scored = self.cfg.num_generations, [first]
        found = int(informative_groups(first.rewards, g).sum())
        while found < want and len(scored) < self.cfg.max_num_gen_batches:
            scored.append(self.rollout_and_score(self.refill_prompts(want).next(), g))
            found += int(informative_groups(scored[-1].rewards, g).sum())
        s, metrics = fill(scored, want, g, self.pad_token_id)
        for name, v in metrics.items():
            self.log(name, v, batch_size=want)
        return s

    def refill_prompts(self, batch_size: int) -> RefillPrompts:
        """The refill source: the training prompts of the Trainer's loader in another order (``seed + 1``)."""
        if self._refill is None:
            if self._trainer is None:
                raise RuntimeError("algo.dynamic_sampling draws refill prompts from the Trainer's training prompts: "
                                   "run it under Trainer.fit")
            loader = self.trainer.train_dataloader
            self._refill = RefillPrompts(loader.dataset, batch_size, loader.collate_fn, self.cfg.seed + 1)
            if self._refill_state is not None:
                self._refill.load_state_dict(self._refill_state)
        return self._refill

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = self._refill.state_dict() if self._refill is not None else self._refill_state
        if state is not None:
            checkpoint["dynamic_sampling_refill"] = state
        checkpoint["adaptive_entropy"] = self.entropy.state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self._refill_state, self._refill = checkpoint.get("dynamic_sampling_refill"), None
        if "adaptive_entropy" in checkpoint:
            self.entropy.load_state_dict(checkpoint["adaptive_entropy"])

    def on_train_start(self) -> None:
        super().on_train_start()
        if self.cfg.dynamic_sampling and self._trainer is not None and self.trainer.world_size > 1:
            raise ValueError("algo.dynamic_sampling runs on one process only (ranks would make different numbers of "
                             "rollouts and wait on each other): set it false under DDP/FSDP")

    def advantages(self, rewards: Tensor, mask: Tensor, per_function: Tensor | None = None) -> Tensor:
        """``[N]`` advantages of ``[N]`` rewards by ``advantage_estimator``: ``grpo`` (group mean removed, scaled
        by ``scale_rewards``; with ``multi_objective_aggregation=normalize_then_sum`` GDPO's from the ``[N, F]``
        rewards of each function), ``rloo`` (leave-one-out baseline, unscaled) or ``reinforce_pp`` (group mean
        removed, whitened over the batch's loss tokens ``mask [N, T]``)."""
        cfg, g = self.cfg, self.cfg.num_generations
        if cfg.multi_objective_aggregation == "normalize_then_sum":
            if per_function is None:
                raise ValueError("multi_objective_aggregation=normalize_then_sum needs each reward function's values")
            weights = torch.tensor([r.weight for r in self.rewards], dtype=per_function.dtype,
                                   device=per_function.device)
            return gdpo_advantages(per_function, weights, g)
        if cfg.advantage_estimator == "rloo":
            return rloo_advantages(rewards, g)
        if cfg.advantage_estimator == "reinforce_pp":
            return reinforce_pp_advantages(rewards, g, mask.sum(1))
        batch_std = gather_rows(rewards).std() if cfg.scale_rewards == "batch" else None
        return group_advantages(rewards, g, cfg.scale_rewards, batch_std)

    def step_loss(self, buf: RolloutBuffer, rows: Tensor, totals: Totals) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, d = self.cfg, buf.data
        mask = d["mask"][rows]
        sc = self.scores(self.policy, buf.scored.batch, rows)                                   # [n, T] each
        old = d["old_logp"][rows] if "old_logp" in d else sc.logp.detach()
        weights, stats = self.corrected(old, buf.scored.batch.logprobs[rows], mask, totals)
        sampler_ratio = None
        if cfg.loss_type == "vespo":   # VESPO folds the correction into its sequence weight
            sampler_ratio, weights = weights, None
        if "token_weight" in d:
            weights = d["token_weight"][rows] if weights is None else weights * d["token_weight"][rows]
        if cfg.off_policy_mask_threshold is not None:
            keep = off_policy_mask(d["adv"][rows], sc.logp, buf.scored.batch.logprobs[rows], mask,
                                   cfg.off_policy_mask_threshold)                                # [n, 1]
            weights = keep if weights is None else weights * keep
        ref = d["ref_logp"][rows] if "ref_logp" in d else None
        loss, part = grpo_loss(sc.logp, old, ref, d["adv"][rows], mask, cfg, totals, weights, sampler_ratio)
        if self.entropy.enabled:   # TRL's bonus: on the same tokens as the policy term
            m = mask.float() * d["token_weight"][rows] if "token_weight" in d else mask.float()
            loss = loss - self.entropy.coef_now() * entropy_bonus(sc.entropy, m, cfg.loss_type, totals)
            self.entropy.add(sc.entropy.detach(), m)
        part["entropy"] = token_mean(sc.entropy.detach(), mask.float(), totals)
        return loss, {**part, **stats}

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """After each optimizer step -- before any callback's end-of-batch hook, so that the step's checkpoint
        holds the result: the adaptive entropy coefficient's update, and TRL's ``sync_ref_model`` (every
        ``ref_model_sync_steps`` optimizer steps ``ref = alpha * policy + (1 - alpha) * ref``)."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        cfg = self.cfg
        if self.entropy.enabled:
            self.entropy.step()
        if cfg.sync_ref_model and self.reference is not None and self.global_step % cfg.ref_model_sync_steps == 0:
            mix_into(self.reference, self.policy, cfg.ref_model_mixup_alpha)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.entropy.enabled:
            self.log("train/entropy_coef", self.entropy.coef, batch_size=len(batch["prompt"]))


@torch.no_grad()
def mix_into(target: nn.Module, source: nn.Module, alpha: float) -> None:
    """``target = alpha * source + (1 - alpha) * target``, parameter by parameter, in place (each in its own
    dtype and placement)."""
    for t, src in zip(target.parameters(), source.parameters(), strict=True):
        t.mul_(1.0 - alpha).add_(src.to(t.dtype), alpha=alpha)


class AdaptiveEntropy:
    """The entropy bonus's coefficient: ``entropy_coef``, or with ``use_adaptive_entropy`` TRL's controller
    (Skywork-OR1): applied only while the previous optimizer step's mean token entropy (all ranks, the policy
    term's tokens) is at or below ``entropy_target``, raised by ``entropy_coef_delta`` after a step at or below it
    (up to ``entropy_coef_max``) and lowered otherwise (down to ``entropy_coef_min``). Its state is checkpointed."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg, self.coef = cfg, cfg.entropy_coef
        self.enabled = cfg.entropy_coef != 0.0 or cfg.use_adaptive_entropy
        self.last = math.inf                 # the previous step's entropy (TRL: +inf before the first)
        self._window: Tensor | None = None   # [2] this step's entropy sum and token count (this rank)

    def coef_now(self) -> float:
        if self.cfg.use_adaptive_entropy and self.last > self.cfg.entropy_target:
            return 0.0
        return self.coef

    def add(self, entropy: Tensor, mask: Tensor) -> None:
        part = torch.stack([(entropy.double() * mask).sum(), mask.double().sum()])
        self._window = part if self._window is None else self._window + part

    def step(self) -> None:
        """At an optimizer step's end: the step's entropy over every rank, then the coefficient's update."""
        if self.cfg.use_adaptive_entropy and self._window is not None:
            totals = global_sum(self._window)
            world = float(totals[0] / totals[1].clamp(min=1.0))
            c = self.cfg
            self.coef = (min(self.coef + c.entropy_coef_delta, c.entropy_coef_max) if world <= c.entropy_target
                         else max(self.coef - c.entropy_coef_delta, c.entropy_coef_min))
            self.last = world
        self._window = None

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last}

    def load_state_dict(self, state: dict) -> None:
        self.coef, self.last = float(state["entropy_coef"]), float(state["last_world_entropy"])
