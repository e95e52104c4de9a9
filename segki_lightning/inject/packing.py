"""Packed projections: the weights that read one input (an MLP's gate and up, a Gated-DeltaNet block's four input
projections, an attention block's q, k and v when they have no biases) moved into one buffer, each Parameter a
view of its own rows.

Past the fused GEMVs' rows (rollout batches of 17-64 rows) :mod:`segki_lightning.ops` then runs ONE cuBLAS product
over the buffer instead of one per weight: at 32 rows a 7 MB product takes nearly as long as a 15 MB one (the
launch's ramp and tail dominate), so the layer's input projections cost about half. Nothing is copied for the
rollout: the Parameters stay the same objects (the optimizer, DDP and checkpoints hold them) and only their
storage moves, once; optimizer steps keep writing into it in place. :func:`unpack_projections` gives each weight
its own storage back (``remove_segment_ki`` calls it).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..ops import joint_weight
from . import forwards as fw

GROUPS = (("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
          ("q_proj", "k_proj", "v_proj"))


def projection_groups(model: nn.Module, injected_only: bool = True) -> list[list[nn.Parameter]]:
    """The weights of each group (of the injected modules only, by default), in the order the joint product
    splits them."""
    found = []
    for m in model.modules():
        if injected_only and fw.SPEC not in m.__dict__:
            continue
        for names in GROUPS:
            linears = [getattr(m, n, None) for n in names]
            if all(isinstance(lin, nn.Linear) and lin.bias is None for lin in linears):
                found.append([lin.weight for lin in linears])
    return found


def one_width(weights: list[Tensor]) -> bool:
    """Distinct matrices of one input width: what one product over their rows needs."""
    return len({id(w) for w in weights}) == len(weights) and all(
        w.dim() == 2 and w.shape[1] == weights[0].shape[1] for w in weights)


def group_buffer(weights: list[Tensor], dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """One empty buffer for the group, split into a ``[N_i, K]`` view per weight, in order."""
    return torch.empty(sum(w.shape[0] for w in weights), weights[0].shape[1], dtype=dtype,
                       device=device).split([w.shape[0] for w in weights])


def _packable(weights: list[nn.Parameter]) -> bool:
    """Plain dense matrices of one dtype, device and width, each the sole owner of its storage (not a shard, a
    gathered buffer's view or a tied weight)."""
    first = weights[0]
    return one_width(weights) and all(
        type(w) is nn.Parameter and type(w.data) is torch.Tensor and not w.is_meta and w.is_contiguous()
        and w.dtype == first.dtype and w.device == first.device
        and w.untyped_storage().nbytes() == w.numel() * w.element_size() for w in weights)


@torch.no_grad()
def pack_projections(model: nn.Module) -> int:
    """Pack each group of the injected modules' projection weights into one buffer; returns how many groups moved
    (groups already packed, or not packable, stay as they are)."""
    moved = 0
    for weights in projection_groups(model):
        if joint_weight(*weights) is not None or not _packable(weights):
            continue
        for w, part in zip(weights, group_buffer(weights, weights[0].dtype, weights[0].device)):
            part.copy_(w)
            w.data = part
        moved += 1
    return moved


@torch.no_grad()
def unpack_projections(model: nn.Module) -> int:
    """Give every weight of each packed group its own storage again; returns how many groups were packed."""
    groups = [ws for ws in projection_groups(model) if joint_weight(*ws) is not None]
    for weights in groups:
        for w in weights:
            w.data = w.data.clone()
    return len(groups)
