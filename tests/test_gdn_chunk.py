"""The torch replacement of flash-linear-attention's gated ``chunk_bwd_dqkwg`` against autograd of the chunk
quantities it differentiates (fp64, exact up to rounding), on equal-length and packed batches, GVA and both state
layouts. The whole chain (fla's kernels plus this one) is checked against transformers' torch rule on the GPU
(tests/gpu/test_training_gpu.py)."""
from __future__ import annotations

import math

import pytest
import torch

from segki_lightning.ops.gdn_chunk import chunk_bwd_dqkwg, chunk_positions

BT = 16


def _chunk_oracle(q, k, v, do, dv, w, h, dh, g_nat, pos, valid, scale):
    """Autograd gradients of L = sum over chunks of <do, o> + <dh, h_next> + <dv, -w h> with h, v, do, dh, dv held
    fixed: what chunk_bwd_dqkwg returns (dq, dk, dw and dg w.r.t. the chunk-local cumulative natural log-decay)."""
    q, k, w, g_nat = (x.detach().clone().requires_grad_(True) for x in (q, k, w, g_nat))
    hv, heads = v.shape[2], q.shape[2]
    flat = lambda x: x.reshape(-1, *x.shape[2:])                                      # noqa: E731
    total = 0.0
    for c in range(pos.shape[0]):
        idx = pos[c][valid[c]]
        for j in range(hv):
            kh = j // (hv // heads)
            qc, kc = flat(q)[idx, kh], flat(k)[idx, kh]                                # [n, K]
            vc, doc, dvc, wc = flat(v)[idx, j], flat(do)[idx, j], flat(dv)[idx, j], flat(w)[idx, j]
            gc = flat(g_nat)[idx, j]                                                   # [n]
            n = len(idx)
            decay = torch.exp(gc[:, None] - gc[None, :]).tril()
            o = scale * (qc * gc.exp()[:, None]) @ h[c, j] + (scale * (qc @ kc.T) * decay).tril() @ vc
            h_next = gc[-1].exp() * h[c, j] + (kc * torch.exp(gc[-1] - gc)[:, None]).T @ vc
            total = total + (doc * o).sum() + (dh[c, j] * h_next).sum() - (dvc * (wc @ h[c, j])).sum()
            assert n >= 1
    total.backward()
    return q.grad, k.grad, w.grad, g_nat.grad


def _local_cumsum(g, pos, valid):
    """Chunk-local cumulative sum of ``g [B, T, HV]`` over each chunk's valid tokens."""
    out = torch.zeros_like(g).reshape(-1, g.shape[-1])
    flat = g.reshape(-1, g.shape[-1])
    for c in range(pos.shape[0]):
        idx = pos[c][valid[c]]
        out[idx] = flat[idx].cumsum(0)
    return out.view_as(g)


@pytest.mark.parametrize("lengths,heads,hv,v_first", [
    pytest.param(None, 2, 2, False, id="equal-lengths"),
    pytest.param(None, 1, 2, True, id="equal-lengths-gva-v-first"),
    pytest.param([5, 37, 16, 1], 2, 4, False, id="packed-gva"),
])
def test_dqkwg_matches_autograd(lengths, heads, hv, v_first):
    torch.manual_seed(0)
    kd, vd = 8, 6
    if lengths is None:
        bsz, length, cu = 2, 40, None
    else:
        bsz, length, cu = 1, sum(lengths), torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    f64 = dict(dtype=torch.float64)
    q = torch.nn.functional.normalize(torch.randn(bsz, length, heads, kd, **f64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(bsz, length, heads, kd, **f64), dim=-1)
    v, do, dv = (torch.randn(bsz, length, hv, vd, **f64) for _ in range(3))
    w = torch.randn(bsz, length, hv, kd, **f64)
    pos, valid = chunk_positions(bsz, length, BT, cu, None, torch.device("cpu"))
    nc = pos.shape[0]
    h, dh = torch.randn(nc, hv, kd, vd, **f64), torch.randn(nc, hv, kd, vd, **f64)
    g_nat = _local_cumsum(-torch.rand(bsz, length, hv, **f64) * 0.3, pos, valid)
    scale = kd ** -0.5
    want = _chunk_oracle(q, k, v, do, dv, w, h, dh, g_nat, pos, valid, scale)
    hs, dhs = (x.transpose(-1, -2).contiguous() for x in (h, dh)) if v_first else (h, dh)
    out = chunk_bwd_dqkwg(q, k, v, do, hs, dhs, w=w, g=g_nat / math.log(2), dv=dv, scale=scale,
                          state_v_first=v_first, cu_seqlens=cu, chunk_size=BT)
    for name, got, ref in zip(("dq", "dk", "dw", "dg"), out, want):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10, msg=name)


