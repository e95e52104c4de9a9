"""Every native op against its reference on fresh random inputs (GPU only).

Outputs are poisoned: before each native call the caching allocator is handed a NaN-filled block of the
output's size, so an element the kernel fails to write shows up as NaN. Relative error is
||native - reference|| / ||reference||, the reference run in fp32 on upcast inputs unless the op's
rounding points are part of its spec. Thresholds per dtype:
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device", allow_module_level=True)

from segki_lightning.ops import dispatch, reference as R
from segki_lightning.ops.extension import native_ops

pytestmark = pytest.mark.gpu

# one output rounding (2^-8 bf16, 2^-11 fp16) plus fp32 accumulation-order noise
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
BATCHES = [1, 2, 7, 16, 33, 64]  # CUDA-core path <= 4 rows, tensor-core path with 1, 2, 4 and 8 row groups
# (name, K, [N_i]) -- real Qwen3.5-4B / 0.8B decode shapes plus odd sizes
PROJ_SHAPES = {
    "4b_gate_up": (2560, [9216, 9216]), "4b_gdn_in": (2560, [8192, 4096, 32, 32]),
    "4b_qkv": (2560, [8192, 1024, 1024]), "4b_o_proj": (4096, [2560]), "4b_down": (9216, [2560]),
    "08b_gate_up": (1024, [3584, 3584]), "08b_gdn_in": (1024, [6144, 2048, 16, 16]),
    "08b_qkv": (1024, [4096, 512, 512]), "08b_down": (3584, [1024]), "odd": (72, [37, 5, 3, 11]),
    # a partial last k block, tiles across weights, 8 K slices on both paths (the CUDA-core path's last slice
    # empty: 8200 columns in slices of 1280)
    "odd_long_k": (8200, [37, 5, 3, 11]),
}


@pytest.fixture(scope="module", autouse=True)
def native():
    if native_ops() is None:
        pytest.fail("the segki extension did not build/load on this GPU machine")


def rel_err(got, want):
    got, want = got.float(), want.float()
    assert not torch.isnan(got).any(), "an output element was never written (NaN poison survived)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_every_element(got, want, dtype):
    """Each element within its own rounding plus 4x the tolerance of the tensor's RMS: a few wrong elements
    (a tile or a K slice left out) cannot hide in a norm."""
    got, want = got.float(), want.float()
    rms = want.pow(2).mean().sqrt()
    worst = ((got - want).abs() - TOL[dtype] * want.abs()).max()
    assert worst <= 4 * TOL[dtype] * rms, f"an element is off by {worst.item():.3g} (RMS {rms.item():.3g})"


def poison(*shapes, dtype):
    """Hand the caching allocator NaN-filled blocks of these sizes; the next allocations reuse them."""
    blocks = [torch.full(s, float("nan"), dtype=dtype, device="cuda") for s in shapes]
    del blocks


def captured(step):
    """``(graph, outputs)`` of ``step`` captured in a CUDA graph, after one warm-up call on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def f32(*ts):
    return [t.float() if t is not None else None for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", list(PROJ_SHAPES))
def test_projection_family(shape, batch, dtype):
    k, ns = PROJ_SHAPES[shape]
    x = randn(batch, k, dtype=dtype)
    ws = [randn(n, k, dtype=dtype, scale=k**-0.5) for n in ns]
    ops = torch.ops.segki
    if len(ns) == 2:
        poison((batch, ns[0]), dtype=dtype)
        got, want = [ops.gated_mlp_front(x, *ws)], [R.gated_mlp_front(*f32(x, *ws))]
    elif len(ns) == 3:
        bs = [randn(n, dtype=dtype) for n in ns]
        poison(*[(batch, n) for n in ns], dtype=dtype)
        got, want = ops.qkv_proj(x, *ws, *bs), R.qkv_proj(*f32(x, *ws, *bs))
    elif len(ns) == 4:
        poison(*[(batch, n) for n in ns], dtype=dtype)
        got, want = ops.gdn_in_proj(x, *ws), R.gdn_in_proj(*f32(x, *ws))
    else:
        poison((batch, ns[0]), dtype=dtype)
        got, want = [ops.linear(x, ws[0], None)], [R.linear(*f32(x, ws[0]))]
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert rel_err(g, w) < TOL[dtype]
        assert_every_element(g, w, dtype)


@pytest.mark.parametrize("adapters", ["fp32", "half"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7, 16, 64])
@pytest.mark.parametrize("shape,rank", [("4b_gdn_in", 16), ("4b_qkv", 8), ("08b_gate_up", 64), ("4b_down", 16),
                                        ("odd", 5)])
def test_lora_add(shape, rank, batch, dtype, adapters, monkeypatch):
    """A group's LoRA paths (csrc/lora.cu) against peft's composition in the same dtypes (its roundings are the
    spec), the base outputs as column slices of one product (as past the native rows); by default (SEGKI_LORA_OP
    unset or 1) the dispatch takes the native op for trainable adapters outside autograd (a rollout)."""
    k, ns = PROJ_SHAPES[shape]
    wdt = torch.float32 if adapters == "fp32" else dtype
    x = randn(batch, k, dtype=dtype)
    outs = list(randn(batch, sum(ns), dtype=dtype).split(ns, dim=-1))
    a = [randn(rank, k, dtype=wdt, scale=k**-0.5).requires_grad_() for _ in ns]
    b = [randn(n, rank, dtype=wdt, scale=rank**-0.5).requires_grad_() for n in ns]
    scales = [2.0, 0.5, 1.0, 0.25][:len(ns)]
    monkeypatch.setenv("SEGKI_LORA_OP", "1")
    with torch.no_grad():
        poison(*[(batch, n) for n in ns], dtype=dtype)
        got = torch.ops.segki.lora_add(x, outs, a, b, scales)
        want = R.lora_add(x, outs, a, b, scales)
        again = dispatch.lora_add(x, outs, a, b, scales)
    for g, w, g2 in zip(got, want, again):
        assert g.dtype == dtype and g.shape == w.shape and g.is_contiguous()
        assert rel_err(g, w) < TOL[dtype]
        assert_every_element(g, w, dtype)
        assert torch.equal(g2, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7, 16, 40])
def test_linear_more_rows_than_one_launch(batch, dtype):
    x, w, b = randn(batch, 3, 128, dtype=dtype), randn(300, 128, dtype=dtype, scale=0.1), randn(300, dtype=dtype)
    got, want = torch.ops.segki.linear(x, w, b), R.linear(*f32(x, w, b))
    assert rel_err(got, want) < TOL[dtype]
    assert_every_element(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 7, 16, 40, 64])
