"""Structural detection: a segment is recognised by attribute names and verified properties, never by
class name. Each ``match_*`` returns a spec for :mod:`.forwards`, or raises :class:`Mismatch` with the
reason the module is left alone."""
from __future__ import annotations

import inspect

import torch
from torch import nn

from .adapters import is_lora
from .forwards import AttentionSpec, GDNSpec, LayerSpec, NormSpec, QKVGroup
from .verify import relative_error

MIXERS = ("self_attn", "linear_attn")


class Mismatch(Exception):
    """The module has a segment's attribute names but not its verified properties."""


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__)


def check_plain_linear(lin: object, name: str, bias_ok: bool = False) -> None:
    """A dense weight on an unwrapped ``nn.Linear`` (no DTensor, quantized or adapter layers, no hooks), or peft's
    vanilla LoRA on one (its low-rank path runs beside the fused ops: :mod:`.adapters`)."""
    if is_lora(lin):
        if getattr(lin, "lora_variant", None) or any(getattr(lin, "use_dora", {}).values()):
            raise Mismatch(f"{name} is a peft LoRA variant (DoRA or another): runs unfused")
        if _has_hooks(lin):
            raise Mismatch(f"{name} has forward hooks or a patched forward")
        lin = lin.base_layer
    if type(lin) is not nn.Linear:
        kind = "a peft adapter layer other than LoRA (runs unfused)" if type(lin).__module__.startswith("peft.") \
            else type(lin).__name__
        raise Mismatch(f"{name} is {kind}, not a plain nn.Linear")
    w = lin.weight
    if type(w) is not nn.Parameter or type(w.data) is not torch.Tensor:
        raise Mismatch(f"{name}.weight is a tensor subclass ({type(w.data).__name__}): sharded or quantized")
    if w.is_meta or w.layout is not torch.strided or not w.dtype.is_floating_point:
        raise Mismatch(f"{name}.weight is not a dense floating-point tensor in memory")
    if lin.bias is not None and not bias_ok:
        raise Mismatch(f"{name} has a bias the fused op does not apply")
    if _has_hooks(lin):
        raise Mismatch(f"{name} has forward hooks or a patched forward")


def _silu_types() -> tuple[type, ...]:
    types: list[type] = [nn.SiLU]
    try:
        from transformers.activations import SiLUActivation
        types.append(SiLUActivation)
    except ImportError:
        pass
    return tuple(types)


def match_gated_mlp(m: nn.Module) -> None:
    for name in ("gate_proj", "up_proj", "down_proj"):
        check_plain_linear(getattr(m, name), name)
    act = getattr(m, "act_fn", None)
    if not isinstance(act, _silu_types()):
        raise Mismatch(f"activation is {type(act).__name__}, not SiLU")
    if m.gate_proj.weight.shape != m.up_proj.weight.shape or m.down_proj.in_features != m.up_proj.out_features:
        raise Mismatch("gate/up/down shapes do not chain")


def match_attention_qkv(m: nn.Module) -> QKVGroup:
    for name in ("q_proj", "k_proj", "v_proj"):
        check_plain_linear(getattr(m, name), name, bias_ok=True)
    return QKVGroup(m.q_proj, m.k_proj, m.v_proj)


ATTENTION_CHILDREN = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"})


def match_attention(m: nn.Module, original_forward) -> AttentionSpec:
    """Softmax attention with separate q/k/v/o projections, optional per-head q/k RMSNorms, and optionally
    Qwen3.5's output gate (q_proj twice as wide as o_proj's input). Whatever the structure cannot show
    (RoPE form, scaling, gate semantics) the decode probe in :mod:`.verify` checks."""
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        check_plain_linear(getattr(m, name, None), name, bias_ok=True)
    extra = {n for n, _ in m.named_children()} - ATTENTION_CHILDREN
    if extra:
        raise Mismatch(f"submodules {sorted(extra)} beyond projections and q/k norms")
    if list(m.parameters(recurse=False)):
        raise Mismatch("has parameters of its own (e.g. attention sinks)")
    if getattr(m, "sliding_window", None):
        raise Mismatch("sliding-window attention")
    d, scaling, layer_idx = (getattr(m, a, None) for a in ("head_dim", "scaling", "layer_idx"))
    if not (isinstance(d, int) and isinstance(scaling, float) and isinstance(layer_idx, int)):
        raise Mismatch("head_dim, scaling or layer_idx missing")
    width = m.o_proj.in_features
    if width % d or m.k_proj.out_features % d or m.k_proj.out_features != m.v_proj.out_features:
        raise Mismatch("projection widths are not whole heads")
    hq, hkv = width // d, m.k_proj.out_features // d
    if m.q_proj.out_features not in (width, 2 * width) or hq % hkv:
        raise Mismatch("q_proj is neither o_proj's input width nor twice it (gated), or Hq % Hkv != 0")
    norms = [getattr(m, n, None) for n in ("q_norm", "k_norm")]
    norm = None
    if any(n is not None for n in norms):
        if any(n is None or n.weight.shape != (d,) for n in norms):
            raise Mismatch("q_norm/k_norm are not both per-head norms")
        norm, k_spec = match_rms_norm(norms[0]), match_rms_norm(norms[1])
        if norm != k_spec:
            raise Mismatch("q_norm and k_norm differ in form or eps")
    sig = inspect.signature(original_forward)
    if "position_embeddings" not in sig.parameters:
        raise Mismatch("forward takes no position_embeddings (RoPE inside the module)")
    return AttentionSpec(hq, d, m.q_proj.out_features == 2 * width, norm, scaling, sig, original_forward)


