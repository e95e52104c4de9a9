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


def test_gemv_row_limits_per_op_and_weight_size_or_from_the_environment(monkeypatch):
    monkeypatch.delenv("SEGKI_GEMV_MAX_ROWS", raising=False)
    limits, from_env = dispatch._gemv_rows()
    assert limits == dispatch.GEMV_ROWS and limits is not dispatch.GEMV_ROWS and not from_env
    monkeypatch.setenv("SEGKI_GEMV_MAX_ROWS", "64")
    limits, from_env = dispatch._gemv_rows()
    assert set(limits.values()) == {64} and limits.keys() == dispatch.GEMV_ROWS.keys() and from_env
    monkeypatch.setenv("SEGKI_GEMV_MAX_ROWS", "gated_mlp_front:32, qkv_proj:24")
    limits, from_env = dispatch._gemv_rows()
    assert limits == {**dispatch.GEMV_ROWS, "gated_mlp_front": 32, "qkv_proj": 24} and from_env
    for bad in ("sixteen", "0", "gate_up:32", "linear:0", "linear:32,", "linear"):
        monkeypatch.setenv("SEGKI_GEMV_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="positive number of rows"):
            dispatch._gemv_rows()


def test_large_weights_leave_the_native_path_after_one_row(monkeypatch):
    """4B-shaped weights go to cuBLAS past 1 row (a single projection of >= 16 MiB; gate|up, q|k|v or the GDN input
    projection of >= 32 MiB together), 0.8B-shaped ones at 16 rows; an explicit SEGKI_GEMV_MAX_ROWS applies to
    every size (meta tensors: no memory is allocated)."""
    def w(n, k):
        return torch.empty(n, k, dtype=torch.bfloat16, device="meta")

    small = {"linear": [w(1024, 3584)], "gated_mlp_front": [w(3584, 1024)] * 2,              # 0.8B: 7, 14 MiB
             "qkv_proj": [w(4096, 1024), w(512, 1024), w(512, 1024)],                          # 10 MiB
             "gdn_in_proj": [w(6144, 1024), w(2048, 1024), w(16, 1024), w(16, 1024)]}          # 16.1 MiB
    large = {"linear": [w(2560, 9216)], "gated_mlp_front": [w(9216, 2560)] * 2,              # 4B: 45, 90 MiB
             "qkv_proj": [w(8192, 2560), w(1024, 2560), w(1024, 2560)],                        # 50 MiB
             "gdn_in_proj": [w(8192, 2560), w(4096, 2560), w(32, 2560), w(32, 2560)]}          # 60 MiB
    monkeypatch.setattr(dispatch, "ROWS_FROM_ENV", False)
    for op in small:
        assert dispatch.native_rows(op, *small[op]) == dispatch.MAX_ROWS[op] == 16, op
        assert dispatch.native_rows(op, *large[op]) == dispatch.LARGE_WEIGHT_ROWS == 1, op
    monkeypatch.setattr(dispatch, "ROWS_FROM_ENV", True)
    assert all(dispatch.native_rows(op, *large[op]) == dispatch.MAX_ROWS[op] for op in large)


def test_the_fused_gdn_conv_has_its_own_row_limit(monkeypatch):
    """The conv in the projection's epilogue runs natively only up to its own measured rows (1), not the
    projection's 16, and an end-to-end SEGKI_GEMV_MAX_ROWS comparison of the GEMVs does not move it."""
    seen = {}
    monkeypatch.setattr(dispatch, "eligible", lambda op, *t, max_rows=None, shape_ok=True: seen.update(
        op=op, max_rows=max_rows, shape_ok=shape_ok) or False)
    x, ws = torch.randn(2, 64), [torch.randn(n, 64) for n in (48, 16, 2, 2)]
    conv = (torch.randn(2, 48, 4), torch.randn(48, 4), None)
    for gemv_rows in (16, 32):
        monkeypatch.setitem(dispatch.MAX_ROWS, "gdn_in_proj", gemv_rows)
        assert not dispatch.fuses_gdn_conv(x, *ws, *conv)
        assert seen == dict(op="gdn_in_proj_conv", max_rows=1, shape_ok=True)
    assert dispatch.CONV_EPILOGUE_ROWS == 1


def test_kernel_switches_accept_their_values_and_name_what_to_change():
    from segki_lightning.ops.switches import check_switches

    check_switches({})
    check_switches({"SEGKI_PDL": "0", "SEGKI_ATTN": "batched", "SEGKI_GEMV_PIPE": "1", "SEGKI_GEMV_BULK": "0",
                    "SEGKI_GEMV_PREFETCH": "-1", "SEGKI_GEMV_MAX_ROWS": "32", "SEGKI_JOINT": "0",
                    "SEGKI_CACHE": "/x", "PATH": "/bin"})
    with pytest.raises(ValueError, match=r"SEGKI_GEMV_BLK is not a segki switch .*SEGKI_GEMV_BULK.*unset it"):
        check_switches({"SEGKI_GEMV_BLK": "1"})
    with pytest.raises(ValueError, match=r"SEGKI_GEMV_BULK='grid': expected 0 or 1 .*or unset for the default"):
        check_switches({"SEGKI_GEMV_BULK": "grid"})
    for bad in ("-2", "2k", ""):
        with pytest.raises(ValueError, match=r"SEGKI_GEMV_PREFETCH=.*expected <int >= -1>"):
            check_switches({"SEGKI_GEMV_PREFETCH": bad})
    check_switches({"SEGKI_GEMV_MAX_ROWS": "gated_mlp_front:32, linear:24", "SEGKI_SKINNY": "0"})
    with pytest.raises(ValueError, match=r"SEGKI_SKINNY='all': expected 0 "):
        check_switches({"SEGKI_SKINNY": "all"})
    for bad in ("0", "linear:0", "linear", "linear:32,", ""):
        with pytest.raises(ValueError, match=r"SEGKI_GEMV_MAX_ROWS=.*op:rows pairs"):
            check_switches({"SEGKI_GEMV_MAX_ROWS": bad})
    with pytest.raises(ValueError, match=r"SEGKI_ATTN='Batched'.*; SEGKI_PDL='off'"):  # every problem at once
        check_switches({"SEGKI_PDL": "off", "SEGKI_ATTN": "Batched"})


def test_a_bad_kernel_switch_stops_the_extension_before_it_loads(monkeypatch):
    monkeypatch.setenv("SEGKI_GEMV_BULK", "yes")
    extension.native_ops.cache_clear()
    try:
        with pytest.raises(ValueError, match="SEGKI_GEMV_BULK='yes'"):
            extension.native_ops()
    finally:
        extension.native_ops.cache_clear()


def test_every_switch_the_kernels_read_is_declared_with_the_values_they_compare():
    """The C++ sources read switches with ``env_is("SEGKI_X", "value")``, ``env_long("SEGKI_X", ...)`` or
    ``std::getenv("SEGKI_X")``: each name must be declared in ``switches.KERNEL_SWITCHES``, and each compared
    value accepted there."""
    import re
    from pathlib import Path

    from segki_lightning.ops.switches import KERNEL_SWITCHES, _accepts

    text = "".join(p.read_text() for p in Path(extension.CSRC).glob("*.c*"))
    compared = re.findall(r'env_is\("(SEGKI_\w+)", "([^"]*)"\)', text)
    read = set(re.findall(r'(?:getenv|env_long)\("(SEGKI_\w+)"', text)) | {name for name, _ in compared}
    assert {"SEGKI_GEMV_PREFETCH", "SEGKI_GEMV_BULK_CHUNKS"} <= read
    assert len(compared) >= 4 and read
    for name in read:
        assert name in KERNEL_SWITCHES, f"{name} is read by the kernels but not declared"
    for name, value in compared:
        assert _accepts(KERNEL_SWITCHES[name][0], value), f"{name}={value} is compared but not accepted"


def test_the_norm_folds_where_the_copy_engine_gemv_runs_by_its_rule():
    """``bulk_gemv_fits``, the rule :func:`dispatch.folds_norm` mirrors from csrc/gemv.cu's bulk_plan, on the
    decode shapes: every 0.8B projection that follows a norm at 1-4 rows, no 4B one unless SEGKI_GEMV_BULK=1,
    nothing past 4 rows or under SEGKI_GEMV_BULK=0; and on the CPU, never."""
    fits = dispatch.bulk_gemv_fits
    mib = 2**20
    for rows in (1, 2, 3, 4):
        assert fits(rows, 1024, 2, 14 * mib, True, None)           # 0.8B gate|up
        assert fits(rows, 1024, 2, 17 * mib, False, None)          # 0.8B GDN input: over 16 MiB, rows of 2 KB
        assert not fits(rows, 2560, 2, 94 * mib, True, None)       # 4B gate|up
        assert not fits(rows, 1024, 2, 14 * mib, True, "0")
    assert fits(1, 2560, 2, 63 * mib, False, "1")                  # 4B GDN input, forced
    assert not fits(5, 1024, 2, 14 * mib, True, None)
    assert not fits(1, 16384, 2, 1 * mib, True, "1")               # a gate|up row pair over one 32 KB slot
    x, w = torch.randn(1, 64), torch.randn(32, 64)
    assert not dispatch.folds_norm(x, w, w, gated=True)
    assert not dispatch.folds_norm(x.bfloat16(), w.bfloat16(), gated=False)


def test_skinny_rule_parts_of_k_and_shared_memory():
    """The skinny product's parts of K (a divisor of K, a multiple of 256, nearest 1280: row copies of 2-4 KB) and
    its size rule (x, or at 1-8 rows the fewest segments of K that divide the parts, and three slots in 218 KB;
    whole rows with the norm; else, on weights of at most 16 MiB, shorter parts down to 512 columns; else, at 9-16
    rows without the norm, deferred segments of one part each: of 1536-2048 columns with x in registers where K has
    them and the product is not gated, else of the parts), as csrc/skinny.cu plans them."""
    assert [dispatch.skinny_part_cols(k) for k in (2560, 4096, 9216, 1024, 3584, 512, 8200, 72)] == \
        [1280, 1024, 1024, 1024, 1792, 512, 0, 0]
    fits = dispatch.skinny_fits

    def segs(*args, **kwargs) -> int:   # segments of K in the plan, 0 where there is none
        plan = dispatch.skinny_plan(*args, **kwargs)
        return plan[1] if plan else 0

    assert fits(16, 2560, 18432, 2) and fits(16, 2560, 12352, 2) and fits(1, 2560, 248320, 2)
    assert segs(16, 2560, 18432, 2) == 1 and segs(16, 2560, 18432, 2, norm=True) == 1
    plan = dispatch.skinny_plan
    assert plan(12, 4096, 2560, 2) == (1024, 1) and plan(16, 4096, 2560, 2) == (2048, 2)   # one part a segment
    assert plan(16, 4096, 2560, 2, norm=True) is None                      # a norm needs whole rows
    assert plan(16, 4096, 1024, 2) == (512, 1)                             # 8 MB: parts of 512 columns
    assert segs(6, 9216, 2560, 2) == 1 and segs(7, 9216, 2560, 2) == 3 and plan(8, 9216, 2560, 2) == (1024, 3)
    assert plan(9, 9216, 2560, 2) == (1536, 6) and plan(16, 9216, 2560, 2) == (1536, 6)   # deferred; x alone 296 KB
    assert plan(16, 9216, 2560, 2, gated=True) == (1024, 9)                # gated: the parts, x in shared memory
    assert [dispatch.skinny_reg_segment_cols(k, 2) for k in (4096, 9216, 6144, 3584, 2048, 16384)] == \
        [2048, 1536, 2048, 0, 0, 2048]                                    # 3584: 7 steps, 2048: one segment
    assert plan(8, 3584, 1024, 2) == (1792, 2) and plan(16, 3584, 1024, 2) == (512, 1)   # the 0.8B down
    assert plan(8, 9216, 2560, 2, norm=True) is None                       # the norm needs whole rows; 47 MB
    assert plan(8, 9216, 128, 2) == (1024, 3) and plan(8, 9216, 128, 2, norm=True) == (512, 1)
    assert plan(3, 16384, 128, 2) == (1024, 1) and plan(4, 16384, 128, 2) == (1024, 2)   # segments at 4 rows too
    assert segs(8, 9216, 16 * 1365, 2) == 3 and segs(4, 9216, 16 * 1366, 2) == 1
    assert plan(8, 9216, 16 * 1366, 2) is None                             # 4098 tiles x segments; 403 MB
    assert not fits(17, 2560, 18432, 2) and not fits(0, 2560, 18432, 2)
    assert not fits(1, 2560, 250, 2)                                      # whole 16-row tiles only
    assert not fits(1, 8200, 256, 2)                                      # no part of K


def test_skinny_deferred_segments_in_shared_memory_under_the_switch(monkeypatch):
    """SEGKI_SKINNY_XSEG=0 (read on every call, as the op reads it): the deferred segments of the parts of K, x in
    shared memory, as before x in registers took them."""
    monkeypatch.setenv("SEGKI_SKINNY_XSEG", "0")
    assert dispatch.skinny_plan(16, 4096, 2560, 2) == (1024, 4) and dispatch.skinny_plan(16, 9216, 2560, 2) == (1024, 9)
    monkeypatch.delenv("SEGKI_SKINNY_XSEG")
    assert dispatch.skinny_plan(16, 4096, 2560, 2) == (2048, 2)


def test_skinny_reference_is_the_linear_and_gated_front_references():
    from segki_lightning.ops import reference as R

    x, wg, wu, res = torch.randn(3, 64), torch.randn(32, 64), torch.randn(32, 64), torch.randn(3, 32)
    packed = torch.cat([wg, wu])
    assert torch.equal(R.skinny_linear(x, packed, gated=True), R.gated_mlp_front(x, wg, wu))
    assert torch.equal(R.skinny_linear(x, wg, res), R.linear(x, wg, None, res))
    assert torch.equal(ops.skinny_linear(x, wg, res), R.linear(x, wg, None, res))   # CPU: the reference
    nw = torch.randn(64)
    assert torch.equal(R.skinny_linear(x, packed, None, True, nw, 1e-6, True),
                       R.gated_mlp_front(x, wg, wu, nw, 1e-6, True))
    assert torch.equal(ops.skinny_linear(x, wg, res, False, nw, 1e-6, False),
                       R.linear(R.rms_norm(x, nw, 1e-6, False), wg, None, res))


@pytest.mark.parametrize("rows", [12, 16])
def test_an_output_projection_in_deferred_segments_hands_its_sums_to_the_norm(rows, monkeypatch):
    """ops.linear_add_rms_norm: where the skinny product plans the projection in deferred segments of K (the 4B
    o_proj / out_proj at 13-16 rows), its fp32 sums go to the residual add + norm kernel, with no sum launch of the
    product's own; elsewhere the projection, then add_rms_norm. On the CPU (natives stubbed) it is the
    reference composition."""
    R = reference
    x, w = torch.randn(rows, 4096).bfloat16(), torch.randn(2560, 4096).bfloat16()
    res, nw = torch.randn(rows, 2560).bfloat16(), torch.randn(2560).bfloat16()
    want = R.add_rms_norm(R.linear(x, w), res, nw, 1e-6, True)
    assert all(torch.equal(g, v) for g, v in zip(ops.linear_add_rms_norm(x, w, None, res, nw, 1e-6, True), want))
    calls = []

    def native(op):
        def run(*args):
            calls.append(op)
            if op == "skinny_linear_sums":
                return R.skinny_linear_sums(*args)
            return getattr(R, op)(*args)
        return run

    monkeypatch.setattr(dispatch, "_native", native)
    monkeypatch.setattr(dispatch, "_skinny_ok", lambda *a, **k: True)
    monkeypatch.setattr(dispatch, "eligible", lambda op, *a, **k: True)
    got = dispatch.linear_add_rms_norm(x, w, None, res, nw, 1e-6, True)
    deferred = dispatch.skinny_plan(rows, 4096, 2560, 2)[1] > 1
    assert deferred == (rows == 16)
    assert calls == (["skinny_linear_sums", "add_rms_norm_sums"] if deferred else ["skinny_linear", "add_rms_norm"])
    if deferred:   # the fp32 product rounded once, not F.linear's bf16 product: the sums' reference
        want = R.add_rms_norm_sums(R.skinny_linear_sums(x, w), res, nw, 1e-6, True)
    assert all(torch.equal(g, v) for g, v in zip(got, want))
    calls.clear()
    dispatch.linear_add_rms_norm(x, w, torch.zeros(2560).bfloat16(), res, nw, 1e-6, True)   # a bias: no sums
    assert "skinny_linear_sums" not in calls


def test_skinny_takes_the_norm_into_its_launch_unless_switched_off(monkeypatch):
    """Where the skinny product takes a packed projection of at most SKINNY_FOLD_ROWS rows, the norm before it rides
    in the same launch; past them, or under SEGKI_FOLD_NORM=0 (dispatch.FOLD_NORM), the norm kernel runs first and
    the product gets no norm."""
    x, w, nw = torch.randn(2, 64), torch.randn(48, 64), torch.randn(64)
    calls = []

    def native(op):
        def run(*args):
            calls.append((op, len(args) > 4 and args[4] is not None))
            return torch.zeros(args[0].shape[0], 48) if op == "skinny_linear" else args[0]
        return run

    monkeypatch.setattr(dispatch, "_native", native)
    monkeypatch.setattr(dispatch, "_skinny_weight", lambda x, weights, gated=False, norm_w=None: w)
    monkeypatch.setattr(dispatch, "rms_norm", lambda x, *a: calls.append(("rms_norm", False)) or x)
    dispatch._skinny_joint(x, (w[:16], w[16:]), nw, 1e-6, True)
    assert calls == [("skinny_linear", True)]
    calls.clear()
    dispatch._skinny_joint(torch.randn(16, 64), (w[:16], w[16:]), nw, 1e-6, True)   # past SKINNY_FOLD_ROWS
    assert calls == [("rms_norm", False), ("skinny_linear", False)]
    calls.clear()
    monkeypatch.setattr(dispatch, "FOLD_NORM", False)
    dispatch._skinny_joint(x, (w[:16], w[16:]), nw, 1e-6, True)
    assert calls == [("rms_norm", False), ("skinny_linear", False)]


def test_skinny_routing_by_rows_and_switch(monkeypatch):
    """Every weight size at 1-16 rows goes to the skinny product, none past 16 rows, under SEGKI_SKINNY=0 or while
    autograd records; CPU tensors never reach the native op."""
    monkeypatch.setattr(dispatch, "_native", lambda op: pytest.fail(f"native {op} called"))
    large, small = torch.empty(2560, 9216, device="meta"), torch.empty(1024, 3584, device="meta")
    routes = dispatch._skinny_routes
    monkeypatch.setattr(dispatch, "SKINNY", None)
    assert routes(torch.randn(1, 9216), large) and routes(torch.randn(16, 9216), large)
    assert routes(torch.randn(1, 3584), small) and routes(torch.randn(9, 3584), small)
    assert not routes(torch.randn(17, 9216), large) and not routes(torch.randn(32, 3584), small)
    assert not routes(torch.randn(1, 9216, requires_grad=True), large)
    monkeypatch.setattr(dispatch, "SKINNY", "0")
    assert not routes(torch.randn(1, 9216), large)
    monkeypatch.setattr(dispatch, "SKINNY", None)
    w = torch.randn(2560, 9216, dtype=torch.bfloat16)
    assert not dispatch._skinny_ok(torch.randn(4, 9216, dtype=torch.bfloat16), w)
    x = torch.randn(1, 9216, dtype=torch.bfloat16)
    assert torch.equal(ops.linear(x, w), reference.linear(x, w))          # CPU: the reference
