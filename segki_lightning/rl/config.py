"""The knobs of each algorithm, named and defaulted as TRL's ``GRPOConfig`` / ``PPOConfig`` name them, where
TRL has them; the README lists every one and says where we differ and why."""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp")
SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")   # TRL's multi_objective_aggregation (GDPO: the second)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_LEVELS = ("token", "sequence")
NONFINITE_MODES = ("raise", "skip_step")   # rl/nonfinite.py
# transformers' ``optim`` names this project builds (rl/optim.py); the 8-bit ones are bitsandbytes' AdamW8bit
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adamw_8bit", "adamw_bnb_8bit")
EIGHT_BIT = ("adamw_8bit", "adamw_bnb_8bit")


@dataclass
class RLConfig:
    """Sampling, optimisation and memory settings every algorithm has.

    ``micro_batch_size``: rows per forward/backward inside one optimizer step (None: all rows at once); the
    gradients of the micro-batches add up to the whole batch's. ``micro_batch_tokens``: a token budget per
    micro-batch as well (real tokens of packed rows; rows x the longest row when padded), so that short rows share
    a pass; as many passes as filling each to the budget takes, balanced. ``padding_free`` (TRL's name): the rows
    of a training pass run packed into one sequence, each row alone (``cu_seqlens``), where the policy's forward
    takes that (segki's injected layers), else padded. ``master_weights``: bf16/fp16 parameters get fp32 master
    copies in the optimizer (the model keeps reading its own half-precision weights).
    ``logprob_chunk``: tokens per chunk of the output projection in the log-prob pass (None: ~1 GiB of fp32
    logits per chunk). ``gc_freeze``: when training starts, every Python object alive then (model, tokenizer,
    dataset, libraries) leaves the garbage collector's walks (:func:`gc.freeze`), so that a full collection in a
    step walks only what training made (see :mod:`~segki_lightning.rl.gc_clock`; ``time/gc_s`` logs the pauses).

    Sampler/trainer correction (TRL's ``vllm_importance_sampling_*``; our sampler is the rollout engine): each
    token's loss is weighted by ``exp(trainer_old_logp - engine_logp)`` (per token, or summed per sequence),
    truncated to ``[clip_min, clip_max]`` or masked to 0 outside it.

    Schedule (transformers' ``get_scheduler``): ``lr_scheduler_type`` over the run's optimizer steps, after
    ``warmup_steps`` (or, when 0, ``warmup_ratio`` of them); ``max_grad_norm`` clips the gradient norm unless the
    Trainer's ``gradient_clip_val`` is set.

    Optimizer (transformers' ``TrainingArguments`` names and defaults): ``optim`` AdamW, fused where the parameters
    allow it (``adamw_torch_fused``: CUDA tensors, not FSDP shards), torch's default implementation
    (``adamw_torch``), or bitsandbytes' 8-bit AdamW (``adamw_8bit`` = ``adamw_bnb_8bit``: the two moments in one
    byte each, block-wise quantized, for tensors of 4096 elements or more -- 6 bytes a parameter less; not under
    FSDP); ``adam_beta1``, ``adam_beta2``, ``adam_epsilon`` its betas and epsilon.

    ``on_nonfinite``: an infinite reward, a non-finite loss or gradient norm stops the run before the optimizer
    step (``raise``) or skips the step (``skip_step``), see :mod:`~segki_lightning.rl.nonfinite`."""

    num_generations: int = 1
    reward_weights: list[float] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    max_prompt_length: int | None = 512
    max_completion_length: int = 512
    stop_strings: list[str] | None = None
    # TRL's: passed to every apply_chat_template, e.g. {enable_thinking: false} ({} rather than TRL's None: Hydra
    # merges a mapping given on the command line into a mapping, not into None)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tool_calling_iterations: int | None = None   # TRL's: tool rounds a rollout may take (null: until its budget)
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    optim: str = "adamw_torch_fused"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float | None = 1.0
    micro_batch_size: int | None = None
    micro_batch_tokens: int | None = None
    padding_free: bool = True
    master_weights: bool = True
    logprob_chunk: int | None = None
    gc_freeze: bool = True
    importance_sampling_correction: bool = True
    importance_sampling_mode: str = "token_truncate"
    importance_sampling_clip_max: float = 3.0
    importance_sampling_clip_min: float | None = None
    disable_dropout: bool = False    # TRL's: every nn.Dropout of the policy (and so of its reference) at p = 0
    shuffle_dataset: bool = True     # TRL's: the recipe's prompt loader shuffles (segki-train's; yours is yours)
    log_completions_every: int = 50
    log_completions: bool = False
    num_generations_eval: int | None = None
    num_completions_to_print: int | None = None
    on_nonfinite: str = "raise"
    seed: int = 0

    def __post_init__(self) -> None:
        from transformers import SchedulerType

        kinds = sorted(t.value for t in SchedulerType if t.value != "reduce_lr_on_plateau")
        if self.lr_scheduler_type not in kinds:
            raise ValueError(f"lr_scheduler_type must be one of {kinds}, got {self.lr_scheduler_type!r}")
        if not 0.0 <= self.warmup_ratio < 1.0 or self.warmup_steps < 0:
            raise ValueError(f"warmup_ratio must be in [0, 1) and warmup_steps >= 0, got {self.warmup_ratio}, "
                             f"{self.warmup_steps}")
        if self.optim not in OPTIMIZERS:
            raise ValueError(f"optim must be one of {OPTIMIZERS} (transformers' names; other optimizers are not "
                             f"built here), got {self.optim!r}")
        if self.optim in EIGHT_BIT and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"optim={self.optim} is bitsandbytes' 8-bit AdamW, which is not installed: pip install "
                             "bitsandbytes (or the project's [bnb] extra), or set optim=adamw_torch_fused")
        if not (0.0 <= self.adam_beta1 < 1.0 and 0.0 <= self.adam_beta2 < 1.0) or not self.adam_epsilon > 0:
            raise ValueError(f"adam_beta1 and adam_beta2 must be in [0, 1) and adam_epsilon > 0, got "
                             f"{self.adam_beta1}, {self.adam_beta2}, {self.adam_epsilon}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 (or null for no clipping), got {self.max_grad_norm}")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {self.on_nonfinite!r}")
        if self.importance_sampling_mode not in IS_MODES:
            raise ValueError(f"importance_sampling_mode must be one of {IS_MODES}, got {self.importance_sampling_mode!r}")
        lo = self.importance_sampling_clip_min
        if self.importance_sampling_clip_max <= 0 or (lo is not None and not 0 <= lo < self.importance_sampling_clip_max):
            raise ValueError("importance_sampling_clip_max must be > 0 and importance_sampling_clip_min in "
                             f"[0, clip_max) or null, got {lo}, {self.importance_sampling_clip_max}")
        if not (self.learning_rate >= 0 and self.weight_decay >= 0):
            raise ValueError(f"learning_rate and weight_decay must be >= 0, got {self.learning_rate}, "
                             f"{self.weight_decay}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):   # the log-probs divide by it
            raise ValueError(f"temperature must be > 0: the log-probs are taken at the sampling temperature "
                             f"(validation rollouts are greedy unless num_generations_eval is set), got "
                             f"{self.temperature}")
        if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_k must be >= 0 (0: off) and top_p in (0, 1] (1.0: off), got {self.top_k}, "
                             f"{self.top_p}")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1 token, got {self.max_completion_length}")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1 token (or null: no limit), got {self.max_prompt_length}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 row (or null for all rows), got {self.micro_batch_size}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 token (or null: no token budget), got "
                             f"{self.micro_batch_tokens}")
        if self.min_p is not None and not 0.0 <= self.min_p < 1.0:
            raise ValueError(f"min_p must be in [0, 1) (or null: off), got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0: off), got {self.repetition_penalty}")
        if self.stop_strings is not None and (isinstance(self.stop_strings, str) or not all(
                isinstance(x, str) and x for x in self.stop_strings)):
            raise ValueError(f"stop_strings must be a list of non-empty strings, got {self.stop_strings!r}")
        kwargs = self.chat_template_kwargs
        if kwargs is not None and not (hasattr(kwargs, "keys") and all(isinstance(k, str) for k in kwargs)):
            raise ValueError(f"chat_template_kwargs must be a mapping of keyword names to values (e.g. "
                             f"{{enable_thinking: false}}), got {self.chat_template_kwargs!r}")
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"max_tool_calling_iterations must be >= 0 (or null: until the completion budget), got "
                             f"{self.max_tool_calling_iterations}")
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"num_generations_eval must be >= 1 (or null: one greedy completion), got "
                             f"{self.num_generations_eval}")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 1:
            raise ValueError(f"num_completions_to_print must be >= 1 (or null: all), got {self.num_completions_to_print}")
        if self.logprob_chunk is not None and self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1 token (or null), got {self.logprob_chunk}")


