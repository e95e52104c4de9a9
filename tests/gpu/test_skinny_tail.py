"""The decoder layer's tail as one skinny launch (``segki::skinny_tail``: output projection + residual, the
post-attention norm, gate|up, down + residual) against the three ``skinny_linear`` launches it replaces (the same
bits), its fp32 reference, graph replay, the dispatch that takes it, and decode through it (GPU only)."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.ops import dispatch, reference as R
from segki_lightning.ops.extension import native_ops

from .test_kernels import DTYPES, TOL, captured, f32, poison, randn, rel_err

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def native():
    if native_ops() is None:
        pytest.fail("the segki extension did not build/load on this GPU machine")


# name -> (K of the output projection, hidden H, intermediate I): the Qwen3.5 0.8B tail (GDN and attention alike),
# the 4B tail (its down is K = 9216 in 9 parts), one whose three products all split tiles over blocks (160-320
# tiles of two parts on ~132 blocks), and one whose first and last products have fewer blocks than the middle one
SHAPES = {"08b": (2048, 1024, 3584), "4b": (4096, 2560, 9216), "split": (2560, 2560, 2560),
          "narrow_ends": (512, 256, 2560)}


def tail_inputs(shape, rows, dtype):
    k0, h, inter = SHAPES[shape]
    x, res = randn(rows, k0, dtype=dtype), randn(rows, h, dtype=dtype)
    w_out, w_down = randn(h, k0, dtype=dtype, scale=k0**-0.5), randn(h, inter, dtype=dtype, scale=inter**-0.5)
    w_front, nw = randn(2 * inter, h, dtype=dtype, scale=h**-0.5), randn(h, dtype=dtype, scale=0.2)
    return x, w_out, res, w_front, w_down, nw


def fits(shape, rows):
    k0, h, inter = SHAPES[shape]
    return (all(dispatch.skinny_fits(rows, k, n, 2) for k, n in ((k0, h), (h, 2 * inter), (inter, h)))
            and dispatch.skinny_tail_fits(rows, (k0, h, inter), 2))


def three_launches(x, w_out, res, w_front, w_down, nw, eps, unit_offset):
    h = torch.ops.segki.skinny_linear(x, w_out, res)
    a = torch.ops.segki.skinny_linear(h, w_front, None, True, nw, eps, unit_offset)
    return torch.ops.segki.skinny_linear(a, w_down, h)


@pytest.mark.parametrize("unit_offset", [True, False], ids=["unit_offset", "plain_w"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tail_is_the_three_skinny_launches_bit_for_bit(shape, rows, dtype, unit_offset):
    """Each product's units are dealt as its own launch deals them, so the outputs equal the three launches' exactly;
    and they are within tolerance of the fp32 reference."""
    if not fits(shape, rows):
        pytest.skip(f"{rows} rows of {SHAPES[shape]} do not fit the tail (x and two units in shared memory)")
    args = tail_inputs(shape, rows, dtype)
    x, w_out, res, w_front, w_down, nw = args
    poison((rows, SHAPES[shape][1]), (rows, SHAPES[shape][2]), dtype=dtype)
    got = torch.ops.segki.skinny_tail(*args, 1e-6, unit_offset)
    assert got.shape == res.shape and got.dtype == dtype
    assert torch.equal(got, three_launches(*args, 1e-6, unit_offset))
    ref = R.skinny_tail(*f32(x, w_out, res, w_front, w_down, nw), 1e-6, unit_offset)
    assert rel_err(got, ref) < TOL[dtype]


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shape", ["split", "08b"])
def test_tail_replays_in_a_graph_and_resets_its_counters(shape, rows):
    """The boundary counters and split-tile flags are zero again after every launch: the same bits launch after
    launch, and from a graph replayed on new inputs (a counter left behind would let a product start early)."""
    if not fits(shape, rows):
        pytest.skip("does not fit")
    args = tail_inputs(shape, rows, torch.bfloat16)
    x = args[0]
    run = lambda: torch.ops.segki.skinny_tail(*args, 1e-6, True)  # noqa: E731
    first = run()
    for _ in range(3):
        assert torch.equal(run(), first)
    graph, out = captured(run)
    for _ in range(4):
        x.copy_(randn(*x.shape, dtype=torch.bfloat16))
        graph.replay()
        assert torch.equal(out, three_launches(*args, 1e-6, True))


def test_dispatch_takes_the_tail_only_where_each_product_is_skinny(monkeypatch):
    """layer_tail: one skinny_tail launch under SKINNY_TAIL where every product fits, the three ops otherwise, the
    same bits either way."""
    from segki_lightning import ops

    calls = []
    real = dispatch._native
    monkeypatch.setattr(dispatch, "_native", lambda op: (calls.append(op), real(op))[1])
    k0, h, inter = SHAPES["08b"]
    gate, up = randn(2 * inter, h, dtype=torch.bfloat16, scale=h**-0.5).split(inter)   # packed: consecutive rows
    w_out, w_down = randn(h, k0, dtype=torch.bfloat16), randn(h, inter, dtype=torch.bfloat16, scale=inter**-0.5)
    nw = randn(h, dtype=torch.bfloat16)
    for rows, takes in ((1, True), (6, True), (8, False), (9, False)):   # 7+ rows of x leave the down < 3 slots
        x, res = randn(rows, k0, dtype=torch.bfloat16), randn(rows, h, dtype=torch.bfloat16)
        tail = (x, w_out, None, res, gate, up, w_down, nw, 1e-6, True)
        monkeypatch.setattr(dispatch, "SKINNY_TAIL", True)
        calls.clear()
        with torch.no_grad():
            got = ops.layer_tail(*tail)
        assert (calls == ["skinny_tail"]) == takes, calls
        monkeypatch.setattr(dispatch, "SKINNY_TAIL", False)
        calls.clear()
        with torch.no_grad():
            assert torch.equal(got, ops.layer_tail(*tail))
        assert "skinny_tail" not in calls


def test_tail_refuses_what_it_does_not_take_with_what_to_change():
    x, w_out, res, w_front, w_down, nw = tail_inputs("08b", 9, torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the skinny path.*use the three products"):
        torch.ops.segki.skinny_tail(x, w_out, res, w_front, w_down, nw, 1e-6, True)
    x, w_out, res, w_front, w_down, nw = tail_inputs("08b", 2, torch.bfloat16)
    with pytest.raises(RuntimeError, match="w_front .* must be \\[2 x 3584, 1024\\]"):
        torch.ops.segki.skinny_tail(x, w_out, res, w_front[:-16], w_down, nw, 1e-6, True)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.segki.skinny_tail(x, w_out, res.half(), w_front, w_down, nw, 1e-6, True)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_decode_through_the_tail_is_the_decode_of_three_launches_bit_for_bit(tmp_path, monkeypatch, rows):
    """Decode with every decoder layer's tail as one launch equals decode with the three launches, tokens and
    log-probs exactly, and the tail did run (once per layer and step)."""
    from segki_lightning import RolloutEngine, SamplingConfig

    from .test_rollout_gpu import cuda_model, prompts

    model = cuda_model(tmp_path, seed=4)
    ps = prompts([7, 12, 30, 5, 9][:rows], seed=6)
    cfg = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=8)
    separate = RolloutEngine(model, max_batch_size=8, max_seq_len=64, eos_token_id=[]).generate(ps, cfg)
    calls = []
    real = dispatch._native
    monkeypatch.setattr(dispatch, "_native", lambda op: (calls.append(op), real(op))[1])
    monkeypatch.setattr(dispatch, "SKINNY_TAIL", True)
    fused = RolloutEngine(model, max_batch_size=8, max_seq_len=64, eos_token_id=[]).generate(ps, cfg)
    assert calls.count("skinny_tail") >= len(model.model.layers)
    assert torch.equal(fused.completion_ids, separate.completion_ids)
    assert torch.equal(fused.logprobs, separate.logprobs)
