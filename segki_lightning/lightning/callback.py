"""SegKICallback: fused decode kernels and CUDA-graph rollouts for a LightningModule's policy."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from ..inject import remove_segment_ki
from ..inject.gdn_training import guard_transformers_gdn
from ..rollout import RolloutEngine

SHARDED = ("FSDP", "DeepSpeed", "ModelParallel")


class SegKICallback(pl.Callback):
    """Injects fused segments into ``pl_module.<policy_attr>`` and gives the module a rollout engine.

    Injection happens in ``on_fit_start``, after Lightning has moved the module to its device and applied
    the precision plugin (``setup`` runs before both). ``teardown`` removes the injection and frees the
    graphs and cache. Where flash-linear-attention's GDN backward refuses the installed Triton, the model's
    own GDN layers train on transformers' torch rule for the fit (also with ``use_segki=False``).

    Args:
        use_segki: inject fused segments (else the plain forward, still with the static cache).
        graph_capture: capture decode steps in CUDA graphs (CUDA only).
        max_batch_size: most rollout rows (prompts x generations) per call.
        max_seq_len: most prompt + completion tokens.
        policy_attr: attribute of the LightningModule holding the Hugging Face policy model.

    Example:
        >>> trainer = Trainer(callbacks=[SegKICallback(max_batch_size=64, max_seq_len=1024)])
        >>> trainer.fit(GRPOModule(...))   # its training_step calls self.rollout(prompts, sampling)
    """

    def __init__(self, use_segki: bool = True, graph_capture: bool = True, max_batch_size: int = 64,
                 max_seq_len: int = 2048, policy_attr: str = "policy"):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.use_segki, self.graph_capture = use_segki, graph_capture
        self.max_batch_size, self.max_seq_len, self.policy_attr = max_batch_size, max_seq_len, policy_attr
        self._engine: RolloutEngine | None = None
        self._unguard: Any = None
        self._rollouts = 0
        self._tokens = 0

    @property
    def engine(self) -> RolloutEngine | None:
        return self._engine

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        name = type(trainer.strategy).__name__
        if any(s in name for s in SHARDED):
            raise RuntimeError(f"SegKICallback does not support the sharded strategy {name} yet: rollouts need "
                               "the full weights on every device. Use strategy='ddp' (or a single device).")
        if not hasattr(pl_module, self.policy_attr):
            raise AttributeError(f"{type(pl_module).__name__} has no attribute {self.policy_attr!r} holding the "
                                 "policy model; set SegKICallback(policy_attr=...)")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        policy = getattr(pl_module, self.policy_attr)
        self._unguard = guard_transformers_gdn()   # the model's own GDN layers, where fla cannot train
        self._engine = RolloutEngine(policy, max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                                     use_segki=self.use_segki, graph_capture=self.graph_capture,
                                     eos_token_id=getattr(pl_module, "eos_token_id", None),
                                     pad_token_id=getattr(pl_module, "pad_token_id", None))
        pl_module.__dict__["_segki_callback"] = self
        rank_zero_info(f"segki: rollout path {self._engine.path}")
        if self._engine.report is not None:
            rank_zero_info(f"segki: injected segments\n{self._engine.report}")

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
        if hasattr(pl_module, self.policy_attr):
            remove_segment_ki(getattr(pl_module, self.policy_attr))
        pl_module.__dict__.pop("_segki_callback", None)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rollouts": self._rollouts, "tokens": self._tokens}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._rollouts = int(state_dict["rollouts"])
        self._tokens = int(state_dict["tokens"])
