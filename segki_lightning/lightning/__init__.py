"""Lightning integration: the callback that injects and owns the rollout engine, and the module mixin."""
from .callback import SegKICallback
from .mixin import SegKIRolloutMixin

__all__ = ["SegKICallback", "SegKIRolloutMixin"]
