"""flash-linear-attention's fused training kernels (``SEGKI_TRAIN_FUSED=1``) against the reference compositions
they replace: outputs and gradients of each op in bf16 at the Qwen3.5 0.8B widths (packed rows for the conv), and
one GRPO-loss step of four 0.8B-shape layers. Tolerances (relative norm error): outputs 1e-2, gradients 2e-2 per
op (one rounding against several); the step's parameter gradients judged against the fp32 step's
(``grpo_step.judge``: no farther from them than the reference bf16 path)."""
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
                       lambda: [randn(1, 5000, 16, 128), randn(1, 5000, 16, 128), 1 + randn(128) * 0.1]),
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
    """Log-probs within bf16 rounding of the reference path's; each parameter gradient no farther from the fp32
    step's than the reference bf16 path is (``grpo_step.judge``); the no-grad scoring pass fused as the update."""
    from . import grpo_step

    fp32, bf16 = grpo_step.models(int(torch.randint(0, 2**31 - 1, ())))
    for m in (fp32, bf16):
        m.activation_checkpointing_enable({"use_reentrant": False})
    inputs, adv = grpo_step.batch([12, 30, 8], [400, 57, 590], int(torch.randint(0, 2**31 - 1, ())))
    monkeypatch.setenv(train_fused.SWITCH, "0")
    lp_t, old_t, truth = grpo_step.step(fp32, inputs, adv, packed=True)
    lp0, _, g0 = grpo_step.step(bf16, inputs, adv, packed=True, old=old_t)
    monkeypatch.setenv(train_fused.SWITCH, "1")
    lp1, old1, g1 = grpo_step.step(bf16, inputs, adv, packed=True)
    assert rel(old1, lp1) <= 1e-2   # the no-grad scoring pass takes the fused kernels too
    assert rel(lp1, lp_t) <= 2 * rel(lp0, lp_t) + 1e-2
    g1 = grpo_step.step(bf16, inputs, adv, packed=True, old=old_t)[2]   # the update against the same old log-probs
    grpo_step.judge(truth, g0, g1)
