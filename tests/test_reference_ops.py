"""Each reference op against the transformers module (or the textbook formula) it specifies."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from segki_lightning.ops import reference as R

from .tiny_models import qwen35_config

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_unit_offset_is_qwen35_norm_exactly(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    norm = Qwen3_5RMSNorm(48, eps=1e-6)
    norm.weight.data = rand(48, scale=0.3)
    norm.to(dtype)
    x = rand(2, 5, 48, dtype=dtype)
    assert torch.equal(R.rms_norm(x, norm.weight, norm.eps, unit_offset=True), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_plain_is_llama_norm_exactly(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-5)
    norm.weight.data = 1 + rand(48, scale=0.3)
    norm.to(dtype)
    x = rand(2, 5, 48, dtype=dtype)
    assert torch.equal(R.rms_norm(x, norm.weight, norm.variance_epsilon, unit_offset=False), norm(x))


@pytest.mark.parametrize("unit_offset", [False, True])
def test_add_rms_norm_returns_normed_sum_and_sum(unit_offset):
    x, res, w = rand(3, 4, 32), rand(3, 4, 32), rand(32)
    normed, new_res = R.add_rms_norm(x, res, w, 1e-6, unit_offset)
    assert torch.equal(new_res, res + x)
    assert torch.equal(normed, R.rms_norm(res + x, w, 1e-6, unit_offset))


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_add_rms_norm_of_sums_is_the_rounded_sum_in_part_order_then_add_rms_norm(parts):
    """x given as fp32 sums in parts (a projection's segments of K): added from the first part on, rounded to the
    residual's dtype, then the residual add + norm; the sums reference adds up to the fp32 product."""
    sums, res, w = rand(parts, 3, 32, scale=4.0), rand(3, 32, dtype=torch.bfloat16), rand(32, dtype=torch.bfloat16)
    x = sums[0]
    for p in sums[1:]:
        x = x + p
    got = R.add_rms_norm_sums(sums, res, w, 1e-6, True)
    want = R.add_rms_norm(x.bfloat16(), res, w, 1e-6, True)
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, v) for g, v in zip(got, want))
    xs, ws = rand(3, 64, dtype=torch.bfloat16), rand(32, 64, dtype=torch.bfloat16)
    assert torch.equal(R.skinny_linear_sums(xs, ws), F.linear(xs.float(), ws.float())[None])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_is_qwen35_gated_norm_exactly(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(16, eps=1e-6)
    norm.weight.data = 1 + rand(16, scale=0.3)
    norm.to(dtype)
    x, z = rand(10, 16, dtype=dtype), rand(10, 16, dtype=dtype)
    assert torch.equal(R.gated_rms_norm(x, z, norm.weight, 1e-6), norm(x, z))


def test_projection_family_equals_separate_linears():
    x = rand(2, 3, 40)
    wg, wu, wq, wk, wv = (rand(n, 40) for n in (24, 24, 32, 16, 16))
    bq, bk, bv = rand(32), rand(16), rand(16)
    torch.testing.assert_close(R.gated_mlp_front(x, wg, wu), F.silu(x @ wg.T) * (x @ wu.T))
    for got, want in zip(R.qkv_proj(x, wq, wk, wv, bq, bk, bv), (x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv)):
        torch.testing.assert_close(got, want)
    ws = [rand(n, 40) for n in (48, 16, 4, 4)]
    for got, w in zip(R.gdn_in_proj(x, *ws), ws):
        torch.testing.assert_close(got, x @ w.T)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
def test_the_projections_norm_prologue_is_the_norm_then_the_projection(unit_offset):
    """norm_w / norm_eps / norm_unit_offset: the projection of ``rms_norm(x)``, exactly."""
    x, nw = rand(3, 40), rand(40)
    xn = R.rms_norm(x, nw, 1e-6, unit_offset)
    norm = dict(norm_w=nw, norm_eps=1e-6, norm_unit_offset=unit_offset)
    wg, wu = rand(24, 40), rand(24, 40)
    assert torch.equal(R.gated_mlp_front(x, wg, wu, **norm), R.gated_mlp_front(xn, wg, wu))
    wq, bq = [rand(32, 40), rand(16, 40), rand(16, 40)], [rand(32), None, rand(16)]
    for got, want in zip(R.qkv_proj(x, *wq, *bq, **norm), R.qkv_proj(xn, *wq, *bq)):
        assert torch.equal(got, want)
    ws = [rand(n, 40) for n in (48, 16, 4, 4)]
    for got, want in zip(R.gdn_in_proj(x, *ws, **norm), R.gdn_in_proj(xn, *ws)):
        assert torch.equal(got, want)
    state, cw, cb = rand(3, 48, 4), rand(48, 4), rand(48)
    s1, s2 = state.clone(), state.clone()
    for got, want in zip(R.gdn_in_proj_conv(x, *ws, s1, cw, cb, **norm), R.gdn_in_proj_conv(xn, *ws, s2, cw, cb)):
        assert torch.equal(got, want)
    assert torch.equal(s1, s2)


def test_gdn_gates_match_the_module_formula_and_stay_finite():
    a, b = rand(4, 8, scale=30.0), rand(4, 8)
    a_log, dt_bias = rand(8), rand(8)
    g, beta = R.gdn_gates(a, b, a_log, dt_bias)
    assert torch.equal(beta, b.sigmoid())
    assert torch.equal(g, -a_log.float().exp() * F.softplus(a.float() + dt_bias))
    big = torch.full((1, 8), 1e4)
    assert torch.isfinite(R.gdn_gates(big, big, a_log, dt_bias)[0]).all()


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 64), (8, 8, 128), (16, 4, 256)])
def test_decode_attention_reads_only_valid_positions(hq, hkv, d):
    b, s = 3, 20
    q, k, v = rand(b, hq, d), rand(b, hkv, s, d), rand(b, hkv, s, d)
    lengths = torch.tensor([1, 7, 20])
    out = R.decode_attention(q, k, v, lengths, d**-0.5)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    for i, n in enumerate(lengths.tolist()):
        poisoned_k[i, :, n:] = float("nan")
        poisoned_v[i, :, n:] = float("nan")
    assert torch.equal(R.decode_attention(q, poisoned_k, poisoned_v, lengths, d**-0.5), out)
    for i, n in enumerate(lengths.tolist()):  # textbook attention on the valid prefix, KV heads repeated
        kk = k[i, :, :n].repeat_interleave(hq // hkv, 0)
        vv = v[i, :, :n].repeat_interleave(hq // hkv, 0)
        want = torch.softmax((q[i, :, None] @ kk.transpose(-1, -2)) * d**-0.5, -1) @ vv
        torch.testing.assert_close(out[i], want[:, 0], rtol=1e-5, atol=1e-5)


def test_gdn_decode_step_matches_transformers_cached_step():
    """Prefill the transformers module with a cache, then compare one cached token against ours (states
    taken from the same cache before the step), both as projection + decode step and as projection-with-conv +
    recurrent step (the split the native path takes at one row)."""
    from transformers import DynamicCache
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    cfg = qwen35_config()
    gdn = Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for p in gdn.parameters():
            p.copy_(torch.randn_like(p) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
        cache = DynamicCache(config=cfg)
        gdn(rand(2, 6, 64), cache=cache)
        conv_state = cache.get_conv_state(0).clone()
        rec_state = cache.get_recurrent_state(0).clone().float()
        conv_split, rec_split = conv_state.clone(), rec_state.clone()
        x = rand(2, 1, 64)
        want = gdn(x, cache=cache)
        ws = (gdn.in_proj_qkv.weight, gdn.in_proj_z.weight, gdn.in_proj_b.weight, gdn.in_proj_a.weight)
        tail = (gdn.A_log, gdn.dt_bias, gdn.norm.weight, gdn.norm.variance_epsilon, gdn.num_k_heads, gdn.head_k_dim,
                gdn.head_v_dim)
        qkv, z, b, a = R.gdn_in_proj(x[:, 0], *ws)
        out = R.gdn_decode_step(qkv, z, b, a, conv_state, gdn.conv1d.weight[:, 0], gdn.conv1d.bias, rec_state,
                                *tail)
        mixed, z, b, a = R.gdn_in_proj_conv(x[:, 0], *ws, conv_split, gdn.conv1d.weight[:, 0], gdn.conv1d.bias)
        split = R.gdn_recurrent_step(mixed, z, b, a, rec_split, *tail)
        got = R.linear(out, gdn.out_proj.weight)
    torch.testing.assert_close(got, want[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_state, cache.get_conv_state(0), rtol=0, atol=0)
    torch.testing.assert_close(rec_state, cache.get_recurrent_state(0).float(), rtol=1e-5, atol=1e-5)
    for a_, b_ in ((split, out), (conv_split, conv_state), (rec_split, rec_state)):
        assert torch.equal(a_, b_)


def test_gdn_recurrence_matches_transformers_chunked_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k = rand(2, 70, 2, 16), rand(2, 70, 2, 16)
    v = rand(2, 70, 4, 16)
    g, beta = -torch.rand(2, 70, 4), torch.rand(2, 70, 4)
    want, want_state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
    got, state = R.gdn_recurrence(q, k, v, g, beta)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)


def test_gdn_chunked_equals_the_recurrence_in_values_and_gradients():
    t = 70  # more than one 64-token chunk
    leaves = [rand(2, t, 2, 16), rand(2, t, 2, 16), rand(2, t, 4, 16), -torch.rand(2, t, 4), torch.rand(2, t, 4)]
    grads = []
    for fn in (lambda *a: R.gdn_recurrence(*a)[0], R.gdn_chunked):
        xs = [x.clone().requires_grad_() for x in leaves]
        out = fn(*xs)
        out.backward(torch.ones_like(out))
        grads.append((out.detach(), [x.grad for x in xs]))
    (want, want_grads), (got, got_grads) = grads
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for g_got, g_want in zip(got_grads, want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-3, atol=1e-4)


# -------------------------------------------------------------------------------------------- sampling
def _sampling_args(b, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    return (torch.full((b,), float(temperature)), torch.full((b,), top_k, dtype=torch.int64),
            torch.full((b,), float(top_p)), torch.arange(b, dtype=torch.int64) + seed * 1000,
            torch.zeros(b, dtype=torch.int64))


def test_greedy_and_top_k_1_are_argmax():
    logits = rand(5, 300)
    for args in (_sampling_args(5, temperature=0.0), _sampling_args(5, top_k=1)):
        tokens, _ = R.sample_tokens(logits, *args)
        assert torch.equal(tokens, logits.argmax(-1))


def test_sampling_is_a_pure_function_of_seed_and_offset():
    logits = rand(4, 1000)
    a = R.sample_tokens(logits, *_sampling_args(4, seed=1))[0]
    b = R.sample_tokens(logits, *_sampling_args(4, seed=1))[0]
    c = torch.stack([R.sample_tokens(logits, *_sampling_args(4, seed=s))[0] for s in range(2, 12)])
    assert torch.equal(a, b)
    assert (c != a).any()


def test_uniform_noise_is_uniform_and_in_open_interval():
    u = R.uniform_noise(torch.tensor([7, 8]), torch.tensor([0, 3]), 200_000)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    assert not torch.equal(u[0], u[1])


def test_temperature_sampling_matches_softmax_distribution():
    """Chi-square test on a 6-token vocabulary, 60k draws (one row each, fixed seeds)."""
    n, temp = 60_000, 0.7
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0]).expand(n, 6)
    args = _sampling_args(n, temperature=temp)
    tokens, logprobs = R.sample_tokens(logits, *args)
    expected = torch.softmax(logits[0] / temp, -1) * n
    observed = torch.bincount(tokens, minlength=6).float()
    chi2 = (((observed - expected) ** 2) / expected).sum().item()
    assert chi2 < 20.5  # p = 0.001 for 5 degrees of freedom
    torch.testing.assert_close(logprobs, torch.log_softmax(logits / temp, -1).gather(-1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (4, 0.5)])
def test_top_k_top_p_keep_the_same_tokens_as_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    n = 4000
    logits = rand(1, 12, scale=2.0).expand(n, 12).contiguous()
    allowed = logits[:1].clone()
    if top_k:
        allowed = TopKLogitsWarper(top_k)(None, allowed)
    if top_p < 1.0:
        allowed = TopPLogitsWarper(top_p)(None, allowed)
    keep = torch.isfinite(allowed[0])
    tokens, _ = R.sample_tokens(logits, *_sampling_args(n, top_k=top_k, top_p=top_p))
    seen = torch.zeros(12, dtype=torch.bool)
    seen[tokens.unique()] = True
    assert torch.equal(seen, keep)


def test_top_p_keeps_every_token_tied_with_the_boundary_in_any_order():
    """Half-precision logits tie often; at the top-p boundary a tied group is kept whole (the native kernel's
    bisection on values does this), so which tokens survive does not depend on their order in the vocabulary.
    Probabilities of [2, 1, 1, 0]: 0.53, 0.20, 0.20, 0.07; at top_p 0.6 both 1s are kept."""
    from segki_lightning.ops.reference.sampling import _filter_top_p

    base = torch.tensor([2.0, 1.0, 1.0, 0.0])
    for _ in range(4):
        perm = torch.randperm(4)
        kept = torch.isfinite(_filter_top_p(base[perm][None], torch.tensor([0.6])))[0]
        assert torch.equal(kept, base[perm] >= 1.0)
    row = rand(1, 1000).half().float()   # many exact ties
    kept = torch.isfinite(_filter_top_p(row, torch.tensor([0.37])))[0]
    edge = row[0][kept].min()
    assert torch.equal(kept, row[0] >= edge)                         # a value threshold: ties kept whole
    probs = torch.softmax(row[0], -1)
    assert probs[row[0] > edge].sum() < 0.37 <= probs[row[0] >= edge].sum()


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prologue_is_qwen35_attention_code_exactly(dtype):
    """q/k norm, partial rotate-half RoPE and the cache write as Qwen3.5's attention forward does them,
    from the same q_proj/k_proj/v_proj outputs, bit for bit; the gate is applied after attention."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, apply_rotary_pos_emb

    b, hq, hkv, d, r, s = 3, 4, 2, 16, 4, 9
    q_and_gate, k, v = rand(b, hq * 2 * d, dtype=dtype), rand(b, hkv * d, dtype=dtype), rand(b, hkv * d, dtype=dtype)
    angles = torch.rand(b, 1, r // 2) * 20
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))   # [B, 1, R]
    q_norm, k_norm = Qwen3_5RMSNorm(d, eps=1e-6), Qwen3_5RMSNorm(d, eps=1e-6)
    for n in (q_norm, k_norm):
        n.weight.data = rand(d, scale=0.3)
        n.to(dtype)
    positions = torch.randint(0, s, (b,))
    k_cache, v_cache = rand(b, hkv, s, d, dtype=dtype), rand(b, hkv, s, d, dtype=dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()

    query, gate = torch.chunk(q_and_gate.view(b, 1, hq, 2 * d), 2, dim=-1)          # the model's own code
    query = q_norm(query).transpose(1, 2)
    key = k_norm(k.view(b, 1, hkv, d)).transpose(1, 2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    rows = torch.arange(b)
    want_k[rows, :, positions] = key[:, :, 0]
    want_v[rows, :, positions] = v.view(b, hkv, d)

    got = R.attention_prologue(q_and_gate, k, v, cos[:, 0], sin[:, 0], q_norm.weight, k_norm.weight, k_cache,
                               v_cache, positions, 1e-6, True, True)
    assert torch.equal(got, query[:, :, 0])
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    lengths = positions + 1
    attn = R.decode_attention(got, k_cache, v_cache, lengths, d**-0.5, gate.reshape(b, hq, d))
    assert torch.equal(attn, R.decode_attention(got, k_cache, v_cache, lengths, d**-0.5)
                       * torch.sigmoid(gate.reshape(b, hq, d)))
    # the whole step from the same projections: the gate is the second half of each head's q_proj columns
    step_k, step_v = want_k.clone(), want_v.clone()
    step_k[rows, :, positions] = float("nan")    # the step writes the new token before attending over it
    step_v[rows, :, positions] = float("nan")
    step = R.decode_attention_step(q_and_gate, k, v, cos[:, 0], sin[:, 0], q_norm.weight, k_norm.weight, step_k,
                                   step_v, positions, lengths, 1e-6, True, True, d**-0.5)
    assert torch.equal(step, attn)
    assert torch.equal(step_k, want_k) and torch.equal(step_v, want_v)


@pytest.mark.parametrize("advance", [False, True], ids=["prefill", "decode_step"])
def test_record_tokens_writes_each_rows_token_and_advances(advance):
    """``record_tokens`` against a row-by-row reading of its contract: a finished row records pad / 0 / mask 0,
    a row that records an EOS id finishes, and a decode step (``lengths`` given) moves offset and lengths on."""
    from .tiny_models import decode_bookkeeping

    pad = 0
    got = decode_bookkeeping(rows=37, cols=11)
    want = {k: v.clone() for k, v in got.items()}
    R.record_tokens(**{**got, "lengths": got["lengths"] if advance else None}, pad=pad)
    for b in range(37):
        done, c = bool(want["finished"][b]), int(want["offset"][b])
        t = pad if done else int(want["tok"][b])
        want["out_tokens"][b, c], want["out_mask"][b, c] = t, int(not done)
        want["out_logprobs"][b, c] = 0.0 if done else want["lp"][b]
        want["finished"][b] = done or t in want["eos"].tolist()
        want["token"][b] = t
        if advance:
            want["offset"][b] += 1
            want["lengths"][b] += 1
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, equal_nan=True, msg=k)
