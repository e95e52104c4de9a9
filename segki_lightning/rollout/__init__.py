"""Rollouts from the training model: static hybrid cache, per-prompt prefill, CUDA-graph decode."""
from .batch import RolloutBatch, RolloutStats
from .config import SamplingConfig
from .engine import RolloutEngine

__all__ = ["RolloutBatch", "RolloutEngine", "RolloutStats", "SamplingConfig"]
