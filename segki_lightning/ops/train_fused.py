"""flash-linear-attention's fused Triton kernels for the element-wise work of a training pass: RMSNorm (with the
residual add), the Gated-DeltaNet output norm with its SiLU gate, SwiGLU and the causal depthwise conv over packed
rows. The reference compositions they replace run ~10 fp32 kernels each over ``[tokens, hidden]`` tensors, twice
with activation checkpointing: at the 0.8B shape they took two thirds of a micro-batch's GPU time, and with these
kernels a 128 x 1024 GRPO step's training part took 0.55x (``benchmarks/results/train_fused/``).

Where they run: CUDA, fla importable, ``SEGKI_TRAIN_FUSED`` not ``0`` (on by default), and either
gradients recorded (the update pass and its checkpoint recompute) or inside :func:`scoring` (the no-grad old
log-prob and reference passes, so that all three passes round alike). Rollout prefill and decode never take them.
They round once at the end where the references round in between (fp32 statistics both), so outputs differ from
the references within bf16 rounding (GPU tests state the tolerances; a GRPO step's gradients stay as near the fp32
step's as the references' do). The price is once per machine: fla tunes each kernel at its first shapes (~1-3
minutes of a first step at the 0.8B-4B shapes, measured), logged when the kernels are first taken."""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from functools import cache

import torch
from torch import Tensor

from .gdn_chunk import _fla_import_error

SWITCH = "SEGKI_TRAIN_FUSED"
DEFAULT = "1"
# fla's norm kernels for widths <= 512 take ceil(rows / bucket) as a compile-time constant: a new token count
# compiles (and autotunes) anew, which at mixed completion lengths is most micro-batches (~160 s in a first
# step, measured). RMSNorm there (Qwen3.5's per-head q/k norms) stays on the reference; Gated-DeltaNet's q/k L2 norm
# (per head, width 128) launches fla's kernels here with the constant held at 1 (_L2Norm), as its output norm can
# (_GatedNorm, under GATED_ONE_LAUNCH); otherwise fla's own functions run in slices of one bucket's rows or fewer.
ROW_KERNEL_MIN_WIDTH = 513
BUCKET_ROWS = 2048 * 32
GATED_ONE_LAUNCH = True   # False: the gated norm in fla's slices again (its GPU test passed at 121d185, one H100)
_SCORING = [0]   # depth of scoring() scopes (one training loop per process)
log = logging.getLogger("segki_lightning")


@contextlib.contextmanager
def scoring() -> Iterator[None]:
    """Scope of a no-grad training pass (old log-probs, reference): the fused kernels run there as in the update."""
    _SCORING[0] += 1
    try:
        yield
    finally:
        _SCORING[0] -= 1


def active(*tensors: Tensor | None) -> bool:
    """Whether a training op on ``tensors`` takes the fused kernels (see the module docstring). A decode step
    (no gradients, no scoring scope) answers at the first check."""
    present = [t for t in tensors if t is not None]
    training = _SCORING[0] > 0 or (torch.is_grad_enabled() and any(t.requires_grad for t in present))
    taken = training and bool(present) and present[0].is_cuda and enabled() and not _fla_import_error()
    if taken:
        _announce()
    return taken


@cache
def _announce() -> None:
    """One line the first time the fused kernels are taken: why the first steps are slow, and the switch."""
    log.info("segki: training passes run flash-linear-attention's fused norms, SwiGLU and conv (%s=0: the fp32 "
             "references); their first steps tune fla's kernels, ~1-3 minutes once on a fresh machine", SWITCH)


def enabled() -> bool:
    """Whether the switch asks for the fused kernels (``SEGKI_TRAIN_FUSED``, default ``DEFAULT``)."""
    return os.environ.get(SWITCH, DEFAULT) == "1"


def _norm_weight(weight: Tensor, unit_offset: bool) -> Tensor:
    """The weight the kernel multiplies by: ``1 + w`` in fp32 for the unit-offset form (Qwen3.5, Gemma), as the
    model computes it; gradients reach ``w`` through it."""
    return 1.0 + weight.float() if unit_offset else weight


