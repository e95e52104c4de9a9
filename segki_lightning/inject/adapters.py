"""peft LoRA layers inside the fused segments. A ``lora.Linear`` on a plain ``nn.Linear`` runs its base weight
through the fused ops like any projection (peft exposes it as the layer's ``weight``), and its low-rank path is
added after the base product the way peft's own forward adds it: the input cast to the adapters' dtype,
``scaling * B(A(dropout(x)))`` summed over the active adapters, the result rounded back to the base output's dtype.
Where a fused op would consume a projection's output inside its own launch (the MLP front's SiLU, the GDN conv,
a norm prologue or a residual epilogue), the adapted projection runs as a plain product instead and the rest
follows unfused (:mod:`.forwards`).

Nothing is merged or copied: every call reads the live adapter Parameters, so a captured decode graph keeps
reading what the optimizer updates in place. A graph holds the adapter state it was captured with (active,
disabled or merged), as the Python branches below decide at capture."""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn


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


def add_lora(lin: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    """``out`` (the base product of ``x``) plus ``lin``'s active adapters, as peft's ``lora.Linear.forward``."""
    names = active(lin)
    if not names:
        return out
    dtype = out.dtype
    for a in names:
        down = lin.lora_A[a]
        out = out + lin.lora_B[a](down(lin.lora_dropout[a](x.to(down.weight.dtype)))) * lin.scaling[a]
    return out.to(dtype)


def add_loras(lins: Sequence[nn.Module], x: Tensor, outs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """:func:`add_lora` for each projection of a packed group (q|k|v, the GDN in-projections) and its output."""
    return tuple(add_lora(lin, x, out) for lin, out in zip(lins, outs))
