"""What GRPO and PPO share: rollout + scoring of a prompt batch, token scores of row slices, the optimizer
(fp32 master weights for half-precision models), micro-batched steps, step timing and logging."""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..inject import is_injected
from ..lightning import SegKIRolloutMixin
from ..lightning.fsdp import is_model_parallel, is_sharded, reshard, shard_frozen, shard_policy, whole
from ..lightning.mixin import is_conversation
from ..rollout import RolloutBatch, RolloutStats, SamplingConfig
from ..rollout.stops import StopStrings
from .buffer import RolloutBuffer
from .correction import importance_weights, mismatch_stats
from .flops import FlopShape, peak_flops
from .gc_clock import GcClock
from .logprobs import TokenScores, completion_logprobs, packs
from .lora import is_peft
from .losses import Totals
from .optim import build_optimizer, build_scheduler, refuse_on_shards
from .reward_model import RewardModel
from .rewards import RewardFn, RewardLogs, TrainerState, WeightedReward, as_rewards, reward_table, summarize
from .metrics import completions_table, write_completions
from .nonfinite import NonFiniteError, check
from .task import check_batch, completion_token_ids, cut_at_stop_strings, decode
from .tools import (ToolSession, check_environment, environment_reward, environment_tools, parse_tool_calls,
                    with_text)
from .update import LossFn, accumulate, micro_batches


