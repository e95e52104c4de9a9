"""Finding the native ``segki`` extension (``torch.ops.segki.*``).

The kernels in ``segki_lightning/csrc`` are compiled just in time for the current GPU. When there is no
CUDA device, no compiler, or no kernel source in this build, every op runs its PyTorch reference and this
is announced once.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from .switches import check_switches

log = logging.getLogger("segki_lightning")
CSRC = Path(__file__).resolve().parent.parent / "csrc"


def kernel_sources() -> list[Path]:
    """The C++/CUDA translation units of the extension."""
    return sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.cu")])


@functools.cache
def native_ops() -> object | None:
    """``torch.ops.segki`` when the extension is built and loaded, else None (announced once). Raises
    ValueError for an unknown ``SEGKI_*`` variable or a switch value the kernels would not understand."""
    check_switches()
    reason = _unavailable_reason()
    if reason is not None:
        log.warning("segki: native kernels unavailable (%s); using the PyTorch reference path.", reason)
        return None
    try:
        from .build import load

        load()
    except Exception as exc:  # a broken toolchain must not stop training: fall back, loudly
        log.warning("segki: building the native kernels failed (%s); using the PyTorch reference path.", exc)
        return None
    return torch.ops.segki


def _unavailable_reason() -> str | None:
    if not kernel_sources():
        return "this build ships no kernel sources"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def has_native(op: str) -> bool:
    """Whether ``torch.ops.segki.<op>`` exists in the loaded extension."""
    ops = native_ops()
    return ops is not None and hasattr(ops, op)
