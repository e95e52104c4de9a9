"""Gated-DeltaNet training on CUDA: the training path (flash-linear-attention's fused chunk kernels, with segki's
dq/dk/dw/dg where fla refuses this Triton) against transformers' torch chunk rule -- outputs and every input
gradient at the Qwen3.5 0.8B and 4B GDN shapes, equal lengths and packed rows -- and padding-free training passes
against padded ones at the 0.8B shape (scores, gradients, one GRPO micro-batch step).

Tolerances (relative norm error): fp32 inputs 5e-3 (fla's matrix products run in tf32), bf16 inputs 2e-2 (fla keeps
bf16 intermediates, the torch rule fp32), as flash-linear-attention's own tests of this rule."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device", allow_module_level=True)

from segki_lightning.ops import varlen
from segki_lightning.ops.gdn_chunk import TORCH, training_path
from segki_lightning.ops.reference import gdn_chunked

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 5e-3, torch.bfloat16: 2e-2}
SHAPES = {"0.8b": (16, 16), "4b": (16, 32)}   # (key heads, value heads), head dims 128


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def gdn_inputs(bsz: int, length: int, hk: int, hv: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=gen)   # noqa: E731
    q, k = rand(bsz, length, hk, 128), rand(bsz, length, hk, 128)
    v = rand(bsz, length, hv, 128)
    g = -torch.nn.functional.softplus(rand(bsz, length, hv)) * 0.5        # fp32 log-decay, as the model's gates
    beta = torch.sigmoid(rand(bsz, length, hv))
    return [t.to(dtype) for t in (q, k, v)] + [g, beta.to(dtype)]


def grads_of(fn, inputs, seed):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    (out.float() * dout).sum().backward()
    return out.detach(), [t.grad for t in inputs]


def test_the_training_path_is_fla():
    assert training_path() != TORCH, training_path()


CASES = [pytest.param(torch.bfloat16, shape, lengths, id=f"bf16-{shape}-{name}") for shape in SHAPES
         for name, lengths in (("equal", None), ("packed", [300, 64, 1, 517, 130]))]
CASES.append(pytest.param(torch.float32, "0.8b", None, id="fp32-0.8b-equal"))


@pytest.mark.parametrize("dtype,shape,lengths", CASES)
def test_fused_gdn_matches_the_torch_rule(dtype, shape, lengths):
    hk, hv = SHAPES[shape]
    seed = int(torch.randint(0, 2**31 - 1, ()))
    if lengths is None:
        inputs, cu = gdn_inputs(2, 333, hk, hv, dtype, seed), None
    else:
        inputs = gdn_inputs(1, sum(lengths), hk, hv, dtype, seed)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    out, grads = grads_of(lambda *t: varlen.gdn_chunk(*t, cu_seqlens=cu), inputs, seed)
    ref_in = [t.double() for t in inputs]

    def torch_rule(*t):   # each row alone, fp64
        if cu is None:
            return gdn_chunked(*t)
        return torch.cat([gdn_chunked(*(x[:, s:e] for x in t)) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)

    want, want_grads = grads_of(torch_rule, ref_in, seed)
    errors = {"out": rel(out, want), **{n: rel(g, w) for n, g, w in zip("qkvgb", grads, want_grads)}}
    assert max(errors.values()) <= TOL[dtype], errors


def test_the_sliced_qk_norm_matches_fla_in_kernel_norm():
    """The training path normalises q/k before fla's chunk rule (one compile for every token count: fla's kernels
    once over every row, or in slices of one bucket): the output and every gradient equal fla's own in-kernel norm
    at more rows (tokens x heads) than one bucket, within a few bf16 roundings of the normalised q/k (the two row
    counts may tune to different block shapes): relative 2e-3, a tenth of the tolerance against the torch rule."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from segki_lightning.ops import train_fused

    seed = int(torch.randint(0, 2**31 - 1, ()))
    length = train_fused.BUCKET_ROWS // 16 + 777                       # 16 key heads: two slices of q and of k
    inputs = gdn_inputs(1, length, 16, 16, torch.bfloat16, seed)
    cu = torch.tensor([0, 1000, length], device="cuda")

    def in_kernel(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]

    out, grads = grads_of(lambda *t: varlen.gdn_chunk(*t, cu_seqlens=cu), inputs, seed)
    want, want_grads = grads_of(in_kernel, inputs, seed)
    errors = {"out": rel(out, want), **{n: rel(g, w) for n, g, w in zip("qkvgb", grads, want_grads)}}
    assert max(errors.values()) <= 2e-3, errors


