"""Structural segment kernel injection: find hot segments by attribute structure, replace their forwards
with fused ops that read the original parameters, and undo it."""
from .api import apply_segment_ki, is_injected, remove_segment_ki
from .packing import pack_projections, unpack_projections
from .report import KINDS, SegmentReport

__all__ = ["KINDS", "SegmentReport", "apply_segment_ki", "is_injected", "pack_projections", "remove_segment_ki",
           "unpack_projections"]
