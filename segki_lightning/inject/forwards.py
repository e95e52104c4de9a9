"""Replacement forwards. Each reads the module's ORIGINAL parameters on every call (no copies, no
snapshots) and goes through :mod:`segki_lightning.ops`, whose reference path is a differentiable torch
composition, so gradients are exact and land on those parameters.

A forward finds its static facts (eps, norm form, sibling modules) in a spec stored in the module's
``__dict__`` under ``SPEC`` -- a plain attribute, invisible to ``state_dict`` and ``parameters()``.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .. import ops
from ..ops import reference, varlen
from .adapters import adapted, add_loras

SPEC = "_segki_spec"


def spec(module: nn.Module) -> Any:
    return module.__dict__[SPEC]


# ----------------------------------------------------------------------------------------------- norms
@dataclass
class NormSpec:
    eps: float
    unit_offset: bool  # True: (1 + w) form (Qwen3.5); False: w form (Llama)


def rms_norm_forward(self: nn.Module, x: Tensor) -> Tensor:
    ahead = normed_ahead(self, x)
    if ahead is not None:
        return ahead
    s: NormSpec = spec(self)
    return ops.rms_norm(x, self.weight, s.eps, s.unit_offset)


AHEAD = "_segki_normed_ahead"   # on an injected norm: (x, norm(x)) from the decoder layer that returned x


def normed_ahead(norm: nn.Module, x: Tensor) -> Tensor | None:
    """``norm(x)`` where the decoder layer that returned this very ``x`` computed it in its residual add (a decode
    step, :func:`_mlp_ahead`); None otherwise. Taken once: the next call computes its own."""
    ahead = norm.__dict__.pop(AHEAD, None)
    return ahead[1] if ahead is not None and ahead[0] is x else None


PostNorm = tuple[Tensor, float, bool]   # an RMSNorm's (weight, eps, unit_offset)


def _normed(x: Tensor, norm: nn.Module | None) -> Tensor:
    """``norm(x)`` by an injected RMSNorm, on its own (where a projection cannot take it as its prologue)."""
    if norm is None:
        return x
    s: NormSpec = spec(norm)
    return ops.rms_norm(x, norm.weight, s.eps, s.unit_offset)


def _project(lin: nn.Module, x: Tensor) -> Tensor:
    """``lin(x)``: the product with its weight (and bias), plus a LoRA layer's low-rank path (:mod:`.adapters`)."""
    return _projects((lin,), x)[0]


def _projects(lins: Sequence[nn.Module], x: Tensor) -> tuple[Tensor, ...]:
    """:func:`_project` for projections of the same x, their plain low-rank paths added as one group."""
    return add_loras(lins, x, [ops.linear(x, lin.weight, lin.bias) for lin in lins])


def norm_prologue(norm: nn.Module | None) -> dict[str, Any]:
    """An injected RMSNorm as the norm prologue of the projection after it (``norm_w``, ``norm_eps``,
    ``norm_unit_offset``: the ops normalize x first, inside their own launch where they can); {} for none."""
    if norm is None:
        return {}
    s: NormSpec = spec(norm)
    return dict(norm_w=norm.weight, norm_eps=s.eps, norm_unit_offset=s.unit_offset)


# ------------------------------------------------------------------------------------------------- MLP
def gated_mlp_forward(self: nn.Module, x: Tensor, residual: Tensor | None = None, norm: nn.Module | None = None
                      ) -> Tensor:
    """``down(silu(gate(x)) * up(x))``, plus ``residual`` when given (the decoder layer's residual add,
    folded into the down projection); with ``norm`` (an injected RMSNorm), of ``norm(x)``."""
    if adapted(self.gate_proj, self.up_proj, self.down_proj):
        return _gated_mlp_adapted(self, x, residual, norm)
    h = ops.gated_mlp_front(x, self.gate_proj.weight, self.up_proj.weight, **norm_prologue(norm))   # [..., I]
    return ops.linear(h, self.down_proj.weight, None, residual)               # [..., H]


def _gated_mlp_adapted(self: nn.Module, x: Tensor, residual: Tensor | None, norm: nn.Module | None) -> Tensor:
    """:func:`gated_mlp_forward` with LoRA on its projections: each projection a product plus its low-rank path,
    the norm, the SiLU gate and the residual add on their own (none fused into a projection's launch)."""
    x = _normed(x, norm)
    h = ops.silu_mul(*_projects((self.gate_proj, self.up_proj), x))                # [..., I]
    out = _project(self.down_proj, h)                                           # [..., H]
    return out if residual is None else out + residual