def test_linear_with_the_residual_add_in_its_epilogue(batch, dtype):
    """down_proj + the decoder layer's residual add: exactly the separate add of the rounded projection."""
    x, w = randn(batch, 9216, dtype=dtype), randn(2560, 9216, dtype=dtype, scale=9216**-0.5)
    res = randn(batch, 2560, dtype=dtype)
    poison((batch, 2560), dtype=dtype)
    got = torch.ops.segki.linear(x, w, None, res)
    assert torch.equal(got, torch.ops.segki.linear(x, w, None) + res)
    assert rel_err(got, R.linear(*f32(x, w), None, res.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
# widths: one stretch of 8 columns a thread, two (kept in registers), and past two (4104: a third for one thread)
@pytest.mark.parametrize("rows,h", [(1, 2560), (7, 1024), (16, 2560), (3, 264), (1, 4104), (2, 6144)])
def test_rms_norm_and_residual_add(rows, h, unit_offset, dtype):
    x, res, w = randn(rows, h, dtype=dtype), randn(rows, h, dtype=dtype), randn(h, dtype=dtype, scale=0.3)
    poison((rows, h), dtype=dtype)
    assert rel_err(torch.ops.segki.rms_norm(x, w, 1e-6, unit_offset), R.rms_norm(x, w, 1e-6, unit_offset)) < TOL[dtype]
    poison((rows, h), (rows, h), dtype=dtype)
    normed, new_res = torch.ops.segki.add_rms_norm(x, res, w, 1e-6, unit_offset)
    want_normed, want_res = R.add_rms_norm(x, res, w, 1e-6, unit_offset)
    assert torch.equal(new_res, want_res)  # one rounded add: exact
    assert rel_err(normed, want_normed) < TOL[dtype]
    # the norm of the rounded sum, as rms_norm computes it: a decode step computes the next layer's norm so, ahead
    assert torch.equal(normed, torch.ops.segki.rms_norm(new_res, w, 1e-6, unit_offset))


def test_rms_norm_of_a_strided_view_takes_the_native_kernel():
    """Qwen3.5's q_norm input is the first half of each q_proj row: a view, copied once for the kernel."""
    from segki_lightning import ops

    b, heads, d = 3, 16, 256
    q_and_gate = randn(b, 1, heads, 2 * d, dtype=torch.bfloat16)
    q = torch.chunk(q_and_gate, 2, dim=-1)[0]                            # [B, 1, H, D], row stride 2D
    w = randn(d, dtype=torch.bfloat16, scale=0.3)
    assert not q.is_contiguous()
    assert dispatch.eligible("rms_norm", q, w, strided_first=True)
    with torch.no_grad():
        got = ops.rms_norm(q, w, 1e-6, True)
    assert got.shape == q.shape
    assert torch.equal(got, torch.ops.segki.rms_norm(q.contiguous(), w, 1e-6, True))
    assert rel_err(got, R.rms_norm(q, w, 1e-6, True)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("variant", ["online", "batched", None])  # SEGKI_ATTN; None: by rows x KV heads
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("hq,hkv,d,s", [(16, 4, 256, 600), (8, 2, 256, 129), (8, 8, 128, 300), (4, 1, 64, 33),
                                        (24, 4, 128, 70)])  # g = 6: the heads past g in an 8-head group
def test_decode_attention(hq, hkv, d, s, batch, dtype, variant, monkeypatch):
    if variant is None:
        monkeypatch.delenv("SEGKI_ATTN", raising=False)
    else:
        monkeypatch.setenv("SEGKI_ATTN", variant)
    q = randn(batch, hq, d, dtype=dtype)
    k, v = randn(batch, hkv, s, d, dtype=dtype), randn(batch, hkv, s, d, dtype=dtype)
    lengths = torch.randint(1, s + 1, (batch,), device="cuda")
    lengths[0] = s
    want = R.decode_attention(*f32(q, k, v), lengths, d**-0.5)
    for i, n in enumerate(lengths.tolist()):  # stale data past each row's length must never be read
        k[i, :, n:] = float("nan")
        v[i, :, n:] = float("nan")
    poison((batch, hq, d), dtype=dtype)
    assert rel_err(torch.ops.segki.decode_attention(q, k, v, lengths, d**-0.5), want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 7, 33])
def test_decode_attention_with_output_gate(batch, dtype):
    """Qwen3.5's gate is the second half of each q_proj head: a strided view the kernel reads in place."""
    hq, hkv, d, s = 16, 4, 256, 300
    q_and_gate = randn(batch, hq, 2 * d, dtype=dtype)
    q, gate = q_and_gate[..., :d].contiguous(), q_and_gate[..., d:]
    k, v = randn(batch, hkv, s, d, dtype=dtype), randn(batch, hkv, s, d, dtype=dtype)
    lengths = torch.randint(1, s + 1, (batch,), device="cuda", dtype=torch.int32)
    want = R.decode_attention(*f32(q, k, v), lengths, d**-0.5).to(dtype) * torch.sigmoid(gate)
    poison((batch, hq, d), dtype=dtype)
    got = torch.ops.segki.decode_attention(q, k, v, lengths, d**-0.5, gate)
    assert rel_err(got, want) < TOL[dtype]
    assert_every_element(got, want, dtype)


# (Hq, Hkv, D, rotary R, gated, norm form: None = no q/k norm, True = 1 + w, False = w)
PROLOGUE_SHAPES = {"4b": (16, 4, 256, 64, True, True), "08b": (8, 2, 256, 64, True, True),
                   "llama": (8, 8, 128, 128, False, None), "qwen3": (4, 1, 64, 64, False, False)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", list(PROLOGUE_SHAPES))
def test_attention_prologue(shape, batch, dtype):
    """Reference in the same dtype: its roundings (norm output, each RoPE product, their sum) are the spec,
    so nearly every element is bit-equal; the rest differ by the fp32 sum-of-squares order."""
    hq, hkv, d, r, gated, unit_offset = PROLOGUE_SHAPES[shape]
    s = 40
    q = randn(batch, hq * d * (2 if gated else 1), dtype=dtype)
    k, v = randn(batch, hkv * d, dtype=dtype), randn(batch, hkv * d, dtype=dtype)
    angles = torch.rand(batch, r // 2, device="cuda") * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    norms = ((randn(d, dtype=dtype, scale=0.3), randn(d, dtype=dtype, scale=0.3)) if unit_offset is not None
             else (None, None))
    k_cache, v_cache = randn(batch, hkv, s, d, dtype=dtype), randn(batch, hkv, s, d, dtype=dtype)
    positions = torch.randint(0, s, (batch,), device="cuda")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = R.attention_prologue(q, k, v, cos, sin, *norms, want_k, want_v, positions, 1e-6, bool(unit_offset), gated)
    poison((batch, hq, d), dtype=dtype)
    got = torch.ops.segki.attention_prologue(q, k, v, cos, sin, *norms, k_cache, v_cache, positions, 1e-6,
                                             bool(unit_offset), gated)
    assert torch.equal(v_cache, want_v)  # values are copied; every other cache position is untouched
    written = torch.zeros(batch, s, dtype=torch.bool, device="cuda")
    written[torch.arange(batch, device="cuda"), positions] = True
    assert torch.equal(k_cache.transpose(1, 2)[~written], want_k.transpose(1, 2)[~written])
    rows = torch.arange(batch, device="cuda")
    for got_t, want_t in ((got, want), (k_cache[rows, :, positions], want_k[rows, :, positions])):
        assert rel_err(got_t, want_t) < TOL[dtype]
        assert_every_element(got_t, want_t, dtype)
        assert (got_t == want_t).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 17, 32])
@pytest.mark.parametrize("shape", list(PROLOGUE_SHAPES))
def test_attention_prologue_reads_column_slices_of_one_product_exactly(shape, batch, dtype):
    """q, k, v as column slices of one [B, Nq + 2*Nk] product (packed q|k|v weights past the GEMV rows) give the
    bits of the same values in contiguous tensors: the query and both caches."""
    hq, hkv, d, r, gated, unit_offset = PROLOGUE_SHAPES[shape]
    s, nq = 40, hq * d * (2 if gated else 1)
    joint = randn(batch, nq + 2 * hkv * d, dtype=dtype)
    q, k, v = joint.split([nq, hkv * d, hkv * d], dim=1)
    angles = torch.rand(batch, r // 2, device="cuda") * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    norms = ((randn(d, dtype=dtype, scale=0.3), randn(d, dtype=dtype, scale=0.3)) if unit_offset is not None
             else (None, None))
    caches = [randn(batch, hkv, s, d, dtype=dtype) for _ in range(2)]
    caches2 = [c.clone() for c in caches]
    positions = torch.randint(0, s, (batch,), device="cuda")
    tail = (positions, 1e-6, bool(unit_offset), gated)
    poison((batch, hq, d), dtype=dtype)
    got = torch.ops.segki.attention_prologue(q, k, v, cos, sin, *norms, *caches, *tail)
    poison((batch, hq, d), dtype=dtype)
    want = torch.ops.segki.attention_prologue(q.contiguous(), k.contiguous(), v.contiguous(), cos, sin, *norms,
                                              *caches2, *tail)
    assert not torch.isnan(got).any() and torch.equal(got, want)
    assert torch.equal(caches[0], caches2[0]) and torch.equal(caches[1], caches2[1])


@pytest.mark.parametrize("variant", ["fused", None])  # SEGKI_ATTN_STEP; None: one launch by rows x KV heads and cache
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("s", [40, 200, 392, 2100])
@pytest.mark.parametrize("batch", [1, 4, 9])
@pytest.mark.parametrize("shape", list(PROLOGUE_SHAPES))
def test_decode_attention_step(shape, batch, s, dtype, variant, monkeypatch):
    """The step's attention (prologue, attention, gate) against the reference: the new key and value land at each
    row's position and nowhere else, the output within the attention tolerance. Cache rows past each row's length
    and the new token's old row hold NaN: the step must read neither (the new token comes from its own prologue).
    q, k and v are column slices of one product except at 4 rows."""
    if variant is None:
        monkeypatch.delenv("SEGKI_ATTN_STEP", raising=False)
    else:
        monkeypatch.setenv("SEGKI_ATTN_STEP", variant)
    hq, hkv, d, r, gated, unit_offset = PROLOGUE_SHAPES[shape]
    nq = hq * d * (2 if gated else 1)
    joint = randn(batch, nq + 2 * hkv * d, dtype=dtype)
    q, k, v = joint.split([nq, hkv * d, hkv * d], dim=1)
    if batch == 4:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    angles = torch.rand(batch, r // 2, device="cuda") * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    norms = ((randn(d, dtype=dtype, scale=0.3), randn(d, dtype=dtype, scale=0.3)) if unit_offset is not None
             else (None, None))
    k_cache, v_cache = randn(batch, hkv, s, d, dtype=dtype), randn(batch, hkv, s, d, dtype=dtype)
    lengths = torch.randint(1, s + 1, (batch,), device="cuda", dtype=torch.int32)
    lengths[0] = s
    positions = lengths.long() - 1
    for i, n in enumerate(lengths.tolist()):
        for c in (k_cache, v_cache):
            c[i, :, n - 1:] = float("nan")
    want_k, want_v = k_cache.clone(), v_cache.clone()
    tail = (positions, lengths, 1e-6, bool(unit_offset), gated, d**-0.5)
    want = R.decode_attention_step(q, k, v, cos, sin, *norms, want_k, want_v, *tail)
    poison((batch, hq, d), dtype=dtype)
    got = torch.ops.segki.decode_attention_step(q, k, v, cos, sin, *norms, k_cache, v_cache, *tail)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0, equal_nan=True)  # values are copied
    rows = torch.arange(batch, device="cuda")
    written = torch.zeros(batch, s, dtype=torch.bool, device="cuda")
    written[rows, positions] = True
    torch.testing.assert_close(k_cache.transpose(1, 2)[~written], want_k.transpose(1, 2)[~written], rtol=0, atol=0,
                               equal_nan=True)
    got_k, want_k_new = k_cache[rows, :, positions], want_k[rows, :, positions]
    assert rel_err(got_k, want_k_new) < TOL[dtype] and (got_k == want_k_new).float().mean() > 0.99
    assert rel_err(got, want) < TOL[dtype]
    assert_every_element(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [17, 64, 300])
