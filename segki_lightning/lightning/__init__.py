"""Lightning integration: the callback that injects and owns the rollout engine, the module mixin, and what keeps a
run's state safe (checkpoint IO, signals, metrics that survive a resume)."""
from .callback import SegKICallback
from .checkpoint_io import CheckpointError, SafeCheckpointIO
from .consistency import RankConsistency
from .csv_logger import ResumableCSVLogger
from .mixin import SegKIRolloutMixin
from .progress import StepProgressBar
from .stop import GracefulStop, TrainingInterrupted

__all__ = ["CheckpointError", "GracefulStop", "RankConsistency", "ResumableCSVLogger", "SafeCheckpointIO",
           "SegKICallback", "SegKIRolloutMixin", "StepProgressBar", "TrainingInterrupted"]
