"""The skinny product (``segki::skinny_linear``: 1-16 rows on large weights) against its fp32 reference, on fresh
random inputs with NaN-poisoned outputs; its split tiles, its determinism, graph replay, its residual and gated
epilogues, the dispatch that routes the packed projections to it, and its errors (GPU only)."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.ops import dispatch, reference as R
from segki_lightning.ops.extension import native_ops

from .test_kernels import DTYPES, TOL, assert_every_element, captured, f32, poison, randn, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def native():
    if native_ops() is None:
        pytest.fail("the segki extension did not build/load on this GPU machine")

# name -> (weight rows, K, gated): the Qwen3.5-4B shapes that take it, 0.8B ones, and small ones whose tiles split
# over blocks at every part boundary (K = 2560: two parts; 200 tiles on ~132 blocks)
SHAPES = {
    "4b_gate_up": (2 * 9216, 2560, True), "4b_gdn_in": (12352, 2560, False), "4b_o_proj": (2560, 4096, False),
    "4b_down": (2560, 9216, False), "08b_gate_up": (2 * 3584, 1024, True), "08b_down": (1024, 3584, False),
    "split_tiles": (16 * 200, 2560, False), "split_gated": (16 * 200, 2560, True), "few_tiles": (16 * 5, 512, False),
}
ROWS = [1, 2, 5, 8, 9, 16]


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


@pytest.mark.parametrize("rows", [1, 7, 16])
def test_skinny_product_is_deterministic_and_replays_in_a_graph(rows):
    """Split tiles are summed in one order every launch: the same bits eagerly, again, and from a graph replayed
    on new inputs."""
    n, k, _ = SHAPES["split_tiles"]
    x, w = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16, scale=k**-0.5)
    first = torch.ops.segki.skinny_linear(x, w)
    assert torch.equal(first, torch.ops.segki.skinny_linear(x, w))
    graph, out = captured(lambda: torch.ops.segki.skinny_linear(x, w))
    for _ in range(3):
        x.copy_(randn(rows, k, dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(out, torch.ops.segki.skinny_linear(x, w))
        assert rel_err(out, want(x, w, False)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_skinny_residual_is_the_separate_add_of_the_rounded_product(rows, dtype):
    n, k, _ = SHAPES["split_tiles"]
    x, w, res = randn(rows, k, dtype=dtype), randn(n, k, dtype=dtype, scale=k**-0.5), randn(rows, n, dtype=dtype)
    poison((rows, n), dtype=dtype)
    got = torch.ops.segki.skinny_linear(x, w, res)
    assert torch.equal(got, torch.ops.segki.skinny_linear(x, w) + res)


@pytest.mark.parametrize("rows", [1, 2, 8, 9, 16])
def test_dispatch_routes_the_4b_projections_at_up_to_8_rows_to_it(rows, monkeypatch):
    """gate|up (with its SiLU-mul), the GDN input projection (column slices of one product) and down_proj with its
    residual, of 4B size: the skinny product at 1-8 rows, cuBLAS past them; within tolerance of the reference
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

    monkeypatch.setattr(dispatch, "_native", lambda op: spy if op == "skinny_linear" else getattr(torch.ops.segki, op))
    with torch.no_grad():
        front = ops.gated_mlp_front(x, block.gate_proj.weight, block.up_proj.weight)
        outs = ops.gdn_in_proj(x, *ws)
        y = ops.linear(h, down, None, res)
    assert rel_err(front, R.gated_mlp_front(*f32(x, block.gate_proj.weight, block.up_proj.weight))) < 1e-2
    for got, ref in zip(outs, R.gdn_in_proj(*f32(x, *ws))):
        assert rel_err(got, ref) < 1e-2
    assert rel_err(y, R.linear(*f32(h, down), None, res.float())) < 1e-2
    routed = rows <= dispatch.SKINNY_ROUTE_ROWS
    fits_down = dispatch.skinny_fits(rows, 9216, 2560, 2)
    assert calls == ([(18432, 2560), (12352, 2560)] + ([(2560, 9216)] if fits_down else []) if routed else [])
    calls.clear()
    monkeypatch.setattr(dispatch, "SKINNY", "0")
    with torch.no_grad():
        ops.gated_mlp_front(x, block.gate_proj.weight, block.up_proj.weight)
        ops.gdn_in_proj(x, *ws)
        ops.linear(h, down, None, res)
    assert calls == []


def test_skinny_product_refuses_what_it_does_not_take_with_what_to_change():
    x, w = randn(17, 2560, dtype=torch.bfloat16), randn(256, 2560, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside this path.*use linear"):
        torch.ops.segki.skinny_linear(x, w)
    with pytest.raises(RuntimeError, match="outside this path"):
        torch.ops.segki.skinny_linear(x[:4], w[:250])           # not whole 16-row tiles
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.segki.skinny_linear(x[:4], w.half())
    with pytest.raises(RuntimeError, match="gated weight"):
        torch.ops.segki.skinny_linear(x[:4], w[:255], None, True)
    # the dispatch entry takes the reference instead
    from segki_lightning import ops

    got = ops.skinny_linear(x, w)
    assert rel_err(got, want(x, w, False)) < 1e-2
