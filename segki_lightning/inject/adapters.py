"""peft LoRA layers inside the fused segments. A ``lora.Linear`` on a plain ``nn.Linear`` runs its base weight
through the fused ops like any projection (peft exposes it as the layer's ``weight``), and its low-rank path is
added after the base product the way peft's own forward adds it: the input cast to the adapters' dtype,
``scaling * B(A(dropout(x)))`` summed over the active adapters, the result rounded back to the base output's dtype.
Where a fused op would consume a projection's output inside its own launch (the MLP front's SiLU, the GDN conv,
a norm prologue or a residual epilogue), the adapted projection runs as a plain product instead; the SiLU and the
residual add then run in the low-rank paths' launch, the norm and the conv on their own (:mod:`.forwards`).

A group's plain paths (one active adapter, ``scaling * B(A(x))`` with no bias, variant or live dropout) go through
:func:`ops.lora_add`: on decode rows two launches for the whole group (``csrc/lora.cu``) instead of peft's five or
six a projection, the second also taking the SiLU gate after gate|up or the residual add after an output
projection; elsewhere (training, CPU) its reference, peft's own composition. Other paths run peft's modules.

Nothing is merged or copied: every call reads the live adapter Parameters, so a captured decode graph keeps
reading what the optimizer updates in place. A graph holds the adapter state it was captured with (active,
disabled or merged), as the Python branches below decide at capture."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from .. import ops


def is_lora(lin: object) -> bool:
    """A peft LoRA ``Linear`` (its base layer, adapters and scalings in place)."""
    return (type(lin).__module__.startswith("peft.tuners.lora") and isinstance(lin, nn.Module)
            and all(hasattr(lin, a) for a in ("base_layer", "lora_A", "lora_B", "scaling", "lora_dropout")))


def active(lin: object) -> list[str]:
    """The adapters of ``lin`` whose low-rank path applies now: none on a plain layer, or with the adapters off
    (``disable_adapter()``, the KL reference) or merged into the base weight."""
    if not is_lora(lin) or lin.disable_adapters or lin.merged:
        return []
    return [a for a in lin.active_adapters if a in lin.lora_A]


def adapted(*lins: object) -> bool:
    """Whether any of these projections adds a low-rank path now."""
    return any(active(lin) for lin in lins)


def plain_path(lin: object) -> tuple[Tensor, Tensor, float] | None:
    """``(A [r, K], B [N, r], scaling)`` of ``lin``'s path when it is plain now: one active adapter whose path is
    ``scaling * B(A(x))`` -- bias-free linear layers, no DoRA or other variant, its dropout off (p = 0, or eval
    mode as in rollouts); None otherwise."""
    names = active(lin)
    if len(names) != 1:
        return None
    a = names[0]
    down, up, drop = lin.lora_A[a], lin.lora_B[a], lin.lora_dropout[a]
    if type(down) is not nn.Linear or type(up) is not nn.Linear or down.bias is not None or up.bias is not None:
        return None
    if getattr(lin, "use_dora", {}).get(a, False) or getattr(lin, "lora_variant", {}).get(a) is not None:
        return None
    if not (isinstance(drop, nn.Identity) or (isinstance(drop, nn.Dropout) and (drop.p == 0 or not drop.training))):
        return None
    return down.weight, up.weight, float(lin.scaling[a])


def add_loras(lins: Sequence[nn.Module], x: Tensor, outs: Sequence[Tensor], **norm: Any) -> tuple[Tensor, ...]:
    """Each projection's output (the base product of ``x``, or with a ``norm`` prologue -- ``norm_w``, ``norm_eps``,
    ``norm_unit_offset`` -- of the normed x) plus its active adapters, as peft's ``lora.Linear.forward`` adds them; a
    packed group's (q|k|v, the GDN in-projections, gate|up) plain paths in one :func:`ops.lora_add`, which takes
    the norm itself."""
    outs, plain = list(outs), []
    for i, lin in enumerate(lins):
        path = plain_path(lin)
        if path is not None:
            plain.append((i, path))
        elif active(lin):
            outs[i] = _peft_path(lin, _normed(x, norm), outs[i])
    if plain:
        a, b, scales = zip(*(path for _, path in plain))
        for (i, _), out in zip(plain, ops.lora_add(x, [outs[i] for i, _ in plain], a, b, scales, **norm)):
            outs[i] = out
    return tuple(outs)


def _normed(x: Tensor, norm: dict[str, Any]) -> Tensor:
    """x after the norm prologue ``norm`` (none: x)."""
    return ops.rms_norm(x, norm["norm_w"], norm["norm_eps"], norm["norm_unit_offset"]) if norm else x


def add_lora_residual(lin: nn.Module, x: Tensor, out: Tensor, residual: Tensor) -> Tensor:
    """``lin``'s output (the base product ``out`` of ``x``) plus its active adapters, plus ``residual`` (a decoder
    layer's residual add after an output projection): a plain path and the add in one :func:`ops.lora_add`."""
    path = plain_path(lin)
    if path is None:
        return add_loras((lin,), x, (out,))[0] + residual
    a, b, scale = path
    return ops.lora_add(x, [out], [a], [b], [scale], residual=residual)[0]


def silu_loras(gate: nn.Module, up: nn.Module, x: Tensor, gate_out: Tensor, up_out: Tensor, **norm: Any) -> Tensor:
    """``silu(gate(x)) * up(x)`` from the base products of ``x`` (``norm``: as in :func:`add_loras`), each projection's
    active adapters added first: two plain paths and the SiLU gate in one :func:`ops.lora_add`."""
    paths = plain_path(gate), plain_path(up)
    if None in paths:
        return ops.silu_mul(*add_loras((gate, up), x, (gate_out, up_out), **norm))
    a, b, scales = zip(*paths)
    return ops.lora_add(x, [gate_out, up_out], a, b, scales, silu=True, **norm)[0]


def _peft_path(lin: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    """peft's own composition of ``lin``'s active adapters: the input cast to the adapters' dtype,
    ``scaling * B(A(dropout(x)))`` summed over them, the result rounded back to the base output's dtype."""
    dtype = out.dtype
    for a in active(lin):
        down = lin.lora_A[a]
        out = out + lin.lora_B[a](down(lin.lora_dropout[a](x.to(down.weight.dtype)))) * lin.scaling[a]
    return out.to(dtype)
