"""The model's own Gated-DeltaNet layers where flash-linear-attention cannot train them.

flash-linear-attention raises in its gated chunk backward on Hopper with Triton in [3.4, 3.7.1) (wrong results
otherwise); :func:`segki_lightning.ops.gdn_chunk.training_path` supplies that kernel there, so fla trains after
all. Where even that is not possible (an fla without its backend registry, ``FLA_DISABLE_BACKEND_DISPATCH=1``),
our injected GDN forward trains on transformers' chunked torch rule, but the model's OWN forward (switches off)
would still call fla. :func:`guard_transformers_gdn` then routes transformers' GDN chunk rule to its torch form
whenever gradients are being recorded there, and leaves fla's forward for everything else (prefill, no-grad
passes). It patches the loaded ``transformers.models.*`` modules that define ``torch_chunk_gated_delta_rule`` and
returns the function that undoes it."""
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
    """False where flash-linear-attention is installed but its gated chunk backward cannot train here (see
    :func:`segki_lightning.ops.gdn_chunk.training_path`)."""
    if importlib.util.find_spec("fla") is None or not torch.cuda.is_available():
        return True
    from ..ops.gdn_chunk import TORCH, training_path

    return training_path() != TORCH


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
            raise RuntimeError("packed sequences (cu_seqlens) need flash-linear-attention's backward, which cannot "
                               "train on this Triton here: upgrade Triton to >= 3.7.1 or set algo.padding_free=false")
        return torch_rule(*args, **kwargs)

    guarded.__segki_guard__ = True
    return guarded


def guard_transformers_gdn(force: bool = False) -> Callable[[], None]:
    """Install the guard when flash-linear-attention is installed and its backward would refuse (or
    ``force``); returns the undo function (a no-op when nothing was patched)."""
    if not force and fla_backward_ok():
        return lambda: None
    patched = []
    for name, module in list(sys.modules.items()):
        rule = getattr(module, RULE, None) if name.startswith("transformers.models.") else None
        if rule is not None and not getattr(rule, "__segki_guard__", False):
            setattr(module, RULE, _guarded(rule))
            patched.append((module, rule))
    if patched:
        log.info("segki: flash-linear-attention's GDN backward cannot train here; the model's own GDN layers "
                 "train on transformers' chunked torch rule (%d modules)", len(patched))

    def undo() -> None:
        for module, rule in patched:
            setattr(module, RULE, rule)

    return undo