def test_silu_mul_beyond_the_gemv_rows(rows, dtype):
    """Past its native row limit the MLP front is two cuBLAS products and one silu_mul launch; same roundings as
    the reference (products rounded to the dtype, SiLU and product in fp32, one rounding)."""
    from segki_lightning import ops

    x = randn(rows, 1024, dtype=dtype)
    wg, wu = randn(3584, 1024, dtype=dtype, scale=1024**-0.5), randn(3584, 1024, dtype=dtype, scale=1024**-0.5)
    gate, up = x @ wg.T, x @ wu.T
    poison((rows, 3584), dtype=dtype)
    got = torch.ops.segki.silu_mul(gate, up)
    want = R.silu_mul(gate, up)
    assert rel_err(got, want) < TOL[dtype]
    assert (got == want).float().mean() > 0.999
    with torch.no_grad():
        assert torch.equal(ops.gated_mlp_front(x, wg, wu), got)  # the dispatch takes exactly this path


# (Hk, Hv, Dk, Dv): the 4B and 0.8B heads, odd sizes, the largest key head (64 state values per thread) and the
# tests' tiny Qwen3.5 (two value heads of 64 per key head: clusters of 4 blocks with the conv inside)
GDN_SHAPES = {"4b": (16, 32, 128, 128), "08b": (16, 16, 128, 128), "odd": (2, 6, 64, 96),
              "dk256": (2, 4, 256, 64), "tiny": (2, 4, 64, 64)}


def gdn_inputs(batch, hk, hv, dk, dv, dtype, width=4):
    c = 2 * hk * dk + hv * dv
    return dict(
        qkv=randn(batch, c, dtype=dtype), z=randn(batch, hv * dv, dtype=dtype), b=randn(batch, hv, dtype=dtype),
        a=randn(batch, hv, dtype=dtype), conv_state=randn(batch, c, width, dtype=dtype),
        conv_weight=randn(c, width, dtype=dtype, scale=0.5), conv_bias=None,
        recurrent_state=torch.randn(batch, hv, dk, dv, device="cuda") * 0.1,
        A_log=randn(hv, dtype=dtype, scale=0.5), dt_bias=randn(hv, dtype=dtype, scale=0.5),
        norm_weight=(1 + randn(dv, dtype=dtype, scale=0.2)).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", list(GDN_SHAPES))
def test_gdn_decode_step(shape, batch, dtype):
    hk, hv, dk, dv = GDN_SHAPES[shape]
    args = gdn_inputs(batch, hk, hv, dk, dv, dtype)
    ref_args = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in args.items()}
    poison((batch, hv * dv), (batch, args["qkv"].shape[1]), dtype=dtype)
    out = torch.ops.segki.gdn_decode_step(*args.values(), 1e-6, hk, dk, dv)
    want = R.gdn_decode_step(*ref_args.values(), 1e-6, hk, dk, dv)
    assert torch.equal(args["conv_state"], ref_args["conv_state"])  # pure data movement: exact
    assert rel_err(args["recurrent_state"], ref_args["recurrent_state"]) < 1e-3
    assert rel_err(out, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 5])
@pytest.mark.parametrize("shape", list(GDN_SHAPES))
def test_gdn_decode_steps_in_a_row_follow_the_reference(shape, batch, dtype):
    """Several steps on the same windows and state, each reading what the one before rewrote (the conv windows
    rewritten by one block of a cluster after all have read them, where the conv runs inside), with q|k|v, z, b
    and a as column slices of one product, as the model's in-projection gives them: every step's windows exact,
    state and output within the dtype's tolerance of the reference carried alongside."""
    hk, hv, dk, dv = GDN_SHAPES[shape]
    g = gdn_inputs(batch, hk, hv, dk, dv, dtype)
    ref = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items()}
    widths = [g[k].shape[1] for k in ("qkv", "z", "b", "a")]
    for _ in range(4):
        joint = randn(batch, sum(widths) + 8, dtype=dtype)   # [B, C + Hv*Dv + 2*Hv + 8]: rows apart
        step = dict(zip(("qkv", "z", "b", "a"), joint[:, :sum(widths)].split(widths, dim=1)))
        g.update(step)
        ref.update({k: v.clone() for k, v in step.items()})
        poison((batch, hv * dv), dtype=dtype)
        out = torch.ops.segki.gdn_decode_step(*g.values(), 1e-6, hk, dk, dv)
        want = R.gdn_decode_step(*ref.values(), 1e-6, hk, dk, dv)
        assert not torch.isnan(out).any()
        assert torch.equal(g["conv_state"], ref["conv_state"])
        assert rel_err(g["recurrent_state"], ref["recurrent_state"]) < 1e-3
        assert rel_err(out, want) < TOL[dtype]
        ref["recurrent_state"].copy_(g["recurrent_state"])   # the next step from the same state: no drift


def misaligned(t):
    """A contiguous copy of ``t`` starting 2 bytes past an 8-byte boundary (the conv's vector loads cannot apply)."""
    buf = torch.full((t.numel() + 1,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 8 != 0 and view.is_contiguous()
    return view


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("width", [2, 3, 4, 6])
def test_gdn_conv_window_of_any_width_and_alignment_is_the_reference_shift_exactly(width, batch, dtype):
    """The conv state after one token is the old window shifted by one with the new value appended, bit for bit,
    for the 8-byte path (width 4, aligned) and the scalar one (other widths, or a state 2 bytes off alignment);
    the recurrence output is the same bits either way and matches the reference."""
    hk, hv, dk, dv = GDN_SHAPES["odd"]
    g = gdn_inputs(batch, hk, hv, dk, dv, dtype, width=width)
    tail = (1e-6, hk, dk, dv)
    ref = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items()}
    want = R.gdn_decode_step(*ref.values(), *tail)
    outs = []
    for state in (g["conv_state"].clone(), misaligned(g["conv_state"])):
        run = dict(g, conv_state=state, recurrent_state=g["recurrent_state"].clone())
        poison((batch, hv * dv), (batch, g["qkv"].shape[1]), dtype=dtype)
        outs.append(torch.ops.segki.gdn_decode_step(*run.values(), *tail))
        assert torch.equal(state, ref["conv_state"])
        assert torch.equal(state[..., -1], g["qkv"]) and torch.equal(state[..., :-1], g["conv_state"][..., 1:])
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[0], want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 17, 32, 64])
@pytest.mark.parametrize("shape", list(GDN_SHAPES))
def test_gdn_step_reads_column_slices_of_one_product_exactly(shape, batch, dtype):
    """qkv, z, b, a as column slices of one [B, C + Hv*Dv + 2*Hv] product (the packed input projections past the
    GEMV rows) give the bits of the same values in contiguous tensors: output and both states."""
    hk, hv, dk, dv = GDN_SHAPES[shape]
    g = gdn_inputs(batch, hk, hv, dk, dv, dtype)
    widths = [g["qkv"].shape[1], hv * dv, hv, hv]
    joint = torch.cat([g["qkv"], g["z"], g["b"], g["a"]], dim=1)
    sliced = dict(g, **dict(zip(("qkv", "z", "b", "a"), joint.split(widths, dim=1))))
    assert not sliced["z"].is_contiguous() or batch == 1
    tail = (1e-6, hk, dk, dv)
    conv, rec = g["conv_state"].clone(), g["recurrent_state"].clone()
    poison((batch, hv * dv), (batch, widths[0]), dtype=dtype)
    want = torch.ops.segki.gdn_decode_step(*g.values(), *tail)
    sliced.update(conv_state=conv, recurrent_state=rec)
    poison((batch, hv * dv), (batch, widths[0]), dtype=dtype)
    got = torch.ops.segki.gdn_decode_step(*sliced.values(), *tail)
    for a, b in ((got, want), (conv, g["conv_state"]), (rec, g["recurrent_state"])):
        assert not torch.isnan(a).any() and torch.equal(a, b)
    mixed = joint[:, :widths[0]]            # the recurrence alone, on a strided q|k|v (as after the fused conv)
    rec2, rec3 = rec.clone(), rec.clone()
    rest = (sliced["z"], sliced["b"], sliced["a"])
    got = torch.ops.segki.gdn_recurrent_step(mixed, *rest, rec2, g["A_log"], g["dt_bias"], g["norm_weight"], *tail)
    want = torch.ops.segki.gdn_recurrent_step(mixed.contiguous(), *(t.contiguous() for t in rest), rec3, g["A_log"],
                                              g["dt_bias"], g["norm_weight"], *tail)
    assert torch.equal(got, want) and torch.equal(rec2, rec3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [9, 32, 33])