@dataclass
class GRPOConfig(RLConfig):
    """GRPO hyper-parameters (TRL names). ``beta = 0`` builds no reference model.

    A rollout of ``prompts x num_generations`` rows serves ``num_iterations x steps_per_generation`` optimizer
    steps: its rows are shuffled once and split into ``steps_per_generation`` slices, and every iteration steps
    once on each slice.

    ``multi_objective_aggregation`` (TRL's): ``sum_then_normalize`` weighs and sums the reward functions, then
    normalizes per ``scale_rewards``; ``normalize_then_sum`` (GDPO) normalizes each function within its groups
    first, sums them weighted, and normalizes the sum over the batch (all processes). ``off_policy_mask_threshold``
    (TRL's, DeepSeek-V3.2's delta): a completion with a negative advantage whose mean per-token KL from the sampler
    to the current policy exceeds it is left out of the policy term."""

    num_generations: int = 8
    num_iterations: int = 1
    steps_per_generation: int = 1
    # TRL's: completions of one rollout over all processes; here a check that the prompts per step agree with it
    generation_batch_size: int | None = None
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    off_policy_mask_threshold: float | None = None
    mask_truncated_completions: bool = False
    top_entropy_quantile: float = 1.0
    use_bias_correction_kl: bool = False
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    advantage_estimator: str = "grpo"
    dynamic_sampling: bool = False
    max_num_gen_batches: int = 4
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2
    sync_ref_model: bool = False
    ref_model_mixup_alpha: float = 0.6
    ref_model_sync_steps: int = 512

    @property
    def steps_per_rollout(self) -> int:
        return self.num_iterations * self.steps_per_generation

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_iterations < 1 or self.steps_per_generation < 1:
            raise ValueError(f"num_iterations and steps_per_generation must be >= 1, got {self.num_iterations}, "
                             f"{self.steps_per_generation}")
        if self.generation_batch_size is not None and (
                self.generation_batch_size < 1 or self.generation_batch_size % self.num_generations):
            raise ValueError(f"generation_batch_size must be a positive multiple of num_generations="
                             f"{self.num_generations} (whole groups), got {self.generation_batch_size}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, got "
                             f"{self.importance_sampling_level!r}")
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if not (self.beta >= 0 and self.epsilon >= 0 and (self.epsilon_high is None or self.epsilon_high >= 0)):
            raise ValueError(f"beta, epsilon and epsilon_high must be >= 0 (the KL coefficient and the clipping "
                             f"bounds), got {self.beta}, {self.epsilon}, {self.epsilon_high}")
        if self.loss_type == "cispo" and self.epsilon_high is None:
            raise ValueError("loss_type=cispo truncates the importance weight at epsilon_high: set it (the CISPO "
                             "paper uses values around 5)")
        if self.delta is not None and self.delta <= 1.0:
            raise ValueError(f"delta (two-sided clipping bound) must be > 1, got {self.delta}")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        # TRL's booleans: True is "group", False is "none" (Hydra hands a str field `true`/`false` as text)
        self.scale_rewards = {True: "group", False: "none", "true": "group", "false": "none", "True": "group",
                              "False": "none"}.get(self.scale_rewards, self.scale_rewards)
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {SCALES} (or TRL's true / false for group / none), got "
                             f"{self.scale_rewards!r}")
        if self.multi_objective_aggregation not in AGGREGATIONS:
            raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got "
                             f"{self.multi_objective_aggregation!r}")
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator != "grpo":
            raise ValueError(f"multi_objective_aggregation=normalize_then_sum forms GRPO's advantages (GDPO): set "
                             f"advantage_estimator=grpo, not {self.advantage_estimator!r}")
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ValueError(f"off_policy_mask_threshold must be > 0 (or null: off), got "
                             f"{self.off_policy_mask_threshold}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: GRPO compares completions within a group")
        if self.max_num_gen_batches < 1:
            raise ValueError(f"max_num_gen_batches must be >= 1 (rollouts a step may make), got {self.max_num_gen_batches}")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got "
                             f"{self.advantage_estimator!r}")
        if min(self.vespo_lambda_pos, self.vespo_lambda_neg) <= 0 or min(self.vespo_k_pos, self.vespo_k_neg) < 0:
            raise ValueError("vespo_lambda_pos and vespo_lambda_neg must be > 0, vespo_k_pos and vespo_k_neg >= 0, got "
                             f"{self.vespo_lambda_pos}, {self.vespo_lambda_neg}, {self.vespo_k_pos}, {self.vespo_k_neg}")
        if self.loss_type == "vespo" and self.importance_sampling_mode.startswith("sequence"):
            raise ValueError("loss_type=vespo folds the sampler correction into its sequence weight token by token: "
                             "importance_sampling_mode must be token_truncate or token_mask")
        if self.use_adaptive_entropy and not (0.0 <= self.entropy_coef_min <= self.entropy_coef_max
                                              and self.entropy_coef_delta > 0):
            raise ValueError("use_adaptive_entropy needs 0 <= entropy_coef_min <= entropy_coef_max and "
                             f"entropy_coef_delta > 0, got {self.entropy_coef_min}, {self.entropy_coef_max}, "
                             f"{self.entropy_coef_delta}")
        if self.sync_ref_model and self.beta == 0.0:
            raise ValueError("sync_ref_model=True needs the reference model, which beta=0.0 does not build: set beta "
                             "> 0 or sync_ref_model=False")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0 or self.ref_model_sync_steps < 1:
            raise ValueError(f"ref_model_mixup_alpha must be in [0, 1] and ref_model_sync_steps >= 1, got "
                             f"{self.ref_model_mixup_alpha}, {self.ref_model_sync_steps}")