# -------------------------------------------------------------------------------------- attention QKV
@dataclass(eq=False)
class QKVGroup:
    """The three sibling projections of one attention block. The model's own attention code calls
    ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` in turn; the first call computes all three with one fused
    op and the next two take their share when they see the same input tensor (else they compute alone)."""

    q: nn.Module
    k: nn.Module
    v: nn.Module
    pending: dict[str, Tensor] = field(default_factory=dict)
    pending_input: Tensor | None = None

    def take(self, role: str, x: Tensor) -> Tensor | None:
        if self.pending_input is x and role in self.pending:
            out = self.pending.pop(role)
            if not self.pending:
                self.pending_input = None
            return out
        return None


def q_proj_forward(self: nn.Module, x: Tensor) -> Tensor:
    g: QKVGroup = spec(self)
    q, k, v = add_loras((g.q, g.k, g.v), x,
                        ops.qkv_proj(x, g.q.weight, g.k.weight, g.v.weight, g.q.bias, g.k.bias, g.v.bias))
    g.pending, g.pending_input = {"k": k, "v": v}, x
    return q


def kv_proj_forward(self: nn.Module, x: Tensor) -> Tensor:
    g: QKVGroup = spec(self)
    out = g.take("k" if self is g.k else "v", x)
    return out if out is not None else _project(self, x)


# ------------------------------------------------------------------------------- attention (decode)
@dataclass
class AttentionSpec:
    """A softmax attention block whose decode step runs as: fused QKV, one prologue op (per-head q/k norm,
    rotate-half RoPE, cache write), decode attention (with the sigmoid output gate of gated attention),
    output projection. Anything but a one-token step on a cache that offers ``segki_attention_state`` goes
    to the original forward."""

    num_heads: int
    head_dim: int
    gated: bool               # q_proj yields [query | gate] per head (Qwen3.5)
    norm: NormSpec | None     # the q_norm/k_norm form, None when the block has no q/k norms
    scaling: float
    signature: inspect.Signature  # of the original forward
    original_forward: Any

    def inputs(self, args: tuple, kwargs: dict) -> tuple[Tensor, Any, tuple[Tensor, Tensor] | None]:
        """``(hidden_states, cache, (cos, sin))`` of a call in the original forward's signature."""
        arguments = self.signature.bind(*args, **kwargs).arguments
        extra = next((v for n, v in arguments.items()
                      if self.signature.parameters[n].kind is inspect.Parameter.VAR_KEYWORD), {})
        cache = arguments.get("cache", extra.get("past_key_values"))
        return next(iter(arguments.values())), cache, arguments.get("position_embeddings")


def attention_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The module's own signature (bound against the original forward): a one-token step on the engine's
    cache runs the fused decode; packed rows (``cu_seq_lens_q``, no cache) varlen attention; everything else
    (prefill, padded training, transformers caches) the original."""
    step = _attention_decode_call(self, args, kwargs) or _attention_packed_call(self, args, kwargs)
    return (step(), None) if step is not None else spec(self).original_forward(*args, **kwargs)


def _attention_packed_call(self: nn.Module, args: tuple, kwargs: dict) -> functools.partial | None:
    """The packed-rows forward of this call, ready to run, when it brings ``cu_seq_lens_q`` and rotary tables and
    no cache; else None."""
    s: AttentionSpec = spec(self)
    x, cache, rope_tables = s.inputs(args, kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or cache is not None or rope_tables is None or x.shape[0] != 1:
        return None
    max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
    return functools.partial(_attention_packed, self, s, x, rope_tables, cu, int(max_len))


def _attention_packed(self: nn.Module, s: AttentionSpec, x: Tensor, rope_tables: tuple[Tensor, Tensor], cu: Tensor,
                      max_len: int) -> Tensor:
    """Rows packed end to end, ``x [1, M, H]`` -> ``[1, M, H]``: the block's own projections and q/k norms, the
    rotary tables at each token's position in its row, causal attention within each row (``cu [R + 1]``), the
    output gate of gated attention, the output projection."""
    h, m, d = x[0], x.shape[1], s.head_dim                                                     # h [M, H]
    q = self.q_proj(h)                                                                        # [M, Hq*D(*2)]
    q, gate = q.view(m, -1, 2 * d).chunk(2, dim=-1) if s.gated else (q.view(m, -1, d), None)  # [M, Hq, D] x2
    k, v = self.k_proj(h).view(m, -1, d), self.v_proj(h).view(m, -1, d)                        # [M, Hkv, D]
    if s.norm is not None:
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = (t[0] for t in rope_tables)                                                     # [M, R]
    q, k = reference.rope(q, cos, sin), reference.rope(k, cos, sin)
    out = varlen.varlen_attention(q, k, v, cu, max_len, s.scaling)                            # [M, Hq, D]
    if gate is not None:
        out = out * torch.sigmoid(gate)
    return self.o_proj(out.reshape(m, -1))[None]


def _attention_decode_call(self: nn.Module, args: tuple, kwargs: dict) -> functools.partial | None:
    """The fused decode of this call, ready to run (see :func:`_attention_decode` for its keywords), when the
    call is a one-token step on the engine's cache; else None."""
    s: AttentionSpec = spec(self)
    x, cache, rope_tables = s.inputs(args, kwargs)
    if hasattr(cache, "segki_attention_state") and x.shape[1] == 1 and rope_tables is not None:
        return functools.partial(_attention_decode, self, s, x, rope_tables,
                                 *cache.segki_attention_state(self.layer_idx))
    return None


