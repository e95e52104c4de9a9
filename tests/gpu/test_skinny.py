"""The skinny product (``segki::skinny_linear``: 1-16 rows on large weights) against its fp32 reference, on fresh
random inputs with NaN-poisoned outputs; its split tiles, tile queues and segments of K, its determinism, graph
replay, its residual and gated epilogues, the dispatch that routes the packed projections to it, and its errors (GPU
only)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device", allow_module_level=True)

from segki_lightning.ops import dispatch, reference as R
from segki_lightning.ops.extension import native_ops

from .test_kernels import (DTYPES, STAMP_PHASES, STAMP_WORDS, TOL, assert_every_element, captured, f32, poison,
                           randn, rel_err, stamp_buffer)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def native():
    if native_ops() is None:
        pytest.fail("the segki extension did not build/load on this GPU machine")

# name -> (weight rows, K, gated): the Qwen3.5-4B shapes that take it, 0.8B ones, small ones whose tiles split over
# blocks at every part boundary (K = 2560: two parts; 200 tiles on ~132 blocks), few tiles of many parts, and
# split tiles in segments of K (K = 9216 at 7-16 rows, as many_parts and 4b_down: three groups of blocks gathered at
# 7-8 rows, six deferred at 9-16 with x in registers, nine gated; 08b_down two at 7-8; 4b_o_proj two at 13-16,
# deferred; xseg_8_steps three of 2048 columns at 9-16, x in registers),
# split tiles in parts of 512 columns where the longer ones do not fit (K = 3584 at 9-16 rows, as 08b_down), and a
# K wide enough for segments at 4 rows and fewer (K = 16384: two at 4-5 rows, four at 8), and at 9-16 rows tiles
# dealt by a queue in three parts of K (x in two pieces; with a norm, in one); at 9-16 rows the 4B's K = 2560
# products (GDN input, gate|up, q|k|v: tiles by a queue) with x in registers
SHAPES = {
    "4b_gate_up": (2 * 9216, 2560, True), "4b_gdn_in": (12352, 2560, False), "4b_o_proj": (2560, 4096, False),
    "4b_down": (2560, 9216, False), "08b_gate_up": (2 * 3584, 1024, True), "08b_down": (1024, 3584, False),
    "08b_o_proj": (1024, 2048, False), "many_parts": (16 * 8, 9216, False), "many_parts_gated": (16 * 8, 9216, True),
    "split_tiles": (16 * 200, 2560, False), "split_gated": (16 * 200, 2560, True), "few_tiles": (16 * 5, 512, False),
    "split_segments": (16 * 200, 9216, False), "split_segments_gated": (16 * 200, 9216, True),
    "split_short_parts": (16 * 140, 3584, False), "split_short_parts_gated": (16 * 140, 3584, True),
    "wide_k": (16 * 12, 16384, False), "wide_k_gated": (16 * 12, 16384, True),
    "queue_three_parts": (16 * 600, 3072, False), "queue_three_parts_gated": (16 * 600, 3072, True),
    "4b_qkv": (10240, 2560, False), "xseg_8_steps": (16 * 200, 6144, False),
}
ROWS = [1, 2, 3, 5, 8, 9, 16]


def want(x, w, gated, residual=None):
    return R.skinny_linear(*f32(x, w), None if residual is None else residual.float(), gated)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_skinny_product_against_the_fp32_reference(shape, rows, dtype):
    n, k, gated = SHAPES[shape]
    if not dispatch.skinny_fits(rows, k, n, 2):
        pytest.skip(f"{rows} rows of K = {k} do not fit the path (x and three slots in shared memory)")
    x, w = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k**-0.5)
    poison((rows, n // 2 if gated else n), dtype=dtype)
    got = torch.ops.segki.skinny_linear(x, w, None, gated)
    assert got.dtype == dtype and got.shape == (rows, n // 2 if gated else n)
    assert rel_err(got, want(x, w, gated)) < TOL[dtype]
    assert_every_element(got, want(x, w, gated), dtype)


@pytest.mark.parametrize("shape", ["split_tiles", "many_parts", "split_segments", "split_short_parts", "wide_k"])
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_skinny_product_is_deterministic_and_replays_in_a_graph(rows, shape):
    """Split tiles and segments of K are summed in one order every launch (and their flags and counters zeroed for
    the next): the same bits eagerly, again, and from a graph replayed on new inputs."""
    n, k, _ = SHAPES[shape]
    if not dispatch.skinny_fits(rows, k, n, 2):
        pytest.skip(f"{rows} rows of K = {k} do not fit the path")
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    first = torch.ops.segki.skinny_linear(x, w)
    assert torch.equal(first, torch.ops.segki.skinny_linear(x, w))
    graph, out = captured(lambda: torch.ops.segki.skinny_linear(x, w))
    for _ in range(3):
        x.copy_(randn(rows, k, dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(out, torch.ops.segki.skinny_linear(x, w))
        assert rel_err(out, want(x, w, False)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("shape", ["split_tiles", "split_segments", "split_short_parts"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
def test_skinny_residual_is_the_separate_add_of_the_rounded_product(rows, dtype, shape):
    n, k, _ = SHAPES[shape]
    if not dispatch.skinny_fits(rows, k, n, 2):
        pytest.skip(f"{rows} rows of K = {k} do not fit the path")
    x, w, res = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k**-0.5), randn(rows, n, dtype=dtype)
    poison((rows, n), dtype=dtype)
    got = torch.ops.segki.skinny_linear(x, w, res)
    assert torch.equal(got, torch.ops.segki.skinny_linear(x, w) + res)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", ["4b_gate_up", "4b_down", "08b_gate_up", "08b_o_proj", "split_tiles", "split_gated",
                                   "many_parts", "few_tiles"])
def test_one_row_is_bit_for_bit_the_first_row_of_two(shape, residual):
    """A row's outputs do not depend on the other rows of x: one row alone gives the bits of the first row of two
    (the same products and sums, whatever a one-row launch does differently). The shapes cover blocks of more than
    8 tiles (4b_gate_up), tiles split between blocks and single-tile blocks."""
    n, k, gated = SHAPES[shape]
    if gated and residual:
        pytest.skip("the gated product takes no residual")
    x, w = randn(2, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    res = randn(2, n, dtype=torch.bfloat16) if residual else None
    two = torch.ops.segki.skinny_linear(x, w, res, gated)
    poison((1, n // 2 if gated else n), dtype=torch.bfloat16)
    one = torch.ops.segki.skinny_linear(x[:1].clone(), w, None if res is None else res[:1].clone(), gated)
    assert torch.equal(one, two[:1])
    assert rel_err(one, want(x[:1], w, gated, None if res is None else res[:1])) < TOL[torch.bfloat16]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", ["4b_down", "split_segments", "split_segments_gated", "many_parts_gated",
                                   "xseg_8_steps"])
def test_deferred_segments_give_each_row_the_bits_it_gets_alone(shape, residual):
    """At 9-16 rows the segments of K (one part each) are summed by a second launch in segment order: the same groups,
    tiles and order at 12 rows as at 16 (at 9, x of all of K fits beside slots of 512 columns on the small weights),
    so the first 12 rows of 16 are the bits of those 12 rows alone (the 4B down: six segments of 1536 columns with x
    in registers; gated, nine of 1024 with x in shared memory, tiles split between blocks), and the output is the
    sums of skinny_linear_sums added in order, rounded, plus the residual."""
    n, k, gated = SHAPES[shape]
    if gated and residual:
        pytest.skip("the gated product takes no residual")
    plan = dispatch.skinny_plan(16, k, n, 2, gated=gated)
    assert plan == dispatch.skinny_plan(12, k, n, 2, gated=gated)
    assert plan == {9216: (1024, 9) if gated else (1536, 6), 6144: (2048, 3)}[k]
    x, w = randn(16, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    res = randn(16, n, dtype=torch.bfloat16) if residual else None
    poison((16, n // 2 if gated else n), dtype=torch.bfloat16)
    sixteen = torch.ops.segki.skinny_linear(x, w, res, gated)
    poison((12, n // 2 if gated else n), dtype=torch.bfloat16)
    twelve = torch.ops.segki.skinny_linear(x[:12].clone(), w, None if res is None else res[:12].clone(), gated)
    assert torch.equal(sixteen[:12], twelve)
    assert rel_err(sixteen, want(x, w, gated, res)) < TOL[torch.bfloat16]
    if not gated:
        added = R.sum_segments(torch.ops.segki.skinny_linear_sums(x, w))           # [16, n] fp32 of [9, 16, n]
        y = added.bfloat16() if res is None else (added.bfloat16().float() + res.float()).bfloat16()
        assert torch.equal(sixteen, y)


@pytest.mark.parametrize("rows", [1, 8, 9, 16])
@pytest.mark.parametrize("shape", ["4b_gdn_in", "4b_gate_up", "4b_o_proj", "4b_down", "split_segments_gated",
                                   "queue_three_parts_gated"])
def test_tile_queues_come_back_to_zero_over_many_launches(shape, rows):
    """Where segments of K are not gathered and a block's group has at least four tiles a block (these shapes at 9-16
    rows: whole K in two and three parts, x in two pieces, deferred segments gated; the 4B o_proj's two deferred
    segments with x in registers, not queued, run the same checks; at 1 and 8 rows the 4B
    GDN input and gate|up), the tiles are dealt by a counter that the launch's last draw sets back to zero, each
    launch taking the next counters of a ring of 64 launches: 200 launches back to back (three turns of the ring, each
    starting under PDL beside the one before) and a graph replayed 70 times on the same counters each give the first
    launch's bits on NaN-poisoned outputs, where a counter left past zero would skip tiles or a shared one deal a tile
    twice. A tile's sums do not depend on the block that takes it."""
    n, k, gated = SHAPES[shape]
    if not dispatch.skinny_fits(rows, k, n, 2):
        pytest.skip(f"{rows} rows of K = {k} do not fit the path")
    out_shape = (rows, n // 2 if gated else n)
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    poison(out_shape, dtype=torch.bfloat16)
    first = torch.ops.segki.skinny_linear(x, w, None, gated)
    assert rel_err(first, want(x, w, gated)) < TOL[torch.bfloat16]
    outs = []
    for _ in range(200):
        poison(out_shape, dtype=torch.bfloat16)
        outs.append(torch.ops.segki.skinny_linear(x, w, None, gated))
    assert all(torch.equal(o, first) for o in outs)
    graph, out = captured(lambda: torch.ops.segki.skinny_linear(x, w, None, gated))
    for _ in range(70):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, first)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6])   # 6: a second round of the 4 parts requested at once
