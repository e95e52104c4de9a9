"""flash-linear-attention's fused training kernels (``SEGKI_TRAIN_FUSED=1``) against the reference compositions
they replace: outputs and gradients of each op in bf16 at the Qwen3.5 0.8B widths (packed rows for the conv), and
one GRPO-loss step of four 0.8B-shape layers. Tolerances (relative norm error): outputs 1e-2, gradients 2e-2 per
op (one rounding against several), 5e-2 for the step's parameter gradients (four layers, as the packed-vs-padded
test)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device", allow_module_level=True)

from segki_lightning.ops import dispatch, train_fused, varlen

pytestmark = pytest.mark.gpu


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def both(monkeypatch, fn, inputs):
    """``fn``'s output and input gradients with the switch off (reference) and on (fused)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    res = []
    for on in ("0", "1"):
        monkeypatch.setenv(train_fused.SWITCH, on)
        xs = [t.detach().clone().requires_grad_(True) for t in inputs]
        out = fn(*xs)
        out = torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out
        dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
        (out.float() * dout).sum().backward()
        res.append((out.detach(), [x.grad for x in xs]))
    assert train_fused.active(torch.zeros(1, device="cuda", requires_grad=True)), "fla's kernels did not run"
    return res


def randn(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda").to(dtype)


OPS = {
    "rms_norm": (lambda x, w: dispatch.rms_norm(x, w, 1e-6, True), lambda: [randn(2, 600, 1024), randn(1024) * 0.1]),
    "add_rms_norm": (lambda x, r, w: dispatch.add_rms_norm(x, r, w, 1e-6, True),
                     lambda: [randn(2, 600, 1024), randn(2, 600, 1024), randn(1024) * 0.1]),
    "gated_rms_norm": (lambda x, z, w: dispatch.gated_rms_norm(x, z, w, 1e-6),
                       lambda: [randn(1, 600, 16, 128), randn(1, 600, 16, 128), 1 + randn(128) * 0.1]),
    "silu_mul": (lambda g, u: dispatch.silu_mul(g, u), lambda: [randn(1200, 3584), randn(1200, 3584)]),
    "conv_packed": (lambda x, w, b: varlen.causal_conv_silu(x, w, b, torch.tensor([0, 300, 364, 365, 882],
                                                                                  device="cuda")),
                    lambda: [randn(1, 882, 6144), randn(6144, 1, 4) * 0.5, None]),
}


@pytest.mark.parametrize("name", list(OPS))
def test_fused_training_op_matches_the_reference(monkeypatch, name):
    fn, make = OPS[name]
    inputs = make()
    if name == "conv_packed":   # no bias in Qwen3.5's conv
        fn0 = fn
        fn, inputs = (lambda x, w: fn0(x, w, None)), inputs[:2]
    (ref, g_ref), (got, g_got) = both(monkeypatch, fn, inputs)
    assert rel(got, ref) <= 1e-2
    for a, b in zip(g_got, g_ref):
        assert rel(a, b) <= 2e-2


def test_a_grpo_step_fused_equals_reference_at_the_0_8b_shape(monkeypatch):
    from transformers import Qwen3_5ForCausalLM

    from segki_lightning.inject import apply_segment_ki
    from segki_lightning.rl import GRPOConfig
    from segki_lightning.rl.logprobs import completion_logprobs
    from segki_lightning.rl.losses import Totals, grpo_loss

    from ..tiny_models import qwen35_config

    cfg = qwen35_config(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                        linear_value_head_dim=128, vocab_size=4096)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).cuda().train()
    apply_segment_ki(model)
    model.activation_checkpointing_enable({"use_reentrant": False})
    prompt, completion = [12, 30, 8], [400, 57, 590]
    pm = torch.zeros(3, max(prompt), dtype=torch.long)
    cm = torch.zeros(3, max(completion), dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompt, completion)):
        pm[r, -p:], cm[r, :c] = 1, 1
    batch = [t.cuda() for t in (torch.randint(2, 4096, pm.shape) * pm, pm, torch.randint(2, 4096, cm.shape) * cm, cm)]
    adv, mask = torch.randn(3, device="cuda"), batch[3]
    results = {}
    for on in ("0", "1"):
        monkeypatch.setenv(train_fused.SWITCH, on)
        model.zero_grad()
        with torch.no_grad():
            old = completion_logprobs(model, *batch, packed=True).logp   # the scoring pass, fused as the update
        s = completion_logprobs(model, *batch, packed=True)
        grpo_loss(s.logp, old, None, adv, mask, GRPOConfig(), Totals.of(mask))[0].backward()
        results[on] = (old, s.logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (old0, lp0, g0), (old1, lp1, g1) = results["0"], results["1"]
    assert rel(old1, lp1) <= 1e-2   # the no-grad scoring pass takes the fused kernels too
    assert rel(lp1, lp0) <= 2e-2
    worst = max((rel(g1[n], g0[n]), n) for n in g0 if g0[n].norm() > 0)
    assert worst[0] <= 5e-2, worst
