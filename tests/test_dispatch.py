"""Dispatch picks the reference whenever the native op is missing or the inputs are ineligible."""
from __future__ import annotations

import logging

import pytest
import torch

from segki_lightning import ops
from segki_lightning.ops import dispatch, extension, reference


def test_cpu_and_fp32_inputs_run_the_reference():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert not dispatch.eligible("linear", x, w)
    assert ops.backend("linear", torch.bfloat16, "cpu") == "reference"
    assert ops.backend("linear", torch.float32, "cpu") == "reference"
    assert torch.equal(ops.linear(x, w), reference.linear(x, w))


def test_missing_native_kernels_are_announced_once(caplog, monkeypatch):
    monkeypatch.setattr(extension, "_unavailable_reason", lambda: "no CUDA device")
    extension.native_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="segki_lightning"):
            assert extension.native_ops() is None
            assert extension.native_ops() is None
            assert not extension.has_native("linear")
        assert sum("reference path" in r.message for r in caplog.records) == 1
    finally:
        extension.native_ops.cache_clear()


def test_every_native_op_has_a_reference_and_a_fake():
    """The op schemas in csrc/bindings.cpp are the contract: each needs a reference of the same name
    (the CPU path and test oracle) and a shape function for tracing/torch.compile."""
    import re
    from pathlib import Path

    root = Path(extension.__file__).resolve().parents[1]
    schemas = re.findall(r'm\.def\("(\w+)\(', (root / "csrc" / "bindings.cpp").read_text())
    fakes = set(re.findall(r'register_fake\("segki::(\w+)"\)', (root / "ops" / "fake.py").read_text()))
    assert len(schemas) >= 10
    for name in schemas:
        assert callable(getattr(reference, name, None)), f"no reference for segki::{name}"
        assert name in fakes, f"no register_fake for segki::{name}"


def test_gemv_row_limits_per_op_or_one_from_the_environment_with_a_clear_error(monkeypatch):
    monkeypatch.delenv("SEGKI_GEMV_MAX_ROWS", raising=False)
    limits = dispatch._gemv_rows()
    assert limits == dispatch.GEMV_ROWS and limits is not dispatch.GEMV_ROWS
    assert limits["linear"] == 4 and limits["gdn_in_proj"] == 16   # a single projection loses to cuBLAS sooner
    monkeypatch.setenv("SEGKI_GEMV_MAX_ROWS", "64")
    assert set(dispatch._gemv_rows().values()) == {64} and dispatch._gemv_rows().keys() == limits.keys()
    monkeypatch.setenv("SEGKI_GEMV_MAX_ROWS", "sixteen")
    with pytest.raises(ValueError, match="positive number of rows"):
        dispatch._gemv_rows()
