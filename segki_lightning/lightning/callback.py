"""SegKICallback: fused decode kernels and CUDA-graph rollouts for a LightningModule's policy."""
from __future__ import annotations

import contextlib
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from ..inject import apply_segment_ki, remove_segment_ki
from ..inject.gdn_training import guard_transformers_gdn
from ..ops.gdn_chunk import training_path
from ..rollout import RolloutEngine
from .fsdp import GatheredWeights, is_model_parallel, is_sharded

UNSUPPORTED = ("FSDPStrategy", "DeepSpeed")   # FSDP1 and DeepSpeed; FSDP2 (ModelParallelStrategy) is supported


class SegKICallback(pl.Callback):
    """Injects fused segments into ``pl_module.<policy_attr>`` and gives the module a rollout engine.

    Injection happens in ``on_fit_start``, after Lightning has moved the module to its device and applied
    the precision plugin (``setup`` runs before both). ``teardown`` removes the injection and frees the
    graphs and cache. On CUDA the Gated-DeltaNet training path is logged once (flash-linear-attention's kernels,
    with the one backward kernel it refuses on Hopper under Triton < 3.7.1 supplied by segki; transformers' torch
    rule where fla cannot train, then also for the model's own GDN layers with ``use_segki=False``). Under FSDP
    (``ModelParallelStrategy``) every rollout runs on full weights gathered once before it (see
    :mod:`segki_lightning.lightning.fsdp`).

    Args:
        use_segki: inject fused segments (else the plain forward, still with the static cache).
        graph_capture: capture decode steps in CUDA graphs (CUDA only).
        max_batch_size: most rollout rows (prompts x generations) per call.
        max_seq_len: most prompt + completion tokens.
        policy_attr: attribute of the LightningModule holding the Hugging Face policy model.
        keep_gathered: under FSDP, keep the gathered full weights between rollouts (the captured graphs stay
            valid) instead of freeing them after each rollout (less memory during training, a new capture per
            rollout).

    Example:
        >>> trainer = Trainer(callbacks=[SegKICallback(max_batch_size=64, max_seq_len=1024)])
        >>> trainer.fit(GRPOModule(...))   # its training_step calls self.rollout(prompts, sampling)
    """

    def __init__(self, use_segki: bool = True, graph_capture: bool = True, max_batch_size: int = 64,
                 max_seq_len: int = 2048, policy_attr: str = "policy", keep_gathered: bool = True):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.use_segki, self.graph_capture = use_segki, graph_capture
        self.max_batch_size, self.max_seq_len, self.policy_attr = max_batch_size, max_seq_len, policy_attr
        self.keep_gathered = keep_gathered
        self._engine: RolloutEngine | None = None
        self._gathered: GatheredWeights | None = None
        self._unguard: Any = None
        self._rollouts = 0
        self._tokens = 0

    @property
    def engine(self) -> RolloutEngine | None:
        return self._engine

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        name = type(trainer.strategy).__name__
        if any(s in name for s in UNSUPPORTED) and not is_model_parallel(trainer.strategy):
            raise RuntimeError(f"SegKICallback does not support {name}: for sharded training use FSDP2 through "
                               "Lightning's ModelParallelStrategy (segki-train: trainer.strategy=fsdp), else "
                               "strategy='ddp' or a single device.")
        if not hasattr(pl_module, self.policy_attr):
            raise AttributeError(f"{type(pl_module).__name__} has no attribute {self.policy_attr!r} holding the "
                                 "policy model; set SegKICallback(policy_attr=...)")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        policy = getattr(pl_module, self.policy_attr)
        if pl_module.device.type == "cuda":
            training_path()   # chooses (and logs) how Gated-DeltaNet layers train
        self._unguard = guard_transformers_gdn()   # the model's own GDN layers, where fla cannot train
        if is_sharded(policy):   # injection and its probe need the full weights
            dtype = getattr(pl_module, "compute_dtype", None) or next(policy.parameters()).dtype
            self._gathered = GatheredWeights(policy, dtype, keep=self.keep_gathered)
        with self.full_weights():
            self._engine = RolloutEngine(policy, max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                                         use_segki=self.use_segki, graph_capture=self.graph_capture,
                                         eos_token_id=getattr(pl_module, "eos_token_id", None),
                                         pad_token_id=getattr(pl_module, "pad_token_id", None))
        reference = getattr(pl_module, "reference", None)
        if self.use_segki and isinstance(reference, nn.Module) and not is_sharded(reference):
            apply_segment_ki(reference)   # its scoring passes take the same fused, packed forward as the policy's
        pl_module.__dict__["_segki_callback"] = self
        rank_zero_info(f"segki: rollout path {self._engine.path}")
        if self._engine.report is not None:
            rank_zero_info(f"segki: injected segments\n{self._engine.report}")

    def full_weights(self):
        """Context for a rollout: under FSDP the full weights gathered and swapped in (a collective), else
        nothing to do."""
        return self._gathered.for_rollout() if self._gathered is not None else contextlib.nullcontext()

    def record(self, tokens: int) -> None:
        """Count one rollout (called by :class:`SegKIRolloutMixin`)."""
        self._rollouts += 1
        self._tokens += tokens

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._engine is not None:
            self._engine.free()
            self._engine = None
        if self._unguard is not None:
            self._unguard()
            self._unguard = None
        if self._gathered is not None:
            self._gathered.free()
            self._gathered = None
        for name in (self.policy_attr, "reference"):
            if isinstance(getattr(pl_module, name, None), nn.Module):
                remove_segment_ki(getattr(pl_module, name))
        pl_module.__dict__.pop("_segki_callback", None)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self._rollouts, "tokens": self._tokens}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rollouts = int(state_dict["rollouts"])
        self._tokens = int(state_dict["tokens"])