@pytest.mark.parametrize("width", [1024, 2560, 4104])
def test_add_rms_norm_of_sums_is_their_rounded_sum_then_the_add_and_norm(width, parts, dtype):
    """add_rms_norm_sums takes x as fp32 sums in parts: added in part order and rounded, then the add_rms_norm
    kernel's arithmetic, so both outputs hold the bits of add_rms_norm on that rounded sum (widths of one and two
    stretches a thread and past them)."""
    rows = 5
    sums = randn(parts, rows, width, dtype=torch.float32, scale=3.0)
    res, nw = randn(rows, width, dtype=dtype), randn(width, dtype=dtype, scale=0.2)
    want = torch.ops.segki.add_rms_norm(R.sum_segments(sums).to(dtype), res, nw, 1e-6, True)
    poison((rows, width), (rows, width), dtype=dtype)
    got = torch.ops.segki.add_rms_norm_sums(sums, res, nw, 1e-6, True)
    for g, v in zip(got, want):
        assert g.dtype == dtype and not torch.isnan(g).any() and torch.equal(g, v)
    ref = R.add_rms_norm_sums(sums, *f32(res, nw), 1e-6, True)
    assert rel_err(got[0], ref[0]) < TOL[dtype]
    with pytest.raises(RuntimeError, match="sums .* must be contiguous"):
        torch.ops.segki.add_rms_norm_sums(sums[:, :2], res, nw, 1e-6, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [12, 16])