@pytest.mark.parametrize("shape", ["4b", "08b"])
def test_resident_gdn_recurrence_gives_each_row_its_bits_alone(shape, batch, dtype):
    """At (row, head) items >= SMs the recurrence of 128x128 heads runs as resident blocks looping over the items
    (gdn_recurrent_pipe_kernel); each row alone (fewer items than SMs) runs the per-tile kernel. Both do the same
    arithmetic in the same order, so every row's output and state equal that row's run alone exactly -- on column
    slices of one product, for item counts around the SM count (the 0.8B shape at 9 rows: 144 items) and with a
    ragged last round; gdn_decode_step and gdn_recurrent_step alike."""
    hk, hv, dk, dv = GDN_SHAPES[shape]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not batch * hv >= sms > hv:
        pytest.skip(f"{sms} SMs: the batch and its rows alone take the same kernel here")
    g = gdn_inputs(batch, hk, hv, dk, dv, dtype)
    widths = [g["qkv"].shape[1], hv * dv, hv, hv]
    joint = torch.cat([g["qkv"], g["z"], g["b"], g["a"]], dim=1)
    g.update(zip(("qkv", "z", "b", "a"), joint.split(widths, dim=1)))
    tail = (1e-6, hk, dk, dv)
    rows = [slice(0, batch)] + [slice(r, r + 1) for r in range(batch)]   # the batch, then each row alone
    runs = []
    for r in rows:
        n = r.stop - r.start
        run = dict(g, conv_state=g["conv_state"][r].clone(), recurrent_state=g["recurrent_state"][r].clone())
        run.update({k: g[k][r] for k in ("qkv", "z", "b", "a")})
        poison((n, hv * dv), (n, widths[0]), dtype=dtype)
        out = torch.ops.segki.gdn_decode_step(*run.values(), *tail)
        rec = g["recurrent_state"][r].clone()
        poison((n, hv * dv), dtype=dtype)
        alone = torch.ops.segki.gdn_recurrent_step(run["qkv"], run["z"], run["b"], run["a"], rec, g["A_log"],
                                                   g["dt_bias"], g["norm_weight"], *tail)
        runs.append((out, run["conv_state"], run["recurrent_state"], alone, rec))
    whole, singles = runs[0], runs[1:]
    for got, want in zip(whole, (torch.cat(parts) for parts in zip(*singles))):
        assert not torch.isnan(got).any() and torch.equal(got, want)
    assert not torch.equal(whole[2], g["recurrent_state"])      # the state moved


