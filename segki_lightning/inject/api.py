"""``apply_segment_ki`` / ``remove_segment_ki``: swap a model's hot segments for fused ops, and back."""
from __future__ import annotations

import logging
import types
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .. import ops
from . import forwards as fw
from .packing import unpack_projections
from .report import KINDS, SegmentReport
from .structure import (Mismatch, match_attention, match_attention_qkv, match_decoder_layer, match_gated_mlp,
                        match_gdn, match_rms_norm)
from .verify import attention_decode_error, relative_error, tolerance

log = logging.getLogger("segki_lightning")
_NEED_PROBE = ("decoder_layer", "attention")  # kept only when verified
_SAVED = "_segki_saved_forward"
_REPORT = "_segki_report"
_OPS = {
    "gated_mlp": ("gated_mlp_front", "linear"),
    "gdn": ("gdn_in_proj_conv", "gdn_recurrent_step", "gdn_in_proj", "gdn_decode_step", "linear"),
    "attention_qkv": ("qkv_proj",),
    "rms_norm": ("rms_norm",),
    "attention": ("qkv_proj", "decode_attention_step", "attention_prologue", "decode_attention", "linear"),
    "decoder_layer": ("add_rms_norm",),
}


@dataclass(eq=False)
class _Segment:
    kind: str
    name: str
    owner: nn.Module                                              # whose output must not change
    installs: list[tuple[nn.Module, Callable, Any]] = field(default_factory=list)  # (module, forward, spec)


def is_injected(model: nn.Module) -> bool:
    return _REPORT in model.__dict__


def apply_segment_ki(model: nn.Module, kinds: Iterable[str] = KINDS, verify: bool = True) -> SegmentReport:
    """Replace the forwards of every structurally matching segment of ``model`` with fused ops.

    Args:
        model: any Hugging Face-style causal LM (or submodule tree).
        kinds: which segment kinds to replace (default: all of ``KINDS``).
        verify: run one tiny probe forward and keep only replacements whose owner module's output is
            unchanged (decoder-layer fusion is kept only when verified).

    Returns:
        The :class:`SegmentReport`. Applying again returns the same report and changes nothing.

    Example:
        >>> report = apply_segment_ki(model)
        >>> print(report)            # per kind: found / replaced / skipped (why) / backend
        >>> remove_segment_ki(model)  # original forwards back
    """
    kinds = tuple(kinds)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown segment kinds {sorted(unknown)}; choose from {KINDS}")
    if is_injected(model):
        return model.__dict__[_REPORT]
    report = SegmentReport()
    segments = _detect(model, set(kinds), report)
    _link_layers(model, segments)
    owners = {s.owner for s in segments}
    recorded = _record(model, owners) if verify else {}
    if verify and recorded is None:
        for s in [s for s in segments if s.kind in _NEED_PROBE]:
            report.skip(s.kind, s.name, "could not run the verification probe")
            segments.remove(s)
        recorded = {}
    for s in segments:
        _install(s)
    for s in sorted(segments, key=lambda s: KINDS.index(s.kind)):  # leaves first, layers last
        if s.owner in recorded and (err := _segment_error(s, recorded[s.owner])) is not None:
            _uninstall(s)
            report.skip(s.kind, s.name, f"verification failed: relative error {err:.2e}")
        else:
            report.replaced[s.kind] += 1
    _record_backends(model, report)
    model.__dict__[_REPORT] = report
    log.debug("segki: injected segments\n%s", report)
    return report


def remove_segment_ki(model: nn.Module) -> None:
    """Restore every original forward that :func:`apply_segment_ki` replaced, and give packed projection weights
    (:func:`~segki_lightning.inject.pack_projections`) their own storage back."""
    unpack_projections(model)
    for m in model.modules():
        if fw.SPEC in m.__dict__:
            _restore(m)
    model.__dict__.pop(_REPORT, None)