_ALLOCATOR_COUNTERS = {"device_allocs": "num_device_alloc", "device_frees": "num_device_free",
                       "alloc_retries": "num_alloc_retries"}


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's running counts of driver allocations, frees and flush-and-retry allocations
    (the counters this PyTorch has; ``torch.cuda.memory_stats``)."""
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats[key]) for name, key in _ALLOCATOR_COUNTERS.items() if key in stats}


@dataclass
class Scored:
    """One scored rollout: rows prompt-major, ``n`` completions per prompt."""

    batch: RolloutBatch
    prompts: list[str]           # [N] the prompt of each row
    texts: list[str]             # [N] decoded completions
    rewards: Tensor              # [N] fp32 weighted reward
    means: dict[str, float]      # mean of each reward function
    rollout_s: float
    tools: dict[str, float] | None = None   # multi-turn rollouts: tool-call metrics by name
    per_function: Tensor | None = None      # [N, F] fp32 each reward function's value, NaN where it does not apply
    reward_logs: RewardLogs | None = None   # what the reward functions logged (TRL's log_metric / log_extra)


def ended_rows(ro: RolloutBatch, eos_token_id: int) -> Tensor:
    """``[N]`` bool: the rows that ended -- an EOS among their tokens, or a stop string -- rather than running out of
    ``max_completion_length`` (TRL's truncated completions are the others)."""
    ended = (ro.completion_ids == eos_token_id).any(1)
    return ended if ro.stopped is None else ended | ro.stopped


def row_lengths(ro: RolloutBatch, rows: Tensor) -> Tensor:
    """``[n]`` real tokens (prompt + completion) of rows ``rows`` of a rollout."""
    return ro.prompt_mask[rows].sum(1) + ro.completion_mask[rows].sum(1)


class RLModule(SegKIRolloutMixin, pl.LightningModule):
    """Base of the RL LightningModules: ``self.policy`` trained in place, rollouts from the same weights."""

    def __init__(self, policy: nn.Module, tokenizer: Any, rewards: list[RewardFn | WeightedReward], cfg: Any,
                 tools: Sequence[Callable] = (), environment_factory: Callable[[], Any] | None = None,
                 tool_call_parser: Callable[[str], list[dict]] | None = None):
        super().__init__()
        self.__dict__["peft_model"] = policy if is_peft(policy) else None   # kept out of the module tree
        if self.peft_model is not None:   # compute on the transformers model inside (its layers carry the adapters)
            policy = policy.get_base_model()
        self.policy, self.tokenizer, self.cfg = policy, tokenizer, cfg
        if cfg.disable_dropout:   # TRL's disable_dropout_in_model: LoRA's dropout too
            for m in policy.modules():
                if isinstance(m, nn.Dropout):
                    m.p = 0.0
        # TRL's tools and environment_factory (:mod:`.tools`): multi-turn rollouts when either is given
        self.tools, self.environment_factory = list(tools), environment_factory
        self.tool_call_parser = tool_call_parser or parse_tool_calls
        self.chat_tools, env_reward = self.tools, None
        self.chat_template_kwargs = dict(cfg.chat_template_kwargs or {})   # every chat rendering (TRL's)
        self._environments: list = []   # built once, reset for every rollout (TRL's pool); grows to the rows needed
        if environment_factory is not None:
            probe = environment_factory()
            check_environment(probe)
            self._environments.append(probe)
            self.chat_tools = self.tools + list(environment_tools(probe).values())
            if callable(getattr(probe, "get_reward", None)):
                env_reward = WeightedReward(environment_reward, 1.0, type(probe).__name__)
        if env_reward is not None and not rewards:   # the environment owns the reward (TRL: then rewards may be empty)
            self.rewards = [env_reward]
        else:
            self.rewards = as_rewards(rewards, cfg.reward_weights) + ([env_reward] if env_reward else [])
        for r in self.rewards:   # a reward model renders conversations with the run's template kwargs (TRL's)
            if isinstance(r.fn, RewardModel) and r.fn.chat_template_kwargs is None:
                r.fn.chat_template_kwargs = dict(self.chat_template_kwargs)
        self.eos_token_id = tokenizer.eos_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self._step_started = 0.0
        self._last_rollout_s = 0.0
        self._last_train_tokens = 0
        self._times: dict[str, float] = {}        # this step's parts (time/<part>_s), see _timed
        self._step_flops = 0.0                    # model FLOPs of this step's training passes (see .flops)
        self._gc = GcClock()                      # the interpreter's collection pauses (time/gc_s), while training
        self._allocs_before: dict[str, int] = {}  # the CUDA allocator's counters at the step's start
        self._flop_shape: FlopShape | None = None
        self._nonfinite_skipped = 0               # steps skipped for non-finite values (on_nonfinite=skip_step)
        self._part = "rollout"                    # the step's part running now (named by an out-of-memory error)
        self._buffer: RolloutBuffer | None = None
        self.reference: nn.Module | None = None   # the frozen KL reference (see keep_reference)
        self._reference_is_base = False           # a LoRA policy's reference: its base, adapters off

    def keep_reference(self) -> None:
        """Freeze a copy of the policy as it starts: the reference of the algorithm's KL term. A LoRA policy's
        reference is its own base, adapters switched off (no copy)."""
        if self.peft_model is not None:
            self._reference_is_base = True
            return
        self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self._reference_is_base

    # ------------------------------------------------------------------------------------ the RL step
    def prepare(self, batch: dict[str, list]) -> RolloutBuffer:
        """Roll out and score ``batch``; return the buffer the next optimizer steps read."""
        raise NotImplementedError

    def step_loss(self, buf: RolloutBuffer, rows: Tensor, totals: Totals) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss and stats of rows ``rows`` (a micro-batch) of the buffer, normalised by ``totals``."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, list], batch_idx: int) -> Tensor | None:
        """One optimizer step: a new rollout when the buffer is used up (the batch is ignored otherwise: the
        recipe's loader repeats each batch for the steps of one rollout), then the next rows, micro-batched. A
        non-finite reward or loss stops here, before any update (see :meth:`on_nonfinite`)."""
        self._last_rollout_s = 0.0
        self._times, self._step_flops = {}, 0.0
        try:
            return self._train_step(batch)
        except NonFiniteError as err:
            return self.on_nonfinite(err)
        except torch.OutOfMemoryError as err:
            raise torch.OutOfMemoryError(self._out_of_memory_message()) from err

    def _train_step(self, batch: dict[str, list]) -> Tensor:
        if not self._buffer:
            check_batch(batch)
            self._part = "rollout"
            self._buffer = self.prepare(batch)
            self._last_rollout_s = self._buffer.scored.rollout_s
            self.log_rollout(self._buffer.scored, len(batch["prompt"]))
        buf = self._buffer
        rows = buf.next_rows()
        mask = buf.data["mask"][rows]
        totals = Totals.of(mask)
        ro = buf.scored.batch
        self._last_train_tokens = int(row_lengths(ro, rows).sum())
        self._times["update"] = -self._now()   # completed in on_train_batch_end, after the optimizer step
        self._part = "update"
        self._count_flops(ro, rows)

        def loss_fn(r: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            start = self._now()   # the previous micro-batch's backward drained (its scores() would wait anyway)
            loss, stats = self.step_loss(buf, r, totals)
            check("the loss", loss)   # before its backward: no non-finite gradient is accumulated; one sync
            self._times["forward"] = self._times.get("forward", 0.0) + time.perf_counter() - start
            return loss, stats

        loss, total, stats = self.accumulate(ro, rows, loss_fn)
        self.log_step(total, stats, len(batch["prompt"]))
        return loss

    def on_nonfinite(self, err: NonFiniteError) -> None:
        """``on_nonfinite=raise``: stop the run with the step and the quantity; ``skip_step``: drop the step's
        gradients (and the rollout, if its rewards were the cause) so that the optimizer changes nothing, count
        it (``train/nonfinite_skipped``) and go on."""
        msg = f"step {self.global_step}: {err}"
        if self.cfg.on_nonfinite == "raise":
            raise NonFiniteError(f"{msg}. The run stops before the optimizer step (algo.on_nonfinite=skip_step "
                                 "skips such steps instead)") from None
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn(f"segki: {msg}; the step is skipped (algo.on_nonfinite=skip_step)")
        self.zero_grad(set_to_none=True)
        if err.of_rollout:
            self._buffer = None
        self._nonfinite_skipped += 1
        self.log("train/nonfinite_skipped", float(self._nonfinite_skipped), reduce_fx="max")
        return None

    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        """Rollouts of held-out prompts (graph-captured on GPU like training's): one greedy completion each, or
        ``num_generations_eval`` sampled ones (TRL's knob; the training sampling settings, seeded by the step):
        ``val/reward``, ``val/rewards/<function>``, ``val/completion_length``."""
        check_batch(batch)
        n = self.cfg.num_generations_eval
        try:
            s = self.rollout_and_score(batch, n or 1, greedy=n is None)
        except NonFiniteError as err:
            if self.cfg.on_nonfinite == "raise":
                raise NonFiniteError(f"validation at step {self.global_step}: {err}") from None
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(f"segki: validation at step {self.global_step}: {err}; this batch is not scored")
            return
        kw = dict(batch_size=len(batch["prompt"]), sync_dist=True)
        self.log("val/reward", s.rewards.mean(), prog_bar=True, **kw)
        for name, v in s.means.items():
            self.log(f"val/rewards/{name}", v, **kw)
        self.log_reward_metrics(s, "val", **kw)
        self.log("val/completion_length", s.batch.completion_mask.sum(1).float().mean(), **kw)

    @torch.no_grad()
    def score_all(self, model: nn.Module, ro: RolloutBatch, value_head: nn.Module | None = None) -> TokenScores:
        """Token scores of every row under ``model`` without gradients, in micro-batches (old and reference
        log-probs, entropies, values)."""
        rows = torch.arange(len(ro), device=ro.completion_ids.device)
        parts = [self.scores(model, ro, r, value_head) for r in self.micro_batches(model, ro, rows)]
        self._count_flops(ro, rows, backward=False)
        return TokenScores(*(None if p[0] is None else torch.cat(p) for p in zip(*parts)))

    def old_scores(self, ro: RolloutBatch, value_head: nn.Module | None = None) -> TokenScores:
        """:meth:`score_all` of the policy as it rolled out (the old log-probs), timed as ``time/old_logprob_s``."""
        with self._timed("old_logprob"):
            return self.score_all(self.policy, ro, value_head)

    def reference_logp(self, ro: RolloutBatch) -> Tensor:
        """``[N, T]`` log-probs of every row under the frozen KL reference (``time/reference_s``). Under FSDP its
        gathered root weights (embeddings, head) are released afterwards: no backward ever does it for a frozen
        model."""
        with self._timed("reference"):
            if self._reference_is_base:
                with self.peft_model.disable_adapter():   # the base alone
                    return self.score_all(self.policy, ro).logp
            logp = self.score_all(self.reference, ro).logp
            reshard(self.reference)
        return logp

    def micro_batches(self, model: nn.Module, ro: RolloutBatch, rows: Tensor) -> list[Tensor]:
        """Pieces of ``rows`` of at most ``micro_batch_size`` rows and ``micro_batch_tokens`` tokens (real tokens
        when ``model`` runs them packed, rows x the longest otherwise)."""
        c = self.cfg
        lengths = row_lengths(ro, rows) if c.micro_batch_tokens else None
        return micro_batches(rows, c.micro_batch_size, c.micro_batch_tokens, lengths, self.packed(model))

    def packed(self, model: nn.Module) -> bool:
        """Whether training passes of ``model`` run their rows packed (``padding_free`` and a forward that takes
        packed rows, see :func:`~segki_lightning.rl.logprobs.packs`)."""
        return bool(self.cfg.padding_free) and packs(model, is_injected(model))

    def _count_flops(self, ro: RolloutBatch, rows: Tensor, backward: bool = True) -> None:
        """Add the model FLOPs of a training pass over ``rows`` (forward + backward, or a forward alone) to this
        step's."""
        if self._flop_shape is None:
            self._flop_shape = FlopShape.of(self.policy)
        lengths, scored = row_lengths(ro, rows).tolist(), int(ro.completion_mask[rows].sum())
        shape = self._flop_shape
        self._step_flops += shape.training(lengths, scored) if backward else shape.forward(lengths, scored)

    def _now(self) -> float:
        """A wall clock that has waited for this device's queue."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextlib.contextmanager
    def _timed(self, part: str):
        """Add the wall time of the block (the device's queue drained at both ends) to ``time/<part>_s``."""
        start, outer, self._part = self._now(), self._part, part
        try:
            yield
        finally:
            self._times[part] = self._times.get(part, 0.0) + self._now() - start
        self._part = outer   # not on an error: the error names the part it hit

    def corrected(self, trainer_logp: Tensor, sampler_logp: Tensor, mask: Tensor, totals: Totals
                  ) -> tuple[Tensor | None, dict[str, Tensor]]:
        """Importance weights of the sampler/trainer correction (None when it is off) and the mismatch stats
        (shares of the batch's token means; the ``_max`` stat is a maximum)."""
        c = self.cfg
        weights, outside = importance_weights(trainer_logp, sampler_logp, mask, c.importance_sampling_mode,
                                              c.importance_sampling_clip_max, c.importance_sampling_clip_min)
        stats = mismatch_stats(trainer_logp, sampler_logp, mask, outside, totals)
        kind = "masked" if c.importance_sampling_mode.endswith("mask") else "truncated"
        stats[f"is_{kind}_frac"] = stats.pop("is_outside_frac")
        return (weights if c.importance_sampling_correction else None), {f"rollout/{k}": v for k, v in stats.items()}

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy`` (``trainer.strategy=fsdp``): shard the policy and the other
        trainable modules with FSDP2 (fp32 shards, computing in the policy's dtype; see
        :mod:`segki_lightning.lightning.fsdp`). Under any other strategy on a GPU: a warning when the replicated
        training state alone would not fit (see :mod:`segki_lightning.rl.sizing`)."""
        if self._trainer is None or is_sharded(self.policy):
            return
        if not is_model_parallel(self.trainer.strategy):
            self._warn_if_replicated_state_does_not_fit()
            return
        refuse_on_shards(self.cfg.optim)   # before sharding: nothing is built for a run that cannot step
        if self.trainer.precision not in ("32-true", "32"):
            raise ValueError(f"under FSDP (ModelParallelStrategy) use precision='32-true', not "
                             f"{self.trainer.precision!r}: the fp32 shards are the master weights and the layers "
                             "compute in the policy's own dtype (load it in bf16 for bf16 compute)")
        extra = tuple(m for name, m in self.named_children() if name != "policy"
                      and any(p.requires_grad for p in m.parameters()))
        self.compute_dtype = shard_policy(self.policy, self.device_mesh["data_parallel"], extra)
        if self.reference is not None:
            shard_frozen(self.reference, self.device_mesh["data_parallel"])

    def _out_of_memory_message(self) -> str:
        """:func:`~segki_lightning.rl.sizing.out_of_memory_message` for this step, with the device's numbers."""
        from .sizing import out_of_memory_message, replicated_state_bytes

        allocated = total = 0
        if self.device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
        return out_of_memory_message(self.global_step, self._part, self.cfg,
                                     bool(getattr(self.policy, "is_gradient_checkpointing", False)),
                                     is_sharded(self.policy),
                                     replicated_state_bytes(self, self.cfg.master_weights, self.cfg.optim),
                                     allocated, total)

    def _warn_if_replicated_state_does_not_fit(self) -> None:
        from lightning.pytorch.utilities import rank_zero_warn

        from .sizing import replicated_state_warning

        root = self.trainer.strategy.root_device
        if root.type != "cuda":
            return
        message = replicated_state_warning(self, self.cfg.master_weights,
                                           torch.cuda.get_device_properties(root).total_memory, self.cfg.optim)
        if message:
            rank_zero_warn(message)

    def configure_optimizers(self):
        """AdamW (``optim``, ``adam_beta1``/``adam_beta2``/``adam_epsilon``; fp32 masters for half-precision
        weights) and the per-step ``lr_scheduler_type`` schedule."""
        c = self.cfg
        opt = build_optimizer(self.parameters(), c.learning_rate, c.weight_decay, c.master_weights, c.optim,
                              (c.adam_beta1, c.adam_beta2), c.adam_epsilon)
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        sched = build_scheduler(opt, c.lr_scheduler_type, max(total, 1), c.warmup_steps, c.warmup_ratio)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """``max_grad_norm`` (TRL) clips the gradient norm; a Trainer ``gradient_clip_val`` takes precedence."""
        if gradient_clip_val is None and self.cfg.max_grad_norm is not None:
            gradient_clip_val, gradient_clip_algorithm = self.cfg.max_grad_norm, "norm"
        self.clip_gradients(optimizer, gradient_clip_val=gradient_clip_val,
                            gradient_clip_algorithm=gradient_clip_algorithm)

    def on_before_optimizer_step(self, optimizer) -> None:
        """The gradient norm before clipping and the learning rate of this step (TRL's ``grad_norm``,
        ``learning_rate``). From here to the end of the optimizer's step (the norm, clipping, the step itself) is
        ``time/optimizer_s``, a part of ``time/update_s``."""
        if "update" in self._times:
            self._times["optimizer"] = -self._now()
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(torch.stack([whole(torch.linalg.vector_norm(g.float())) for g in grads]))
            try:
                check("the gradient norm", norm)
            except NonFiniteError as err:
                self.on_nonfinite(err)   # raises, or drops every gradient: the optimizer then steps nothing
                return
            self.log("train/grad_norm", norm, sync_dist=True)
        self.log("train/learning_rate", float(optimizer.param_groups[0]["lr"]))

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        """Nothing here: Lightning zeroes between ``training_step`` and its backward, which would drop the
        micro-batches ``training_step`` has already back-propagated. :meth:`optimizer_step` zeroes instead,
        right after each step (so ``accumulate_grad_batches`` still sums over its batches)."""

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        optimizer.step(closure=optimizer_closure)
        optimizer.zero_grad(set_to_none=True)
        if self._times.get("optimizer", 0.0) < 0:
            self._times["optimizer"] += self._now()

    def scores(self, model: nn.Module, ro: RolloutBatch, rows: Tensor, value_head: nn.Module | None = None
               ) -> TokenScores:
        """Token scores of rows ``rows`` of a rollout under ``model`` (``[n, T]`` each), on the columns those
        rows use: prompt columns that are padding in every row and completion columns past the longest
        completion are not computed (their scores are 0)."""
        pm, cm = ro.prompt_mask[rows], ro.completion_mask[rows]
        first = int(pm.any(0).int().argmax()) if pm.any() else pm.shape[1] - 1
        width = max(int(cm.sum(1).max()), 1)
        s = completion_logprobs(model, ro.prompt_ids[rows, first:], pm[:, first:], ro.completion_ids[rows, :width],
                                cm[:, :width], self.cfg.temperature, value_head, self.cfg.logprob_chunk,
                                packed=self.packed(model))
        pad = cm.shape[1] - width
        return TokenScores(*(None if t is None else F.pad(t, (0, pad)) for t in s))

    def accumulate(self, ro: RolloutBatch, rows: Tensor, loss_fn: LossFn) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """``loss_fn`` over the policy's micro-batches of ``rows`` (see :meth:`micro_batches`, :mod:`.update`)."""
        return accumulate(self.micro_batches(self.policy, ro, rows), loss_fn, self._backward)

    def _backward(self, loss: Tensor) -> None:
        """Back-propagate an intermediate micro-batch the way Lightning back-propagates the step's loss:
        divided by ``accumulate_grad_batches`` (as Lightning divides what ``training_step`` returns), through the
        precision plugin (loss scaling, hooks); plain ``backward`` outside a Trainer."""
        if self._trainer is not None:
            self.trainer.strategy.backward(loss / self.trainer.accumulate_grad_batches, None)
        else:
            loss.backward()

    def sampling(self, n: int, greedy: bool = False) -> SamplingConfig:
        c = self.cfg
        if greedy:
            return SamplingConfig(max_new_tokens=c.max_completion_length, temperature=0.0, n=n,
                                  repetition_penalty=c.repetition_penalty)
        return SamplingConfig(max_new_tokens=c.max_completion_length, temperature=c.temperature, top_k=c.top_k,
                              top_p=c.top_p, min_p=c.min_p or 0.0, repetition_penalty=c.repetition_penalty, n=n,
                              seed=c.seed + self.global_step)

    def prompt_ids(self, prompts: list) -> list[list[int]]:
        """Token ids of each prompt (string, conversation or ids), cut from the left to ``max_prompt_length``."""
        keep = self.cfg.max_prompt_length
        return [ids[-keep:] if keep else ids for ids in (self._prompt_ids(p) for p in prompts)]

    def rollout_and_score(self, batch: dict[str, list], n: int, greedy: bool = False) -> Scored:
        """Roll out ``n`` completions of every prompt of ``batch`` and score them with the reward functions, which
        get what TRL passes: the prompts as given and, for conversations, each completion as one assistant message."""
        t0 = time.perf_counter()
        prompts, session, envs = [p for p in batch["prompt"] for _ in range(n)], None, None
        if self.tools or self.environment_factory is not None:
            ro, prompts, session, envs = self.tool_rollout(batch, n, greedy)
        else:
            ids, sampling = self.prompt_ids(batch["prompt"]), self.sampling(n, greedy)
            if self.cfg.stop_strings:   # the engine stops rows early; a subclass's two-argument rollout still works
                ro = self.rollout(ids, sampling, StopStrings(self.tokenizer, self.cfg.stop_strings))
            else:
                ro = self.rollout(ids, sampling)
        if self.cfg.stop_strings:
            ro.stopped = cut_at_stop_strings(ro.completion_ids, ro.completion_mask, self.tokenizer,
                                             self.cfg.stop_strings).to(ro.completion_mask.device)
        rollout_s = time.perf_counter() - t0
        texts = decode(self.tokenizer, ro.completion_ids, ro.completion_mask)
        columns = {k: [v for v in vals for _ in range(n)] for k, vals in batch.items() if k != "prompt"}
        chat = is_conversation(prompts[0])
        if session is not None and chat:   # TRL's: the turns as messages, tool results included
            completions = session.messages
        else:
            completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        extra = {"environments": envs} if envs is not None else {}
        logs = RewardLogs()   # TRL's keywords besides the columns: progress, and two ways to log from a reward
        extra.update(trainer_state=TrainerState(self.global_step, self.trainer.max_steps if self._trainer else -1,
                                                self.current_epoch),
                     log_metric=logs.log_metric, log_extra=logs.log_extra)
        for r in self.rewards:   # reward models score where the module runs
            if isinstance(r.fn, RewardModel) and r.fn.device != self.device:
                r.fn.to(self.device)
        table = reward_table(self.rewards, prompts, completions, columns, completion_ids=completion_token_ids(
            ro.completion_ids, ro.completion_mask), **extra)
        total, means = summarize(self.rewards, table)
        rewards = torch.tensor(total, dtype=torch.float32, device=self.device)
        per_function = torch.tensor(table, dtype=torch.float32, device=self.device).T          # [N, F]
        tools = None if session is None else {"tools/call_frequency": session.calls / len(ro),
                                              "tools/failure_frequency": session.failures / max(session.calls, 1),
                                              "time/rollout_tools_s": session.tool_s}
        return Scored(ro, prompts, texts, rewards, means, rollout_s, tools, per_function, logs)

    def environment_pool(self, rows: int) -> list:
        """``rows`` environments: those built for earlier rollouts, and new ones from the factory past them
        (TRL's contract: construct once, reset for every rollout)."""
        while len(self._environments) < rows:
            env = self.environment_factory()
            check_environment(env)
            self._environments.append(env)
        return self._environments[:rows]

    def tool_rollout(self, batch: dict[str, list], n: int, greedy: bool):
        """A multi-turn rollout with TRL's tools / environment_factory: one environment per row, reset with the
        row's columns (text it returns joins the prompt's last user message), then turns of the engine with a
        :class:`~segki_lightning.rl.tools.ToolSession` between them. Rows are prompt-major as in a single-turn
        rollout (``n`` per prompt); returns ``(batch, prompts [N], session, environments [N] or None)``."""
        envs = None if self.environment_factory is None else self.environment_pool(len(batch["prompt"]) * n)
        prompts = []
        for i, prompt in enumerate(batch["prompt"]):
            row = {k: vals[i] for k, vals in batch.items()}
            for k in range(n):
                prompts.append(prompt if envs is None else with_text(prompt, envs[i * n + k].reset(**row)))
        session = ToolSession(self.tokenizer, self.tools, envs, len(prompts), self.tool_call_parser,
                              self.chat_template_kwargs)
        rounds = self.cfg.max_tool_calling_iterations
        max_turns = 1 + (rounds if rounds is not None else self.cfg.max_completion_length)
        ro = self.rollout_turns(self.prompt_ids(prompts), self.sampling(1, greedy), session.respond, max_turns)
        ro.prompt_index = torch.arange(len(prompts), device=ro.prompt_index.device) // n
        return ro, prompts, session, envs

    def log_rollout(self, s: Scored, n_prompts: int) -> None:
        """Metrics of a new rollout (reduced across ranks; tokens/s summed)."""
        kw = dict(batch_size=n_prompts, sync_dist=True)
        self.log("train/reward", s.rewards.mean(), prog_bar=True, **kw)
        self.log("train/reward_std", s.rewards.std() if len(s.rewards) > 1 else torch.zeros(()), **kw)
        for name, v in s.means.items():
            self.log(f"train/rewards/{name}", v, **kw)
        self.log_reward_metrics(s, "train", **kw)
        self.log("train/completion_length", s.batch.model_mask.sum(1).float().mean(), **kw)
        if s.batch.turns is not None:   # multi-turn: turns, tool calls (TRL's names), appended tokens
            st = s.batch.stats
            self.log("rollout/turns", s.batch.turns.float().mean(), **kw)
            self.log("rollout/observation_tokens", float(st.observation_tokens) / len(s.batch), **kw)
            self.log("rollout/observations_cut", float(st.observations_cut), **kw)
            self.log("time/rollout_respond_s", st.respond_s, **kw)
            self.log("rollout/respond_share", st.respond_s / max(s.rollout_s, 1e-9), **kw)   # tools' share
            for name, v in (s.tools or {}).items():
                self.log(name, float(v), **kw)
        self.log("rollout/tokens_per_s", s.batch.stats.tokens / max(s.rollout_s, 1e-9), prog_bar=True,
                 batch_size=n_prompts, sync_dist=True, reduce_fx="sum")
        # the engine's parts of time/rollout_s: before the prefill (checks, packing, captures), the prompts' forward
        # and the decode loop (GPU drained at each end), the batch's assembly after it
        for part in RolloutStats.PARTS:
            self.log(f"time/rollout_{part}_s", getattr(s.batch.stats, f"{part}_s"), **kw)
        every = getattr(self.cfg, "log_completions_every", 0)
        if every and self.global_step % every == 0 and self.global_rank == 0:
            keep = self.cfg.num_completions_to_print   # TRL's: None keeps them all
            extra = s.reward_logs.columns if s.reward_logs is not None else {}
            rows = [dict(step=self.global_step, prompt=p, completion=c, reward=float(r),
                         **{k: v[i] for k, v in extra.items() if i < len(v)})
                    for i, (p, c, r) in enumerate(list(zip(s.prompts, s.texts, s.rewards.tolist()))[:keep])]
            write_completions(self.loggers, rows, self.global_step)
            if self.cfg.log_completions:
                print(completions_table(rows), flush=True)

    def log_reward_metrics(self, s: Scored, prefix: str, **kw: Any) -> None:
        """The scalars the reward functions logged with ``log_metric``: their mean, as ``<prefix>/<name>``."""
        for name, values in (s.reward_logs.metrics if s.reward_logs is not None else {}).items():
            self.log(f"{prefix}/{name}", sum(values) / len(values), **kw)

    def log_step(self, loss: Tensor, stats: dict[str, Tensor], n_prompts: int) -> None:
        """Metrics of every optimizer step: the loss and the loss's stats (``train/...``, or as named)."""
        kw = dict(batch_size=n_prompts, sync_dist=True)
        self.log("train/loss", loss.detach(), **kw)
        for name, v in stats.items():
            self.log(name if "/" in name and name.split("/")[0] in ("rollout", "train") else f"train/{name}", v,
                     reduce_fx="max" if name.endswith("_max") else "mean", **kw)

    def on_train_start(self) -> None:
        """The policy trains in train mode (Lightning keeps each submodule's mode, and ``from_pretrained``
        returns models in eval mode: activation checkpointing and dropout would silently be off); the
        reference model stays in eval mode. ``on_nonfinite=skip_step`` needs one process."""
        if self.cfg.on_nonfinite == "skip_step" and self.trainer.world_size > 1:
            raise ValueError("algo.on_nonfinite=skip_step runs on one process only (ranks would skip different "
                             "steps and wait on each other): use algo.on_nonfinite=raise under DDP/FSDP")
        self.policy.train()
        self._continue_schedule()
        self._gc.start(freeze=self.cfg.gc_freeze)

    def teardown(self, stage: str) -> None:
        self._gc.stop()
        super().teardown(stage)

    def _continue_schedule(self) -> None:
        """The next step's learning rate from the schedule as built for THIS run's ``trainer.max_steps``, at the
        step the run (re)starts from. A resumed checkpoint's optimizer holds the rate of the step it stopped
        after -- 0.0 at the end of a finished linear schedule -- so a run resumed with a larger ``max_steps``
        would take its first new step at that rate; an interrupted run resumed with the same ``max_steps`` gets
        the very rate it had (the same formula, the same float)."""
        if self._trainer is None:
            return
        for conf in self.trainer.lr_scheduler_configs:
            sched = conf.scheduler
            if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):   # transformers' get_scheduler kinds
                for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                    group["lr"] = base * fn(sched.last_epoch)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._allocs_before = _allocator_counts(self.device)
        self._gc.take()
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Wall time of the whole step (rollout, scoring, forward, backward, optimizer; the GPU's queue
        drained) and of its parts -- ``time/update_s`` (the micro-batches' forward and backward and the optimizer
        step: ``time/forward_s`` the forwards with their losses, ``time/optimizer_s`` the gradient norm, clipping
        and step, ``time/backward_s`` the rest), ``time/old_logprob_s`` and
        ``time/reference_s`` on the steps that run those passes -- the rollout's share, trained tokens (prompt +
        completion) per second of the rest, the model FLOPs rate of the rest (``time/train_tflops``; ``time/mfu``
        against the GPU's dense bf16 peak where it is known, see :mod:`.flops`), the step's peak GPU memory, the
        caching allocator's trips to the driver (``memory/device_allocs``, ``memory/device_frees``,
        ``memory/alloc_retries``: an allocation that misses its cache waits on the driver, a retry synchronizes the
        device) and the garbage-collection pauses (``time/gc_s``; ``time/gc_full`` the collections of the oldest
        generation, see :mod:`.gc_clock`)."""
        now = self._now()
        gc_s, gc_full = self._gc.take()
        if self.device.type == "cuda":
            self.log("memory/peak_gib", torch.cuda.max_memory_allocated(self.device) / 2**30,
                     batch_size=len(batch["prompt"]), sync_dist=True, reduce_fx="max")
            for name, n in _allocator_counts(self.device).items():
                self.log(f"memory/{name}", float(n - self._allocs_before.get(name, 0)),
                         batch_size=len(batch["prompt"]), sync_dist=True, reduce_fx="max")
        if "update" in self._times:
            self._times["update"] += now
            t = self._times   # what the forwards and the optimizer leave: the backward passes, Lightning between
            t["backward"] = max(t["update"] - t.get("forward", 0.0) - t.get("optimizer", 0.0), 0.0)
        step_s = max(now - self._step_started, 1e-9)
        train_s = max(step_s - self._last_rollout_s, 1e-9)
        kw = dict(batch_size=len(batch["prompt"]), sync_dist=True)
        self.log("rollout/time_share", self._last_rollout_s / step_s, **kw)
        self.log("time/step_s", step_s, **kw)
        self.log("time/rollout_s", self._last_rollout_s, **kw)
        for part, seconds in self._times.items():
            self.log(f"time/{part}_s", seconds, **kw)
        self.log("time/gc_s", gc_s, **kw)
        self.log("time/gc_full", float(gc_full), batch_size=len(batch["prompt"]), sync_dist=True, reduce_fx="max")
        self.log("time/train_tokens_per_s", self._last_train_tokens / train_s,
                 batch_size=len(batch["prompt"]), sync_dist=True, reduce_fx="sum")
        self.log("time/train_tflops", self._step_flops / train_s / 1e12, **kw)
        peak = peak_flops(self.device)
        if peak:
            self.log("time/mfu", self._step_flops / train_s / peak, **kw)