GDN_STEP_CALLS = """
import sys, torch
from segki_lightning.ops.extension import native_ops
ops, outs = native_ops(), []
for case in torch.load(sys.argv[1]):
    g = {k: v.cuda() if torch.is_tensor(v) else v for k, v in case.items()}
    tail, sliced = g.pop("tail"), g.pop("sliced")
    if sliced:  # q|k|v, z, b, a as column slices of one product, as past the native rows
        parts = [g[k] for k in ("qkv", "z", "b", "a")]
        joint = torch.cat(parts, dim=1)
        g.update(zip(("qkv", "z", "b", "a"), joint.split([t.shape[1] for t in parts], dim=1)))
    out = ops.gdn_decode_step(*g.values(), *tail)
    outs.append([out.cpu(), g["conv_state"].cpu(), g["recurrent_state"].cpu()])
torch.save(outs, sys.argv[2])
"""


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gdn_step_with_its_conv_inside_gives_the_split_kernels_bits(tmp_path, dtype):
    """gdn_decode_step runs the conv inside the recurrence: where its (row, value head) items are fewer than the SMs,
    inside the cluster kernel (each block computing its key head's q and k channels, one block per key head rewriting
    their windows once every block of the cluster has read them); where they are as many or more, inside the streamed
    kernel (a block takes a key head's value heads in a row and computes the conv of all its items into shared memory
    first, rewriting each window it read). ``SEGKI_GDN_CONV=split`` keeps the conv kernel before the recurrence. Output,
    conv windows and recurrent state are bit-identical: the 4B heads (two value heads per key head: clusters of 8
    blocks), the 0.8B's and Dk = 256, at 1 and 3 rows, at the most rows below the SM count and the fewest at or above it
    (streamed where Dk is 128; Dk = 256 keeps the conv kernel there), at 16 and at 33 rows (a block's groups of items
    wrap past the grid), with a conv bias, and on column slices of one product. One child process per setting."""
    import os
    import subprocess
    import sys

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = []
    for shape in ("4b", "08b", "dk256"):
        hk, hv, dk, dv = GDN_SHAPES[shape]
        for batch, bias, sliced in ((1, False, False), (3, True, False), ((sms - 1) // hv, False, True),
                                    (-(-sms // hv), False, False), (16, True, True), (33, False, False)):
            g = gdn_inputs(batch, hk, hv, dk, dv, dtype)
            if bias:
                g["conv_bias"] = randn(g["qkv"].shape[1], dtype=dtype)
            cases.append({**{k: v.cpu() if torch.is_tensor(v) else v for k, v in g.items()},
                          "tail": (1e-6, hk, dk, dv), "sliced": sliced})
    torch.save(cases, tmp_path / "inputs.pt")
    script = tmp_path / "calls.py"
    script.write_text(GDN_STEP_CALLS)
    outs = []
    for value in ("", "split"):
        out = tmp_path / f"out_{value or 'inside'}.pt"
        env = {k: v for k, v in os.environ.items() if k != "SEGKI_GDN_CONV"}
        subprocess.run([sys.executable, str(script), str(tmp_path / "inputs.pt"), str(out)], check=True,
                       env={**env, "SEGKI_GDN_CONV": value} if value else env, timeout=600)
        outs.append(torch.load(out))
    for case, inside, split in zip(cases, *outs, strict=True):
        for a, b in zip(inside, split, strict=True):
            assert not torch.isnan(a).any() and torch.equal(a, b)
        assert not torch.equal(inside[1], case["conv_state"])     # the windows moved


def stamped_gdn_step(rows: int, shape: str):
    """One bf16 gdn_decode_step of `rows` rows of a GDN_SHAPES shape while the timeline stamps: its launch table and
    the stamp buffer."""
    hk, hv, dk, dv = GDN_SHAPES[shape]
    g = gdn_inputs(rows, hk, hv, dk, dv, torch.bfloat16)
    buf = stamp_buffer()
    torch.ops.segki.timeline_stamps(buf, True)
    torch.ops.segki.gdn_decode_step(*g.values(), 1e-6, hk, dk, dv)
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    return table, buf


@pytest.mark.parametrize("shape", ["4b", "08b"])
def test_the_gdn_step_runs_its_conv_inside_the_streamed_recurrence(shape, monkeypatch):
    """Where the (row, value head) items are as many as the SMs (16 rows of the 4B and 0.8B heads), gdn_decode_step
    is one stamped launch: the streamed recurrence (kind 6) with the conv inside (the launch table's fourth number),
    no conv kernel; with ``SEGKI_GDN_CONV=split`` in the environment of a child process it would be two (the bits
    are the same: test_the_gdn_step_with_its_conv_inside_gives_the_split_kernels_bits)."""
    monkeypatch.delenv("SEGKI_GDN_CONV", raising=False)
    hv = GDN_SHAPES[shape][1]
    table, buf = stamped_gdn_step(16, shape)
    assert table.shape == (1, 9)
    launch, kind, rows, _, _, conv, grid, items, _ = table[0].tolist()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (kind, rows, conv, grid, items) == (6, 16, 1, sms, 16 * hv)
    rec = stamped_records(buf, launch, grid)                               # every block has items at 16 rows
    assert rec[:, 6 + STAMP_PHASES].sum().item() == items                  # every item, once


@pytest.mark.parametrize("shape", list(GDN_SHAPES))
def test_the_gdn_step_runs_its_conv_inside_where_a_cluster_holds_a_key_heads_blocks(shape, monkeypatch):
    """gdn_decode_step at one row is one stamped launch, the recurrence's cluster kernel, with the conv inside
    (the launch table's fourth number) where a key head's value heads fit one cluster of 8 blocks (the 4B, 0.8B
    and Dk = 256 heads), and the conv kernel (kind 5, with its width and channels) then the recurrence where they do
    not (``odd``: 3 value heads of 3 blocks)."""
    monkeypatch.delenv("SEGKI_GDN_CONV", raising=False)
    hk, hv, dk, dv = GDN_SHAPES[shape]
    table, _ = stamped_gdn_step(1, shape)
    if shape == "odd":
        assert table.shape == (2, 9) and table[:, 1].tolist() == [5, 1]      # the conv kernel, the recurrence
        assert table[0, 2:5].tolist() == [1, 4, 2 * hk * dk + hv * dv]      # rows, conv width, channels
    else:
        assert table.shape == (1, 9) and table[0, 1].item() == 1             # one launch stamped: the recurrence
    assert table[-1, 5].item() == (0 if shape == "odd" else 1)   # launch, kind, rows, Dk, Hv x Dv, conv


STAMP_WORDS, STAMP_PHASES = 16, 8  # csrc/timeline.cuh: words per record, phases per block


def stamp_buffer(room: int = 512):
    """A timeline buffer: header (records written, room), then room for `room` records."""
    buf = torch.zeros(STAMP_WORDS * (room + 1), dtype=torch.int64, device="cuda")
    buf[1] = room
    return buf


def stamped_records(buf, launch: int, grid: int):
    """The records of one stamped launch of `grid` blocks, checked: one per block, each with the launch's id, the SM
    clock in phase order and a timer span."""
    count = int(buf[0])
    assert count == grid
    rec = buf[STAMP_WORDS:STAMP_WORDS * (count + 1)].view(count, STAMP_WORDS).cpu()
    assert sorted((rec[:, 0] & 0xFFFFFFFF).tolist()) == list(range(grid)) and ((rec[:, 0] >> 32) == launch).all()
    clock = rec[:, 4:4 + STAMP_PHASES]
    assert (clock[:, 1:] >= clock[:, :-1]).all() and (rec[:, 3] >= rec[:, 2]).all() and (rec[:, 2] > 0).all()
    return rec


@pytest.mark.parametrize("batch", [1, 3, 16])   # 16: 256 (row, head) items, at least one an SM: the streamed kernel
def test_stamping_recurrence_records_every_block_and_changes_no_bit(batch):
    """While the timeline's buffer is set, the recurrence writes one record per block -- the cluster kernel at few
    rows (kind 1 in the launch table, with its rows, Dk, Hv x Dv, conv, grid, blocks per head and heads), the
    streamed kernel where the (row, head) items are as many as the SMs (kind 6: its grid of one block an SM, the
    items, whose count its blocks' units add up to); the SM clock in phase order -- and gives the plain launch's
    output and state bits; once unset, nothing more is written."""
    hk, hv, dk, dv = GDN_SHAPES["08b"]
    g = gdn_inputs(batch, hk, hv, dk, dv, torch.bfloat16)
    rec_plain, rec_stamped = g["recurrent_state"].clone(), g["recurrent_state"].clone()

    def step(rec):
        return torch.ops.segki.gdn_recurrent_step(g["qkv"], g["z"], g["b"], g["a"], rec, g["A_log"], g["dt_bias"],
                                                  g["norm_weight"], 1e-6, hk, dk, dv)

    plain = step(rec_plain)
    buf = stamp_buffer()
    torch.ops.segki.timeline_stamps(buf, True)
    poison((batch, hv * dv), dtype=torch.bfloat16)
    stamped = step(rec_stamped)
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    assert torch.equal(stamped, plain) and torch.equal(rec_stamped, rec_plain)
    assert table.shape == (1, 9)
    launch, kind, rows, k, n, gated, grid, per_head, heads = table[0].tolist()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    streamed = batch * hv >= sms
    assert (kind, rows, k, n, gated, heads) == (6 if streamed else 1, batch, dk, hv * dv, 0, hv)
    rec = stamped_records(buf, launch, grid)
    units = rec[:, 6 + STAMP_PHASES]
    if streamed:
        assert grid == sms and per_head == batch * hv and units.sum().item() == batch * hv and (units > 0).all()
    else:
        assert per_head == dv // 32 and grid == batch * hv * (dv // 32) and (units == 1).all()
    step(g["recurrent_state"].clone())
    torch.cuda.synchronize()
    assert int(buf[0]) == grid


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "add_rms_norm_sums"])
def test_stamping_the_norms_records_every_block_and_changes_no_bit(op):
    """While the buffer is set, each norm kernel writes one record per row's block (kind 3: rows, width, the
    residual add, grid, parts of sums; the SM clock in phase order) and gives the plain launch's bits; once unset,
    nothing more is written."""
    rows, h, parts = 5, 2560, 3
    x, res = randn(rows, h, dtype=torch.bfloat16), randn(rows, h, dtype=torch.bfloat16)
    nw, sums = randn(h, dtype=torch.bfloat16, scale=0.2), randn(parts, rows, h, dtype=torch.float32)

    def call():
        if op == "rms_norm":
            return (torch.ops.segki.rms_norm(x, nw, 1e-6, True),)
        args = (sums,) if op == "add_rms_norm_sums" else (x,)
        return tuple(getattr(torch.ops.segki, op)(*args, res, nw, 1e-6, True))

    plain = call()
    buf = stamp_buffer()
    torch.ops.segki.timeline_stamps(buf, True)
    poison((rows, h), (rows, h), dtype=torch.bfloat16)
    stamped = call()
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(stamped, plain, strict=True))
    assert table.shape == (1, 9)
    launch, kind, r, width, _, add, grid, sum_parts, _ = table[0].tolist()
    assert (kind, r, width, add, grid) == (3, rows, h, int(op != "rms_norm"), rows)
    assert sum_parts == (parts if op == "add_rms_norm_sums" else 0)
    stamped_records(buf, launch, grid)
    call()
    torch.cuda.synchronize()
    assert int(buf[0]) == grid


@pytest.mark.parametrize("batch", [1, 2])
def test_stamping_attention_step_records_every_block_and_changes_no_bit(batch, monkeypatch):
    """While the timeline's buffer is set, the one-launch attention step writes one record per block (kind 2 in the
    launch table, with its rows, D, query heads, gate, grid, splits and KV heads; the SM clock in phase order; each
    block's positions, which add up to every row's length per KV head) and gives the plain launch's output and cache
    bits; once unset, nothing more is written."""
    monkeypatch.setenv("SEGKI_ATTN_STEP", "fused")
    hq, hkv, d, r, gated, unit_offset = PROLOGUE_SHAPES["08b"]
    s, nq = 392, hq * d * 2
    q, k, v = randn(batch, nq, dtype=torch.bfloat16), randn(batch, hkv * d, dtype=torch.bfloat16), randn(
        batch, hkv * d, dtype=torch.bfloat16)
    angles = torch.rand(batch, r // 2, device="cuda") * 50
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    norms = (randn(d, dtype=torch.bfloat16, scale=0.3), randn(d, dtype=torch.bfloat16, scale=0.3))
    caches = [randn(batch, hkv, s, d, dtype=torch.bfloat16) for _ in range(2)]
    caches2 = [c.clone() for c in caches]
    lengths = torch.randint(1, s + 1, (batch,), device="cuda", dtype=torch.int32)
    tail = (lengths.long() - 1, lengths, 1e-6, True, gated, d**-0.5)
    plain = torch.ops.segki.decode_attention_step(q, k, v, cos, sin, *norms, *caches, *tail)
    buf = stamp_buffer()
    torch.ops.segki.timeline_stamps(buf, True)
    stamped = torch.ops.segki.decode_attention_step(q, k, v, cos, sin, *norms, *caches2, *tail)
    table = torch.ops.segki.timeline_stamps(buf, False)
    torch.cuda.synchronize()
    assert torch.equal(stamped, plain) and torch.equal(caches2[0], caches[0]) and torch.equal(caches2[1], caches[1])
    assert table.shape == (1, 9)
    launch, kind, rows, dim, heads, gate, grid, splits, kv_heads = table[0].tolist()
    assert (kind, rows, dim, heads, gate, kv_heads) == (2, batch, d, hq, 1, hkv) and grid == splits * hkv * batch
    rec = stamped_records(buf, launch, grid)
    assert rec[:, 6 + STAMP_PHASES].sum().item() == hkv * lengths.sum().item()
    torch.ops.segki.decode_attention_step(q, k, v, cos, sin, *norms, *caches2, *tail)
    torch.cuda.synchronize()
    assert int(buf[0]) == grid


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [17, 32, 300])
def test_silu_mul_reads_the_halves_of_one_product_exactly(rows, dtype):
    """gate and up as the two halves of one [rows, 2I] product (packed gate|up weights) give the bits of the same
    values in contiguous tensors; an odd row stride takes the reference instead of raising."""
    from segki_lightning import ops

    y = randn(rows, 2 * 3584, dtype=dtype)
    gate, up = y.split(3584, dim=1)
    poison((rows, 3584), dtype=dtype)
    got = torch.ops.segki.silu_mul(gate, up)
    assert not torch.isnan(got).any() and got.is_contiguous()
    assert torch.equal(got, torch.ops.segki.silu_mul(gate.contiguous(), up.contiguous()))
    odd = randn(rows, 2 * 3584 + 4, dtype=dtype)[:, 4:].split(3584, dim=1)   # rows 8 bytes off 16-byte alignment
    assert torch.equal(ops.silu_mul(*odd), R.silu_mul(*odd))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [17, 32, 64])
