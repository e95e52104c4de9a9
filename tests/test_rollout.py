"""RolloutEngine on CPU/fp32 (eager + reference path): per-prompt equivalence with transformers'
``generate``, seeded sampling, EOS handling, log-probs, and clear errors."""
from __future__ import annotations

import time

import pytest
import torch

from segki_lightning import RolloutEngine, SamplingConfig

from .tiny_models import VOCAB, build_model, cut_norm_links


def random_prompts(lengths, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, ())))
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(params=["qwen3_5", "llama"])
def family(request):
    return request.param


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("use_segki", [True, False], ids=["segki", "plain"])
def test_greedy_rows_equal_generate_on_each_prompt_alone(family, n, use_segki, tmp_path):
    model = build_model(family, tmp_path)
    engine = RolloutEngine(model, max_batch_size=32, max_seq_len=48, use_segki=use_segki, graph_capture=False,
                           eos_token_id=[])
    lengths = [1, 30, 7, 18, 2, 11, 25, 4] if n == 1 else [1, 30, 9]
    prompts = random_prompts(lengths)
    t = 10
    batch = engine.generate(prompts, SamplingConfig(max_new_tokens=t, temperature=0.0, n=n))
    assert batch.completion_ids.shape == (len(prompts) * n, t)
    for i, p in enumerate(prompts):
        want = model.generate(torch.tensor([p]), max_new_tokens=t, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(p):]
        for r in range(i * n, (i + 1) * n):
            assert torch.equal(batch.completion_ids[r], want), f"row {r} (prompt {i}, {len(p)} tokens)"
            assert batch.prompt_index[r] == i
    assert torch.equal(batch.prompt_mask.sum(1), torch.tensor(lengths).repeat_interleave(n))
    assert (batch.prompt_ids[batch.prompt_mask == 0] == engine.pad).all()


def test_seeds_reproduce_and_differ(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=16, max_seq_len=40, graph_capture=False, eos_token_id=[])
    prompts = random_prompts([3, 8])
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, n=4, seed=7)
    a, b = engine.generate(prompts, cfg), engine.generate(prompts, cfg)
    c = engine.generate(prompts, SamplingConfig(max_new_tokens=12, temperature=1.0, n=4, seed=8))
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    assert len({tuple(r) for r in a.completion_ids[:4].tolist()}) > 1  # the n samples of a prompt differ


def test_top_k_1_equals_greedy(tmp_path):
    model = build_model("llama", tmp_path)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=40, graph_capture=False, eos_token_id=[])
    prompts = random_prompts([5, 9])
    greedy = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=0.0))
    topk1 = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=1.3, top_k=1, seed=3))
    assert torch.equal(greedy.completion_ids, topk1.completion_ids)


def test_logprobs_equal_a_separate_forward(family, tmp_path):
    model = build_model(family, tmp_path)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=40, graph_capture=False, eos_token_id=[])
    prompts = random_prompts([4, 11])
    temp = 0.7
    batch = engine.generate(prompts, SamplingConfig(max_new_tokens=9, temperature=temp, n=2, seed=1))
    for r in range(len(batch)):
        p = batch.prompt_ids[r][batch.prompt_mask[r].bool()]
        seq = torch.cat([p, batch.completion_ids[r]])[None]
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1:-1].float()                   # [T, V]
        want = torch.log_softmax(logits / temp, -1).gather(-1, batch.completion_ids[r][:, None])[:, 0]
        torch.testing.assert_close(batch.logprobs[r], want, rtol=1e-4, atol=1e-4)


def test_eos_pads_and_masks_the_rest(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    prompts = random_prompts([6, 3, 10], seed=0)
    free = RolloutEngine(model, max_batch_size=8, max_seq_len=40, graph_capture=False, eos_token_id=[])
    cfg = SamplingConfig(max_new_tokens=10, temperature=0.0)
    ref = free.generate(prompts, cfg).completion_ids
    eos = int(ref[0, 3])  # the 4th greedy token of row 0 becomes EOS
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=40, graph_capture=False, eos_token_id=eos,
                           pad_token_id=0)
    batch = engine.generate(prompts, cfg)
    for r in range(len(batch)):
        hits = (ref[r] == eos).nonzero()
        stop = int(hits[0]) + 1 if len(hits) else 10
        assert torch.equal(batch.completion_ids[r, :stop], ref[r, :stop])
        assert (batch.completion_ids[r, stop:] == 0).all()
        assert batch.completion_mask[r].tolist() == [1] * stop + [0] * (10 - stop)
        assert (batch.logprobs[r, stop:] == 0).all()
    assert batch.completion_mask[0].sum() <= 4  # row 0 stops at its first EOS, at index 3 or earlier
    assert batch.stats.tokens == int(batch.completion_mask.sum())


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n "), (dict(top_k=-1), "top_k"),
    (dict(temperature=float("nan")), "finite"), (dict(temperature=float("inf")), "finite"),
    (dict(top_p=float("nan")), "top_p"),
])
def test_bad_sampling_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_bad_prompts_are_clear_errors_and_lose_nothing(tmp_path):
    model = build_model("llama", tmp_path)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=16, graph_capture=False)
    cfg = SamplingConfig(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        engine.generate([list(range(2, 15))], cfg)
    with pytest.raises(ValueError, match="exceed max_batch_size"):
        engine.generate([[2, 3]] * 3, SamplingConfig(max_new_tokens=4, n=2))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[2, 3], []], cfg)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[2, VOCAB]], cfg)
    with pytest.raises(ValueError, match="prompts is empty"):
        engine.generate([], cfg)
    with pytest.raises(TypeError, match="token ids"):
        engine.generate("1+2=", cfg)
    with pytest.raises(TypeError, match="must be integers"):
        engine.generate([torch.tensor([2.0, 3.0])], cfg)
    with pytest.raises(TypeError, match="Python ints"):
        engine.generate([[2, 3.5]], cfg)
    assert engine.generate([[2, 3]], cfg).completion_ids.shape == (1, 4)  # the engine still works