@pytest.mark.parametrize("norm", ["qk_l2", "gated_output"])
def test_the_one_launch_norms_match_fla_in_slices(norm):
    """The q/k L2 norm and the gated output norm run fla's kernels once each way over every row (their unused bucket
    constant held at 1): output and input gradients equal fla's own functions in slices of one bucket, on strided
    bf16 inputs at more than one bucket of rows, within a few bf16 roundings (the two may tune to different row
    blocks): relative 1e-3. The gated norm's weight gradient, a sum over every row, is rounded to bf16 once here,
    and in fla's slices once per slice and again as the slices' sums are added (the two ~2.5e-3 apart, simulated):
    it is held to the fp32 reference instead, one rounding (4e-3), and no further from it than the slices' (+1e-3).
    The freed memory the outputs land in is poisoned with NaN first."""
    from fla.modules.fused_norm_gate import rms_norm_gated
    from fla.modules.l2norm import l2norm as fla_l2norm

    from segki_lightning.ops import train_fused
    from segki_lightning.ops.reference import gated_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    length = train_fused.BUCKET_ROWS // 16 + 777                       # 16 heads: two buckets of rows
    base = torch.randn(1, length, 3 * 16 * 128, device="cuda", generator=gen).bfloat16()
    dy = torch.randn(1, length, 16, 128, device="cuda", generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(128, device="cuda", generator=gen)).bfloat16()
    if norm == "qk_l2":
        assert train_fused._l2norm_kernels() is not None, "this fla's L2-norm kernels take other arguments"
        forms = {"one launch": lambda x, z, w: train_fused.l2norm(x),
                 "slices": lambda x, z, w: train_fused._by_bucket(fla_l2norm, x)}
    else:
        assert train_fused._gated_norm_kernels() is not None, "this fla's gated-norm kernels take other arguments"
        forms = {"one launch": lambda x, z, w: train_fused._GatedNorm.apply(x, z, w, 1e-6),
                 "slices": lambda x, z, w: train_fused._by_bucket(
                     lambda a, b: rms_norm_gated(a, b, w, None, activation="swish", eps=1e-6), x, z)}
    got = {}
    for name, fn in forms.items():
        torch.full((4 * base.numel(),), float("nan"), device="cuda")    # freed: the outputs' blocks hold NaN
        x, w = base.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        heads = lambda i: x[..., i * 16 * 128:(i + 1) * 16 * 128].unflatten(-1, (16, 128))   # noqa: E731 q|k|v
        out = fn(heads(1), heads(2), w)                                 # strided views, as k and the gate are
        out.backward(dy)
        got[name] = (out.detach(), x.grad[..., 16 * 128:], w.grad)
    (a, da, wa), (b, db, wb) = got["one launch"], got["slices"]
    assert torch.isfinite(a).all() and torch.isfinite(da).all()
    assert rel(a, b) <= 1e-3 and rel(da, db) <= 1e-3, (rel(a, b), rel(da, db))
    if norm == "gated_output":
        x, w = base.float().requires_grad_(True), weight.float().requires_grad_(True)
        gated_rms_norm(x[..., 16 * 128:2 * 16 * 128].unflatten(-1, (16, 128)),
                       x[..., 2 * 16 * 128:].unflatten(-1, (16, 128)), w, 1e-6).backward(dy.float())
        assert rel(wa, w.grad) <= 4e-3 and rel(wa, w.grad) <= rel(wb, w.grad) + 1e-3, (rel(wa, w.grad),
                                                                                      rel(wb, w.grad))


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_dqkwg_equals_the_eager_one(shape, monkeypatch):
    """segki's dq/dk/dw/dg compiled (the default on CUDA) against the same function eager, bf16 packed rows at the
    0.8B and 4B GDN shapes: the same products, only the element-wise passes fused (fp32 reduction order apart)."""
    from segki_lightning.ops import gdn_chunk

    hk, hv = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    rand = lambda *s, dtype=torch.bfloat16: torch.randn(*s, device="cuda", generator=gen).to(dtype)   # noqa: E731
    lengths = [300, 64, 1, 517, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    t = sum(lengths)
    pos, valid = gdn_chunk.chunk_positions(1, t, 64, cu, None, torch.device("cuda"))
    nc = pos.shape[0]
    q, k = (torch.nn.functional.normalize(rand(1, t, hk, 128).float(), dim=-1).bfloat16() for _ in range(2))
    v, do, dv, w = (rand(1, t, hv, 128) for _ in range(4))
    h, dh = (rand(nc, hv, 128, 128) * 0.1 for _ in range(2))
    g = -torch.rand(1, t, hv, device="cuda", generator=gen).cumsum(1) * 0.02
    src = valid.reshape(-1).nonzero()[:, 0]
    args = (q, k, v, do, h, dh, w, g, dv, pos, valid, src, pos.reshape(-1)[src], 128 ** -0.5, False)
    want = gdn_chunk._dqkwg_math(*args)
    monkeypatch.setenv(gdn_chunk.COMPILE_SWITCH, "1")
    got = gdn_chunk._math_on(q.device)(*args)
    assert gdn_chunk._compiled and gdn_chunk._compiled[0] is not None, "the compiled function fell back to eager"
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel(a, b) <= 1e-2, (name, rel(a, b))


def test_a_grpo_step_packed_equals_padded_at_the_0_8b_shape():
    """Four layers of the Qwen3.5-0.8B shape (3 GDN + 1 attention, segki injected), five rows of 38-600 real
    tokens: the packed bf16 pass's log-probs and GRPO-loss parameter gradients against the padded one's, each judged
    by its distance from the padded fp32 step (``grpo_step.judge``)."""
    from segki_lightning.rl.logprobs import packs

    from . import grpo_step

    fp32, bf16 = grpo_step.models(0)
    assert packs(bf16, injected=True)
    gen = torch.Generator().manual_seed(1)
    prompt = [int(n) for n in torch.randint(8, 40, (5,), generator=gen)]
    completion = [int(n) for n in torch.randint(30, 560, (5,), generator=gen)]
    inputs, adv = grpo_step.batch(prompt, completion, 2)
    lp_t, old, truth = grpo_step.step(fp32, inputs, adv, packed=False)
    lp_pad, _, g_pad = grpo_step.step(bf16, inputs, adv, packed=False, old=old)
    lp_pack, _, g_pack = grpo_step.step(bf16, inputs, adv, packed=True, old=old)
    assert rel(lp_pack, lp_pad) <= 2e-2
    grpo_step.judge(truth, g_pad, g_pack)