def test_packed_projections_take_one_product_past_the_gemv_rows(rows, dtype):
    """With the weights packed, the MLP front and the GDN input projection past 16 rows are one cuBLAS product (the
    outputs are column slices of it) within the dtype's tolerance of the fp32 reference, and the whole GDN step on
    them equals the step on contiguous copies bit for bit."""
    from torch import nn

    from segki_lightning import ops
    from segki_lightning.inject.packing import pack_projections

    k, hk, hv, dk, dv = GDN_IN_SHAPES["08b"]
    c = 2 * hk * dk + hv * dv
    block = nn.Module()
    for name, n in (("in_proj_qkv", c), ("in_proj_z", hv * dv), ("in_proj_b", hv), ("in_proj_a", hv),
                    ("gate_proj", 3584), ("up_proj", 3584)):
        setattr(block, name, nn.Linear(k, n, bias=False, device="cuda", dtype=dtype))
    block.__dict__["_segki_spec"] = None       # as an injected module
    assert pack_projections(block) == 2
    x = randn(rows, k, dtype=dtype)
    ws = [block.in_proj_qkv.weight, block.in_proj_z.weight, block.in_proj_b.weight, block.in_proj_a.weight]
    with torch.no_grad():
        outs = ops.gdn_in_proj(x, *ws)
        front = ops.gated_mlp_front(x, block.gate_proj.weight, block.up_proj.weight)
    assert all(o.stride(0) == c + hv * dv + 2 * hv for o in outs)
    for got, want in zip(outs, R.gdn_in_proj(*f32(x, *ws))):
        assert rel_err(got, want) < TOL[dtype]
    assert rel_err(front, R.gated_mlp_front(*f32(x, block.gate_proj.weight, block.up_proj.weight))) < TOL[dtype]
    g = gdn_inputs(rows, hk, hv, dk, dv, dtype)
    conv, rec, conv2, rec2 = (g[n].clone() for n in ("conv_state", "recurrent_state") * 2)
    tail = (g["A_log"], g["dt_bias"], g["norm_weight"], 1e-6, hk, dk, dv)
    got = ops.gdn_decode_step(*outs, conv, g["conv_weight"], None, rec, *tail)
    want = torch.ops.segki.gdn_decode_step(*(o.contiguous() for o in outs), conv2, g["conv_weight"], None, rec2, *tail)
    assert torch.equal(got, want) and torch.equal(conv, conv2) and torch.equal(rec, rec2)


GDN_IN_SHAPES = {"4b": (2560, 16, 32, 128, 128), "08b": (1024, 16, 16, 128, 128), "odd": (72, 2, 6, 64, 96)}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 4, 5, 16, 64])   # CUDA-core rows, tensor-core rows, a full launch
@pytest.mark.parametrize("shape", list(GDN_IN_SHAPES))
def test_gdn_in_proj_conv_equals_the_unfused_native_ops_exactly(shape, batch, dtype, bias):
    """The conv in the projection's epilogue + the recurrence alone == projection, then the conv + recurrence
    kernels: the same bits in every output and both states (one conv rule, the projection rounded to T before
    it); and within tolerance of the fp32 reference."""
    k, hk, hv, dk, dv = GDN_IN_SHAPES[shape]
    g = gdn_inputs(batch, hk, hv, dk, dv, dtype)
    c = g["qkv"].shape[1]
    g["conv_bias"] = randn(c, dtype=dtype, scale=0.5) if bias else None
    x, ws = randn(batch, k, dtype=dtype), [randn(n, k, dtype=dtype, scale=k**-0.5) for n in (c, hv * dv, hv, hv)]
    conv = (g["conv_state"].clone(), g["conv_weight"], g["conv_bias"])
    rec = g["recurrent_state"].clone()
    tail = (g["A_log"], g["dt_bias"], g["norm_weight"], 1e-6, hk, dk, dv)
    ops = torch.ops.segki
    poison((batch, c), (batch, hv * dv), (batch, hv), (batch, hv), dtype=dtype)
    mixed, z, b, a = ops.gdn_in_proj_conv(x, *ws, *conv)
    out = ops.gdn_recurrent_step(mixed, z, b, a, rec, *tail)
    qkv, z2, b2, a2 = ops.gdn_in_proj(x, *ws)
    conv2, rec2 = g["conv_state"].clone(), g["recurrent_state"].clone()
    out2 = ops.gdn_decode_step(qkv, z2, b2, a2, conv2, g["conv_weight"], g["conv_bias"], rec2, *tail)
    for got, want in ((out, out2), (conv[0], conv2), (rec, rec2), (z, z2), (b, b2), (a, a2)):
        assert not torch.isnan(got).any() and torch.equal(got, want)
    ref_conv = g["conv_state"].float()
    ref_mixed = R.gdn_in_proj_conv(*f32(x, *ws), ref_conv, *f32(g["conv_weight"], g["conv_bias"]))[0]
    assert rel_err(mixed, ref_mixed) < TOL[dtype]
    assert rel_err(conv[0], ref_conv) < TOL[dtype]   # the appended token is the rounded projection


SWITCH_CALLS = """
import sys, torch
from segki_lightning.ops.extension import native_ops
ops, outs = native_ops(), []
for x, ws, res in torch.load(sys.argv[1]):
    x, ws, res = x.cuda(), [w.cuda() for w in ws], None if res is None else res.cuda()
    outs.append([ops.gated_mlp_front(x, *ws)] if len(ws) == 2 else list(ops.gdn_in_proj(x, *ws)) if len(ws) == 4
                else [ops.linear(x, ws[0], None, res)])
torch.save([[o.cpu() for o in out] for out in outs], sys.argv[2])
"""


def assert_same_bits_under(tmp_path, cases, switch, values):
    """The GEMV family on ``cases`` ((x, weights, residual or None), on the CPU; 2 weights: gated front, 4: GDN
    input projection, 1: linear) in one child process per value of the process-wide kernel switch ``switch``:
    every output bit-identical across the values, and none left unwritten."""
    import os
    import subprocess
    import sys

    torch.save(cases, tmp_path / "inputs.pt")
    script = tmp_path / "calls.py"
    script.write_text(SWITCH_CALLS)
    outs = []
    for value in values:
        out = tmp_path / f"out_{value}.pt"
        subprocess.run([sys.executable, str(script), str(tmp_path / "inputs.pt"), str(out)], check=True,
                       env={**os.environ, switch: value}, timeout=600)
        outs.append(torch.load(out))
    for other in outs[1:]:
        for first, second in zip(outs[0], other, strict=True):
            for a, b in zip(first, second, strict=True):
                assert not torch.isnan(a).any() and torch.equal(a, b)


def test_the_pipelined_tensor_core_gemv_gives_the_single_stage_bits(tmp_path):
    """The tensor-core GEMV's two register stages (the next k blocks' loads in flight during this stage's mma)
    sum the same products in the same order as one stage at a time (``SEGKI_GEMV_PIPE=0``): the outputs are
    bit-identical, for 5-64 rows of the gated front, the GDN input projection, a single projection and an odd
    shape with a partial last k block."""
    cases = [(randn(batch, PROJ_SHAPES[shape][0], dtype=torch.bfloat16).cpu(),
              [randn(n, PROJ_SHAPES[shape][0], dtype=torch.bfloat16, scale=PROJ_SHAPES[shape][0] ** -0.5).cpu()
               for n in PROJ_SHAPES[shape][1]], None)
             for shape in ("4b_gate_up", "08b_gdn_in", "4b_o_proj", "odd_long_k") for batch in (5, 16, 33, 64)]
    assert_same_bits_under(tmp_path, cases, "SEGKI_GEMV_PIPE", ("1", "0"))