# ------------------------------------------------------------------------------------------ detection
def _detect(model: nn.Module, kinds: set[str], report: SegmentReport) -> list[_Segment]:
    segments: list[_Segment] = []
    covered: set[nn.Module] = set()  # submodules a GDN replacement computes itself
    norm_specs: dict[nn.Module, fw.NormSpec] = {}
    named = list(model.named_modules())

    def attempt(kind: str, name: str, m: nn.Module, build: Callable[[], _Segment]) -> None:
        report.found[kind] += 1
        if kind not in kinds:
            report.skip(kind, name, "kind not requested")
            return
        try:
            segments.append(build())
        except Mismatch as why:
            report.skip(kind, name, str(why))

    for name, m in named:
        if all(hasattr(m, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
            covered.update(m.modules())
            attempt("gdn", name, m, lambda m=m, name=name: _Segment(
                "gdn", name, m, [(m, fw.gdn_forward, match_gdn(m, _current_forward(m)))]))
        elif all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")):
            attempt("gated_mlp", name, m, lambda m=m, name=name: (
                match_gated_mlp(m), _Segment("gated_mlp", name, m, [(m, fw.gated_mlp_forward, None)]))[1])
        elif all(hasattr(m, a) for a in ("q_proj", "k_proj", "v_proj")):
            attempt("attention_qkv", name, m, lambda m=m, name=name: _qkv_segment(name, m))
            if hasattr(m, "o_proj"):
                attempt("attention", name, m, lambda m=m, name=name: _Segment(
                    "attention", name, m, [(m, fw.attention_forward, match_attention(m, _current_forward(m)))]))
    for name, m in named:
        if m not in covered and _looks_like_norm(m):
            def build(m=m, name=name):
                norm_specs[m] = match_rms_norm(m)
                return _Segment("rms_norm", name, m, [(m, fw.rms_norm_forward, norm_specs[m])])
            attempt("rms_norm", name, m, build)
    for name, m in named:
        if hasattr(m, "input_layernorm") and hasattr(m, "post_attention_layernorm"):
            attempt("decoder_layer", name, m, lambda m=m, name=name: _Segment(
                "decoder_layer", name, m, [(m, fw.decoder_layer_forward, match_decoder_layer(m, norm_specs))]))
    return segments


def _link_layers(model: nn.Module, segments: list[_Segment]) -> None:
    """Each decoder layer's next norm (``LayerSpec.next_norm``): the next layer's input norm in the same list, or
    after the list's last layer the final norm beside it (``norm`` of the module holding the list), where that norm
    is injected too. The link lets a decode step compute that norm ahead (``forwards.normed_ahead``); a call with
    any other tensor than the layer's output ignores it."""
    layers = {s.owner: s.installs[0][2] for s in segments if s.kind == "decoder_layer"}
    norms = {s.owner for s in segments if s.kind == "rms_norm"}
    for holder in model.modules():
        for seq in (list(c) for c in holder.children() if isinstance(c, nn.ModuleList)):
            for layer, nxt in zip(seq, [*seq[1:], None]):
                if layer not in layers:
                    continue
                if nxt is not None and nxt in layers and nxt.input_layernorm in norms:
                    layers[layer].next_norm, layers[layer].next_owner = nxt.input_layernorm, nxt
                elif nxt is None and getattr(holder, "norm", None) in norms:
                    layers[layer].next_norm = layers[layer].next_owner = holder.norm


def _qkv_segment(name: str, m: nn.Module) -> _Segment:
    group = match_attention_qkv(m)
    return _Segment("attention_qkv", name, m, [(group.q, fw.q_proj_forward, group),
                                               (group.k, fw.kv_proj_forward, group),
                                               (group.v, fw.kv_proj_forward, group)])


def _looks_like_norm(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    has_eps = any(isinstance(getattr(m, a, None), float) for a in ("variance_epsilon", "eps"))
    return has_eps and isinstance(w, nn.Parameter) and w.dim() == 1 and not list(m.children())


# ------------------------------------------------------------------------------------ install/restore
def _current_forward(m: nn.Module) -> Callable:
    return m.__dict__.get("forward") or types.MethodType(type(m).forward, m)


def _install(s: _Segment) -> None:
    for m, forward, spec in s.installs:
        m.__dict__[_SAVED] = m.__dict__.get("forward")
        m.__dict__[fw.SPEC] = spec
        m.forward = types.MethodType(forward, m)


def _restore(m: nn.Module) -> None:
    saved = m.__dict__.pop(_SAVED, None)
    m.__dict__.pop(fw.SPEC, None)
    m.__dict__.pop(fw.AHEAD, None)
    if saved is None:
        m.__dict__.pop("forward", None)
    else:
        m.forward = saved


def _uninstall(s: _Segment) -> None:
    for m, _, _ in s.installs:
        _restore(m)


def _record_backends(model: nn.Module, report: SegmentReport) -> None:
    p = next(model.parameters(), None)
    if p is None:
        return
    for kind in KINDS:
        if report.replaced[kind]:
            report.backends[kind] = {op: ops.backend(op, p.dtype, p.device) for op in _OPS[kind]}


# ------------------------------------------------------------------------------------- verification
@contextmanager
def _eval_no_grad(model: nn.Module):
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, mode in modes.items():
            m.train(mode)


def _record(model: nn.Module, owners: set[nn.Module]) -> dict[nn.Module, tuple] | None:
    """Run the original model once on a small padded batch; keep each owner's (args, kwargs, output)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if emb is None or not hasattr(emb, "num_embeddings"):
        return None
    dev = emb.weight.device
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, emb.num_embeddings, (2, 8), device=dev, generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    seen: dict[nn.Module, tuple] = {}
    handles = []
    for m in owners:
        def pre(mod, args, kwargs):
            seen.setdefault(mod, (args, kwargs))
        def post(mod, args, kwargs, out):
            a, k = seen[mod]
            if len(seen[mod]) == 2:
                seen[mod] = (a, k, out[0] if isinstance(out, tuple) else out)
        handles += [m.register_forward_pre_hook(pre, with_kwargs=True),
                    m.register_forward_hook(post, with_kwargs=True)]
    try:
        with _eval_no_grad(model):
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    except Exception as exc:  # verification is best effort; its absence is reported
        log.warning("segki: verification probe failed (%s)", exc)
        return None
    finally:
        for h in handles:
            h.remove()
    return {m: v for m, v in seen.items() if len(v) == 3}


def _segment_error(s: _Segment, record: tuple) -> float | None:
    """The owner's output error on the recorded call and, for attention, the decode probe's error."""
    err = _owner_error(s.owner, record)
    if err is None and s.kind == "attention":
        spec = s.installs[0][2]
        tables = spec.inputs(record[0], record[1])[2]
        if tables is None:
            return float("nan")
        try:
            with _eval_no_grad(s.owner):   # as the recorded call: no dropout (attention's, an adapter's)
                err = attention_decode_error(s.owner, spec, tables)
        except Exception as exc:  # a model whose attention code our probe cache cannot serve
            log.warning("segki: attention decode probe failed on %s (%s)", s.name, exc)
            return float("nan")
    return err


def _owner_error(owner: nn.Module, record: tuple) -> float | None:
    """Relative error of the owner's output with the replacements in place, or None when it matches."""
    args, kwargs, expected = record
    with _eval_no_grad(owner):
        out = owner(*args, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    err = relative_error(out, expected)
    return None if err < tolerance(expected.dtype) else err
