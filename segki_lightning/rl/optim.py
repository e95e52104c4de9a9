"""fp32 master weights for bf16/fp16 models, as an optimizer.

At RL learning rates (~1e-6) an AdamW update is far below half a bf16 ulp of a typical weight (0.02 has an
ulp of 1.2e-4), so updating bf16 weights in place rounds almost every update away. Here the optimizer keeps
an fp32 copy of each half-precision parameter, steps that copy with any torch optimizer, and writes the
rounded result back INTO the parameter's own storage: the model, its injected segments and captured CUDA
graphs keep reading the same bf16 tensors, and nothing the fp32 copy holds is lost.

We chose master weights over stochastic rounding: the run equals an fp32 run's optimizer trajectory
(testable to 1e-7), costs 4 bytes per parameter, and works with every torch optimizer unchanged."""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Callable

import torch
from torch import Tensor

from ..lightning.fsdp import HALF, is_shard
from .config import EIGHT_BIT

BUCKET_ELEMENTS = 1 << 28   # fp32 gradients made at once while stepping (1 GiB)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_cls`` so that it steps fp32 masters of the half-precision parameters.

    ``param_groups`` hold the model's own parameters and the hyper-parameters, so Lightning's gradient
    clipping and zero_grad, and LR schedulers, work on it as on any optimizer; the inner optimizer steps the
    masters (fp32 parameters are stepped in place). ``state_dict`` carries the masters and the inner
    state, so a checkpoint resumes exactly.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        optimizer_cls: the optimizer that steps the masters (default ``torch.optim.AdamW``).
        **defaults: its hyper-parameters (``lr``, ``weight_decay``, ...).

    Example:
        >>> opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-6)
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
                 **defaults: Any):
        super().__init__(params, defaults)
        self._masters: list[list[Tensor]] = [
            [p.detach().float().clone() if p.dtype in HALF else p.detach() for p in g["params"]]
            for g in self.param_groups]   # fp32 parameters: a view of their own storage, with its own .grad
        inner_groups = [{**_hyper(g), "params": ms} for g, ms in zip(self.param_groups, self._masters)]
        self.inner = optimizer_cls(inner_groups, **defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update(_hyper(group))   # LR schedulers move the outer groups
        for bucket in self._buckets():
            for p, m in bucket:
                m.grad = None if p.grad is None else p.grad.to(m.dtype)
            self.inner.step()            # steps only the masters that have a gradient
            for p, m in bucket:
                if p.dtype in HALF:
                    p.copy_(m)           # round to the parameter's dtype, in its own storage
                m.grad = None
        return loss

    def _buckets(self) -> Iterable[list[tuple[Tensor, Tensor]]]:
        """(parameter, master) pairs of the half-precision parameters, ~``BUCKET_ELEMENTS`` at a time (so the
        fp32 gradients made for a step stay bounded); fp32 parameters are stepped in the first bucket."""
        pairs = [(p, m) for g, ms in zip(self.param_groups, self._masters) for p, m in zip(g["params"], ms)]
        fp32 = [(p, m) for p, m in pairs if p.dtype not in HALF]
        half = [(p, m) for p, m in pairs if p.dtype in HALF]
        bucket, size = list(fp32), 0
        for p, m in half:
            if size and size + m.numel() > BUCKET_ELEMENTS:
                yield bucket
                bucket, size = [], 0
            bucket.append((p, m))
            size += m.numel()
        if bucket:
            yield bucket

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["inner"] = self.inner.state_dict()
        sd["masters"] = {i: m for i, m in enumerate(self._flat_masters()) if m is not None}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        inner, masters = state_dict.pop("inner"), state_dict.pop("masters")
        super().load_state_dict(state_dict)
        self.inner.load_state_dict(inner)
        for i, m in enumerate(self._flat_masters()):
            if m is not None:
                m.copy_(masters[i])

    def _flat_masters(self) -> list[Tensor | None]:
        """Each parameter's fp32 master in param-group order; None where the parameter is its own."""
        return [m if p.dtype in HALF else None for g, ms in zip(self.param_groups, self._masters)
                for p, m in zip(g["params"], ms)]


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def refuse_on_shards(optim: str) -> None:
    """bitsandbytes' 8-bit AdamW does not step FSDP's DTensor shards: one error naming the setting to change."""
    if optim in EIGHT_BIT:
        raise ValueError(f"optim={optim} (bitsandbytes) does not step FSDP's sharded parameters: set "
                         "optim=adamw_torch_fused (algo.optim in a recipe) under trainer.strategy=fsdp")


def build_optimizer(params: Iterable[Tensor], lr: float, weight_decay: float, master_weights: bool = True,
                    optim: str = "adamw_torch_fused", betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8
                    ) -> torch.optim.Optimizer:
    """AdamW as ``optim`` names it (transformers' names: ``adamw_torch_fused`` fused where every parameter is a CUDA
    tensor and none an FSDP shard, ``adamw_torch`` torch's default implementation, ``adamw_8bit`` /
    ``adamw_bnb_8bit`` bitsandbytes' 8-bit AdamW), wrapped in :class:`MasterWeightOptimizer` when ``master_weights``
    and any parameter is bf16/fp16 (the 8-bit moments are then the fp32 masters')."""
    params = [p for p in params if p.requires_grad]
    kw: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps)
    sharded = any(is_shard(p) for p in params)
    if optim in EIGHT_BIT:
        if sharded:
            refuse_on_shards(optim)
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit
    else:
        cls = torch.optim.AdamW
        if optim == "adamw_torch_fused" and params and all(p.is_cuda for p in params) and not sharded:
            kw["fused"] = True   # (FSDP's DTensor shards take the default foreach implementation)
    if master_weights and any(p.dtype in HALF for p in params):
        return MasterWeightOptimizer(params, cls, **kw)
    return cls(params, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, kind: str, total_steps: int, warmup_steps: int = 0,
                    warmup_ratio: float = 0.0):
    """transformers' ``get_scheduler`` (TRL's ``lr_scheduler_type``): warmup of ``warmup_steps`` optimizer steps,
    or ``warmup_ratio`` of ``total_steps`` when that is 0."""
    from transformers import get_scheduler

    warmup = warmup_steps or math.ceil(warmup_ratio * total_steps)
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
