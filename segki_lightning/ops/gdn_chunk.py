"""The Gated-DeltaNet chunk rule for training: flash-linear-attention's fused chunked kernels (forward and
backward, packed sequences included) wherever they give the right gradients, else transformers' torch rule.

fla raises in one backward kernel, the gated ``chunk_bwd_dqkwg`` (dq, dk, dw and dg of a chunk from its states),
on Hopper with Triton in [3.4, 3.7.1): Triton miscompiles it there (fla issue 640). Every other fla kernel of the
gated delta rule runs. :func:`chunk_bwd_dqkwg` below computes that one kernel's outputs with batched matrix products
in torch (compiled on CUDA), from the same inputs, and :func:`training_path` registers it as an fla backend on
exactly that platform (after fla's own TileLang backend, which fla prefers when ``tilelang`` is installed). The rest
of the backward stays in fla's Triton kernels.

Notation (fla's): ``B, T`` batch and length (``B = 1`` with ``cu_seqlens``), ``H, K`` key heads and dim, ``HV, V``
value heads and dim (``HV % H == 0``), ``BT`` the chunk size, ``NC`` chunks over the batch; ``g`` is the chunk-local
cumulative log-decay in log2 units (fla scales by ``1 / ln 2`` and uses ``exp2``)."""
from __future__ import annotations

import logging
import os
from functools import cache, lru_cache

import torch
from torch import Tensor

log = logging.getLogger("segki_lightning")

FLA = "flash-linear-attention"
FLA_DQKWG = "flash-linear-attention + segki dq/dk/dw/dg"
FLA_TILELANG = "flash-linear-attention + its TileLang dq/dk/dw/dg"
TORCH = "transformers' chunked torch rule"


