"""The knobs of each algorithm, named and defaulted as TRL's ``GRPOConfig`` / ``PPOConfig`` name them, where
TRL has them; the README lists every one and says where we differ and why."""
from __future__ import annotations

from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass
class RLConfig:
    """Sampling, optimisation and memory settings every algorithm has.

    ``micro_batch_size``: rows per forward/backward inside one optimizer step (None: all rows at once); the
    gradients of the micro-batches add up to the whole batch's. ``master_weights``: bf16/fp16 parameters get
    fp32 master copies in the optimizer (the model keeps reading its own half-precision weights).
    ``logprob_chunk``: tokens per chunk of the output projection in the log-prob pass (None: ~1 GiB of fp32
    logits per chunk)."""

    num_generations: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_completion_length: int = 16
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    micro_batch_size: int | None = None
    master_weights: bool = True
    logprob_chunk: int | None = None
    log_completions_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 row (or null for all rows), got {self.micro_batch_size}")
        if self.logprob_chunk is not None and self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1 token (or null), got {self.logprob_chunk}")


@dataclass
class GRPOConfig(RLConfig):
    """GRPO hyper-parameters (TRL names). ``beta = 0`` builds no reference model."""

    num_generations: int = 8
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {SCALES}, got {self.scale_rewards!r}")
        if self.num_generations < 2:
            raise ValueError("num_generations must be >= 2: GRPO compares completions within a group")


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
        super().__post_init__()
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
