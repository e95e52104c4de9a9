"""Sharded training (FSDP2, through Lightning's ``ModelParallelStrategy``) with rollouts on gathered weights.

Training: every decoder layer of the policy, then the policy itself, is ``fully_shard``-ed over the
data-parallel mesh, so parameters, gradients and optimizer state are split across ranks. The shards are fp32 --
they are the master weights -- and the layers compute in the dtype the policy came in (bf16 on GPU, through
FSDP's ``MixedPrecisionPolicy``), so no :class:`~segki_lightning.rl.MasterWeightOptimizer` is needed.

A frozen KL reference is sharded the same way, in its own dtype (no optimizer state: 2 bytes per parameter
/ N in bf16), and its gathered root weights are released after it has scored a rollout.

Rollouts: before each rollout :class:`GatheredWeights` gathers the full parameters once, in the compute dtype,
into buffers that are swapped into the modules for the rollout while FSDP's forward hooks are set aside. The
injected segments and the captured CUDA graphs read those buffers; they are refilled in place for the next
rollout, so the graphs stay valid across steps. Afterwards the shards and the hooks are put back. The buffers are
the only full copy of the weights; ``keep=False`` frees them after each rollout (the graphs are then captured
again on the next one).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import nn

HALF = (torch.bfloat16, torch.float16)
T = TypeVar("T")


def is_model_parallel(strategy) -> bool:
    """Whether ``strategy`` is Lightning's FSDP2 strategy (``ModelParallelStrategy``)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)


def is_shard(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP shard, or a value computed from shards)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a shard (a collective: every rank calls it); ``t`` itself otherwise."""
    return t.full_tensor() if is_shard(t) else t


def is_sharded(module: nn.Module) -> bool:
    return any(is_shard(p) for p in module.parameters())


def full_state_dict(module: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The sharded ``module``'s whole state dict on the CPU (a collective), each tied weight once (under its first
    name, as ``save_pretrained`` writes it), in ``dtype`` when given."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            full.pop(name, None)
    return {k: v.to(dtype or v.dtype) for k, v in full.items()}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: instances of transformers' ``_no_split_modules`` classes."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_policy(policy: nn.Module, mesh, extra: tuple[nn.Module, ...] = ()) -> torch.dtype:
    """``fully_shard`` each decoder layer, then the policy, over ``mesh``; the shards become fp32 and the layers
    compute in the policy's current dtype. ``extra`` trainable modules (a value head) are sharded alongside, so
    their gradients are reduced too. Returns the compute dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    compute = next(policy.parameters()).dtype
    mp = MixedPrecisionPolicy(param_dtype=compute if compute in HALF else None, reduce_dtype=torch.float32)
    policy.float()
    for layer in decoder_layers(policy):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)
    for module in extra:
        fully_shard(module.float(), mesh=mesh, mp_policy=mp)
    return compute


def shard_frozen(model: nn.Module, mesh) -> None:
    """``fully_shard`` a frozen model (the KL reference) over ``mesh`` in its own dtype, like the policy: each
    rank keeps 1/N of its weights, and its forward gathers one decoder layer at a time."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def through_root(model: nn.Module, fn: Callable[[], T]) -> T:
    """``fn()``, run as ``model``'s forward when ``model`` is an FSDP2 root: code that reads the root group's own
    weights (the embeddings, the output head) outside ``model(...)`` -- chunked log-probs, the plain-head probe
    -- then sees them gathered, and FSDP's backward hooks cover it. Plainly ``fn()`` for any other model."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return fn()
    own = model.__dict__.get("forward")
    model.forward = lambda run: run()
    try:
        return model(fn)   # one argument: FSDP's root pre-forward of some torch versions indexes the inputs
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


