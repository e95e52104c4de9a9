"""The decode step's L2 warm-up schedule (ops.ahead): what it warms when, on CPU (the warm-up itself is a CUDA
kernel; here it is recorded instead of launched)."""
from __future__ import annotations

import pytest
import torch

from segki_lightning import RolloutEngine, SamplingConfig
from segki_lightning.ops import ahead

from .tiny_models import VOCAB, build_model


class Recording(ahead.Ahead):
    """A schedule that records what it would warm (entry index, tensors) instead of launching."""

    def __init__(self, max_bytes: int = ahead.MIB):
        super().__init__(max_bytes)
        self.warmed: list[tuple[int, tuple[torch.Tensor, ...]]] = []

    def _warm(self, tensors):
        self.warmed.append((len(self.entries) - 1, tensors))


def fresh(n: int) -> list[torch.Tensor]:
    return [torch.randn(int(torch.randint(1, 9, ())), 4) for _ in range(n)]


def test_each_entry_warms_the_next_entry_of_the_previous_pass():
    ts = fresh(4)
    s = Recording()
    for _ in range(2):
        with ahead.warm_ahead(s):
            for t in ts:
                ahead.before(t, None)   # absent optional operands are dropped
    assert [k for k, _ in s.warmed] == [0, 1, 2]              # the first pass only records
    assert all(w[0] is ts[k + 1] for k, w in s.warmed)
    assert [e[0] for e in s.last] == ts and s.entries == []


def test_a_pass_that_differs_warms_nothing_where_it_differs():
    ts = fresh(4)
    s = Recording()
    with ahead.warm_ahead(s):
        for t in ts:
            ahead.before(t)
    other = torch.randn(3, 4)
    with ahead.warm_ahead(s):
        for t in (ts[0], other, ts[2], ts[3]):
            ahead.before(t)
    assert [k for k, _ in s.warmed] == [0, 2]   # entry 1 is not what the previous pass had there
    assert s.warmed[0][1][0] is ts[1] and s.warmed[1][1][0] is ts[3]   # what came next in the previous pass
    assert s.last[1] == (other,)


def test_outside_a_step_nothing_is_recorded_and_steps_nest():
    s, inner = Recording(), Recording()
    ahead.before(torch.ones(2))
    with ahead.warm_ahead(s):
        ahead.before(torch.ones(2))
        with ahead.warm_ahead(inner):
            ahead.before(torch.ones(3))
        ahead.before(torch.ones(4))
    assert [e[0].shape[0] for e in s.last] == [2, 4] and [e[0].shape[0] for e in inner.last] == [3]
    with ahead.warm_ahead(None):
        ahead.before(torch.ones(2))
    assert ahead._active is None


def test_cpu_tensors_are_never_warmed():
    s = ahead.Ahead(ahead.MIB)
    for _ in range(3):
        with ahead.warm_ahead(s):
            ahead.before(torch.randn(8, 8))
            ahead.before(torch.randn(8, 8))
    assert s.issued == 0 and s.side is None and not s.forked


def test_the_size_comes_from_the_environment_in_mib(monkeypatch):
    from segki_lightning.ops.switches import check_switches

    monkeypatch.delenv("SEGKI_L2_AHEAD", raising=False)
    assert ahead.ahead_bytes() == ahead.DEFAULT_MIB * ahead.MIB
    monkeypatch.setenv("SEGKI_L2_AHEAD", "16")
    assert ahead.ahead_bytes() == 16 * 2**20
    check_switches({"SEGKI_L2_AHEAD": "0"})
    for bad in ("-1", "16M", ""):
        with pytest.raises(ValueError, match=r"SEGKI_L2_AHEAD=.*expected <int >= 0>"):
            check_switches({"SEGKI_L2_AHEAD": bad})


def test_the_injected_decode_step_has_one_entry_per_weighted_op_in_a_stable_order(tmp_path, monkeypatch):
    """Each GDN layer: input projection, recurrent state, out_proj, gate|up, down; each attention layer: q|k|v,
    o_proj, gate|up, down. Two passes of the tiny Qwen3.5 (3 GDN + 1 attention layer) give the same entries."""
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=24, graph_capture=False, eos_token_id=[])
    assert engine._ahead_bytes == 0                   # on CPU nothing is warmed, whatever the switch says
    schedules: list[Recording] = []
    monkeypatch.setattr(engine, "_ahead_bytes", ahead.MIB)
    monkeypatch.setattr("segki_lightning.rollout.engine.Ahead", lambda n: schedules.append(Recording(n))
                        or schedules[-1])
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 7)]
    batch = engine.generate(prompts, SamplingConfig(max_new_tokens=4, temperature=0.0))
    plain = RolloutEngine(model, max_batch_size=4, max_seq_len=24, graph_capture=False, eos_token_id=[])
    assert torch.equal(batch.completion_ids, plain.generate(prompts, SamplingConfig(max_new_tokens=4,
                                                                                    temperature=0.0)).completion_ids)
    (s,) = schedules
    layers = model.model.layers
    want = []
    for layer in layers:
        if hasattr(layer, "linear_attn"):
            m = layer.linear_attn
            want += [(m.in_proj_qkv.weight, m.in_proj_z.weight, m.in_proj_b.weight, m.in_proj_a.weight), None,
                     (m.out_proj.weight,)]
        else:
            a = layer.self_attn
            want += [(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), (a.o_proj.weight,)]
        want += [(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight), (layer.mlp.down_proj.weight,)]
    assert len(s.last) == len(want) == 5 * 3 + 4
    for got, w in zip(s.last, want):
        if w is None:   # the recurrent state: a [rows, Hv, Dk, Dv] fp32 slice of the cache
            assert got[0].dtype == torch.float32 and got[0].dim() == 4
        else:
            assert [t.data_ptr() for t in got] == [t.data_ptr() for t in w]
    steps = 3   # max_new_tokens - 1 decode steps: the first records, each later one warms every entry but the last
    assert len(s.warmed) == (steps - 1) * (len(want) - 1)