def norm_width_ok(x: Tensor) -> bool:
    """Whether fla's RMSNorm on ``x [..., D]`` compiles once for every token count (its row kernel, D > 512)."""
    return x.shape[-1] >= ROW_KERNEL_MIN_WIDTH


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor:
    """``x [..., H]`` -> ``[..., H]`` in x's dtype (see ``reference.rms_norm``)."""
    from fla.modules.layernorm import rms_norm as fla_rms_norm

    return fla_rms_norm(x, _norm_weight(weight, unit_offset), None, eps=eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> tuple[Tensor, Tensor]:
    """``(norm(residual + x), residual + x)`` (see ``reference.add_rms_norm``); the sum kept in the residual's dtype."""
    from fla.modules.layernorm import rms_norm as fla_rms_norm

    normed, summed = fla_rms_norm(x, _norm_weight(weight, unit_offset), None, residual=residual, eps=eps,
                                  prenorm=True)
    return normed, summed


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``w * rmsnorm(x) * silu(z)`` per head: ``x, z [..., D]`` -> ``[..., D]`` (see ``reference.gated_rms_norm``).

    fla's kernels, once each way over every row (:class:`_GatedNorm`, under ``GATED_ONE_LAUNCH``) where this fla's
    kernels take the arguments that form needs, else fla's own function in slices of one bucket."""
    if GATED_ONE_LAUNCH and x.shape[-1] < ROW_KERNEL_MIN_WIDTH and _gated_norm_kernels() is not None:
        return _GatedNorm.apply(x, z, weight, eps)
    from fla.modules.fused_norm_gate import rms_norm_gated

    return _by_bucket(lambda a, b: rms_norm_gated(a, b, weight, None, activation="swish", eps=eps), x, z)


def l2norm(x: Tensor) -> Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim in x's dtype, differentiable: fla's L2 norm, the one its
    chunk rule runs in-kernel (``use_qk_l2norm_in_kernel``), one compile for every token count. Taken wherever fla
    runs the chunk rule, switch or not: it is the kernel fla would run there anyway.

    Its kernels run once each way over every row (:class:`_L2Norm`) where this fla's kernels take the arguments
    that form needs, else through fla's own function in slices of one bucket (a launch, an autograd node and a
    ``cat`` per slice: at 0.8B, ~6 slices of q and of k per layer and pass at 24k tokens)."""
    if x.shape[-1] < ROW_KERNEL_MIN_WIDTH and _l2norm_kernels() is not None:
        return _L2Norm.apply(x)
    from fla.modules.l2norm import l2norm as fla_l2norm

    return _by_bucket(fla_l2norm, x)


# The arguments of fla 0.6's row-block norm kernels (forward, backward), those its heuristics and autotuner fill in
# included: the one-launch forms below pass the rest by name, and are taken only where a kernel's names are these.
_L2NORM_ARGS = ({"x", "y", "rstd", "eps", "T", "D", "BD", "NB", "BT"},
                {"y", "rstd", "dy", "dx", "eps", "T", "D", "BD", "NB", "BT"})
_GATED_NORM_ARGS = ({"x", "g", "y", "w", "b", "residual", "residual_out", "mean", "rstd", "eps", "T", "D", "BT", "BD",
                     "NB", "ACTIVATION", "IS_RMS_NORM", "STORE_RESIDUAL_OUT", "HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS"},
                    {"x", "g", "w", "b", "y", "dy", "dx", "dg", "dw", "db", "dresidual", "dresidual_in", "mean",
                     "rstd", "T", "BS", "D", "BT", "BD", "NB", "ACTIVATION", "IS_RMS_NORM", "STORE_DRESIDUAL",
                     "HAS_DRESIDUAL", "HAS_WEIGHT", "HAS_BIAS", "RECOMPUTE_OUTPUT"})


def _fla_kernels(module: str, names: tuple[str, str], args: tuple[set, set], what: str) -> tuple | None:
    """``(triton, forward kernel, backward kernel)`` from fla's ``module`` where both take exactly ``args``
    (fla 0.6's), else None: the norm then runs in slices, said once."""
    try:
        import triton
        kernels = tuple(getattr(importlib.import_module(module), name) for name in names)
    except (ImportError, AttributeError):
        return None
    if [set(getattr(k, "arg_names", ())) for k in kernels] != list(args):
        log.info("segki: this flash-linear-attention's %s kernels take other arguments; it runs in slices of %d "
                 "rows", what, BUCKET_ROWS)
        return None
    return (triton, *kernels)


@cache
def _l2norm_kernels() -> tuple | None:
    """fla's L2-norm row-block kernels, as :class:`_L2Norm` launches them (see :func:`_fla_kernels`)."""
    return _fla_kernels("fla.modules.l2norm", ("l2norm_fwd_kernel", "l2norm_bwd_kernel"), _L2NORM_ARGS,
                        "q/k L2-norm")


@cache
def _gated_norm_kernels() -> tuple | None:
    """fla's gated-norm row-block kernels, as :class:`_GatedNorm` launches them (see :func:`_fla_kernels`)."""
    return _fla_kernels("fla.modules.fused_norm_gate", ("layer_norm_gated_fwd_kernel", "layer_norm_gated_bwd_kernel"),
                        _GATED_NORM_ARGS, "gated output norm")


class _L2Norm(torch.autograd.Function):
    """fla's L2-norm kernels, one launch each way over all rows ``[..., D]`` (D <= 512). fla's own wrapper passes
    ``NB = cdiv(rows, 65536)``, an autotune key and compile-time constant its kernels never read, so every new
    bucket of rows compiles and tunes anew; held at 1 here, one compile and one tuning serve every token count
    (``T`` is not specialised). Saves what fla's saves: the normalised rows and their ``1 / norm`` in fp32."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        triton, fwd, _ = _l2norm_kernels()
        rows = x.reshape(-1, x.shape[-1]).contiguous()                                 # [T, D]
        t, d = rows.shape
        y = torch.empty_like(rows)                                                     # [T, D] x's dtype
        rstd = torch.empty(t, dtype=torch.float32, device=x.device)                    # [T]
        with torch.cuda.device(x.device):
            fwd[lambda meta: (triton.cdiv(t, meta["BT"]),)](x=rows, y=y, rstd=rstd, eps=1e-6, T=t, D=d,
                                                            BD=triton.next_power_of_2(d), NB=1)
        ctx.save_for_backward(y, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        triton, _, bwd = _l2norm_kernels()
        y, rstd = ctx.saved_tensors
        t, d = y.shape
        dy = dy.reshape(t, d).contiguous()                                             # [T, D]
        dx = torch.empty_like(y)
        with torch.cuda.device(y.device):
            bwd[lambda meta: (triton.cdiv(t, meta["BT"]),)](y=y, rstd=rstd, dy=dy, dx=dx, eps=1e-6, T=t, D=d,
                                                            BD=triton.next_power_of_2(d), NB=1)
        return dx.view(ctx.shape)


class _GatedNorm(torch.autograd.Function):
    """fla's gated RMSNorm kernels (``w * rmsnorm(x) * silu(z)``), one launch each way over all rows ``[..., D]``
    (D <= 512), ``NB`` held at 1 as in :class:`_L2Norm`. Saves what fla's saves (x, z and ``1 / rms`` in fp32);
    the backward launches one program per SM, each summing its rows' ``dw`` in fp32, and adds the partial sums."""

    @staticmethod
    def forward(ctx, x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
        triton, fwd, _ = _gated_norm_kernels()
        d = x.shape[-1]
        rows, gate = x.reshape(-1, d).contiguous(), z.reshape(-1, d).contiguous()      # [T, D] each
        t = rows.shape[0]
        y = torch.empty_like(rows)                                                     # [T, D] x's dtype
        rstd = torch.empty(t, dtype=torch.float32, device=x.device)                    # [T]
        with torch.cuda.device(x.device):
            fwd[lambda meta: (triton.cdiv(t, meta["BT"]),)](
                x=rows, g=gate, y=y, w=weight, b=None, residual=None, residual_out=None, mean=None, rstd=rstd,
                eps=eps, T=t, D=d, BD=triton.next_power_of_2(d), NB=1, ACTIVATION="swish", IS_RMS_NORM=True)
        ctx.save_for_backward(rows, gate, weight, rstd)
        ctx.shapes = (x.shape, z.shape)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        triton, _, bwd = _gated_norm_kernels()
        rows, gate, weight, rstd = ctx.saved_tensors
        t, d = rows.shape
        dy = dy.reshape(t, d).contiguous()                                             # [T, D]
        dx, dz = torch.empty_like(rows), torch.empty_like(gate)
        programs = max(1, min(torch.cuda.get_device_properties(rows.device).multi_processor_count, t))
        dw = torch.empty(programs, d, dtype=torch.float32, device=rows.device)         # [programs, D] partial sums
        with torch.cuda.device(rows.device):
            bwd[(programs,)](x=rows, g=gate, w=weight, b=None, y=None, dy=dy, dx=dx, dg=dz, dw=dw, db=None,
                             dresidual=None, dresidual_in=None, mean=None, rstd=rstd, T=t, BS=-(-t // programs), D=d,
                             BD=triton.next_power_of_2(d), NB=1, ACTIVATION="swish", IS_RMS_NORM=True,
                             STORE_DRESIDUAL=False)
        return dx.view(ctx.shapes[0]), dz.view(ctx.shapes[1]), dw.sum(0).to(weight.dtype), None


def _by_bucket(fn: Callable[..., Tensor], *xs: Tensor) -> Tensor:
    """``fn`` over ``[rows, D]`` slices of at most ``BUCKET_ROWS`` rows of ``xs [..., D]`` (row-wise ops: one
    compiled fla kernel whatever the token count), reassembled to ``xs[0]``'s shape."""
    d = xs[0].shape[-1]
    out = [fn(*rows) for rows in zip(*(x.reshape(-1, d).split(BUCKET_ROWS) for x in xs))]   # [<= BUCKET_ROWS, D]
    return (out[0] if len(out) == 1 else torch.cat(out)).view(xs[0].shape)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` (see ``reference.silu_mul``)."""
    from fla.modules.activations import swiglu

    return swiglu(gate, up)


def causal_conv_silu(x: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor | None) -> Tensor:
    """``SiLU(causal depthwise conv)`` of ``x [B, T, C]`` with ``weight [C, 1, W]``, each packed row from zeros."""
    from fla.modules.causal_conv1d import causal_conv1d

    y, _ = causal_conv1d(x, weight[:, 0], bias, activation="silu", cu_seqlens=cu_seqlens)
    return y