def match_gdn(m: nn.Module, original_forward) -> GDNSpec:
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        check_plain_linear(getattr(m, name), name)
    conv = getattr(m, "conv1d", None)
    if type(conv) is not nn.Conv1d or conv.groups != conv.in_channels or conv.in_channels != m.in_proj_qkv.out_features:
        raise Mismatch("conv1d is not a depthwise nn.Conv1d over the qkv channels")
    if getattr(m, "activation", "silu") != "silu":
        raise Mismatch(f"conv activation is {m.activation}, not silu")
    for name in ("A_log", "dt_bias"):
        if not isinstance(getattr(m, name, None), nn.Parameter):
            raise Mismatch(f"{name} parameter missing")
    norm = getattr(m, "norm", None)
    eps = _eps(norm)
    try:
        s = GDNSpec(int(m.num_k_heads), int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim), eps,
                    original_forward)
    except AttributeError as exc:
        raise Mismatch(f"head geometry missing ({exc})") from None
    if m.num_v_heads % m.num_k_heads or m.in_proj_qkv.out_features != 2 * s.num_k_heads * s.head_k_dim + s.num_v_heads * s.head_v_dim:
        raise Mismatch("head geometry does not match the projections")
    return s


def _eps(norm: object) -> float:
    for attr in ("variance_epsilon", "eps"):
        eps = getattr(norm, attr, None)
        if isinstance(eps, float):
            return eps
    raise Mismatch("norm has no float eps / variance_epsilon")


def match_rms_norm(m: nn.Module) -> NormSpec:
    """An RMSNorm in the ``w`` or ``1 + w`` form, told apart by running the module on a random probe."""
    params = dict(m.named_parameters(recurse=False))
    w = params.get("weight")
    if set(params) != {"weight"} or w is None or w.dim() != 1 or list(m.children()):
        raise Mismatch("not a single-weight leaf norm")
    if w.is_meta or type(w.data) is not torch.Tensor:
        raise Mismatch("weight is not a dense tensor in memory")
    if _has_hooks(m):
        raise Mismatch("has forward hooks or a patched forward")
    eps = _eps(m)
    gen = torch.Generator(device=w.device).manual_seed(1234)
    x = torch.randn(4, w.shape[0], device=w.device, generator=gen).to(w.dtype)
    with torch.no_grad():
        try:
            out = type(m).forward(m, x)
        except TypeError as exc:
            raise Mismatch(f"forward is not f(x): {exc}") from None
        from ..ops import reference
        tol = 1e-5 if w.dtype == torch.float32 else 2e-2
        for unit_offset in (False, True):
            if relative_error(out, reference.rms_norm(x, w, eps, unit_offset)) < tol:
                return NormSpec(eps, unit_offset)
    raise Mismatch("output is neither w * rmsnorm(x) nor (1 + w) * rmsnorm(x)")


def match_decoder_layer(m: nn.Module, norm_specs: dict[nn.Module, NormSpec]) -> LayerSpec:
    mixers = [n for n in MIXERS if isinstance(getattr(m, n, None), nn.Module)]
    if len(mixers) != 1:
        raise Mismatch(f"needs exactly one token mixer among {MIXERS}, has {mixers}")
    if not isinstance(getattr(m, "mlp", None), nn.Module):
        raise Mismatch("no mlp")
    for name in ("input_layernorm", "post_attention_layernorm"):
        if getattr(m, name, None) not in norm_specs:
            raise Mismatch(f"{name} is not a verified RMSNorm")
    extra = [n for n, _ in m.named_children()
             if "norm" in n and n not in ("input_layernorm", "post_attention_layernorm")]
    if extra:
        raise Mismatch(f"extra norms {extra}: not a plain pre-norm residual layer")
    sig = inspect.signature(m.forward)
    mixer_sig = inspect.signature(getattr(m, mixers[0]).forward).parameters.values()
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in mixer_sig)
    mixer_params = None if accepts_any else frozenset(p.name for p in mixer_sig)
    return LayerSpec(mixers[0], sig, mixer_params, norm_specs[m.post_attention_layernorm])
