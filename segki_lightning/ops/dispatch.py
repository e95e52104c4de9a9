"""One entry point per fused op: the native kernel when it is loaded and the inputs are eligible, else the
reference. Eligible means: CUDA tensors, bf16 or fp16, contiguous, no autograd graph being recorded (native
kernels are forward-only; training goes through the differentiable reference), and the op's own limits
(e.g. at most ``MAX_ROWS[op]`` rows for the decode GEMVs). Never a crash, never a silent numerics
change: ineligible inputs take the reference.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import reference, train_fused
from .extension import has_native

NATIVE_DTYPES = (torch.bfloat16, torch.float16)


# Rows up to which each decode GEMV runs natively; beyond, cuBLAS (which also reads each weight once). Measured
# on the H200 (benchmarks/results/v5_main_2bf991c/kernels.md, native kernel vs the cuBLAS composition): the
# fused multi-weight projections win up to 16 rows on the 0.8B shape (1.6-1.9x) and are even on the 4B shape
# (0.92-1.16x), but lose at 32 rows on the 4B shape (0.74-0.87x).
GEMV_ROWS = {"linear": 16, "gated_mlp_front": 16, "qkv_proj": 16, "gdn_in_proj": 16}
# The GDN conv in the input projection's epilogue (gdn_in_proj_conv) only at one row, whatever the GEMV rows:
# decode with it against the separate conv (benchmarks/results/v8_decode/) gains 3-4 % at b=1 (0.8B 898 -> 929
# tok/s, 4B 321 -> 328) and loses 8 % at b=16 on 0.8B (9506 -> 8771) and 2 % on 4B: the epilogue's scalar
# conv-state reads and writes grow with the rows, while the launch it saves does not.
CONV_EPILOGUE_ROWS = 1
# A single projection (o_proj, the GDN out_proj, down_proj) of a large weight leaves the native path after one
# row: on the 4B shape (21-47 MB weights) the tensor-core path runs at 0.55-0.84x cuBLAS from 4 to 16 rows, and
# decode gains 18 % at b=8 and 9 % at b=16 with cuBLAS there (benchmarks/results/decode_limits/); at 2-4 rows,
# with every 4B projection on cuBLAS, b=2 gains 10 % (583 -> 643 tok/s) and b=4 31 % (913 -> 1198) over the
# CUDA-core GEMVs (benchmarks/results/rows_4b/). Small weights stay native: on the 0.8B shape (4-7 MB) cuBLAS is
# as fast in isolation, but decode loses 4-5 % at b=8-16 with it (a cuBLAS launch breaks the chain of
# programmatic dependent launches that the native kernels keep).
LARGE_LINEAR_BYTES = 16 * 2**20
LARGE_WEIGHT_ROWS = 1
# The multi-weight projections (gate|up, q|k|v, the GDN input projection) of large weights leave it after one row
# too, since one cuBLAS product covers packed weights: on the 4B shape (gate|up 100 MB, GDN input 63 MB, q|k|v
# 52 MB) decode gains 15 % at 8-16 rows with cuBLAS there (b=8 1907 -> 2190 tok/s, b=16 3398 -> 3915;
# benchmarks/results/joint/). The 0.8B shapes (11-17 MB) stay native: with every projection on cuBLAS past 4
# rows its decode lost 3-10 %.
LARGE_FUSED_BYTES = 32 * 2**20
# The copy-engine GEMV (1-4 rows; csrc/gemv.cu: bulk_plan) stages x in shared memory, so the RMSNorm before a
# projection can run there: a block reduction while the weights' copies land, instead of a launch of its own. Its
# rule, mirrored by folds_norm: weights of at most 16 MiB or rows of at most 2 KB, a weight row (gate and up rows
# together) within a 32 KB slot, x and two slots within 108 KB of shared memory, 16-byte aligned weights, sm_90.
BULK_ROWS, BULK_MAX_WEIGHT_BYTES, BULK_MAX_ROW_BYTES = 4, 16 * 2**20, 2048
BULK_CHUNK_BYTES, BULK_SMEM_BYTES = 32 * 1024, 108 * 1024
FOLD_NORM = os.environ.get("SEGKI_FOLD_NORM", "1") != "0"   # 0: the norms as their own kernels (for comparisons)
# Rows up to which the norms fold into the copy-engine GEMV (the skinny product takes them at all its rows, see
# below; benchmarks/results/fold_norm_prologue/, 0.8B decode against SEGKI_FOLD_NORM=0 in one run): 1 row +5.4 %
# (1113 -> 1173 tok/s), 2 rows +1.8 %, 4 rows -3.2 % (each block normalizes every row before its dot products; that
# grows with the rows, the launch saved does not).
FOLD_ROWS = 2


# The skinny product (csrc/skinny.cu: one block per SM, a producer warp streaming 16-row weight tiles through
# the copy engine, 8 warps on tensor cores, stream-K over the tiles, or a queue of them where a block has four
# or more) takes every projection at 1-SKINNY_ROUTE_ROWS rows where it runs, in place of the GEMVs (and of
# cuBLAS past one row on the large weights). Measured on the H200 (benchmarks/results/skinny/): 4B decode b=1
# 327.0 -> 354.6 tok/s and b=4 1186.9 -> 1283.5 on the 4B weights alone (run2); on every weight size 0.8B b=1
# 1163.1 -> 1187.0 and b=4 3280.1 -> 4458.7 (run3 -> run4, one machine), though at one row it gives up the 0.8B conv
# epilogue. It runs the norm before it in its x staging (folds_norm): against SEGKI_FOLD_NORM=0 in one run
# (run6_fold_ring), 0.8B b=1/4/8 +2.1/+2.2/+0.1 %, 4B +4.3/+1.6/+0.7 %. The GDN conv in its epilogue lost twice
# and was removed (run9_ab, run10_conv_ahead: 0.8B b=1 -3.8 % with the windows read at each tile end, -2.6 %
# with them read ahead). At 9-16 rows it takes x after the norm kernel (SKINNY_FOLD_ROWS): there, staging and
# normalizing 16 rows of x in every block took ~10 us of each 4B product in the step
# (benchmarks/results/staging16/: routed with the norm inside, 4B b=16 4143 -> 3885 tok/s; with the norm as its own
# kernel 4143, 0.8B 11 340 -> 12 886; with x copied in at once, 4B 4233, 0.8B 12 891; the norm inside with its x
# copied in at once, 4B 3962). It holds x in shared memory for the whole product, so its rule (skinny_fits) also
# bounds rows x K; at 1-8 rows, where all of K does not fit, groups of blocks each take a segment of K, their
# sums added across groups (skinny_plan: the 4B and 0.8B down at 7-8 rows; against cuBLAS there, 0.8B b=8
# +7.4 %, 4B +0.5 %, benchmarks/results/segments/). At 9-16 rows segments so gathered lost to cuBLAS (4B b=16
# -2.1 %); there, weights of at most 16 MiB take shorter parts of K instead (the 0.8B down in parts of 512
# columns: 0.8B b=16 +7.3 %, b=12 +8.0 %; the 4B o_proj / out_proj so lost, 4B b=16 -1.4 %,
# benchmarks/results/short_parts/), and larger ones deferred segments: each group stores its sums, a second
# launch adds them (the 4B o_proj, out_proj and down at 9-16 rows; 4B b=16 +3.7-4.0 %, b=12 +6 %, the output
# projections' sums into the norm kernel after them +0.2-0.4 %, benchmarks/results/deferred_segments/); where K
# has parts of 1536-2048 columns and the product is not gated, in those, x held in registers (4B b=16 +2.7 %,
# b=12 +2.1 %, benchmarks/results/deferred_xregs/).
# SEGKI_SKINNY=0: never (the GEMVs and cuBLAS, as before).
SKINNY = os.environ.get("SEGKI_SKINNY")
SKINNY_ROUTE_ROWS = 16
SKINNY_FOLD_ROWS = 8
SKINNY_ROWS, SKINNY_TILE, SKINNY_PAD, SKINNY_SMEM_BYTES, SKINNY_MIN_SLOTS = 16, 16, 32, 218 * 1024, 3
SKINNY_SEGMENT_ROWS, SKINNY_MAX_SEG_TILES = 8, 4096   # rows up to which segments are gathered; tiles x segments
SKINNY_MIN_PART_COLS = 512    # the shortest parts of K it plans where the longer ones do not fit (1 KB row copies)
SKINNY_SHORT_PARTS_MAX_BYTES = 16 * 2**20   # weights up to which it plans them (the 0.8B down 7.3 MB, not 4B's 21)
SKINNY_MAX_SLOTS, SKINNY_REG_SEG_COLS, SKINNY_REG_SEG_STEPS = 6, 2048, (6, 8)   # deferred segments, x in registers


def skinny_part_cols(k: int) -> int:
    """Columns per part of K on the skinny path (csrc/skinny.cu: part_cols): the divisor of K that is a multiple
    of 256 closest to 1280 (the smaller on a tie), or 0 when there is none."""
    best = 0
    for p in range(1, 65):
        kp, rem = divmod(k, p)
        if rem or kp % 256:
            continue
        if best == 0 or (abs(kp - 1280), kp) < (abs(best - 1280), best):
            best = kp
    return best


def skinny_plan(rows: int, k: int, weight_rows: int, elem_size: int, norm: bool = False,
                gated: bool = False) -> tuple[int, int] | None:
    """``(columns per part of K, segments of K)`` of the skinny product for x ``[rows, k]`` by a weight of
    ``weight_rows`` rows (csrc/skinny.cu: skinny_plan), or None where it does not take them: 1-16 rows, whole 16-row
    tiles, x and three slots of one part in its shared memory. The parts of :func:`skinny_part_cols`, at up to
    ``SKINNY_SEGMENT_ROWS`` rows without the norm prologue (``norm``: its sums need whole rows) in the fewest
    segments that fit; else, in one segment on weights of at most ``SKINNY_SHORT_PARTS_MAX_BYTES``, the longest
    smaller parts that fit, down to ``SKINNY_MIN_PART_COLS``; else, past ``SKINNY_SEGMENT_ROWS`` rows without the
    norm, in deferred segments of one part of K each (their sums added by a second launch): not ``gated``, the
    longer parts of :func:`skinny_reg_segment_cols` with x in registers where K has them."""
    kp = skinny_part_cols(k)
    if not 1 <= rows <= SKINNY_ROWS or weight_rows % SKINNY_TILE or kp == 0:
        return None
    segs = _skinny_fit(rows, k, weight_rows, elem_size, kp,
                       "gathered" if not norm and rows <= SKINNY_SEGMENT_ROWS else "whole")
    if segs:
        return kp, segs
    if weight_rows * k * elem_size <= SKINNY_SHORT_PARTS_MAX_BYTES:
        for p in range(kp - 256, SKINNY_MIN_PART_COLS - 1, -256):
            if k % p == 0 and _skinny_fit(rows, k, weight_rows, elem_size, p, "whole"):
                return p, 1
    if norm or rows <= SKINNY_SEGMENT_ROWS:
        return None
    reg_kp = 0 if gated else skinny_reg_segment_cols(k, elem_size)
    if reg_kp:
        return reg_kp, k // reg_kp
    segs = _skinny_fit(rows, k, weight_rows, elem_size, kp, "deferred")
    return (kp, segs) if segs else None


def skinny_reg_segment_cols(k: int, elem_size: int) -> int:
    """Columns of each deferred segment of K where the skinny product holds x in registers (csrc/skinny.cu:
    plan_deferred_regs): the longest multiple of 256 up to 2048 that divides K in 6 or 8 steps of 256, with three
    slots of it in shared memory and at least two segments; 0 where none, or under SEGKI_SKINNY_XSEG=0 (read on
    every call, as the op reads it)."""
    if os.environ.get("SEGKI_SKINNY_XSEG") == "0":
        return 0
    for kp in range(SKINNY_REG_SEG_COLS, 256 * min(SKINNY_REG_SEG_STEPS) - 1, -256):
        if k % kp or kp // 256 not in SKINNY_REG_SEG_STEPS:
            continue
        slots = min(SKINNY_MAX_SLOTS, SKINNY_SMEM_BYTES // (SKINNY_TILE * (kp + SKINNY_PAD) * elem_size))
        return kp if slots >= SKINNY_MIN_SLOTS and k // kp >= 2 else 0
    return 0


def _skinny_fit(rows: int, k: int, weight_rows: int, elem_size: int, kp: int, segments: str) -> int:
    """Segments of K whose x and three slots of kp columns fit, or 0 (csrc/skinny.cu: plan_parts): ``"whole"`` one;
    ``"gathered"`` the fewest (within the tile sums' workspace); ``"deferred"`` one part of K each."""
    parts, slot = k // kp, SKINNY_TILE * (kp + SKINNY_PAD) * elem_size
    first, last = {"whole": (1, 1), "gathered": (1, parts), "deferred": (parts, parts)}[segments]
    for segs in range(first, last + 1):
        if parts % segs:
            continue
        if segments == "gathered" and segs > 1 and weight_rows // SKINNY_TILE * segs > SKINNY_MAX_SEG_TILES:
            return 0
        if rows * (k // segs + SKINNY_PAD) * elem_size + SKINNY_MIN_SLOTS * slot <= SKINNY_SMEM_BYTES:
            return segs
    return 0


def skinny_fits(rows: int, k: int, weight_rows: int, elem_size: int, norm: bool = False, gated: bool = False) -> bool:
    """Whether the skinny product takes x ``[rows, k]`` by a weight of ``weight_rows`` rows (see
    :func:`skinny_plan`)."""
    return skinny_plan(rows, k, weight_rows, elem_size, norm, gated) is not None


def _rows(x: Tensor) -> int:
    """Rows of x ``[..., K]``: every leading dimension flattened."""
    return x.numel() // max(x.shape[-1], 1)


def _skinny_routes(x: Tensor, *weights: Tensor) -> bool:
    """Whether a projection of x by these weights goes to the skinny product (where it also runs)."""
    rows = _rows(x)
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return False   # forward-only kernel; the packed view it reads would also hide the weights from autograd
    return SKINNY != "0" and rows <= SKINNY_ROUTE_ROWS


def _skinny_ok(x: Tensor, w: Tensor | None, residual: Tensor | None = None, gated: bool = False,
               norm_w: Tensor | None = None) -> bool:
    """Whether ``skinny_linear`` runs natively on x ``[..., K]`` by ``w`` (None: weights that are not packed)."""
    if w is None or x.device.type != "cuda" or torch.compiler.is_compiling():
        return False
    rows = _rows(x)
    ok = (w.dim() == 2 and w.is_contiguous() and w.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
          and skinny_fits(rows, x.shape[-1], w.shape[0], x.element_size(), norm=norm_w is not None, gated=gated)
          and (not gated or (w.shape[0] % 2 == 0 and residual is None))
          and (norm_w is None or (norm_w.shape == (x.shape[-1],) and norm_w.data_ptr() % 16 == 0))
          and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return eligible("skinny_linear", x, w, residual, norm_w, shape_ok=ok)


def _skinny_weight(x: Tensor, weights: tuple[Tensor, ...], gated: bool = False,
                   norm_w: Tensor | None = None) -> Tensor | None:
    """The packed weight of these projections when the skinny product takes x by it, else None."""
    if not _skinny_routes(x, *weights):
        return None
    w = joint_weight(*weights)
    return w if _skinny_ok(x, w, gated=gated, norm_w=norm_w) else None


def _skinny_folds(x: Tensor) -> bool:
    """Whether the skinny product of x runs the norm before it inside its x staging."""
    return FOLD_NORM and _rows(x) <= SKINNY_FOLD_ROWS


def _skinny_joint(x: Tensor, weights: tuple[Tensor, ...], norm_w, norm_eps, norm_unit_offset,
                  gated: bool = False) -> Tensor | None:
    """The packed projections of x (after the norm prologue: inside the launch at up to ``SKINNY_FOLD_ROWS`` rows
    unless ``SEGKI_FOLD_NORM=0``, else the norm kernel first) as one skinny product ``[..., sum N_i]`` (gated:
    ``[..., N_0]``, the SiLU-mul applied), or None where it does not run (the caller's GEMV or cuBLAS path then)."""
    fold = _skinny_folds(x)
    w = _skinny_weight(x, weights, gated, norm_w if fold else None)
    if w is None:
        return None
    if not fold:
        x, norm_w = _norm_first(x, norm_w, norm_eps, norm_unit_offset), None
    y = _native("skinny_linear")(x.reshape(-1, x.shape[-1]), w, None, gated, norm_w, norm_eps, norm_unit_offset)
    return y.unflatten(0, x.shape[:-1])


def _gemv_rows() -> tuple[dict[str, int], bool]:
    """The native row limits, and whether ``SEGKI_GEMV_MAX_ROWS`` set them (for end-to-end comparisons): a number
    sets one limit for every op and every weight size; ``op:rows,...`` sets those ops' limits for every weight
    size and keeps the others' defaults."""
    raw = os.environ.get("SEGKI_GEMV_MAX_ROWS")
    if raw is None:
        return dict(GEMV_ROWS), False
    if raw.isdigit() and int(raw) >= 1:
        return dict.fromkeys(GEMV_ROWS, int(raw)), True
    rows = dict(GEMV_ROWS)
    for item in raw.split(","):
        op, _, n = (part.strip() for part in item.partition(":"))
        if op not in GEMV_ROWS or not n.isdigit() or int(n) < 1:
            raise ValueError(f"SEGKI_GEMV_MAX_ROWS={raw!r}: expected a positive number of rows, or op:rows pairs "
                             f"separated by commas with op one of {sorted(GEMV_ROWS)} (unset: per-op limits "
                             f"{GEMV_ROWS})")
        rows[op] = int(n)
    return rows, True


MAX_ROWS, ROWS_FROM_ENV = _gemv_rows()   # read at import; the kernels themselves take up to 64 rows per launch
# Past those rows, projections whose weights are packed (inject.packing) run as one cuBLAS product over the
# packed buffer; SEGKI_JOINT=0 keeps one product per weight (for comparisons)
JOINT = os.environ.get("SEGKI_JOINT", "1") != "0"


def native_rows(op: str, *weights: Tensor) -> int:
    """Rows up to which the projection ``op`` with these weights runs natively: ``MAX_ROWS[op]``, or
    ``LARGE_WEIGHT_ROWS`` for large weights (unless ``SEGKI_GEMV_MAX_ROWS`` set one limit for all)."""
    large = LARGE_LINEAR_BYTES if op == "linear" else LARGE_FUSED_BYTES
    if ROWS_FROM_ENV or sum(w.numel() * w.element_size() for w in weights) < large:
        return MAX_ROWS[op]
    return min(MAX_ROWS[op], LARGE_WEIGHT_ROWS)


def eligible(op: str, *tensors: Tensor | None, max_rows: int | None = None, shape_ok: bool = True,
             strided_first: bool = False, row_strided: int = 0) -> bool:
    """Whether ``torch.ops.segki.<op>`` may run on these tensors: all CUDA, contiguous and of one half
    dtype (None entries are absent optional inputs), no autograd recording, at most ``max_rows`` rows of
    the first tensor, and the op's own shape limits (``shape_ok``). ``strided_first``: the caller copies the
    first tensor to contiguous memory itself, so its layout does not matter. ``row_strided``: the first that
    many tensors may also be matrices of contiguous rows lying apart (column slices of a joint product)."""
    present = [t for t in tensors if t is not None]
    first = present[0]
    if not shape_ok or first.device.type != "cuda" or first.dtype not in NATIVE_DTYPES:
        return False
    if any(t.device != first.device or t.dtype != first.dtype for t in present):
        return False
    if any(not _rows_ok(t) for t in present[:row_strided]):
        return False
    if any(not t.is_contiguous() for t in present[max(row_strided, 1 if strided_first else 0):]):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in present):
        return False
    if max_rows is not None and _rows(first) > max_rows:
        return False
    return has_native(op)


def _rows_ok(t: Tensor) -> bool:
    """Contiguous, or a matrix of contiguous rows lying apart."""
    return t.is_contiguous() or (t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1])


def _vector_rows(t: Tensor) -> bool:
    """Every row of ``t`` starts on a 16-byte boundary (for 8-value loads); contiguous tensors: the allocator's."""
    return t.is_contiguous() or (t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0)


def joint_weight(*weights: Tensor) -> Tensor | None:
    """The weights as one ``[sum N_i, K]`` matrix when they are consecutive rows of one buffer (as
    :func:`segki_lightning.inject.pack_projections` lays them out), else None. A view of their storage made
    outside autograd: only for products that record no gradient."""
    first = weights[0]
    if any(w.dim() != 2 or not w.is_contiguous() or w.dtype != first.dtype or w.device != first.device
           or w.shape[1] != first.shape[1] for w in weights):
        return None
    row_bytes = first.shape[1] * first.element_size()
    for w, nxt in zip(weights, weights[1:]):
        if nxt.data_ptr() != w.data_ptr() + w.shape[0] * row_bytes:
            return None
    storage = first.untyped_storage().data_ptr()
    if any(w.untyped_storage().data_ptr() != storage for w in weights[1:]):
        return None
    rows = sum(w.shape[0] for w in weights)
    return first.detach().as_strided((rows, first.shape[1]), (first.shape[1], 1))


def _joint_product(x: Tensor, weights: tuple[Tensor, ...]) -> list[Tensor] | None:
    """``x [..., K]`` times packed ``weights`` as ONE product, split into each weight's ``[M, N_i]`` output (column
    slices of the ``[M, sum N_i]`` product; M = rows of x): past the fused GEMVs' rows a 7 MB cuBLAS product
    costs nearly what a 15 MB one does (launch ramp and tail). None when the weights are not packed, an
    autograd graph is being recorded, or under torch.compile; the caller then takes one product per weight."""
    if not JOINT or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)):
        return None
    w = joint_weight(*weights)
    if w is None:
        return None
    y = F.linear(x.reshape(-1, x.shape[-1]), w)                                     # [M, sum N_i]
    return list(y.split([t.shape[0] for t in weights], dim=-1))