class GatheredWeights:
    """Full copies of a sharded module's parameters for rollouts (see the module docstring).

    Args:
        module: the ``fully_shard``-ed policy, in its resharded state (outside a forward).
        dtype: the dtype of the copies (the compute dtype).
        keep: keep the copies between rollouts (graphs stay valid) or free them after each.
    """

    def __init__(self, module: nn.Module, dtype: torch.dtype, keep: bool = True):
        self.module, self.dtype, self.keep = module, dtype, keep
        reshard(module)
        self.slots = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
                      if p is not None and is_shard(p)]
        self.full: dict[int, nn.Parameter] = {}   # id(shard) -> its full copy (tied weights share one)

    @torch.no_grad()
    def gather(self) -> None:
        """All-gather every parameter into its full copy, in place (a collective: every rank calls it)."""
        if not self.full:
            self._allocate()
        done: set[int] = set()
        for _, _, shard in self.slots:
            if id(shard) in done:   # a tied weight: one copy
                continue
            done.add(id(shard))
            full = shard.full_tensor()
            self.full[id(shard)].copy_(full)
            del full

    def _allocate(self) -> None:
        """Empty full copies. The weights of each projection group (``inject.packing``: gate|up, the GDN input
        projections, q|k|v) are rows of one buffer, as ``pack_projections`` lays them out on one device, so past
        the fused GEMVs' rows the rollout takes one product per group here too."""
        from ..inject.packing import group_buffer, one_width, projection_groups

        shards = {id(shard): shard for _, _, shard in self.slots}
        for weights in projection_groups(self.module, injected_only=False):
            if not one_width(weights) or any(id(w) not in shards or id(w) in self.full for w in weights):
                continue   # not one input width, not all sharded here, or shared with another group
            for w, part in zip(weights, group_buffer(weights, self.dtype, weights[0].device)):
                self.full[id(w)] = nn.Parameter(part, requires_grad=False)
        for sid, shard in shards.items():
            if sid not in self.full:
                self.full[sid] = nn.Parameter(torch.empty(shard.shape, dtype=self.dtype, device=shard.device),
                                              requires_grad=False)

    def free(self) -> None:
        self.full.clear()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The full copies in place of the shards, FSDP's forward hooks set aside; both restored on exit."""
        reshard(self.module)   # an FSDP root stays unsharded after a forward without backward
        hooks = _fsdp_hooks(self.module)
        for m, pre, post in hooks:
            m._forward_pre_hooks.pop(pre[0])
            m._forward_hooks.pop(post[0])
        for m, name, shard in self.slots:
            m._parameters[name] = self.full[id(shard)]
        try:
            yield
        finally:
            for m, name, shard in self.slots:
                m._parameters[name] = shard
            for m, pre, post in hooks:
                m._forward_pre_hooks[pre[0]] = pre[1]
                m._forward_pre_hooks.move_to_end(pre[0], last=False)   # FSDP's pre-hook runs first
                m._forward_hooks[post[0]] = post[1]

    @contextlib.contextmanager
    def for_rollout(self) -> Iterator[None]:
        """Gather, swap in, and (``keep=False``) free the copies afterwards."""
        self.gather()
        try:
            with self.swapped():
                yield
        finally:
            if not self.keep:
                self.free()


def reshard(module: nn.Module) -> None:
    """Every FSDP unit of ``module`` back to its shards (its modules then hold the sharded parameters). An FSDP
    root keeps its own weights gathered after a forward without backward; this releases them."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _fsdp_hooks(module: nn.Module) -> list[tuple[nn.Module, tuple, tuple]]:
    """``(module, (pre_id, pre_hook), (post_id, post_hook))`` of every module that ``fully_shard`` gave hooks."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        pre_id, post_id = state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id
        if pre_id not in m._forward_pre_hooks or post_id not in m._forward_hooks:
            raise RuntimeError("the installed torch registers FSDP's forward hooks differently from what segki "
                               "expects; rollouts under FSDP need torch >= 2.6")
        out.append((m, (pre_id, m._forward_pre_hooks[pre_id]), (post_id, m._forward_hooks[post_id])))
    return out
