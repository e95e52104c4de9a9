"""peft LoRA layers inside the fused segments. A ``lora.Linear`` on a plain ``nn.Linear`` runs its base weight
through the fused ops like any projection (peft exposes it as the layer's ``weight``), and its low-rank path is
added after the base product the way peft's own forward adds it: the input cast to the adapters' dtype,
``scaling * B(A(dropout(x)))`` summed over the active adapters, the result rounded back to the base output's dtype.
Where a fused op would consume a projection's output inside its own launch (the MLP front's SiLU, the GDN conv,
a norm prologue or a residual epilogue), the adapted projection runs as a plain product instead and the rest
follows unfused (:mod:`.forwards`).

A group's plain paths (one active adapter, ``scaling * B(A(x))`` with no bias, variant or live dropout) go through
:func:`ops.lora_add`: on decode rows two launches for the whole group (``csrc/lora.cu``) instead of peft's five or
six a projection; elsewhere (training, CPU) its reference, peft's own composition. Other paths run peft's modules.

Nothing is merged or copied: every call reads the live adapter Parameters, so a captured decode graph keeps
reading what the optimizer updates in place. A graph holds the adapter state it was captured with (active,
disabled or merged), as the Python branches below decide at capture."""
from __future__ import annotations

from collections.abc import Sequence

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


def add_loras(lins: Sequence[nn.Module], x: Tensor, outs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """Each projection's output (the base product of ``x``) plus its active adapters, as peft's
    ``lora.Linear.forward`` adds them; a packed group's (q|k|v, the GDN in-projections, gate|up) plain paths in one
    :func:`ops.lora_add`."""
    outs, plain = list(outs), []
    for i, lin in enumerate(lins):
        path = plain_path(lin)
        if path is not None:
            plain.append((i, path))
        elif active(lin):
            outs[i] = _peft_path(lin, x, outs[i])
    if plain:
        a, b, scales = zip(*(path for _, path in plain))
        for (i, _), out in zip(plain, ops.lora_add(x, [outs[i] for i, _ in plain], a, b, scales)):
            outs[i] = out
    return tuple(outs)


def _peft_path(lin: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    """peft's own composition of ``lin``'s active adapters: the input cast to the adapters' dtype,
    ``scaling * B(A(dropout(x)))`` summed over them, the result rounded back to the base output's dtype."""
    dtype = out.dtype
    for a in active(lin):
        down = lin.lora_A[a]
        out = out + lin.lora_B[a](down(lin.lora_dropout[a](x.to(down.weight.dtype)))) * lin.scaling[a]
    return out.to(dtype)