def test_an_output_projection_hands_the_norm_its_sums_with_the_same_bits(rows, dtype, monkeypatch):
    """ops.linear_add_rms_norm on the 4B o_proj / out_proj shape: at 16 rows (deferred segments) the product's sums
    go to the norm kernel, no sum kernel between; the bits of the product (with its own sum launch) then
    add_rms_norm either way; refused by skinny_linear_sums where the plan has no deferred segments."""
    from segki_lightning import ops

    n, k, _ = SHAPES["4b_o_proj"]
    x, w = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k**-0.5)
    res, nw = randn(rows, n, dtype=dtype), randn(n, dtype=dtype, scale=0.2)
    want = torch.ops.segki.add_rms_norm(torch.ops.segki.skinny_linear(x, w), res, nw, 1e-6, True)
    calls = []
    monkeypatch.setattr(dispatch, "_native", lambda op: calls.append(op) or getattr(torch.ops.segki, op))
    poison((rows, n), (rows, n), dtype=dtype)
    with torch.no_grad():
        got = ops.linear_add_rms_norm(x, w, None, res, nw, 1e-6, True)
    deferred = rows > dispatch.SKINNY_SEGMENT_ROWS and dispatch.skinny_plan(rows, k, n, 2)[1] > 1
    assert deferred == (rows == 16)
    assert calls == (["skinny_linear_sums", "add_rms_norm_sums"] if deferred else ["skinny_linear", "add_rms_norm"])
    for g, v in zip(got, want):
        assert torch.equal(g, v)
    ref = R.add_rms_norm(R.linear(*f32(x, w)), *f32(res, nw), 1e-6, True)
    assert rel_err(got[0], ref[0]) < 2 * TOL[dtype]
    if not deferred:
        with pytest.raises(RuntimeError, match="not planned in deferred segments"):
            torch.ops.segki.skinny_linear_sums(x, w)