def test_the_copy_engine_gemv_gives_the_register_path_bits(tmp_path, monkeypatch):
    """The 1-4 row GEMV that copies each block's chunk of weight rows into shared memory with the copy engine
    (``SEGKI_GEMV_BULK=1``) sums each row as the register path (``=0``) does when both take a row's K whole:
    K = 1024, chunks of 16 (single projection, a partial last chunk) or 8 (gated front) rows, where the register
    path does not split K. The four-weight case has two weights of 5 and 3 rows, so some blocks take three or four
    chunks through their two slots and refill one; with three chunks per block (``SEGKI_GEMV_BULK_CHUNKS=3``)
    every block refills. The outputs are bit-identical, residual epilogue included."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    k = 1024

    def w(rows):
        return randn(rows, k, dtype=torch.bfloat16, scale=k**-0.5).cpu()

    cases = []
    for batch in (1, 2, 3, 4):
        x = randn(batch, k, dtype=torch.bfloat16).cpu()
        rows = 16 * 2 * sms + 7
        cases.append((x, [w(rows)], randn(batch, rows, dtype=torch.bfloat16).cpu()))
        cases.append((x, [w(8 * sms), w(8 * sms)], None))
        cases.append((x, [w(16 * sms + 4), w(5), w(3), w(16 * sms)], None))
    assert_same_bits_under(tmp_path, cases, "SEGKI_GEMV_BULK", ("1", "0"))
    monkeypatch.setenv("SEGKI_GEMV_BULK", "1")
    assert_same_bits_under(tmp_path, cases, "SEGKI_GEMV_BULK_CHUNKS", ("3", "1"))


# (name, K, [N_i]): where the copy-engine GEMV takes the norm into its x staging (0.8B shapes, an odd width, a
# width of two 2048-column stretches per thread), and where the op runs the norm kernel first (4B weights)
NORM_SHAPES = {name: PROJ_SHAPES[name] for name in ("08b_gate_up", "08b_gdn_in", "08b_qkv", "odd", "4b_gdn_in")}
NORM_SHAPES["k2560_small"] = (2560, [1024, 256, 16, 16])


def _projection(ws, x, norm=()):
    """The projection family op for these weights (2: gated front, 6: q|k|v and their biases, 4: GDN input), its
    outputs as a list."""
    ops = torch.ops.segki
    if len(ws) == 2:
        return [ops.gated_mlp_front(x, *ws, *norm)]
    if len(ws) == 6:
        return list(ops.qkv_proj(x, *ws, *norm))
    return list(ops.gdn_in_proj(x, *ws, *norm))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shape", list(NORM_SHAPES))
def test_the_norm_prologue_gives_the_norm_kernels_bits(shape, batch, unit_offset, dtype):
    """A projection given the RMSNorm before it (norm_w, norm_eps, norm_unit_offset) equals the native norm
    kernel followed by the projection, bit for bit: inside the copy-engine GEMV's x staging (1-4 rows on the
    small weights) the norm is that kernel's arithmetic thread for thread; elsewhere (7 rows, 4B weights) the op
    runs the norm kernel first. Also within the dtype's tolerance of the fp32 reference (given the normed x in
    the dtype), outputs poisoned."""
    k, ns = NORM_SHAPES[shape]
    x, nw = randn(batch, k, dtype=dtype, scale=3.0), randn(k, dtype=dtype, scale=0.3)
    ws = [randn(n, k, dtype=dtype, scale=k**-0.5) for n in ns]
    if len(ns) == 3:
        ws += [randn(n, dtype=dtype) for n in ns]
    norm = (nw, 1e-6, unit_offset)
    poison(*[(batch, n) for n in ns], dtype=dtype)
    got = _projection(ws, x, norm)
    want = _projection(ws, torch.ops.segki.rms_norm(x, *norm))
    # the normed x as HF's RMSNorm (and the norm kernel) hands it to the projection, roundings included: the plain
    # form rounds x * rsqrt to the dtype before the weight's product, so an fp32 norm rounded once differs by up to
    # an ulp per element, which small outputs amplify past the tolerance (3.0e-3 seen in fp16 and 1.02e-2 in bf16,
    # with outputs near 0.05-0.1, the fused and unfused bits equal)
    ref_x = R.rms_norm(x, nw, 1e-6, unit_offset).float()
    ref = {2: R.gated_mlp_front, 3: R.qkv_proj, 6: R.qkv_proj, 4: R.gdn_in_proj}[len(ws)](ref_x, *f32(*ws))
    ref = list(ref) if isinstance(ref, tuple) else [ref]
    for g, w, r in zip(got, want, ref):
        assert g.dtype == dtype and torch.equal(g, w)
        assert rel_err(g, r) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["08b_gdn_in", "odd", "4b_gdn_in"])
def test_the_norm_prologue_of_the_gdn_projection_with_its_conv_gives_the_unfused_bits(shape, dtype):
    """gdn_in_proj_conv with the norm prologue (one row) equals the norm kernel then gdn_in_proj_conv exactly, in
    every output and in the shifted conv state."""
    k, ns = NORM_SHAPES[shape]
    x, nw = randn(1, k, dtype=dtype, scale=3.0), randn(k, dtype=dtype, scale=0.3)
    ws = [randn(n, k, dtype=dtype, scale=k**-0.5) for n in ns]
    state, cw, cb = randn(1, ns[0], 4, dtype=dtype), randn(ns[0], 4, dtype=dtype), randn(ns[0], dtype=dtype)
    fused_state, unfused_state = state.clone(), state.clone()
    poison(*[(1, n) for n in ns], dtype=dtype)
    got = torch.ops.segki.gdn_in_proj_conv(x, *ws, fused_state, cw, cb, nw, 1e-6, True)
    normed = torch.ops.segki.rms_norm(x, nw, 1e-6, True)
    want = torch.ops.segki.gdn_in_proj_conv(normed, *ws, unfused_state, cw, cb)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(fused_state, unfused_state) and not torch.equal(fused_state, state)


def test_dispatch_hands_the_norm_to_the_projection_only_where_its_launch_runs_it(monkeypatch):
    """``ops.gated_mlp_front(..., norm_w=...)``: one native call with the norm at one row on the 0.8B shape; the
    native norm, then the projection without it, on the 4B shape and past the fold's rows (``FOLD_ROWS``)."""
    calls = []
    real = dispatch._native
    monkeypatch.setattr(dispatch, "_native", lambda op: (lambda *a: (calls.append((op, len(a))), real(op)(*a))[1]))
    for (k, n), rows, want in [((1024, 3584), 1, [("gated_mlp_front", 6)]),
                               ((2560, 9216), 1, [("rms_norm", 4), ("gated_mlp_front", 3)]),
                               ((1024, 3584), 3, [("rms_norm", 4), ("gated_mlp_front", 3)]),
                               ((1024, 3584), 7, [("rms_norm", 4), ("gated_mlp_front", 3)])]:
        x, nw = randn(rows, k, dtype=torch.bfloat16), randn(k, dtype=torch.bfloat16)
        wg, wu = (randn(n, k, dtype=torch.bfloat16, scale=k**-0.5) for _ in range(2))
        calls.clear()
        dispatch.gated_mlp_front(x, wg, wu, norm_w=nw, norm_eps=1e-6, norm_unit_offset=True)
        assert calls == want, (k, rows, calls)
        assert dispatch.folds_norm(x, wg, wu, gated=True) == (len(want) == 1)


BAD_INPUT_CALLS = """
import torch
from segki_lightning.ops.extension import native_ops
ops = native_ops()
bf = dict(device="cuda", dtype=torch.bfloat16)
x = torch.randn(2, 72, **bf)
calls = {
    "linear": lambda: ops.linear(x, torch.randn(8, 64, **bf), None, None),
    "gated_mlp_front": lambda: ops.gated_mlp_front(x, torch.randn(8, 72, **bf), torch.randn(8, 72, **bf),
                                                   torch.randn(64, **bf), 1e-6, True),
    "gdn_in_proj_conv": lambda: ops.gdn_in_proj_conv(x, *[torch.randn(n, 72, **bf) for n in (40, 8, 2, 2)],
                                                     torch.randn(2, 41, 4, **bf), torch.randn(40, 4, **bf), None),
    "gdn_decode_step": lambda: ops.gdn_decode_step(
        torch.randn(2, 384, **bf), torch.randn(2, 128, **bf), torch.randn(2, 2, **bf), torch.randn(2, 2, **bf),
        torch.randn(1, 384, 4, **bf), torch.randn(384, 4, **bf), None,
        torch.zeros(2, 2, 64, 64, device="cuda"), torch.randn(2, **bf), torch.randn(2, **bf),
        torch.ones(64, **bf), 1e-6, 2, 64, 64),
}
for name, call in calls.items():
    try:
        call()
    except RuntimeError as e:
        print(name, "raised:", str(e).splitlines()[0][:120], flush=True)
    else:
        print(name, "did not raise", flush=True)
"""