def _attention_decode(self: nn.Module, s: AttentionSpec, x: Tensor, rope_tables: tuple[Tensor, Tensor],
                      k_cache: Tensor, v_cache: Tensor, positions: Tensor, lengths: Tensor,
                      norm: nn.Module | None = None, residual: Tensor | None = None,
                      post_norm: PostNorm | None = None, normed: Tensor | None = None
                      ) -> Tensor | tuple[Tensor, Tensor]:
    """``x [B, 1, H]`` -> ``[B, 1, H]``; the new key/value land in the caches at ``positions``, attention
    reads ``[0, lengths[b])``. ``norm``: an injected RMSNorm applied to x first, in the QKV projection, unless
    ``normed [B, 1, H]`` brings ``norm(x)`` (computed ahead); ``residual [B, 1, H]``: added in the output
    projection; ``post_norm``: see :func:`_out_projection`."""
    bsz = x.shape[0]
    qp, kp, vp = self.q_proj, self.k_proj, self.v_proj
    h, pro = _projection_input(x, norm, normed, adapted(qp, kp, vp))                         # [B, H]
    q, k, v = ops.qkv_proj(h, qp.weight, kp.weight, vp.weight, qp.bias, kp.bias, vp.bias, **pro)  # [B, Hq*D(*2)] ...
    q, k, v = add_loras((qp, kp, vp), h, (q, k, v))
    cos, sin = (t.expand(bsz, 1, t.shape[-1]).reshape(bsz, -1) for t in rope_tables)             # [B, R]
    q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if s.norm is not None else (None, None)
    eps, unit_offset = (s.norm.eps, s.norm.unit_offset) if s.norm is not None else (0.0, False)
    out = ops.decode_attention_step(q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, lengths, eps,
                                    unit_offset, s.gated, s.scaling)                              # [B, Hq, D]
    return _out_projection(out.view(bsz, -1), self.o_proj, residual, post_norm)


# ------------------------------------------------------------------------------------ Gated DeltaNet
@dataclass
class GDNSpec:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    norm_eps: float
    original_forward: Any  # the forward used for caches this package does not own