NORM_SHAPES = ["4b_gate_up", "4b_gdn_in", "4b_o_proj", "4b_down", "08b_gate_up", "split_tiles", "many_parts",
               "queue_three_parts"]


@pytest.mark.parametrize("unit_offset", [True, False], ids=["unit_offset", "plain_w"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_skinny_norm_prologue_is_the_norm_kernel_then_the_product(shape, rows, dtype, unit_offset):
    """The RMSNorm in the x staging holds the norm kernel's bits (the same per-thread sums and block reduction), so
    the product equals the one of the norm kernel's output exactly where both launches have the same plan (without
    the norm, x may come in segments of K: other sums, within tolerance); K of 1024 (idle threads), 2560 and 4096
    (a second 2048-column stretch) and 9216 (five), both weight forms; and within tolerance of the fp32
    reference."""
    n, k, gated = SHAPES[shape]
    if not dispatch.skinny_fits(rows, k, n, 2, norm=True):
        pytest.skip(f"{rows} rows of K = {k} do not fit the path with a norm (all of x and three slots)")
    x, w = randn(rows, k, dtype=dtype, scale=3.0), randn(n, k, dtype=dtype, scale=k**-0.5)
    nw, eps = randn(k, dtype=dtype, scale=0.2), 1e-6
    normed = torch.ops.segki.rms_norm(x, nw, eps, unit_offset)
    res = None if gated else randn(rows, n, dtype=dtype)
    poison((rows, n // 2 if gated else n), dtype=dtype)
    got = torch.ops.segki.skinny_linear(x, w, res, gated, nw, eps, unit_offset)
    after = torch.ops.segki.skinny_linear(normed, w, res, gated)
    if dispatch.skinny_plan(rows, k, n, 2, norm=True) == dispatch.skinny_plan(rows, k, n, 2):
        assert torch.equal(got, after)
    else:
        assert rel_err(got, after) < TOL[dtype]
    ref = R.skinny_linear(*f32(x, w, res), gated, nw.float(), eps, unit_offset)
    assert rel_err(got, ref) < TOL[dtype]


def test_skinny_norm_prologue_refuses_a_norm_weight_of_another_width():
    x, w = randn(2, 2560, dtype=torch.bfloat16), randn(256, 2560, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="norm_w.*must be \\[2560\\]"):
        torch.ops.segki.skinny_linear(x, w, None, False, randn(1024, dtype=torch.bfloat16), 1e-6, True)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16, 17])
def test_dispatch_routes_the_4b_projections_at_up_to_16_rows_to_it(rows, monkeypatch):
    """gate|up (with its SiLU-mul) and the GDN input projection (column slices of one product), each after its
    norm, and down_proj with its residual, of 4B size: the skinny product with the norm in its launch at 1-8 rows,
    after the norm kernel at 9-16 rows, the norm kernel and cuBLAS past them; within tolerance of the reference
    either way; none of it under SEGKI_SKINNY=0 (dispatch.SKINNY)."""
    from torch import nn

    from segki_lightning import ops
    from segki_lightning.inject.packing import pack_projections

    dtype, k = torch.bfloat16, 2560
    block = nn.Module()
    for name, n in (("in_proj_qkv", 8192), ("in_proj_z", 4096), ("in_proj_b", 32), ("in_proj_a", 32),
                    ("gate_proj", 9216), ("up_proj", 9216)):
        setattr(block, name, nn.Linear(k, n, bias=False, device="cuda", dtype=dtype))
    block.__dict__["_segki_spec"] = None
    assert pack_projections(block) == 2
    down = randn(2560, 9216, dtype=dtype, scale=9216**-0.5)
    ws = [block.in_proj_qkv.weight, block.in_proj_z.weight, block.in_proj_b.weight, block.in_proj_a.weight]
    x, h, res = randn(rows, k, dtype=dtype), randn(rows, 9216, dtype=dtype), randn(rows, 2560, dtype=dtype)
    calls = []
    real = torch.ops.segki.skinny_linear

    def spy(*args):
        calls.append(tuple(args[1].shape))
        return real(*args)

    def native(op):
        if op == "rms_norm":
            calls.append("rms_norm")
        return spy if op == "skinny_linear" else getattr(torch.ops.segki, op)

    monkeypatch.setattr(dispatch, "_native", native)
    nw = randn(k, dtype=dtype, scale=0.2)
    with torch.no_grad():
        front = ops.gated_mlp_front(x, block.gate_proj.weight, block.up_proj.weight, nw, 1e-6, True)
        outs = ops.gdn_in_proj(x, *ws, nw, 1e-6, True)
        y = ops.linear(h, down, None, res)
    xn = R.rms_norm(x.float(), nw.float(), 1e-6, True)
    assert rel_err(front, R.gated_mlp_front(xn, *f32(block.gate_proj.weight, block.up_proj.weight))) < 1e-2
    for got, ref in zip(outs, R.gdn_in_proj(xn, *f32(*ws))):
        assert rel_err(got, ref) < 1e-2
    assert rel_err(y, R.linear(*f32(h, down), None, res.float())) < 1e-2
    routed, folded = rows <= dispatch.SKINNY_ROUTE_ROWS, rows <= dispatch.SKINNY_FOLD_ROWS
    fits_down = dispatch.skinny_fits(rows, 9216, 2560, 2)
    # folded, the norms run inside the skinny launches (dispatch.folds_norm says so to the decoder layer)
    fronts = [(18432, 2560), (12352, 2560)] if folded else ["rms_norm", (18432, 2560), "rms_norm", (12352, 2560)]
    assert calls == (fronts + ([(2560, 9216)] if fits_down else []) if routed else ["rms_norm", "rms_norm"])
    with torch.no_grad():
        assert dispatch.folds_norm(x, block.gate_proj.weight, block.up_proj.weight, gated=True) == folded
    calls.clear()
    monkeypatch.setattr(dispatch, "SKINNY", "0")
    with torch.no_grad():
        ops.gated_mlp_front(x, block.gate_proj.weight, block.up_proj.weight)
        ops.gdn_in_proj(x, *ws)
        ops.linear(h, down, None, res)
    assert calls == []


@pytest.mark.parametrize("k", [1024, 2048, 2560, 3584, 4096, 6144, 9216, 12288, 16384])
def test_the_op_takes_exactly_what_dispatch_says_fits(k):
    """dispatch.skinny_fits mirrors the plan of csrc/skinny.cu (parts, segments of K, shorter parts under a weight
    size bound), so decode never sends the op what it refuses: at 1-17 rows, with and without the norm prologue, on
    a small weight and on one just over the shorter parts' bound, the op runs where dispatch says it fits (within
    tolerance of the reference on the small weight) and refuses elsewhere."""
    over = 16 * (dispatch.SKINNY_SHORT_PARTS_MAX_BYTES // (16 * k * 2) + 1)
    for n in (32, over):
        w = randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
        for rows in range(1, 18):
            x, nw = randn(rows, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16, scale=0.2)
            for norm_w in (None, nw):
                args = (x, w, None, False, norm_w, 1e-6, False)
                if not dispatch.skinny_fits(rows, k, n, 2, norm=norm_w is not None):
                    with pytest.raises(RuntimeError, match="outside this path"):
                        torch.ops.segki.skinny_linear(*args)
                    continue
                got = torch.ops.segki.skinny_linear(*args)
                if n == 32:
                    ref = R.skinny_linear(*f32(x, w), None, False, None if norm_w is None else norm_w.float(), 1e-6)
                    assert rel_err(got, ref) < TOL[torch.bfloat16], (rows, norm_w is not None)


def test_skinny_product_refuses_what_it_does_not_take_with_what_to_change():
    x, w = randn(17, 2560, dtype=torch.bfloat16), randn(256, 2560, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside this path.*use linear"):
        torch.ops.segki.skinny_linear(x, w)
    with pytest.raises(RuntimeError, match="outside this path"):
        torch.ops.segki.skinny_linear(x[:4], w[:250])           # not whole 16-row tiles
    shifted = randn(4 * 2560 + 1, dtype=torch.bfloat16)[1:].view(4, 2560)   # 2 bytes past a 16-byte start
    with pytest.raises(RuntimeError, match="x must start on 16 bytes"):
        torch.ops.segki.skinny_linear(shifted, w)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.segki.skinny_linear(x[:4], w.half())
    with pytest.raises(RuntimeError, match="gated weight"):
        torch.ops.segki.skinny_linear(x[:4], w[:255], None, True)
    wide, nw = randn(16, 9216, dtype=torch.bfloat16), randn(9216, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="with a norm is outside this path"):   # x alone 296 KB
        torch.ops.segki.skinny_linear(wide, randn(256, 9216, dtype=torch.bfloat16), None, False, nw, 1e-6, False)
    # the dispatch entry takes the reference instead
    from segki_lightning import ops

    got = ops.skinny_linear(x, w)
    assert rel_err(got, want(x, w, False)) < 1e-2


@pytest.mark.parametrize("rows,shape", [(3, "split_tiles"), (16, "4b_gdn_in")])   # 16: tiles dealt by a queue
def test_stamping_launches_record_every_block_in_phase_order_and_change_no_bit(rows, shape):
    """While a stamp buffer is set, each block writes one record (launch id, block, SM, grid, its timer span, the SM
    clock at eight phases in order, the cycles waiting for units and in tile ends inside its first -> last, its
    units: all of them together the launch's; the clock when its last unit had landed, within its span) and the
    launch table names the launch's shape; the outputs are the plain launch's bits; once unset, no launch
    writes."""
    n, k, _ = SHAPES[shape]
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    plain = torch.ops.segki.skinny_linear(x, w)
    room, words, phases = 512, 16, 8
    buf = torch.zeros(words * (room + 1), dtype=torch.int64, device="cuda")
    buf[1] = room
    torch.ops.segki.timeline_stamps(buf, True)
    stamped = torch.ops.segki.skinny_linear(x, w)
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    assert torch.equal(stamped, plain)
    assert table.shape == (1, 9)
    launch, kind, m, kk, nn, flags, grid, parts, tiles = table[0].tolist()
    assert (kind, m, kk, nn, tiles) == (0, rows, k, n, n // 16) and parts == k // dispatch.skinny_part_cols(k)
    assert flags == (2 if rows > 8 else 0)  # not gated; x in registers at 9-16 rows of K = 2560 by a queue
    count = int(buf[0])
    assert count == grid
    rec = buf[words:words * (count + 1)].view(count, words).cpu()
    assert sorted((rec[:, 0] & 0xFFFFFFFF).tolist()) == list(range(grid))
    assert ((rec[:, 0] >> 32) == launch).all() and ((rec[:, 1] & 0xFFFFFFFF) == grid).all()
    assert (rec[:, 3] >= rec[:, 2]).all() and (rec[:, 2] > 0).all()                  # the timer span
    clock = rec[:, 4:4 + phases]
    assert (clock[:, 1:] >= clock[:, :-1]).all() and (clock[:, 0] > 0).all()
    first_last = clock[:, 6] - clock[:, 5]                                               # first unit -> last
    assert (rec[:, 4 + phases] + rec[:, 5 + phases] <= first_last).all()
    assert int(rec[:, 6 + phases].sum()) == tiles * parts and (rec[:, 6 + phases] > 0).all()
    landed = rec[:, 7 + phases]                                                          # seen by the producer warp
    assert ((landed > clock[:, 0]) & (landed <= clock[:, 7])).all()
    torch.ops.segki.skinny_linear(x, w)
    torch.cuda.synchronize()
    assert int(buf[0]) == count
    assert torch.ops.segki.timeline_stamps(buf, False).shape == (0, 9)


def product_flags(x, w, gated):
    """The flags (1 gated, 2 x in registers) that one stamped launch of the product writes in the launch table."""
    buf = stamp_buffer(1024)
    torch.ops.segki.timeline_stamps(buf, True)
    torch.ops.segki.skinny_linear(x, w, None, gated)
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    assert table.shape[0] == 1 and table[0, 1] == 0
    return int(table[0, 5])


def assert_replay_gives_the_bits_of(x, w, gated, monkeypatch, switch):
    """The product captured in a graph, replayed on fresh x into NaN-poisoned outputs, gives the bits of an eager
    launch with `switch` set to 0 (the path it is compared with)."""
    graph, out = captured(lambda: torch.ops.segki.skinny_linear(x, w, None, gated))
    x.copy_(randn(*x.shape, dtype=x.dtype))
    out.fill_(float("nan"))
    graph.replay()
    monkeypatch.setenv(switch, "0")
    assert torch.equal(out, torch.ops.segki.skinny_linear(x, w, None, gated))


@pytest.mark.parametrize("rows", [9, 12, 16])
@pytest.mark.parametrize("shape", ["4b_gdn_in", "4b_gate_up", "4b_qkv"])
def test_x_in_registers_gives_the_bits_of_x_in_shared_memory(shape, rows, monkeypatch):
    """At 9-16 rows the 4B's K = 2560 products hold x in the consumer warps' registers (the launch table's flag 2)
    and their ring takes all of shared memory; each thread multiplies the same fragments in the same order as from
    shared memory, so the outputs are the bits of SEGKI_SKINNY_XREG=0's launch (flag 0), on fresh inputs with
    NaN-poisoned outputs, eagerly and from a replayed graph."""
    n, k, gated = SHAPES[shape]
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    out_shape = (rows, n // 2 if gated else n)
    monkeypatch.setenv("SEGKI_SKINNY_XREG", "0")
    assert product_flags(x, w, gated) == int(gated)
    poison(out_shape, dtype=torch.bfloat16)
    shared = torch.ops.segki.skinny_linear(x, w, None, gated)
    monkeypatch.delenv("SEGKI_SKINNY_XREG")
    assert product_flags(x, w, gated) == int(gated) | 2
    poison(out_shape, dtype=torch.bfloat16)
    regs = torch.ops.segki.skinny_linear(x, w, None, gated)
    assert torch.equal(regs, shared)
    assert rel_err(regs, want(x, w, gated)) < TOL[torch.bfloat16]
    assert_replay_gives_the_bits_of(x, w, gated, monkeypatch, "SEGKI_SKINNY_XREG")


@pytest.mark.parametrize("rows", [1, 5, 8, 16])
@pytest.mark.parametrize("shape", ["4b_gate_up", "4b_down", "split_tiles", "08b_down"])
def test_a_paced_first_fill_gives_the_bits_of_the_whole_ring_at_once(shape, rows, monkeypatch):
    """SEGKI_SKINNY_FILL paces when a block's first fill of weight copies goes out (unset: two units in flight at
    1-8 rows), not what is multiplied or in which order: every pace gives the bits of the whole ring at once (0),
    on fresh inputs with NaN-poisoned outputs, eagerly and from a replayed graph."""
    n, k, gated = SHAPES[shape]
    if not dispatch.skinny_fits(rows, k, n, 2):
        pytest.skip(f"{rows} rows of K = {k} do not fit the path")
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    out_shape = (rows, n // 2 if gated else n)
    monkeypatch.setenv("SEGKI_SKINNY_FILL", "0")
    poison(out_shape, dtype=torch.bfloat16)
    whole = torch.ops.segki.skinny_linear(x, w, None, gated)
    assert rel_err(whole, want(x, w, gated)) < TOL[torch.bfloat16]
    for fill in ("1", "2", "4", None):
        if fill is None:
            monkeypatch.delenv("SEGKI_SKINNY_FILL")
        else:
            monkeypatch.setenv("SEGKI_SKINNY_FILL", fill)
        poison(out_shape, dtype=torch.bfloat16)
        assert torch.equal(torch.ops.segki.skinny_linear(x, w, None, gated), whole), fill
    assert_replay_gives_the_bits_of(x, w, gated, monkeypatch, "SEGKI_SKINNY_FILL")


def test_stamping_deferred_segments_records_the_product_and_its_sum_kernel():
    """At 16 rows in deferred segments of K (the 4B down: six), the stamped launches are the product (kind 0) and
    its segments' sum kernel (kind 4: rows, output columns, gated, grid, segments), every block of both writing one
    record with the SM clock in phase order; the output is the plain launches' bits."""
    n, k, _ = SHAPES["4b_down"]
    rows, words, phases = 16, STAMP_WORDS, STAMP_PHASES
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    plain = torch.ops.segki.skinny_linear(x, w)
    buf = stamp_buffer(1024)
    torch.ops.segki.timeline_stamps(buf, True)
    poison((rows, n), dtype=torch.bfloat16)
    stamped = torch.ops.segki.skinny_linear(x, w)
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    assert torch.equal(stamped, plain)
    assert table.shape == (2, 9) and table[:, 1].tolist() == [0, 4]
    launch, _, m, _, nn, gated, grid, segs, _ = table[1].tolist()
    assert (m, nn, gated, segs) == (rows, n, 0, dispatch.skinny_plan(rows, k, n, 2)[1])
    assert grid == (rows * n // 4 + 255) // 256
    count = int(buf[0])
    assert count == table[0, 6].item() + grid
    rec = buf[words:words * (count + 1)].view(count, words).cpu()
    mine = rec[(rec[:, 0] >> 32) == launch]
    assert sorted((mine[:, 0] & 0xFFFFFFFF).tolist()) == list(range(grid))
    clock = mine[:, 4:4 + phases]
    assert (clock[:, 1:] >= clock[:, :-1]).all() and (mine[:, 3] >= mine[:, 2]).all()
