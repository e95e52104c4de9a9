"""segki_lightning: fused decode kernels injected into the Hugging Face model you train with Lightning,
and CUDA-graph rollouts on the same weights."""
from .inject import SegmentReport, apply_segment_ki, remove_segment_ki
from .lightning import SegKICallback, SegKIRolloutMixin
from .rollout import RolloutBatch, RolloutEngine, SamplingConfig

__version__ = "0.1.0"
__all__ = ["RolloutBatch", "RolloutEngine", "SamplingConfig", "SegKICallback", "SegKIRolloutMixin", "SegmentReport",
           "apply_segment_ki", "remove_segment_ki"]