def folds_norm(x: Tensor, *weights: Tensor, gated: bool = False) -> bool:
    """Whether the native projection of ``x [..., K]`` by ``weights`` runs an RMSNorm of x inside its own launch
    (the skinny product's x staging wherever it takes the packed weights; else the copy-engine GEMV's, at most
    ``FOLD_ROWS`` rows; ``gated``: the SiLU-gated front, whose gate and up rows stream together). Elsewhere the
    projections' norm prologue runs as the norm kernel first: the same bits, one launch more."""
    if not FOLD_NORM or x.device.type != "cuda" or x.dtype not in NATIVE_DTYPES or x.shape[-1] == 0:
        return False
    size, rows, w = x.element_size(), _rows(x), _skinny_weight(x, weights, gated)
    if w is not None:   # the norm inside where x fits whole (no segments of K)
        return _skinny_folds(x) and skinny_fits(rows, x.shape[-1], w.shape[0], size, norm=True)
    if rows > FOLD_ROWS:
        return False
    fits = bulk_gemv_fits(rows, x.shape[-1], size, sum(w.numel() for w in weights) * size, gated,
                          os.environ.get("SEGKI_GEMV_BULK"))
    return (fits and all(w.data_ptr() % 16 == 0 for w in weights)
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def bulk_gemv_fits(rows: int, k: int, elem_size: int, weight_bytes: int, gated: bool, setting: str | None) -> bool:
    """The copy-engine GEMV's size rule for ``rows`` of x by weights of ``weight_bytes`` (``setting``: the
    ``SEGKI_GEMV_BULK`` switch)."""
    row_bytes = k * elem_size * (2 if gated else 1)
    if setting == "0" or not 1 <= rows <= BULK_ROWS or row_bytes > BULK_CHUNK_BYTES:
        return False
    if setting != "1" and weight_bytes > BULK_MAX_WEIGHT_BYTES and k * elem_size > BULK_MAX_ROW_BYTES:
        return False
    x_bytes = -(-rows * k * elem_size // 128) * 128
    return x_bytes + 2 * (BULK_CHUNK_BYTES // row_bytes) * row_bytes <= BULK_SMEM_BYTES


def _takes_norm(x: Tensor, norm_w: Tensor | None, weights: tuple[Tensor, ...], gated: bool = False) -> bool:
    """Whether a native projection that is eligible anyway should be handed the norm prologue: there is none, or
    it runs inside the launch (:func:`folds_norm`) on a weight of x's width."""
    return norm_w is None or (norm_w.shape == (x.shape[-1],) and folds_norm(x, *weights, gated=gated))


def _norm_first(x: Tensor, norm_w: Tensor | None, norm_eps: float, norm_unit_offset: bool) -> Tensor:
    """x after the projection's norm prologue, as its own op (:func:`rms_norm`): where no launch takes it."""
    return x if norm_w is None else rms_norm(x, norm_w, norm_eps, norm_unit_offset)


def backend(op: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """``"native"`` or ``"reference"``: what ``op`` uses for decode-time inputs of this dtype/device."""
    native = torch.device(device).type == "cuda" and dtype in NATIVE_DTYPES and has_native(op)
    return "native" if native else "reference"


def _native(op: str):
    return getattr(torch.ops.segki, op)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """See :func:`reference.linear`. At up to ``SKINNY_ROUTE_ROWS`` rows without a bias: the skinny product where it
    runs."""
    if bias is None and _skinny_routes(x, weight) and _skinny_ok(x, weight, residual):
        return _native("skinny_linear")(x, weight, residual, False)
    if eligible("linear", x, weight, bias, residual, max_rows=native_rows("linear", weight),
                shape_ok=x.shape[-1] % 8 == 0):
        return _native("linear")(x, weight, bias, residual)
    return reference.linear(x, weight, bias, residual)


def skinny_linear(x: Tensor, weight: Tensor, residual: Tensor | None = None, gated: bool = False,
                  norm_w: Tensor | None = None, norm_eps: float = 0.0, norm_unit_offset: bool = False) -> Tensor:
    """See :func:`reference.skinny_linear`: natively where the skinny path takes the inputs (whatever the
    ``SEGKI_SKINNY`` routing of the projections), else the reference."""
    args = (x, weight, residual, gated, norm_w, norm_eps, norm_unit_offset)
    if _skinny_ok(x, weight, residual, gated, norm_w):
        return _native("skinny_linear")(*args)
    return reference.skinny_linear(*args)


def gated_mlp_front(x: Tensor, w_gate: Tensor, w_up: Tensor, norm_w: Tensor | None = None, norm_eps: float = 0.0,
                    norm_unit_offset: bool = False) -> Tensor:
    """See :func:`reference.gated_mlp_front`. At up to ``SKINNY_ROUTE_ROWS`` rows on packed weights: the skinny
    product with its SiLU-mul epilogue where it runs. The norm prologue inside the native launch where it runs there
    (:func:`folds_norm`), else first. Past the native rows: cuBLAS products (one when gate|up are packed), then
    :func:`silu_mul`."""
    rows = native_rows("gated_mlp_front", w_gate, w_up)
    y = _skinny_joint(x, (w_gate, w_up), norm_w, norm_eps, norm_unit_offset, gated=True)
    if y is not None:
        return y                                                                     # [..., I]
    if eligible("gated_mlp_front", x, w_gate, w_up, norm_w, max_rows=rows, shape_ok=x.shape[-1] % 8 == 0) and \
            _takes_norm(x, norm_w, (w_gate, w_up), gated=True):
        return _native("gated_mlp_front")(x, w_gate, w_up, norm_w, norm_eps, norm_unit_offset)
    x = _norm_first(x, norm_w, norm_eps, norm_unit_offset)
    if eligible("gated_mlp_front", x, w_gate, w_up, max_rows=rows, shape_ok=x.shape[-1] % 8 == 0):
        return _native("gated_mlp_front")(x, w_gate, w_up)
    parts = _joint_product(x, (w_gate, w_up))
    if parts is not None:
        return silu_mul(*parts).unflatten(0, x.shape[:-1])                          # [..., I]
    return silu_mul(F.linear(x, w_gate), F.linear(x, w_up))


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """See :func:`reference.silu_mul`; ``gate``/``up`` may be column slices of one product. Training passes:
    :mod:`.train_fused` where it runs."""
    if train_fused.active(gate, up):
        return train_fused.silu_mul(gate, up)
    ok = gate.shape[-1] % 8 == 0 and gate.shape == up.shape and _vector_rows(gate) and _vector_rows(up)
    if eligible("silu_mul", gate, up, shape_ok=ok, row_strided=2):
        return _native("silu_mul")(gate, up)
    return reference.silu_mul(gate, up)


# Rows up to which the native lora_add runs (decode): its shrink re-reads each member's A for every row, where a
# prefill's thousands of rows want cuBLAS products (the reference's).
LORA_OP_ROWS = 64


def lora_add(x: Tensor, outs: Sequence[Tensor], a: Sequence[Tensor], b: Sequence[Tensor], scales: Sequence[float]
             ) -> list[Tensor]:
    """See :func:`reference.lora_add`: one group's LoRA paths in two launches (``csrc/lora.cu``) where the native op
    takes them -- up to ``LORA_OP_ROWS`` rows of a half dtype, adapters of fp32 or that dtype, 1-4 members, no
    autograd -- else the reference (peft's five or six launches a member; also under ``SEGKI_LORA_OP=0``). The
    switch is read at each call, so a captured graph keeps the path it was captured with."""
    adapters, k = [*a, *b], x.shape[-1]
    ok = (0 < len(outs) <= 4 and x.is_cuda and x.dtype in NATIVE_DTYPES and x.is_contiguous()
          and 0 < k and x.numel() // k <= LORA_OP_ROWS and adapters[0].dtype in (torch.float32, x.dtype)
          and all(t.dtype == adapters[0].dtype and t.is_contiguous() and t.device == x.device for t in adapters)
          and all(o.dtype == x.dtype and o.device == x.device and _rows_ok(o) for o in outs)
          and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *outs, *adapters))))
    if ok and os.environ.get("SEGKI_LORA_OP") != "0" and has_native("lora_add"):
        return list(_native("lora_add")(x, list(outs), list(a), list(b), [float(s) for s in scales]))
    return reference.lora_add(x, outs, a, b, scales)


def qkv_proj(x, w_q, w_k, w_v, b_q=None, b_k=None, b_v=None, norm_w=None, norm_eps: float = 0.0,
             norm_unit_offset: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """See :func:`reference.qkv_proj`; the norm prologue as in :func:`gated_mlp_front`. Past the native rows, one
    cuBLAS product when the three weights are packed (and have no biases): the outputs are then column slices of
    it."""
    rows, ok = native_rows("qkv_proj", w_q, w_k, w_v), x.shape[-1] % 8 == 0
    y = _skinny_joint(x, (w_q, w_k, w_v), norm_w, norm_eps, norm_unit_offset) if b_q is None and b_k is None \
        and b_v is None else None
    if y is not None:
        return tuple(y.split([w_q.shape[0], w_k.shape[0], w_v.shape[0]], dim=-1))
    if eligible("qkv_proj", x, w_q, w_k, w_v, b_q, b_k, b_v, norm_w, max_rows=rows, shape_ok=ok) and \
            _takes_norm(x, norm_w, (w_q, w_k, w_v)):
        return tuple(_native("qkv_proj")(x, w_q, w_k, w_v, b_q, b_k, b_v, norm_w, norm_eps, norm_unit_offset))
    x = _norm_first(x, norm_w, norm_eps, norm_unit_offset)
    if eligible("qkv_proj", x, w_q, w_k, w_v, b_q, b_k, b_v, max_rows=rows, shape_ok=ok):
        return tuple(_native("qkv_proj")(x, w_q, w_k, w_v, b_q, b_k, b_v))
    parts = _joint_product(x, (w_q, w_k, w_v)) if b_q is None and b_k is None and b_v is None else None
    if parts is not None:
        return tuple(p.unflatten(0, x.shape[:-1]) for p in parts)
    return reference.qkv_proj(x, w_q, w_k, w_v, b_q, b_k, b_v)


def gdn_in_proj(x, w_qkv, w_z, w_b, w_a, norm_w=None, norm_eps: float = 0.0,
                norm_unit_offset: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """See :func:`reference.gdn_in_proj`; the norm prologue as in :func:`gated_mlp_front`. Past the native rows,
    one cuBLAS product when the four weights are packed: the outputs are then column slices of it (rows ``sum N_i``
    apart)."""
    ws = (w_qkv, w_z, w_b, w_a)
    rows, ok = native_rows("gdn_in_proj", *ws), x.shape[-1] % 8 == 0
    y = _skinny_joint(x, ws, norm_w, norm_eps, norm_unit_offset)
    if y is not None:
        return tuple(y.split([w.shape[0] for w in ws], dim=-1))
    if eligible("gdn_in_proj", x, *ws, norm_w, max_rows=rows, shape_ok=ok) and _takes_norm(x, norm_w, ws):
        return tuple(_native("gdn_in_proj")(x, *ws, norm_w, norm_eps, norm_unit_offset))
    x = _norm_first(x, norm_w, norm_eps, norm_unit_offset)
    if eligible("gdn_in_proj", x, *ws, max_rows=rows, shape_ok=ok):
        return tuple(_native("gdn_in_proj")(x, *ws))
    parts = _joint_product(x, (w_qkv, w_z, w_b, w_a))
    if parts is not None:
        return tuple(p.unflatten(0, x.shape[:-1]) for p in parts)
    return reference.gdn_in_proj(x, w_qkv, w_z, w_b, w_a)


def fuses_gdn_conv(x, w_qkv, w_z, w_b, w_a, conv_state, conv_weight, conv_bias) -> bool:
    """Whether :func:`gdn_in_proj_conv` runs natively here (the conv in the projection's epilogue, one launch):
    at most ``CONV_EPILOGUE_ROWS`` rows (where it measured faster; ``SEGKI_GEMV_MAX_ROWS`` does not move it), a
    conv width of at most 8. Otherwise callers keep the projection (:func:`gdn_in_proj`) and the native conv +
    recurrence of :func:`gdn_decode_step`."""
    ok = (x.shape[-1] % 8 == 0 and x.dim() == 2 and conv_state.dim() == 3 and conv_state.shape[-1] <= 8
          and conv_state.shape[:2] == (x.shape[0], w_qkv.shape[0])
          and conv_weight.shape == (w_qkv.shape[0], conv_state.shape[-1]))
    ok = ok and _skinny_weight(x, (w_qkv, w_z, w_b, w_a)) is None   # the skinny product takes the projection
    return eligible("gdn_in_proj_conv", x, w_qkv, w_z, w_b, w_a, conv_state, conv_weight, conv_bias,
                    max_rows=min(CONV_EPILOGUE_ROWS, MAX_ROWS["gdn_in_proj"]), shape_ok=ok)


def gdn_in_proj_conv(x, w_qkv, w_z, w_b, w_a, conv_state, conv_weight, conv_bias, norm_w=None,
                     norm_eps: float = 0.0, norm_unit_offset: bool = False) -> tuple[Tensor, ...]:
    """See :func:`reference.gdn_in_proj_conv`; the norm prologue as in :func:`gated_mlp_front`."""
    ws, conv = (w_qkv, w_z, w_b, w_a), (conv_state, conv_weight, conv_bias)
    if fuses_gdn_conv(x, *ws, *conv) and _takes_norm(x, norm_w, ws) and (
            norm_w is None or eligible("gdn_in_proj_conv", norm_w, x)):
        return tuple(_native("gdn_in_proj_conv")(x, *ws, *conv, norm_w, norm_eps, norm_unit_offset))
    x = _norm_first(x, norm_w, norm_eps, norm_unit_offset)
    if fuses_gdn_conv(x, *ws, *conv):
        return tuple(_native("gdn_in_proj_conv")(x, *ws, *conv))
    return reference.gdn_in_proj_conv(x, *ws, *conv)


def rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool) -> Tensor:
    """See :func:`reference.rms_norm`. A strided view (Qwen3.5's q_norm gets half of each q_proj row) is
    copied once for the native kernel rather than sent through the ~10-kernel reference composition. Training
    passes: :mod:`.train_fused` where it runs."""
    if train_fused.active(x, weight) and train_fused.norm_width_ok(x):
        return train_fused.rms_norm(x, weight, eps, unit_offset)
    if eligible("rms_norm", x, weight, shape_ok=x.shape[-1] % 8 == 0, strided_first=True):
        return _native("rms_norm")(x.contiguous(), weight, eps, unit_offset)
    return reference.rms_norm(x, weight, eps, unit_offset)


def add_rms_norm(x, residual, weight, eps: float, unit_offset: bool) -> tuple[Tensor, Tensor]:
    """See :func:`reference.add_rms_norm`; training passes: :mod:`.train_fused` where it runs."""
    if train_fused.active(x, residual, weight) and train_fused.norm_width_ok(x):
        return train_fused.add_rms_norm(x, residual, weight, eps, unit_offset)
    if eligible("add_rms_norm", x, residual, weight, shape_ok=x.shape[-1] % 8 == 0):
        return tuple(_native("add_rms_norm")(x, residual, weight, eps, unit_offset))
    return reference.add_rms_norm(x, residual, weight, eps, unit_offset)


def _skinny_defers(x: Tensor, weight: Tensor) -> bool:
    """Whether the skinny product plans x by weight in deferred segments of K (past ``SKINNY_SEGMENT_ROWS`` rows,
    where x of all of K and three slots do not fit): its sums can go to the next kernel."""
    rows = _rows(x)
    plan = skinny_plan(rows, x.shape[-1], weight.shape[0], x.element_size())
    return plan is not None and plan[1] > 1 and rows > SKINNY_SEGMENT_ROWS


def linear_add_rms_norm(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor, norm_w: Tensor,
                        eps: float, unit_offset: bool) -> tuple[Tensor, Tensor]:
    """``add_rms_norm(linear(x, weight, bias), residual, norm_w, eps, unit_offset)``: a mixer's output projection,
    then the decoder layer's residual add and norm. Where the skinny product takes the projection in deferred
    segments of K (the 4B o_proj / out_proj at 13-16 rows), the norm kernel adds the segments' sums itself
    (``add_rms_norm_sums``): one launch fewer, the same bits (through the product's sum kernel instead, decode 4B
    b=16 -0.4-0.6 %, results/v47_decode/out_sums/)."""
    if (bias is None and residual.shape == (*x.shape[:-1], weight.shape[0]) and _skinny_routes(x, weight)
            and _skinny_ok(x, weight) and _skinny_defers(x, weight)
            and eligible("add_rms_norm_sums", residual, norm_w, shape_ok=residual.shape[-1] % 8 == 0)):
        sums = _native("skinny_linear_sums")(x, weight)                                # [S, ..., N] fp32
        return tuple(_native("add_rms_norm_sums")(sums, residual, norm_w, eps, unit_offset))
    return add_rms_norm(linear(x, weight, bias), residual, norm_w, eps, unit_offset)


def decode_attention(q, k_cache, v_cache, lengths, scale: float, gate: Tensor | None = None) -> Tensor:
    """See :func:`reference.decode_attention`. ``gate`` may be a strided view (half of each q_proj row)."""
    ok = q.shape[-1] in (64, 128, 256) and q.shape[1] % k_cache.shape[1] == 0 and q.shape[1] // k_cache.shape[1] <= 8
    ok = ok and lengths.is_cuda and (gate is None or (gate.shape == q.shape and gate.stride(-1) == 1))
    if eligible("decode_attention", q, k_cache, v_cache, shape_ok=ok) and (gate is None or eligible(
            "decode_attention", gate, q, strided_first=True)):
        return _native("decode_attention")(q, k_cache, v_cache, lengths, scale, gate)
    return reference.decode_attention(q, k_cache, v_cache, lengths, scale, gate)


def _prologue_ok(q, k, v, cos, q_norm_w, k_norm_w, k_cache, positions) -> bool:
    """The native attention prologue's shape limits: D in {64, 128, 256}, an even rotary width up to D, contiguous
    CUDA int64 positions, both q/k norms or neither, 2-D projections."""
    d, r = k_cache.shape[-1], cos.shape[-1]
    return (d in (64, 128, 256) and r % 2 == 0 and r <= d and positions.dtype == torch.int64 and positions.is_cuda
            and positions.is_contiguous() and (q_norm_w is None) == (k_norm_w is None)
            and q.dim() == k.dim() == v.dim() == 2)


def attention_prologue(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions, eps: float,
                       unit_offset: bool, gated: bool) -> Tensor:
    """See :func:`reference.attention_prologue`; ``q``, ``k``, ``v`` may be column slices of one product."""
    ok = _prologue_ok(q, k, v, cos, q_norm_w, k_norm_w, k_cache, positions)
    if eligible("attention_prologue", q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, shape_ok=ok,
                row_strided=3):
        return _native("attention_prologue")(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions,
                                             eps, unit_offset, gated)
    return reference.attention_prologue(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions, eps,
                                        unit_offset, gated)


def decode_attention_step(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions, lengths, eps: float,
                          unit_offset: bool, gated: bool, scale: float) -> Tensor:
    """See :func:`reference.decode_attention_step`: one native op (one launch at few rows and a short cache) where
    both halves are eligible, else :func:`attention_prologue` and :func:`decode_attention`, each on its own path."""
    d, hkv = k_cache.shape[-1], k_cache.shape[1]
    hq = q.shape[-1] // (2 * d if gated else d)
    ok = (_prologue_ok(q, k, v, cos, q_norm_w, k_norm_w, k_cache, positions) and hq % hkv == 0 and hq // hkv <= 8
          and lengths.is_cuda)
    if eligible("decode_attention_step", q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, shape_ok=ok,
                row_strided=3):
        return _native("decode_attention_step")(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions,
                                                lengths, eps, unit_offset, gated, scale)
    query = attention_prologue(q, k, v, cos, sin, q_norm_w, k_norm_w, k_cache, v_cache, positions, eps, unit_offset,
                               gated)                                                          # [B, Hq, D]
    gate = q.view(q.shape[0], hq, 2 * d)[..., d:] if gated else None                            # [B, Hq, D]
    return decode_attention(query, k_cache, v_cache, lengths, scale, gate)


def _recurrence_ok(head_k_dim: int, head_v_dim: int, recurrent_state: Tensor) -> bool:
    """The native GDN recurrence's limits: Dk in {64, 128, 256}, Dv a multiple of 32 up to 256, a contiguous
    fp32 state."""
    return (head_k_dim in (64, 128, 256) and head_v_dim % 32 == 0 and head_v_dim <= 256
            and recurrent_state.dtype == torch.float32 and recurrent_state.is_contiguous())


def gdn_decode_step(qkv, z, b, a, conv_state, conv_weight, conv_bias, recurrent_state, A_log, dt_bias,
                    norm_weight, norm_eps: float, num_k_heads: int, head_k_dim: int, head_v_dim: int) -> Tensor:
    """See :func:`reference.gdn_decode_step`."""
    args = (qkv, z, b, a, conv_state, conv_weight, conv_bias, recurrent_state, A_log, dt_bias, norm_weight)
    ok = _recurrence_ok(head_k_dim, head_v_dim, recurrent_state) and conv_state.shape[-1] <= 8
    ok = ok and qkv.dim() == z.dim() == b.dim() == a.dim() == 2
    if eligible("gdn_decode_step", qkv, z, b, a, conv_state, conv_weight, conv_bias, norm_weight, shape_ok=ok,
                row_strided=4):
        return _native("gdn_decode_step")(*args, norm_eps, num_k_heads, head_k_dim, head_v_dim)
    return reference.gdn_decode_step(*args, norm_eps, num_k_heads, head_k_dim, head_v_dim)


def gdn_recurrent_step(mixed, z, b, a, recurrent_state, A_log, dt_bias, norm_weight, norm_eps: float,
                       num_k_heads: int, head_k_dim: int, head_v_dim: int) -> Tensor:
    """See :func:`reference.gdn_recurrent_step`."""
    args = (mixed, z, b, a, recurrent_state, A_log, dt_bias, norm_weight)
    ok = _recurrence_ok(head_k_dim, head_v_dim, recurrent_state) and mixed.dim() == z.dim() == b.dim() == a.dim() == 2
    if eligible("gdn_recurrent_step", mixed, z, b, a, norm_weight, shape_ok=ok, row_strided=4):
        return _native("gdn_recurrent_step")(*args, norm_eps, num_k_heads, head_k_dim, head_v_dim)
    return reference.gdn_recurrent_step(*args, norm_eps, num_k_heads, head_k_dim, head_v_dim)


def sample_tokens(logits, temperature, top_k, top_p, seed, offset) -> tuple[Tensor, Tensor]:
    """See :func:`reference.sample_tokens`."""
    ok = (logits.dim() == 2 and temperature.dtype == top_p.dtype == torch.float32
          and top_k.dtype == seed.dtype == offset.dtype == torch.int64
          and all(t.is_cuda and t.is_contiguous() for t in (temperature, top_k, top_p, seed, offset)))
    if eligible("sample_tokens", logits, shape_ok=ok):
        return tuple(_native("sample_tokens")(logits, temperature, top_k, top_p, seed, offset))
    return reference.sample_tokens(logits, temperature, top_k, top_p, seed, offset)


def process_logits(logits, seen, penalty, min_p, temperature) -> tuple[Tensor, Tensor]:
    """See :func:`reference.process_logits`: two native launches instead of ~25 PyTorch kernels per decode step."""
    rows = [t for t in (penalty, min_p, temperature) if t is not None]
    ok = (logits.dim() == 2 and all(t.is_cuda and t.dtype == torch.float32 and t.is_contiguous() for t in rows)
          and (seen is None or (seen.is_cuda and seen.dtype == torch.bool and seen.is_contiguous()
                                and seen.shape == logits.shape)))
    if eligible("process_logits", logits, shape_ok=ok):
        return tuple(_native("process_logits")(logits, seen, penalty, min_p, temperature))
    return reference.process_logits(logits, seen, penalty, min_p, temperature)


def record_tokens(tok, lp, finished, offset, token, out_tokens, out_logprobs, out_mask, eos, pad: int,
                  lengths: Tensor | None = None) -> None:
    """See :func:`reference.record_tokens`: one native launch instead of ~15 PyTorch kernels per decode step."""
    want = ((tok, torch.int64), (lp, torch.float32), (finished, torch.bool), (offset, torch.int64),
            (token, torch.int64), (out_tokens, torch.int64), (out_logprobs, torch.float32),
            (out_mask, torch.int64), (eos, torch.int64), (lengths, torch.int64))
    ok = all(t is None or (t.is_cuda and t.dtype == dt and t.is_contiguous() and t.device == tok.device)
             for t, dt in want)
    ok = ok and out_tokens.dim() == 2 and out_tokens.shape == out_logprobs.shape == out_mask.shape
    if ok and has_native("record_tokens"):
        return _native("record_tokens")(tok, lp, finished, offset, token, out_tokens, out_logprobs, out_mask, eos,
                                        pad, lengths)
    return reference.record_tokens(tok, lp, finished, offset, token, out_tokens, out_logprobs, out_mask, eos, pad,
                                   lengths)


gdn_gates = reference.gdn_gates


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """See :func:`reference.gated_rms_norm`; training passes: :mod:`.train_fused` where it runs."""
    if train_fused.active(x, z, weight):
        return train_fused.gated_rms_norm(x, z, weight, eps)
    return reference.gated_rms_norm(x, z, weight, eps)
