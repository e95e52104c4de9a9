"""Gated-DeltaNet training where flash-linear-attention's backward refuses the installed Triton.

flash-linear-attention raises in its gated chunk backward on Hopper with Triton in [3.4, 3.7.1) (wrong
results otherwise). Our injected GDN forward then trains on transformers' chunked torch rule; the model's
OWN forward (switches off) would still call fla. :func:`guard_transformers_gdn` routes transformers' GDN
chunk rule to its torch form whenever gradients are being recorded there, and leaves fla's forward for
everything else (prefill, no-grad passes). It patches the loaded ``transformers.models.*`` modules that
define ``torch_chunk_gated_delta_rule`` and returns the function that undoes it."""
from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import sys
from typing import Callable

import torch

log = logging.getLogger("segki_lightning")
RULE = "torch_chunk_gated_delta_rule"


def fla_backward_ok() -> bool:
    """False where flash-linear-attention refuses its gated chunk backward: Hopper with Triton in [3.4, 3.7.1)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return True
    return not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _guarded(rule: Callable) -> Callable:
    """``rule`` (transformers' kernel-dispatching wrapper) that takes the torch function while recording."""
    torch_rule = inspect.unwrap(rule)

    @functools.wraps(rule)
    def guarded(*args, **kwargs):
        if not _needs_grad(args, kwargs):
            return rule(*args, **kwargs)
        if kwargs.get("cu_seqlens") is not None:
            raise RuntimeError("packed sequences (cu_seqlens) need flash-linear-attention's backward, which refuses "
                               "this Triton on Hopper: upgrade Triton to >= 3.7.1 or train unpacked batches")
        return torch_rule(*args, **kwargs)

    guarded.__segki_guard__ = True
    return guarded


def guard_transformers_gdn(force: bool = False) -> Callable[[], None]:
    """Install the guard when flash-linear-attention is installed and its backward would refuse (or
    ``force``); returns the undo function (a no-op when nothing was patched)."""
    if not force and (importlib.util.find_spec("fla") is None or fla_backward_ok()):
        return lambda: None
    patched = []
    for name, module in list(sys.modules.items()):
        rule = getattr(module, RULE, None) if name.startswith("transformers.models.") else None
        if rule is not None and not getattr(rule, "__segki_guard__", False):
            setattr(module, RULE, _guarded(rule))
            patched.append((module, rule))
    if patched:
        log.info("segki: flash-linear-attention's GDN backward refuses this Triton; the model's own GDN layers "
                 "train on transformers' chunked torch rule (%d modules)", len(patched))

    def undo() -> None:
        for module, rule in patched:
            setattr(module, RULE, rule)

    return undo