GDN_IN = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _gdn_in_proj(self: nn.Module, x: Tensor, **prologue: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """qkv, z, b, a of a Gated-DeltaNet block from its four projection weights (plus their LoRA paths; x as the
    product saw it: with a norm ``prologue`` there is no LoRA, see :func:`_projection_input`)."""
    lins = [getattr(self, n) for n in GDN_IN]
    out = ops.gdn_in_proj(x, *(lin.weight for lin in lins), **prologue)
    return add_loras(lins, x, out)


def gdn_forward(self: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> Tensor:
    """The module's forward: a one-token step on the engine's cache runs the fused decode; a transformers cache the
    original forward; anything else the whole-sequence rule from a zero state, over packed rows when the call
    brings ``cu_seq_lens_q`` (flash-attention's keyword, which transformers passes to every layer)."""
    s: GDNSpec = spec(self)
    cache = kwargs.pop("cache_params", cache)
    step = _gdn_decode_call(self, hidden_states, cache)
    if step is not None:
        return step()
    if cache is not None:  # a transformers cache: its bookkeeping is the model's own code's business
        return s.original_forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    cu = kwargs.get("cu_seq_lens_q")
    x = hidden_states
    if attention_mask is not None and attention_mask.ndim == 2:  # zero padded positions (2-D padding mask)
        x = (x * attention_mask[:, :, None]).to(x.dtype)
    bsz, t, _ = x.shape
    qkv, z, b, a = _gdn_in_proj(self, x)
    mixed = varlen.causal_conv_silu(qkv, self.conv1d.weight, self.conv1d.bias, cu)          # [B, T, C]
    key_dim = s.num_k_heads * s.head_k_dim
    q, k, v = mixed.split([key_dim, key_dim, mixed.shape[-1] - 2 * key_dim], dim=-1)
    q = q.reshape(bsz, t, s.num_k_heads, s.head_k_dim)
    k = k.reshape(bsz, t, s.num_k_heads, s.head_k_dim)
    v = v.reshape(bsz, t, s.num_v_heads, s.head_v_dim)
    g, beta = ops.gdn_gates(a, b, self.A_log, self.dt_bias)
    core = varlen.gdn_chunk(q, k, v, g, beta, cu)                                          # [B, T, Hv, Dv]
    core = ops.gated_rms_norm(core, z.view(bsz, t, s.num_v_heads, s.head_v_dim), self.norm.weight, s.norm_eps)
    return _project(self.out_proj, core.reshape(bsz, t, -1))


def _gdn_decode_call(self: nn.Module, x: Tensor, cache: Any) -> functools.partial | None:
    """The fused decode of this call, ready to run (see :func:`_gdn_decode` for its keywords), when it is a
    one-token step on the engine's cache; else None."""
    if cache is not None and hasattr(cache, "segki_gdn_states") and x.shape[1] == 1:
        return functools.partial(_gdn_decode, self, spec(self), x, *cache.segki_gdn_states(self.layer_idx))
    return None


def _gdn_decode(self: nn.Module, s: GDNSpec, x: Tensor, conv_state: Tensor, recurrent_state: Tensor,
                norm: nn.Module | None = None, residual: Tensor | None = None,
                post_norm: PostNorm | None = None, normed: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """One token per row against a static cache's states (updated in place): the fused decode step. Where
    :func:`ops.fuses_gdn_conv` says so (one row) the conv runs in the input projection's epilogue (two launches
    before ``out_proj``), otherwise after the projection, beside the recurrence. ``norm``: an injected RMSNorm
    applied to x first, in the input projection, unless ``normed [B, 1, K]`` brings ``norm(x)`` (computed ahead);
    ``residual [B, 1, K]``: added in ``out_proj``; ``post_norm``: see :func:`_out_projection`."""
    lora = adapted(*(getattr(self, n) for n in GDN_IN))
    h, pro = _projection_input(x, norm, normed, lora)                              # h [B, K]
    w = tuple(getattr(self, n).weight for n in GDN_IN)
    conv = (conv_state, self.conv1d.weight[:, 0], self.conv1d.bias)                 # [B, C, W] [C, W] [C]
    tail = (recurrent_state, self.A_log, self.dt_bias, self.norm.weight, s.norm_eps, s.num_k_heads, s.head_k_dim,
            s.head_v_dim)
    if not lora and ops.fuses_gdn_conv(h, *w, *conv):
        mixed, z, b, a = ops.gdn_in_proj_conv(h, *w, *conv, **pro)                  # [B, C] [B, Hv*Dv] [B, Hv] x2
        core = ops.gdn_recurrent_step(mixed, z, b, a, *tail)                       # [B, Hv*Dv]
    else:   # the conv beside the recurrence (LoRA: after the adapters' paths joined the products)
        qkv, z, b, a = _gdn_in_proj(self, h, **pro)
        core = ops.gdn_decode_step(qkv, z, b, a, *conv, *tail)
    return _out_projection(core, self.out_proj, residual, post_norm)


def _projection_input(x: Tensor, norm: nn.Module | None, normed: Tensor | None, lora: bool = False
                      ) -> tuple[Tensor, dict[str, Any]]:
    """A mixer's input projection's x ``[B, H]`` and norm prologue: ``norm(x)`` given ahead, with none; else x and
    ``norm``'s, or with ``lora`` (the adapters' paths need the normed x too) ``norm(x)`` on its own."""
    if normed is not None:
        return normed[:, 0], {}
    if lora:
        return _normed(x[:, 0], norm), {}
    return x[:, 0], norm_prologue(norm)


def _out_projection(y: Tensor, proj: nn.Module, residual: Tensor | None, post_norm: PostNorm | None
                    ) -> Tensor | tuple[Tensor, Tensor]:
    """A mixer's output projection of ``y [B, N]`` -> ``[B, 1, H]``, plus ``residual [B, 1, H]`` when given. With
    ``post_norm`` (the residual is then required), the decoder layer's residual add and norm after it too:
    ``(norm(h), h)`` of ``h = residual + projection`` (one launch fewer where the projection's sums go straight
    into the norm, :func:`ops.linear_add_rms_norm`)."""
    bsz = y.shape[0]
    res = residual[:, 0] if residual is not None else None                        # [B, H]
    if adapted(proj):   # the adapter's path joins the product first: the add (and norm) on their own
        out = _project(proj, y)                                                    # [B, H]
        if post_norm is None:
            return (out if res is None else out + res).view(bsz, 1, -1)
        normed, h = ops.add_rms_norm(out, res, *post_norm)
        return normed.view(bsz, 1, -1), h.view(bsz, 1, -1)
    if post_norm is None:
        return ops.linear(y, proj.weight, proj.bias, res).view(bsz, 1, -1)
    normed, h = ops.linear_add_rms_norm(y, proj.weight, proj.bias, res, *post_norm)
    return normed.view(bsz, 1, -1), h.view(bsz, 1, -1)


# ------------------------------------------------------------------------------------- decoder layer
@dataclass
class LayerSpec:
    """A pre-norm residual decoder layer: ``x + mixer(norm1(x))`` then ``+ mlp(norm2(.))``; the first
    residual add is fused with ``norm2``, the second with the MLP's down projection when that is injected."""

    mixer: str                           # "self_attn" | "linear_attn"
    signature: inspect.Signature         # of the layer's original forward
    mixer_params: frozenset[str] | None  # what the mixer accepts by name; None: anything (**kwargs)
    post_norm: NormSpec
    next_norm: nn.Module | None = None   # the norm the layer's output meets next: the next layer's input norm, or
                                         # after the last layer the model's final norm (set by the injection)
    next_owner: nn.Module | None = None  # the module called with the output (set with next_norm): the next layer, or
                                         # the final norm


def decoder_layer_forward(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """The fused layer; under transformers' activation checkpointing (which wraps the class's ``forward``, not
    this instance one) it checkpoints itself the same way: recomputed in the backward, activations not kept."""
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        kwargs = {k: v for k, v in kwargs.items() if k not in ("use_cache", "cache", "past_key_values")}
        return self._gradient_checkpointing_func(functools.partial(_decoder_layer, self, **kwargs), hidden_states,
                                                 *args)
    return _decoder_layer(self, hidden_states, *args, **kwargs)


def _decoder_layer(self: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    s: LayerSpec = spec(self)
    bound = s.signature.bind(hidden_states, *args, **kwargs)
    mixer_kwargs: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = s.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            mixer_kwargs.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            mixer_kwargs[name] = value
    mixer_kwargs.pop(next(iter(s.signature.parameters)))  # the hidden states themselves
    if s.mixer_params is not None:
        mixer_kwargs = {k: v for k, v in mixer_kwargs.items() if k in s.mixer_params}
    step = _mixer_decode_call(self, s, hidden_states, mixer_kwargs)
    if step is not None:
        return _decode_layer(self, s, hidden_states, step)
    out = getattr(self, s.mixer)(self.input_layernorm(hidden_states), **mixer_kwargs)
    if isinstance(out, tuple):
        out = out[0]
    return _mlp_half(self, s, out, hidden_states)


def _mlp_half(self: nn.Module, s: LayerSpec, out: Tensor, hidden_states: Tensor) -> Tensor:
    """``h + mlp(norm2(h))`` with ``h = hidden_states + out``: the first residual add fused with norm2, the
    second in the down projection when the MLP is injected."""
    return _mlp(self, *ops.add_rms_norm(out, hidden_states, *_post_norm(self, s)))


def _post_norm(self: nn.Module, s: LayerSpec) -> PostNorm:
    return self.post_attention_layernorm.weight, s.post_norm.eps, s.post_norm.unit_offset


def _mlp(self: nn.Module, normed: Tensor, residual: Tensor) -> Tensor:
    """``residual + mlp(normed)``, the add in the down projection when the MLP is injected."""
    if _plain(self.mlp, gated_mlp_forward):
        return gated_mlp_forward(self.mlp, normed, residual)
    return residual + self.mlp(normed)


def _hooked(module: nn.Module) -> bool:
    """``module`` has forward hooks, which must see its inputs and outputs."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _plain(module: nn.Module, forward: Any) -> bool:
    """``module`` runs the injected ``forward`` and has no hooks that would see its inputs."""
    return getattr(module.forward, "__func__", None) is forward and not _hooked(module)


def _mixer_decode_call(self: nn.Module, s: LayerSpec, x: Tensor, mixer_kwargs: dict) -> functools.partial | None:
    """The mixer's fused decode of this call, when it is an engine decode step through an injected mixer and
    input norm (none hooked): the layer then runs the norm inside the mixer's input projection."""
    mixer = getattr(self, s.mixer)
    if not _plain(self.input_layernorm, rms_norm_forward) or _hooked(mixer):
        return None
    forward = getattr(mixer.forward, "__func__", None)
    if forward is attention_forward:
        return _attention_decode_call(mixer, (x,), mixer_kwargs)
    if forward is gdn_forward:
        return _gdn_decode_call(mixer, x, mixer_kwargs.get("cache_params", mixer_kwargs.get("cache")))
    return None


def _decode_layer(self: nn.Module, s: LayerSpec, x: Tensor, mixer_step: functools.partial) -> Tensor:
    """A decode step of the layer, ``x [B, 1, H]``: norm1 inside the mixer's input projection. Where the MLP
    front takes norm2 inside its launch too (:func:`ops.folds_norm`: the skinny product at 1-8 rows), the first
    residual add moves into the mixer's output projection, so that no launch is left between the projections;
    elsewhere norm2 stays fused with that add, which the output projection takes on (its sums then go straight
    into the norm kernel where they come in segments of K). The same roundings either way (the projection
    rounded, then the sum rounded). In that second form the MLP's residual add computes the next norm too, ahead
    (:func:`_mlp_ahead`), and a layer given its norm1 so takes it as is."""
    mlp = self.mlp
    ahead = normed_ahead(self.input_layernorm, x)                                  # [B, 1, H] norm1(x), or None
    if ahead is not None:
        mixer_step = functools.partial(mixer_step, normed=ahead)
    if _plain(mlp, gated_mlp_forward) and ops.folds_norm(x, mlp.gate_proj.weight, mlp.up_proj.weight, gated=True):
        h = mixer_step(norm=self.input_layernorm, residual=x)                      # [B, 1, H] = x + mixer(norm1(x))
        return gated_mlp_forward(mlp, h, h, norm=self.post_attention_layernorm)
    normed, h = mixer_step(norm=self.input_layernorm, residual=x, post_norm=_post_norm(self, s))  # norm2(h), h
    return _mlp_ahead(self, s, normed, h)


def _mlp_ahead(self: nn.Module, s: LayerSpec, normed: Tensor, residual: Tensor) -> Tensor:
    """:func:`_mlp`, and where the layer's output meets a known norm next (``s.next_norm``; no hooks on the way)
    that norm of it too, computed with the residual add (:func:`ops.add_rms_norm`) and left on the norm for the call
    with that output (:func:`normed_ahead`): past the skinny product's rows decode then runs no add of its own, one
    launch a layer fewer (0.8B b=32 +4 %, results/norm_ahead/). The same roundings: the projection rounded, the sum
    rounded, the norm of that sum. The down's sums in deferred segments of K (the 4B down at 9-16 rows) go through
    the product's own sum kernel first: straight into the norm kernel decode 4B b=16 lost 1.4-1.5 % (nine segments,
    one block a row) and 1.0 % (a cluster of 8 one-warp blocks a row, results/tile_queue/run3_rows_1_8.md)."""
    mlp, nxt = self.mlp, s.next_norm
    if (nxt is None or not _plain(mlp, gated_mlp_forward) or not _plain(nxt, rms_norm_forward) or _hooked(self)
            or _hooked(s.next_owner)):
        return _mlp(self, normed, residual)
    bsz, ns = normed.shape[0], spec(nxt)
    after, out = ops.add_rms_norm(gated_mlp_forward(mlp, normed[:, 0]), residual[:, 0], nxt.weight, ns.eps,
                                  ns.unit_offset)                                         # [B, H] x2
    out = out.view(bsz, 1, -1)                                                            # [B, 1, H]
    nxt.__dict__[AHEAD] = (out, after.view(bsz, 1, -1))
    return out