def test_plain_engine_leaves_the_model_uninjected(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=16, use_segki=False, graph_capture=False)
    assert engine.report is None and engine.path == "eager+reference"
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_rope_table_equals_the_models_rotary(family, dtype, tmp_path):
    """The decode step's rotary table returns exactly what the model's rotary module computes, for the
    positions the decode step passes ([B, 1]; Qwen3.5's model hands its rotary three equal sections)."""
    from segki_lightning.rollout.rope import RopeTable, rotary_module

    model = build_model(family, tmp_path, dtype=dtype)
    rotary = rotary_module(model)
    assert rotary is not None
    table = RopeTable(rotary, 64, dtype, torch.device("cpu"))
    pos = torch.randint(0, 64, (5, 1))
    sections = pos[None].expand(3, -1, -1) if family == "qwen3_5" else pos
    x = torch.randn(5, 1, model.config.hidden_size, dtype=dtype)
    want = rotary(x, sections)
    with table.installed():
        got = rotary(x, sections)
    assert "forward" not in rotary.__dict__   # the module's own forward is back
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("conv_in_projection", [False, True], ids=["conv_beside_recurrence", "conv_in_projection"])
def test_a_decode_step_launches_no_pytorch_kernel_per_layer(tmp_path, conv_in_projection):
    """Count the kernels one decode step would launch on a GPU (from a CPU run: each fused-op call is one
    native launch; every PyTorch op outside them that is not a view is one kernel). The layers must be made
    of fused ops only, and the step adds a fixed handful around them (it had ~29 before the rotary table and
    the fused bookkeeping). Both GDN decode paths: the conv in the input projection's epilogue (one row on a
    GPU), and after the projection."""
    import functools

    from torch.utils._python_dispatch import TorchDispatchMode

    from segki_lightning import ops
    from segki_lightning.ops import dispatch

    fused = ["linear", "linear_add_rms_norm", "gated_mlp_front", "qkv_proj", "gdn_in_proj", "rms_norm", "add_rms_norm",
             "decode_attention", "attention_prologue", "decode_attention_step", "gdn_decode_step", "gdn_in_proj_conv",
             "gdn_recurrent_step", "sample_tokens", "record_tokens"]
    launches: list[str] = []
    inside = [0]

    def counted(name, fn):
        @functools.wraps(fn)
        def call(*a, **k):
            if not inside[0]:
                launches.append(name)
            inside[0] += 1
            try:
                return fn(*a, **k)
            finally:
                inside[0] -= 1
        return call

    class Kernels(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and not func.is_view and name not in ("detach", "lift_fresh", "_unsafe_view"):
                launches.append(f"aten.{name}")
            return func(*args, **(kwargs or {}))

    def per_step(layers: int) -> list[str]:
        kinds = (["linear_attention"] * 3 + ["full_attention"]) * (layers // 4)
        model = build_model("qwen3_5", tmp_path, num_hidden_layers=layers, layer_types=kinds, dtype=torch.bfloat16)
        engine = RolloutEngine(model, max_batch_size=2, max_seq_len=32, graph_capture=False)
        engine.generate([[3, 4, 5]], SamplingConfig(max_new_tokens=2, n=2, seed=0))
        launches.clear()
        with torch.no_grad(), Kernels():
            engine._step(2)
        return [k for k in launches if k.startswith("aten.")]

    import unittest.mock as mock

    wrapped = {n: counted(n, getattr(dispatch, n)) for n in fused}
    with mock.patch.multiple(ops, fuses_gdn_conv=lambda *a: conv_in_projection, **wrapped):
        four, eight = per_step(4), per_step(8)
    gdn_ops = {"gdn_in_proj_conv", "gdn_recurrent_step"} if conv_in_projection else {"gdn_in_proj", "gdn_decode_step"}
    assert gdn_ops <= set(launches), "the GDN layers did not take the path under test"
    assert {"linear_add_rms_norm", "gated_mlp_front"} <= set(launches), launches
    assert four == eight, "a PyTorch kernel per layer crept into the decode step"
    assert len(four) <= 5, four   # lengths + 1, embedding, two rotary gathers, the output head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norms_inside_the_projections_decode_exactly_like_the_separate_norms(tmp_path, monkeypatch, dtype):
    """Where the MLP front takes norm2 inside its launch (``ops.folds_norm``, forced here: on a GPU the skinny product
    at 1-8 rows), a decode step moves the first residual add into the mixer's output projection and hands both
    norms to the projections after them, with no norm op of its own. The same roundings in the same order: tokens
    and log-probs equal the separate norms' exactly, on the GDN and the attention layers."""
    from segki_lightning import ops

    model = build_model("qwen3_5", tmp_path, dtype=dtype)
    prompts = random_prompts([5, 9, 3])
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=3)
    separate = RolloutEngine(model, max_batch_size=4, max_seq_len=32, graph_capture=False).generate(prompts, cfg)
    calls = []
    for name in ("add_rms_norm", "rms_norm"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    monkeypatch.setattr(ops, "folds_norm", lambda *a, **k: True)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=32, graph_capture=False)
    folded = engine.generate(prompts, cfg)
    assert torch.equal(folded.completion_ids, separate.completion_ids)
    assert torch.equal(folded.logprobs, separate.logprobs)
    calls.clear()
    with torch.no_grad():
        engine._step(4)
    assert calls == ["rms_norm"], calls   # the final norm only: the layers call none


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_next_norms_computed_ahead_decode_exactly_like_their_own_calls(tmp_path, monkeypatch, dtype):
    """Where the MLP front does not take norm2 inside its launch (on a GPU past 8 rows), each decode step's MLP
    residual add computes the next layer's input norm, and after the last layer the final norm, with the add
    (``ops.add_rms_norm``): the step calls no norm of its own. Tokens and log-probs equal those of each norm
    computing its own call exactly (the same roundings), on the GDN and the attention layers."""
    from segki_lightning import ops

    model = build_model("qwen3_5", tmp_path, dtype=dtype)
    prompts = random_prompts([5, 9, 3])
    cfg = SamplingConfig(max_new_tokens=8, temperature=1.0, seed=5)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=32, graph_capture=False)
    ahead = engine.generate(prompts, cfg)
    calls = []
    for name in ("rms_norm", "add_rms_norm", "linear_add_rms_norm"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name,
                            lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    with torch.no_grad():
        engine._step(4)
    layers = len(model.model.layers)
    assert calls == ["linear_add_rms_norm", "add_rms_norm"] * layers, calls   # out_proj + norm2, down + next norm
    cut_norm_links(model)
    calls.clear()
    own = RolloutEngine(model, max_batch_size=4, max_seq_len=32, graph_capture=False).generate(prompts, cfg)
    assert "rms_norm" in calls
    assert torch.equal(ahead.completion_ids, own.completion_ids)
    assert torch.equal(ahead.logprobs, own.logprobs)


def test_a_hooked_next_layer_computes_its_own_norm_at_decode(tmp_path):
    """A forward pre-hook on a decoder layer may change the hidden states in place before its norm reads them, so the
    layer before hands it no norm computed ahead: decode equals that of every norm computing its own call."""
    model = build_model("qwen3_5", tmp_path)
    prompts = random_prompts([4, 7])
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=2)
    def shift(module, args):
        args[0].add_(0.5)

    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=32, graph_capture=False)   # injected, verified
    model.model.layers[2].register_forward_pre_hook(shift)
    hooked = engine.generate(prompts, cfg)
    cut_norm_links(model)
    own = RolloutEngine(model, max_batch_size=2, max_seq_len=32, graph_capture=False).generate(prompts, cfg)
    assert torch.equal(hooked.logprobs, own.logprobs)


def test_a_hooked_input_norm_keeps_its_own_call_at_decode(tmp_path):
    """A forward hook on a decoder layer's input norm must see every call, so that layer keeps the norm as its own
    op at decode (the fold would skip the module)."""
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=32, graph_capture=False)
    seen = []
    model.model.layers[0].input_layernorm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    engine.generate([[3, 4, 5]], SamplingConfig(max_new_tokens=4, temperature=0.0))
    assert len(seen) == 4 and seen[-1][1] == 1   # the prefill and 3 decode steps


def test_stats_split_the_call_into_setup_prefill_decode_and_collect(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=24, graph_capture=False, eos_token_id=[])
    t0 = time.perf_counter()
    s = engine.generate(random_prompts([4, 6]), SamplingConfig(max_new_tokens=5, temperature=0.0, n=2)).stats
    wall = time.perf_counter() - t0
    parts = (s.setup_s, s.prefill_s, s.decode_s, s.collect_s)
    assert all(p > 0 for p in parts) and sum(parts) <= wall
    assert s.steps == 4 and s.tokens == 4 * 5
