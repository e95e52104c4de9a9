"""The fused training kernels' gate (segki_lightning.ops.train_fused): they run only on CUDA with the switch on and
gradients recorded or inside a scoring pass; on CPU the ops stay the references, switch or not. Their numerics are
checked on a GPU (tests/gpu/test_train_fused_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.ops import reference, train_fused
from segki_lightning.ops import dispatch
from segki_lightning.ops.switches import check_switches


def test_off_by_default_and_never_on_cpu(monkeypatch):
    x = torch.randn(4, 8, requires_grad=True)
    monkeypatch.delenv(train_fused.SWITCH, raising=False)
    assert not train_fused.active(x)
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
