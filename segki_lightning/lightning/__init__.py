"""Lightning integration: the callback that injects and owns the rollout engine, and the module mixin."""
from .callback import SegKICallback
from .consistency import RankConsistency
from .mixin import SegKIRolloutMixin
from .progress import StepProgressBar

__all__ = ["RankConsistency", "SegKICallback", "SegKIRolloutMixin", "StepProgressBar"]