def test_a_native_op_raises_on_bad_input_instead_of_crashing():
    """A failed shape check inside a native op reaches Python as a RuntimeError naming the input. Run in a child
    process: two such calls (the folded norm's row limit, the fused conv's state shape) ended the whole test
    process with a segmentation fault on the H200 machine, cause not yet known."""
    import re
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", BAD_INPUT_CALLS], capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:   # what the extension links against, beside torch's own libraries, for the diagnosis
        from segki_lightning.ops.build import NAME, _arch_list, build_dir

        so = build_dir(_arch_list(None)) / f"{NAME}.so"
        libs = subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout
        cxx = subprocess.run(["c++", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        built = re.findall(r"CXX_COMPILER=[^,]*", torch.__config__.show()) + \
            [f"CXX11 ABI {torch._C._GLIBCXX_USE_CXX11_ABI}"]
        fault = "\n".join(line for line in proc.stderr.splitlines()[:40] if not line.startswith("Extension modules"))
        pytest.fail(f"the child process died (exit {proc.returncode}):\n{proc.stdout}{fault}\n"
                    f"ldd {so.name}:\n{libs}\nthe extension's compiler: {cxx}\ntorch built with: {built}")
    assert "linear raised: segki::linear: weight" in proc.stdout, proc.stdout
    assert "gdn_in_proj_conv raised: segki::gdn_in_proj_conv: conv_state" in proc.stdout, proc.stdout
    assert "gdn_decode_step raised: segki::gdn_decode_step: conv_state" in proc.stdout, proc.stdout
    assert "gated_mlp_front raised: segki::gated_mlp_front: norm_w" in proc.stdout, proc.stdout


def sampling_args(b, temperature, top_k=0, top_p=1.0):
    return (torch.full((b,), float(temperature), device="cuda"), torch.full((b,), top_k, device="cuda"),
            torch.full((b,), float(top_p), device="cuda"), torch.arange(b, device="cuda") * 7919 + 3,
            torch.full((b,), 5, device="cuda"))


@pytest.mark.parametrize("advance", [False, True], ids=["prefill", "decode_step"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_record_tokens_matches_reference_exactly(rows, advance):
    """The decode step's bookkeeping: native == reference on every buffer (NaN-poisoned outputs, NaN log-probs
    on finished rows, EOS hits)."""
    from ..tiny_models import decode_bookkeeping

    want = {k: v.cuda() for k, v in decode_bookkeeping(rows, cols=40).items()}
    if not advance:
        want["lengths"] = None
    got = {k: (v.clone() if v is not None else None) for k, v in want.items()}
    torch.ops.segki.record_tokens(got["tok"], got["lp"], got["finished"], got["offset"], got["token"],
                                  got["out_tokens"], got["out_logprobs"], got["out_mask"], got["eos"], 3,
                                  got["lengths"])
    R.record_tokens(**want, pad=3)
    for k in (k for k in want if want[k] is not None):
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True, msg=k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [248320, 1000])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 50, 1.0),
                                                     (1.0, 0, 0.9), (0.8, 40, 0.8)])
@pytest.mark.parametrize("b", [1, 16, 37])  # 64, 64 and 29 vocabulary slices per row
def test_sample_tokens_match_reference_stream(vocab, temperature, top_k, top_p, dtype, b):
    logits = randn(b, vocab, dtype=dtype, scale=3.0)
    args = sampling_args(b, temperature, top_k, top_p)
    tokens, logprobs = torch.ops.segki.sample_tokens(logits, *args)
    want_tokens, want_logprobs = R.sample_tokens(logits, *args)
    if temperature == 0.0:
        assert torch.equal(tokens, logits.float().argmax(-1))
    # same counter-based stream: identical draws except where two perturbed scores tie within rounding
    assert int((tokens != want_tokens).sum()) <= b // 16
    same = tokens == want_tokens
    torch.testing.assert_close(logprobs[same], want_logprobs[same], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [248320, 1001])   # Qwen3.5's, and one the vectorised path cannot take
@pytest.mark.parametrize("penalty,min_p,temperature", [(1.3, None, 1.0), (None, 0.05, 0.7), (1.2, 0.1, 1.0),
                                                       (0.7, 0.3, 0.0), (1.5, 0.999, 2.0)])
@pytest.mark.parametrize("b", [1, 16, 37])
def test_process_logits_match_reference_exactly(vocab, penalty, min_p, temperature, dtype, b):
    """Penalised and min-p-masked logits bit for bit (NaN-poisoned output), the raw log-sum-exp within fp32
    summation-order noise."""
    logits = randn(b, vocab, dtype=dtype, scale=4.0)
    seen = torch.rand(b, vocab, device="cuda") < 0.05 if penalty is not None else None
    row = lambda v: torch.full((b,), float(v), device="cuda")   # noqa: E731
    args = (seen, row(penalty or 1.0), row(min_p) if min_p is not None else None, row(temperature))
    poison((b, vocab), dtype=dtype)
    got, lse = torch.ops.segki.process_logits(logits, *args)
    want, want_lse = R.process_logits(logits, *args)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-4)
    if min_p is not None:
        assert torch.isinf(got).any() and torch.isfinite(got).any(1).all()


def test_every_op_replays_inside_a_cuda_graph():
    dtype, b = torch.bfloat16, 4
    x = randn(b, 256, dtype=dtype)
    wg, wu = randn(512, 256, dtype=dtype, scale=0.06), randn(512, 256, dtype=dtype, scale=0.06)
    q, kc, vc = randn(b, 8, 128, dtype=dtype), randn(b, 2, 64, 128, dtype=dtype), randn(b, 2, 64, 128, dtype=dtype)
    lengths = torch.tensor([64, 1, 30, 17], device="cuda")
    logits = randn(b, 5000, dtype=dtype)
    sargs = sampling_args(b, 1.0, 20, 0.9)
    gdn = gdn_inputs(b, 2, 4, 128, 128, dtype)
    gate = randn(b, 8, 256, dtype=dtype)[..., 128:]
    qkv = randn(b, 8 * 256, dtype=dtype), randn(b, 2 * 128, dtype=dtype), randn(b, 2 * 128, dtype=dtype)
    rope = randn(b, 64, dtype=dtype), randn(b, 64, dtype=dtype)
    norms = randn(128, dtype=dtype, scale=0.3), randn(128, dtype=dtype, scale=0.3)
    positions = torch.tensor([5, 0, 63, 20], device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()

    def step():
        return (torch.ops.segki.gated_mlp_front(x, wg, wu), torch.ops.segki.rms_norm(x, wg[0, :256], 1e-6, True),
                torch.ops.segki.decode_attention(q, kc, vc, lengths, 128**-0.5, gate),
                torch.ops.segki.sample_tokens(logits, *sargs)[0],
                torch.ops.segki.gdn_decode_step(*gdn.values(), 1e-6, 2, 128, 128),
                torch.ops.segki.attention_prologue(*qkv, *rope, *norms, kc2, vc2, positions, 1e-6, True, True),
                torch.ops.segki.silu_mul(wg, wu),
                torch.ops.segki.process_logits(logits, logits > 0, sargs[2], sargs[2], sargs[0])[0])

    graph, outs = captured(step)
    for _ in range(3):  # new inputs copied into the static buffers
        for t in (x, q, kc, vc, logits, *qkv, *rope):
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(dtype))
        positions.copy_(torch.randint(0, 64, (b,), device="cuda"))
        kc2_ref, vc2_ref = kc2.clone(), vc2.clone()
        lengths.copy_(torch.randint(1, 65, (b,), device="cuda"))
        sargs[4].add_(1)
        conv0, rec0 = gdn["conv_state"].clone(), gdn["recurrent_state"].clone()
        ref_gdn = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in gdn.items()}
        graph.replay()
        assert rel_err(outs[0], R.gated_mlp_front(*f32(x, wg, wu))) < 1e-2
        assert rel_err(outs[1], R.rms_norm(x, wg[0, :256], 1e-6, True)) < 1e-2
        want_attn = R.decode_attention(*f32(q, kc, vc), lengths, 128**-0.5).to(dtype) * torch.sigmoid(gate)
        assert rel_err(outs[2], want_attn) < 1e-2
        assert (outs[3] == R.sample_tokens(logits, *sargs)[0]).float().mean() >= 0.75
        assert torch.equal(outs[7], R.process_logits(logits, logits > 0, sargs[2], sargs[2], sargs[0])[0])
        ref_gdn["conv_state"], ref_gdn["recurrent_state"] = conv0, rec0
        assert rel_err(outs[4], R.gdn_decode_step(*ref_gdn.values(), 1e-6, 2, 128, 128)) < 1e-2
        want_q = R.attention_prologue(*qkv, *rope, *norms, kc2_ref, vc2_ref, positions, 1e-6, True, True)
        assert rel_err(outs[5], want_q) < 1e-2 and rel_err(kc2, kc2_ref) < 1e-2 and torch.equal(vc2, vc2_ref)
        assert rel_err(outs[6], R.silu_mul(wg, wu)) < 1e-2


def test_dispatch_uses_native_for_eligible_decode_inputs_only():
    x = randn(2, 256, dtype=torch.bfloat16)
    w = randn(64, 256, dtype=torch.bfloat16).requires_grad_()
    assert dispatch.eligible("linear", x, w.detach(), max_rows=dispatch.MAX_ROWS["linear"])
    assert not dispatch.eligible("linear", x, w)  # recording autograd -> reference
    with torch.no_grad():
        assert dispatch.eligible("linear", x, w)
    assert not dispatch.eligible("linear", x.float(), w.float().detach())  # fp32 -> reference
    assert dispatch.backend("linear", torch.bfloat16, "cuda") == "native"