def test_chunk_positions_packed_and_padding_rows():
    cu = torch.tensor([0, 3, 20])
    pos, valid = chunk_positions(1, 20, 8, cu, None, torch.device("cpu"))
    assert pos.shape == (4, 8)   # 1 chunk of 3 tokens, 3 chunks of 17
    assert valid.sum(1).tolist() == [3, 8, 8, 1]
    assert pos[1, 0].item() == 3 and pos[3, 0].item() == 19
    idx = torch.tensor([[0, 0], [1, 0], [-1, 0]])   # fla's padding rows carry sequence id -1
    pos, valid = chunk_positions(1, 20, 8, cu, idx, torch.device("cpu"))
    assert valid.sum(1).tolist() == [3, 8, 0]


def test_the_chunk_layout_syncs_once_per_pass_not_per_layer(monkeypatch):
    """The valid chunk slots (a host sync) are found once per ``cu_seqlens`` tensor, which every layer of a pass
    shares, and once per shape of equal rows; a new tensor of the same values counts again, the layout equal."""
    from segki_lightning.ops import gdn_chunk

    found = []
    positions = gdn_chunk.chunk_positions
    monkeypatch.setattr(gdn_chunk, "chunk_positions", lambda *a: found.append(1) or positions(*a))
    gdn_chunk._equal_layout.cache_clear()
    cpu = torch.device("cpu")
    cu = torch.tensor([0, 3, 20])
    first = gdn_chunk._chunk_layout(1, 20, 8, cu, None, cpu)
    assert all(gdn_chunk._chunk_layout(1, 20, 8, cu, None, cpu) is first for _ in range(5)) and len(found) == 1
    again = gdn_chunk._chunk_layout(1, 20, 8, cu.clone(), None, cpu)
    assert len(found) == 2 and all(torch.equal(a, b) for a, b in zip(again, first))
    pos, valid, src, dest = first
    assert torch.equal(src, valid.reshape(-1).nonzero()[:, 0]) and torch.equal(dest, pos.reshape(-1)[src])
    equal = [gdn_chunk._chunk_layout(2, 12, 8, None, None, cpu) for _ in range(3)]
    assert len(found) == 3 and all(e is equal[0] for e in equal)


def test_a_compile_failure_falls_back_to_the_eager_math_once(monkeypatch, caplog):
    """Where ``torch.compile`` cannot build the dq/dk/dw/dg (a compiler stack without Triton, say), the call returns
    the eager function's result, says so in one warning, and later calls go straight to the eager function."""
    from segki_lightning.ops import gdn_chunk

    def broken(fn, **_):
        def run(*args):
            raise RuntimeError("no compiler backend")
        return run

    monkeypatch.setattr(gdn_chunk, "_compiled", [])
    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.delenv(gdn_chunk.COMPILE_SWITCH, raising=False)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    q, k = (torch.nn.functional.normalize(torch.randn(1, 20, 1, 8, generator=gen), dim=-1) for _ in range(2))
    v, do, dv, w = (torch.randn(1, 20, 2, 8, generator=gen) for _ in range(4))
    cu = torch.tensor([0, 7, 20])
    pos, valid = chunk_positions(1, 20, BT, cu, None, torch.device("cpu"))
    h, dh = (torch.randn(pos.shape[0], 2, 8, 8, generator=gen) for _ in range(2))
    g = -torch.rand(1, 20, 2, generator=gen)
    src = valid.reshape(-1).nonzero()[:, 0]
    args = (q, k, v, do, h, dh, w, g, dv, pos, valid, src, pos.reshape(-1)[src], 8 ** -0.5, False)
    with caplog.at_level("WARNING", logger="segki_lightning"):
        got = gdn_chunk._math_on(torch.device("cuda"))(*args)   # the device type picks the compiled path
    assert "running it eagerly" in caplog.text
    for a, b in zip(got, gdn_chunk._dqkwg_math(*args)):
        assert torch.equal(a, b)
    assert gdn_chunk._compiled == [None] and gdn_chunk._math_on(torch.device("cuda")) is gdn_chunk._dqkwg_math
