"""The fused training kernels' gate (segki_lightning.ops.train_fused): they run only on CUDA with the switch on and
gradients recorded or inside a scoring pass; on CPU the ops stay the references, switch or not. Their numerics are
checked on a GPU (tests/gpu/test_train_fused_gpu.py)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from segki_lightning.ops import reference, train_fused
from segki_lightning.ops import dispatch
from segki_lightning.ops.switches import check_switches


def test_on_by_default_off_by_the_switch_and_never_on_cpu(monkeypatch):
    x = torch.randn(4, 8, requires_grad=True)
    monkeypatch.delenv(train_fused.SWITCH, raising=False)
    assert train_fused.enabled() and not train_fused.active(x)
    monkeypatch.setenv(train_fused.SWITCH, "0")
    assert not train_fused.enabled()
    monkeypatch.setenv(train_fused.SWITCH, "1")
    assert not train_fused.active(x)
    with train_fused.scoring():
        assert not train_fused.active(x.detach())


def test_the_switch_is_checked():
    check_switches({"SEGKI_TRAIN_FUSED": "1"})
    with pytest.raises(ValueError, match="SEGKI_TRAIN_FUSED='yes'"):
        check_switches({"SEGKI_TRAIN_FUSED": "yes"})


def test_scoring_scopes_nest_and_unwind():
    assert train_fused._SCORING[0] == 0
    with pytest.raises(RuntimeError):
        with train_fused.scoring():
            with train_fused.scoring():
                assert train_fused._SCORING[0] == 2
            raise RuntimeError("a pass that fails")
    assert train_fused._SCORING[0] == 0


def test_cpu_training_ops_are_the_references_with_the_switch_on(monkeypatch):
    monkeypatch.setenv(train_fused.SWITCH, "1")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x, r, z = (torch.randn(3, 5, 16, generator=gen, requires_grad=True) for _ in range(3))
    w = torch.randn(16, generator=gen, requires_grad=True)
    assert torch.equal(dispatch.rms_norm(x, w, 1e-6, True), reference.rms_norm(x, w, 1e-6, True))
    for a, b in zip(dispatch.add_rms_norm(x, r, w, 1e-6, True), reference.add_rms_norm(x, r, w, 1e-6, True)):
        assert torch.equal(a, b)
    assert torch.equal(dispatch.gated_rms_norm(x, z, w, 1e-6), reference.gated_rms_norm(x, z, w, 1e-6))
    assert torch.equal(dispatch.silu_mul(x, z), reference.silu_mul(x, z))


def test_the_row_wise_norms_run_in_slices_of_one_compile_bucket(monkeypatch):
    """fla's narrow norms compile per ceil(rows / bucket): every call they get has at most one bucket of rows, and
    the slices' outputs land where the rows were (checked with the references standing in for fla's kernels)."""
    import sys
    import types

    calls = []

    def gated(x, z, weight, bias, activation, eps):
        calls.append(("gated", x.shape[0]))
        assert x.dim() == 2 and bias is None and activation == "swish"
        return reference.gated_rms_norm(x, z, weight, eps)

    def l2(x):
        calls.append(("l2", x.shape[0]))
        assert x.dim() == 2
        return reference.l2norm(x)

    for name in ("fla", "fla.modules"):   # fla's own package needs Triton; stand-in modules are enough here
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.fused_norm_gate", types.SimpleNamespace(rms_norm_gated=gated))
    monkeypatch.setitem(sys.modules, "fla.modules.l2norm", types.SimpleNamespace(l2norm=l2))
    monkeypatch.setattr(train_fused, "BUCKET_ROWS", 64)
    monkeypatch.setattr(train_fused, "_l2norm_kernels", lambda: None)   # an fla whose kernels take other arguments
    monkeypatch.setattr(train_fused, "_gated_norm_kernels", lambda: None)
    x, z = torch.randn(1, 37, 4, 8), torch.randn(1, 37, 4, 8)   # 148 rows of 8
    w = torch.randn(8)
    assert torch.equal(train_fused.gated_rms_norm(x, z, w, 1e-6), reference.gated_rms_norm(x, z, w, 1e-6))
    q = torch.randn(1, 37, 12, requires_grad=True)[..., 4:].unflatten(-1, (1, 8))   # a strided view, as q/k are
    got = train_fused.l2norm(q)
    assert got.shape == q.shape and torch.equal(got, reference.l2norm(q))
    assert calls == [("gated", 64), ("gated", 64), ("gated", 20), ("l2", 37)]
    q = torch.randn(2, 40, 2, 8)
    assert torch.equal(train_fused.l2norm(q), reference.l2norm(q)) and calls[4:] == [("l2", 64), ("l2", 64), ("l2", 32)]


class _FakeKernel:
    """Stands in for an fla Triton kernel: ``kernel[grid](**args)`` checks the launch (every argument fla 0.6's
    kernel takes but those its autotuner and heuristics fill in, ``NB`` held at 1, a grid covering every row: at a
    block of 16 rows, or programs of ``BS`` rows each) and runs the reference math on the arguments it reads."""

    def __init__(self, names, math, filled=("BT",)):
        self.arg_names, self.math, self.filled, self.launches = [*names], math, {*filled}, []

    def __getitem__(self, grid):
        def launch(**args):
            assert set(args) | self.filled == set(self.arg_names) and not set(args) & self.filled
            assert args["NB"] == 1 and args.get("eps", 1e-6) == 1e-6 and args["BD"] >= args["D"]
            t = args["T"]
            assert grid({"BT": 16}) == (-(-t // 16),) if callable(grid) else grid[0] * args["BS"] >= t > (
                grid[0] - 1) * args["BS"]
            self.launches.append(t)
            self.math(**{k: v for k, v in args.items() if k in self.math.__code__.co_varnames})
        return launch


def _l2_fwd(x, y, rstd, eps, T, D, BD, NB):
    r = torch.rsqrt(x.pow(2).sum(-1) + eps)                                           # [T]
    y.copy_(x * r[:, None])
    rstd.copy_(r)


def _l2_bwd(y, rstd, dy, dx, eps, T, D, BD, NB):
    dx.copy_(dy * rstd[:, None] - (dy * y).sum(-1, keepdim=True) * y * rstd[:, None])


def test_the_qk_l2_norm_is_one_launch_each_way_over_every_row(monkeypatch):
    """Where fla's kernels take fla 0.6's arguments, the q/k L2 norm is one forward and one backward launch over
    all rows (NB held at 1: one compile for every token count), a strided q/k view made contiguous, and its value
    and gradient those of the reference (fp64 rows, the 1 / norm in fp32 as fla keeps it; the fake kernels run the
    reference math)."""
    import types

    fwd = _FakeKernel(train_fused._L2NORM_ARGS[0], _l2_fwd)
    bwd = _FakeKernel(train_fused._L2NORM_ARGS[1], _l2_bwd)
    fake_triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b),
                                        next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    monkeypatch.setattr(train_fused, "_l2norm_kernels", lambda: (fake_triton, fwd, bwd))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    base = torch.randn(1, 37, 3 * 12, dtype=torch.float64, generator=gen, requires_grad=True)
    q = base[..., 12:].unflatten(-1, (2, 12))                                          # [1, 37, 2, 12] strided
    got = train_fused.l2norm(q)
    want = reference.l2norm(q)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)                      # 1 / norm kept in fp32, as fla
    dy = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    g_got, = torch.autograd.grad(got, base, dy)
    g_want, = torch.autograd.grad(want, base, dy)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-7)
    assert fwd.launches == [74] and bwd.launches == [74]                               # 37 tokens x 2 heads, once


def _gated_fwd(x, g, y, w, rstd, eps, ACTIVATION, IS_RMS_NORM):
    assert ACTIVATION == "swish" and IS_RMS_NORM
    r = torch.rsqrt(x.float().pow(2).mean(-1) + eps)                                  # [T] fp32, as fla keeps it
    y.copy_(x * r[:, None] * w * torch.nn.functional.silu(g))
    rstd.copy_(r)


def _gated_bwd(x, g, w, dy, dx, dg, dw, rstd, T, BS):
    xhat = x * rstd[:, None]                                                           # [T, D]
    dg.copy_(dy * xhat * w * torch.sigmoid(g) * (1 + g * (1 - torch.sigmoid(g))))
    dyg = dy * torch.nn.functional.silu(g)
    dwx = dyg * w
    dx.copy_((dwx - xhat * (xhat * dwx).mean(-1, keepdim=True)) * rstd[:, None])
    for i in range(dw.shape[0]):                                                       # each program's rows
        dw[i] = (dyg * xhat)[i * BS:(i + 1) * BS].sum(0)


def test_the_gated_output_norm_is_one_launch_each_way_over_every_row(monkeypatch):
    """Where fla's kernels take fla 0.6's arguments, the Gated-DeltaNet output norm is one forward and one backward
    launch over all rows (NB held at 1), the backward as one program per SM at most (its dw partial sums added);
    its value and gradients (x, z, weight) those of the reference (fp64 rows; the fake kernels run fla's math)."""
    import types

    fwd = _FakeKernel(train_fused._GATED_NORM_ARGS[0], _gated_fwd,
                      ("BT", "STORE_RESIDUAL_OUT", "HAS_RESIDUAL", "HAS_WEIGHT", "HAS_BIAS"))
    bwd = _FakeKernel(train_fused._GATED_NORM_ARGS[1], _gated_bwd,
                      ("BT", "HAS_DRESIDUAL", "HAS_WEIGHT", "HAS_BIAS", "RECOMPUTE_OUTPUT"))
    fake_triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b),
                                        next_power_of_2=lambda n: 1 << (n - 1).bit_length())
    monkeypatch.setattr(train_fused, "_gated_norm_kernels", lambda: (fake_triton, fwd, bwd))
    monkeypatch.setattr(train_fused, "GATED_ONE_LAUNCH", True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(multi_processor_count=7))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    base = torch.randn(1, 37, 2 * 3 * 12, dtype=torch.float64, generator=gen, requires_grad=True)
    x = base[..., :36].unflatten(-1, (3, 12))                                         # [1, 37, 3, 12] strided
    z = base[..., 36:].unflatten(-1, (3, 12))
    w = torch.randn(12, dtype=torch.float64, generator=gen, requires_grad=True)
    got = train_fused.gated_rms_norm(x, z, w, 1e-6)
    want = reference.gated_rms_norm(x, z, w, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)                      # 1 / rms kept in fp32, as fla
    dy = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    g_got = torch.autograd.grad(got, (base, w), dy)
    g_want = torch.autograd.grad(want, (base, w), dy)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert fwd.launches == [111] and bwd.launches == [111]                            # 37 tokens x 3 heads, once


def test_narrow_norms_stay_on_the_reference():
    """RMSNorm of width <= 512 (per-head q/k norms) would compile per token count in fla: not taken."""
    assert not train_fused.norm_width_ok(torch.zeros(2, 256)) and train_fused.norm_width_ok(torch.zeros(2, 1024))


def test_the_first_use_is_announced_once(caplog):
    """The one-time tuning cost is what a user sees first: one line naming it and the switch, not one per op."""
    train_fused._announce.cache_clear()
    with caplog.at_level("INFO", logger="segki_lightning"):
        train_fused._announce()
        train_fused._announce()
    lines = [r.getMessage() for r in caplog.records if "fused norms" in r.getMessage()]
    assert len(lines) == 1 and "SEGKI_TRAIN_FUSED=0" in lines[0]