def chunk_positions(batch: int, length: int, chunk: int, cu_seqlens: Tensor | None,
                    chunk_indices: Tensor | None, device: torch.device) -> tuple[Tensor, Tensor]:
    """Where each chunk's tokens sit in the flattened ``[B * T]`` sequence, in fla's chunk order (batch-major for
    equal lengths, ``chunk_indices``' order for packed sequences): ``(positions [NC, BT] int64, valid [NC, BT])``,
    positions past a sequence's end clamped into range and marked invalid. A negative sequence id in
    ``chunk_indices`` (fla's padding rows for graph capture) is a chunk with no valid token."""
    offs = torch.arange(chunk, device=device)
    if cu_seqlens is None:
        nt = -(-length // chunk)
        start = (torch.arange(batch, device=device)[:, None] * length
                 + torch.arange(nt, device=device)[None, :] * chunk).reshape(-1)          # [NC]
        end = (torch.arange(batch, device=device)[:, None] * length + length).expand(batch, nt).reshape(-1)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        if chunk_indices is None:
            counts = (cu[1:] - cu[:-1] + chunk - 1) // chunk
            seq = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
            first = torch.cumsum(counts, 0) - counts
            idx = torch.arange(len(seq), device=device) - first[seq]
        else:
            seq, idx = chunk_indices[:, 0].long(), chunk_indices[:, 1].long()
        real = seq >= 0
        seq = seq.clamp_min(0)
        start = cu[seq] + idx * chunk
        end = torch.where(real, cu[seq + 1], start)
    pos = start[:, None] + offs[None, :]                                                   # [NC, BT]
    valid = pos < end[:, None]
    return pos.clamp_max(batch * length - 1), valid


def _chunks(x: Tensor, pos: Tensor, valid: Tensor | None = None) -> Tensor:
    """``x [B, T, Hx, ...]`` -> ``[NC, Hx, BT, ...]`` contiguous, in one gather. Slots past a sequence's end hold
    some other token's (finite) values, or 0 where ``valid`` is given: callers mask what those slots touch."""
    flat = x.reshape(-1, *x.shape[2:])                                                     # [N, Hx, ...]
    heads = torch.arange(flat.shape[1], device=x.device)
    out = flat[pos[:, None, :], heads[None, :, None]]                                      # [NC, Hx, BT, ...]
    if valid is not None:
        out = out.masked_fill(~valid.view(valid.shape[0], 1, valid.shape[1], *(1,) * (out.dim() - 3)), 0)
    return out


def _unchunk(x: Tensor, where: tuple[Tensor, Tensor], shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Inverse of :func:`_chunks`: ``[NC, Hx, BT, ...]`` -> ``shape`` (``[B, T, Hx, ...]``) in ``dtype``; ``where``
    is ``(source, destination)``: the valid slots of the flattened ``[NC * BT]`` chunks and their tokens."""
    src, dest = where
    bt = x.shape[2]
    heads = torch.arange(x.shape[1], device=x.device)
    rows = x.to(dtype)[(src // bt)[:, None], heads[None, :], (src % bt)[:, None]]           # [M, Hx, ...]
    out = torch.zeros(shape[0] * shape[1], *shape[2:], dtype=dtype, device=x.device)
    out[dest] = rows
    return out.view(shape)


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (the exactness tests)."""
    return torch.promote_types(t.dtype, torch.float32)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in the inputs' dtype (fp32 accumulation on CUDA for bf16/fp16), in the accumulation dtype."""
    return torch.matmul(a, b.to(a.dtype)).to(_acc(a))


def chunk_bwd_dqkwg(q: Tensor, k: Tensor, v: Tensor, do: Tensor, h: Tensor, dh: Tensor, w: Tensor | None = None,
                    g: Tensor | None = None, g_gamma: Tensor | None = None, dv: Tensor | None = None,
                    scale: float | None = None, state_v_first: bool = False, cu_seqlens: Tensor | None = None,
                    chunk_size: int = 64, chunk_indices: Tensor | None = None, **_: object
                    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """fla's gated ``chunk_bwd_dqkwg`` in torch, same arguments and outputs.

    Args:
        q, k: ``[B, T, H, K]`` (l2-normed); v: ``[B, T, HV, V]`` the chunk-corrected values (fla's ``v_new``).
        do: ``[B, T, HV, V]`` output gradient; dv: ``[B, T, HV, V]`` the values' gradient so far (for ``dw``).
        h, dh: ``[..., NC, HV, K, V]`` (``[V, K]`` with ``state_v_first``) each chunk's starting state and its
            gradient. w: ``[B, T, HV, K]`` or None. g: ``[B, T, HV]`` fp32 chunk-local cumulative log2-decay.
    Returns:
        ``dq, dk [B, T, H, K]`` (q's dtype), ``dw [B, T, HV, K]`` (None without ``w``), ``dg [B, T, HV]`` fp32 (per
        position, before fla's reverse cumulative sum).

    Per chunk and value head, with ``G = exp2(g)`` and the lower-triangular causal mask ``L``::

        dq = scale * G * (do h^T) + ds k          ds = scale * L * (do v^T) * G_i / G_j   (rounded to k's dtype)
        dk = G_last / G * (v dh^T) + ds^T q       dw = -(dv h^T)
        dg = rowsum(dq * q) - rowsum(dk * k), plus at the chunk's last token G_last * sum(h * dh) + sum(dk * k)
    """
    if g is None or g_gamma is not None:
        raise ValueError("chunk_bwd_dqkwg here covers the gated case only (g given, no g_gamma)")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    layout = _chunk_layout(*k.shape[:2], chunk_size, cu_seqlens, chunk_indices, k.device)
    return _math_on(k.device)(q, k, v, do, h, dh, w, g, dv, *layout, scale, state_v_first)


def _chunk_layout(batch: int, length: int, chunk: int, cu_seqlens: Tensor | None, chunk_indices: Tensor | None,
                  device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(pos, valid, src, dest)`` of :func:`chunk_positions` and the valid slots' indices (``src``) and tokens
    (``dest``). Their one host sync (the count of valid slots) runs once per shape of equal rows, or once per
    ``cu_seqlens`` tensor for packed rows (the one every layer of a pass shares), not in every layer's backward."""
    if cu_seqlens is None:
        return _equal_layout(batch, length, chunk, device)
    from .varlen import _layout   # varlen imports this module
    indices = None if chunk_indices is None else (chunk_indices.data_ptr(), tuple(chunk_indices.shape))
    return _layout(cu_seqlens, ("dqkwg", batch, length, chunk, device, indices),
                   lambda: _find_layout(batch, length, chunk, cu_seqlens, chunk_indices, device))


@lru_cache(maxsize=8)
def _equal_layout(batch: int, length: int, chunk: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_chunk_layout` of equal-length rows, by shape."""
    return _find_layout(batch, length, chunk, None, None, device)


def _find_layout(batch: int, length: int, chunk: int, cu_seqlens: Tensor | None, chunk_indices: Tensor | None,
                 device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_chunk_layout`, computed."""
    pos, valid = chunk_positions(batch, length, chunk, cu_seqlens, chunk_indices, device)
    src = valid.reshape(-1).nonzero()[:, 0]                                             # one host sync
    return pos, valid, src, pos.reshape(-1)[src]


def _dqkwg_math(q: Tensor, k: Tensor, v: Tensor, do: Tensor, h: Tensor, dh: Tensor, w: Tensor | None, g: Tensor,
                dv: Tensor | None, pos: Tensor, valid: Tensor, src: Tensor, dest: Tensor, scale: float,
                state_v_first: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """:func:`chunk_bwd_dqkwg` past its one host sync: ``pos, valid [NC, BT]`` the chunks' tokens, ``src, dest
    [M]`` the valid chunk slots and their tokens. No data-dependent shape, so that it compiles whole."""
    bsz, length, heads, kdim = k.shape
    hv = v.shape[2]
    nc, bt = pos.shape
    where = (src, dest)
    group = hv // heads
    acc = _acc(q)
    # q, k, v, do unmasked: every product that reads a slot past a sequence's end is masked by `keep`/`vmask`
    # (finite values times 0), and those slots' outputs are never unchunked; g masked, as exp2 of it is taken
    qc, kc = (_chunks(x, pos) for x in (q, k))                                          # [NC, H, BT, K]
    if group > 1:
        qc, kc = qc.repeat_interleave(group, 1), kc.repeat_interleave(group, 1)         # [NC, HV, BT, K]
    vc, doc = _chunks(v, pos), _chunks(do, pos)                                         # [NC, HV, BT, V]
    gc = _chunks(g.to(acc), pos, valid)                                                 # [NC, HV, BT]
    hs, dhs = (x.reshape(-1, hv, *x.shape[-2:])[:nc] for x in (h, dh))                  # [NC, HV, K, V]
    if state_v_first:
        hs, dhs = hs.transpose(-1, -2), dhs.transpose(-1, -2)
    last = (valid.sum(1) - 1).clamp_min(0)                                              # [NC]
    g_last = gc.gather(2, last[:, None, None].expand(nc, hv, 1))                        # [NC, HV, 1]
    vmask = valid[:, None, :].float()                                                   # [NC, 1, BT]
    dq = _mm(doc, hs.transpose(-1, -2)) * (torch.exp2(gc) * scale)[..., None]           # [NC, HV, BT, K]
    dk = _mm(vc, dhs.transpose(-1, -2)) * (torch.exp2(g_last - gc) * vmask)[..., None]
    dg_last = (hs.to(acc) * dhs.to(acc)).sum((-1, -2)) * torch.exp2(g_last[..., 0]) + (dk * kc.to(acc)).sum((-1, -2))
    causal = torch.ones(bt, bt, dtype=torch.bool, device=k.device).tril()
    keep = causal & valid[:, None, :, None] & valid[:, None, None, :]                   # [NC, 1, BT, BT]
    ds = _mm(doc, vc.transpose(-1, -2))                                                 # [NC, HV, BT, BT]
    ds = torch.where(keep, ds * torch.exp2(gc[..., :, None] - gc[..., None, :]), 0.0) * scale
    ds = ds.to(k.dtype)
    dq = dq + _mm(ds, kc)
    dk = dk + _mm(ds.transpose(-1, -2), qc)
    dg = (dq * qc.to(acc)).sum(-1) - (dk * kc.to(acc)).sum(-1)                          # [NC, HV, BT]
    dg = dg.scatter_add(2, last[:, None, None].expand(nc, hv, 1), dg_last[..., None])
    dw = None
    if w is not None:
        dw = _unchunk(-_mm(_chunks(dv, pos), hs.transpose(-1, -2)), where, w.shape, w.dtype)
    shape = (bsz, length, hv, kdim)
    dq, dk = (_unchunk(x, where, torch.Size(shape), q.dtype) for x in (dq, dk))
    if group > 1:
        dq, dk = (x.view(bsz, length, heads, group, kdim).sum(3) for x in (dq, dk))
    return dq, dk, dw, _unchunk(dg, where, g.shape, acc)


COMPILE_SWITCH = "SEGKI_DQKWG_COMPILE"
_compiled: list = []   # [the compiled _dqkwg_math] once made; [None] after compiling failed


def _math_on(device: torch.device):
    """:func:`_dqkwg_math` compiled on CUDA (its element-wise passes over fp32 chunk tensors fused around the
    products: a 0.8B 32-row micro-batch's forward + backward 0.909 -> 0.757 s, peak 8.4 -> 6.9 GiB, one H100; ~20 s
    to compile once, cached on disk by torch), eager elsewhere, under ``SEGKI_DQKWG_COMPILE=0``, or after compiling
    failed once (announced)."""
    if device.type != "cuda" or os.environ.get(COMPILE_SWITCH, "1") == "0" or _compiled == [None]:
        return _dqkwg_math
    if not _compiled:
        log.info("segki: the Gated-DeltaNet dq/dk/dw/dg compiles in its first backward (~20 s on a fresh machine; "
                 "torch caches the kernels; %s=0 runs it eagerly)", COMPILE_SWITCH)
        _compiled.append(torch.compile(_dqkwg_math, dynamic=True))
    return _run_compiled


def _run_compiled(*args):
    """The compiled :func:`_dqkwg_math`; where the compiler stack cannot build it, the eager function (the same
    math), announced once and used from then on."""
    try:
        return _compiled[0](*args)
    except Exception as err:
        log.warning("segki: compiling the Gated-DeltaNet dq/dk/dw/dg failed (%s: %s); running it eagerly",
                    type(err).__name__, str(err)[:200])
        _compiled[:] = [None]
        return _dqkwg_math(*args)


def _fla_refuses() -> bool:
    """fla's gated backward refuses this platform: Hopper with Triton in [3.4, 3.7.1)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    return bool(IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def _register_dqkwg() -> str:
    """Register :func:`chunk_bwd_dqkwg` with fla's backend dispatch for the gated case; returns the path fla will
    take for it (fla's TileLang backend first where it is installed and enabled)."""
    import fla.ops.common.chunk_o  # noqa: F401  (creates fla's 'common' registry)
    from fla.backends import BaseBackend, TileLangBackend, register

    class SegkiTorchBackend(BaseBackend):
        backend_type = "segki_torch"
        priority = 8   # fla's own backends (TileLang: 5) come first

        def chunk_bwd_dqkwg_verifier(self, *args, g=None, g_gamma=None, **kwargs) -> tuple[bool, str | None]:
            if g is None or g_gamma is not None:
                return False, "segki's torch dq/dk/dw/dg covers the gated case only"
            return True, None

        def chunk_bwd_dqkwg(self, *args, **kwargs):
            return chunk_bwd_dqkwg(*args, **kwargs)

    register("common")(SegkiTorchBackend)
    return FLA_TILELANG if TileLangBackend.can_use() else FLA_DQKWG


@cache
def training_path() -> str:
    """Which implementation trains the Gated-DeltaNet chunk rule on CUDA here (logged once): fla, fla with the one
    backward kernel from TileLang or from :func:`chunk_bwd_dqkwg`, or transformers' torch rule (one line saying
    why)."""
    path, why = _probe_path()
    if why:
        log.warning("segki: Gated-DeltaNet training runs %s: %s", path, why)
    else:
        log.info("segki: Gated-DeltaNet training runs %s", path)
    return path


def _probe_path() -> tuple[str, str]:
    why = _fla_import_error()
    if why:
        return TORCH, why
    if not torch.cuda.is_available() or not _fla_refuses():
        return FLA, ""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return TORCH, ("fla's gated backward refuses Triton < 3.7.1 on Hopper and FLA_DISABLE_BACKEND_DISPATCH=1 "
                       "keeps its replacement out")
    try:
        return _register_dqkwg(), ""
    except Exception as err:   # an fla without this backend API
        return TORCH, f"fla's gated backward refuses this Triton and its backend registry failed ({err})"


def fla_runs(needs_grad: bool) -> bool:
    """Whether a CUDA chunk rule runs fla's kernels: where its backward trains here, or without gradients wherever
    fla imports."""
    return training_path() != TORCH or (not needs_grad and not _fla_import_error())


@cache
def _fla_import_error() -> str:
    """Why fla's gated delta rule cannot be imported here ('' when it can)."""
    try:
        import fla.backends  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError as err:   # not installed, or no Triton
        return f"flash-linear-attention is not usable ({err}); pip install -e '.[gpu]' for the fused kernels"
    except Exception as err:   # an fla/Triton combination that fails at import
        return f"flash-linear-attention failed to import ({type(err).__name__}: {err})"
    return ""