@dataclass
class PPOConfig(RLConfig):
    """PPO hyper-parameters (TRL names). ``kl_coef = 0`` builds no reference model. A rollout serves
    ``num_ppo_epochs x num_mini_batches`` optimizer steps (each epoch a fresh shuffle of its rows)."""

    learning_rate: float = 3e-6
    num_ppo_epochs: int = 4
    num_mini_batches: int = 1
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    kl_coef: float = 0.05
    kl_estimator: str = "k1"                  # TRL's: k1 = log(p / ref), k3 = ref / p - 1 - log(ref / p)
    missing_eos_penalty: float | None = None  # TRL's: subtracted from the score of a completion that did not end
    whiten_rewards: bool = False              # TRL's: the token rewards whitened (their mean kept) before GAE
    whiten_advantages: bool = True

    @property
    def steps_per_rollout(self) -> int:
        return self.num_ppo_epochs * self.num_mini_batches

    def __post_init__(self) -> None:
        super().__post_init__()
        if min(self.cliprange, self.cliprange_value, self.vf_coef, self.kl_coef) < 0:
            raise ValueError(f"cliprange, cliprange_value, vf_coef and kl_coef must be >= 0, got {self.cliprange}, "
                             f"{self.cliprange_value}, {self.vf_coef}, {self.kl_coef}")
        if self.num_ppo_epochs < 1 or self.num_mini_batches < 1:
            raise ValueError(f"num_ppo_epochs and num_mini_batches must be >= 1, got {self.num_ppo_epochs}, "
                             f"{self.num_mini_batches}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be k1 or k3 (TRL's), got {self.kl_estimator!r}")
        if self.missing_eos_penalty is not None and self.missing_eos_penalty < 0:
            raise ValueError(f"missing_eos_penalty must be >= 0 (or null: off), got {self.missing_eos_penalty}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
