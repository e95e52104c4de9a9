"""Injection invariants on CPU/fp32: same outputs, exact gradients on the original parameters, invisible to
checkpoints, reversible, idempotent, live weights, structural skips."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from segki_lightning import apply_segment_ki, remove_segment_ki
from segki_lightning.inject import KINDS

from .tiny_models import build_model, padded_batch

FAMILIES = ["qwen3_5", "llama", "qwen3"]
# fp32; Qwen3.5 differs from transformers only by the order of the GDN recurrence (its chunked scan vs our
# token-by-token reference), which moves logits by ~1e-5 relative.
TOL = dict(rtol=1e-4, atol=1e-4)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def valid_logits(model, ids, mask):
    return logits(model, ids, mask)[mask.bool()]  # padded positions are don't-care


@pytest.mark.parametrize("family", FAMILIES)
def test_injected_logits_equal_original_with_padding(family, tmp_path):
    model = build_model(family, tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        want = valid_logits(model, ids, mask)
        report = apply_segment_ki(model)
        got = valid_logits(model, ids, mask)
    assert sum(report.replaced.values()) > 0
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_uninjected_on_every_parameter(family, tmp_path):
    model = build_model(family, tmp_path).train()
    twin = copy.deepcopy(model)
    apply_segment_ki(model)
    ids, mask = padded_batch(seed=None)
    target = torch.randn(int(mask.sum()), model.config.vocab_size)
    for m in (model, twin):
        (valid_logits(m, ids, mask) * target).sum().backward()
    # Qwen3.5: transformers runs the GDN recurrence chunked, the reference token by token; the relative
    # gradient difference is ~1e-5 typically with a tail to ~4e-4 on some random models. A wrong gradient is O(1).
    bound = 1e-3 if family == "qwen3_5" else 1e-5
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert p.grad is not None, f"no gradient reached {name}"
        assert rel_err(p.grad, q.grad) < bound, f"gradient of {name}: {rel_err(p.grad, q.grad):.2e}"


def test_fused_segments_backprop_for_3d_activations(tmp_path):
    """Module-level: [B, T, H] activations through every replaced module type, gradients vs original."""
    model = build_model("qwen3_5", tmp_path).train()
    twin = copy.deepcopy(model)
    apply_segment_ki(model)
    layer, layer0 = model.model.layers[0], twin.model.layers[0]
    for name in ("mlp", "linear_attn", "input_layernorm"):
        x = torch.randn(2, 7, 64, requires_grad=True)
        x0 = x.detach().clone().requires_grad_()
        g = torch.randn(2, 7, 64)
        (getattr(layer, name)(x) * g).sum().backward()
        (getattr(layer0, name)(x0) * g).sum().backward()
        torch.testing.assert_close(x.grad, x0.grad, rtol=1e-4, atol=1e-5)
        for (pn, p), p0 in zip(getattr(layer, name).named_parameters(), getattr(layer0, name).parameters()):
            torch.testing.assert_close(p.grad, p0.grad, rtol=1e-4, atol=1e-5, msg=f"{name}.{pn}")


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_is_untouched(family, tmp_path):
    model = build_model(family, tmp_path)
    before = {k: (v.data_ptr(), v.shape, v.dtype) for k, v in model.state_dict().items()}
    n_params, n_buffers = len(list(model.parameters())), len(list(model.buffers()))
    apply_segment_ki(model)
    after = {k: (v.data_ptr(), v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert before == after
    assert (len(list(model.parameters())), len(list(model.buffers()))) == (n_params, n_buffers)


def test_apply_twice_equals_once_and_remove_restores(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        want = logits(model, ids, mask)
    first = apply_segment_ki(model)
    forwards = {m: m.__dict__.get("forward") for m in model.modules()}
    second = apply_segment_ki(model)
    assert second is first
    assert forwards == {m: m.__dict__.get("forward") for m in model.modules()}
    remove_segment_ki(model)
    assert not any("forward" in m.__dict__ or "_segki_spec" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(logits(model, ids, mask), want)
    remove_segment_ki(model)  # removing twice is harmless


def test_live_weights_after_optimizer_step(tmp_path):
    model = build_model("qwen3_5", tmp_path).train()
    apply_segment_ki(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids, mask = padded_batch()
    (valid_logits(model, ids, mask) ** 2).mean().backward()
    opt.step()
    fresh = build_model("qwen3_5", tmp_path, seed=0)  # same architecture, uninjected
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(valid_logits(model, ids, mask), valid_logits(fresh, ids, mask), **TOL)


def test_report_counts_every_segment_of_tiny_qwen35(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    report = apply_segment_ki(model)
    assert report.found["gated_mlp"] == report.replaced["gated_mlp"] == 4
    assert report.found["gdn"] == report.replaced["gdn"] == 3
    assert report.found["attention_qkv"] == report.replaced["attention_qkv"] == 1
    assert report.found["attention"] == report.replaced["attention"] == 1  # its decode probe passed
    assert report.replaced["decoder_layer"] == 4
    # 2 per layer + final norm + q_norm/k_norm of the attention layer; GDN's gated norm is part of "gdn"
    assert report.replaced["rms_norm"] == 11
    assert all(not v for v in report.skipped.values()), report
    assert report.backends["gdn"]["gdn_in_proj"] == "reference"  # CPU
    assert "gated_mlp" in str(report) and report.to_dict()["replaced"]["gdn"] == 3


def test_gelu_gated_mlp_is_skipped_and_unchanged(tmp_path):
    model = build_model("gemma", tmp_path)
    ids, mask = padded_batch()
    with torch.no_grad():
        want = valid_logits(model, ids, mask)
        report = apply_segment_ki(model)
        got = valid_logits(model, ids, mask)
    assert report.found["gated_mlp"] == 2 and report.replaced["gated_mlp"] == 0
    assert all("not SiLU" in why for _, why in report.skipped["gated_mlp"])
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
    torch.testing.assert_close(got, want, **TOL)


class QuantLinear(nn.Linear):
    """Stands in for a quantized / adapter Linear subclass."""


def test_non_plain_linears_and_hooked_modules_are_never_fused(tmp_path):
    model = build_model("llama", tmp_path)
    layer0, layer1 = model.model.layers
    old = layer0.mlp.gate_proj
    layer0.mlp.gate_proj = QuantLinear(old.in_features, old.out_features, bias=False)
    layer0.mlp.gate_proj.weight = old.weight
    layer1.self_attn.k_proj.register_forward_hook(lambda *a: None)
    report = apply_segment_ki(model)
    skipped = dict(report.skipped["gated_mlp"]) | dict(report.skipped["attention_qkv"])
    assert "not a plain nn.Linear" in skipped["model.layers.0.mlp"]
    assert "hooks" in skipped["model.layers.1.self_attn"]
    assert report.replaced["gated_mlp"] == 1 and report.replaced["attention_qkv"] == 1


def test_verification_rejects_a_layer_that_is_not_plain_pre_norm(tmp_path):
    """Granite scales the residual branch: same attribute names, different math -> not fused."""
    from transformers import AutoModelForCausalLM, GraniteConfig

    cfg = GraniteConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=97, residual_multiplier=0.5, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        want = valid_logits(model, ids, mask)
        report = apply_segment_ki(model)
        got = valid_logits(model, ids, mask)
    assert report.replaced["decoder_layer"] == 0
    assert all("verification failed" in why for _, why in report.skipped["decoder_layer"])
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("family", ["qwen3_5", "llama", "qwen3", "gemma"])
def test_attention_decode_is_replaced_only_where_its_probe_agrees(family, tmp_path):
    """The structure cannot show the RoPE form or what happens at a one-token step; the decode probe can.
    Here the model's attention behaves differently only for one-token steps on a cache: the owner check
    (a full-sequence call) passes, the decode probe must not, and the original forward stays."""
    model = build_model(family, tmp_path)
    attn_type = type(model.model.layers[-1].self_attn)

    class DecodeDiffers(attn_type):
        @functools.wraps(attn_type.forward)  # same signature as the model's own
        def forward(self, hidden_states, *args, **kwargs):
            out, weights = super().forward(hidden_states, *args, **kwargs)
            return (out * 1.5 if hidden_states.shape[1] == 1 else out), weights

    control = build_model(family, tmp_path)
    assert apply_segment_ki(control).replaced["attention"] == len(control.model.layers) - (3 if family == "qwen3_5" else 0)
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.__class__ = DecodeDiffers
    report = apply_segment_ki(model)
    assert report.replaced["attention"] == 0 and report.found["attention"] >= 1
    assert all("verification failed" in why for _, why in report.skipped["attention"]), report.skipped["attention"]
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers if hasattr(layer, "self_attn"))


def test_unknown_kind_is_a_clear_error(tmp_path):
    model = build_model("llama", tmp_path)
    with pytest.raises(ValueError, match="unknown segment kinds"):
        apply_segment_ki(model, kinds=["mlp"])
    report = apply_segment_ki(model, kinds=["gated_mlp"])
    assert report.replaced["gated_mlp"] == 2 and report.replaced["rms_norm"] == 0
    assert set(KINDS) >= set(report.replaced)


def test_generate_with_transformers_cache_still_works(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    ids = torch.randint(2, 97, (1, 6))
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **kw)
    apply_segment_ki(model)
    assert torch.equal(model.generate(ids, **kw), want)


def test_public_exports():
    import segki_lightning

    assert segki_lightning.apply_segment_ki is apply_segment_ki
    assert segki_lightning.remove_segment_ki is remove_segment_ki


def test_attention_decode_takes_rope_tables_broadcast_over_rows(tmp_path):
    """Position embeddings computed for one row ([1, 1, R]) serve every row, as the model's own code allows."""
    from segki_lightning.inject.verify import _ProbeCache

    model = build_model("qwen3_5", tmp_path)
    apply_segment_ki(model)
    attn = model.model.layers[-1].self_attn
    d, hkv = attn.head_dim, attn.k_proj.out_features // attn.head_dim
    x = torch.randn(2, 1, attn.q_proj.in_features)
    keys, values, positions = torch.randn(2, hkv, 6, d), torch.randn(2, hkv, 6, d), torch.tensor([2, 4])
    r = 4  # the tiny config's rotary width (partial rotary)
    cos, sin = torch.randn(1, 1, r), torch.randn(1, 1, r)
    outs = []
    for tables in ((cos, sin), (cos.expand(2, 1, r), sin.expand(2, 1, r))):
        cache = _ProbeCache(keys.clone(), values.clone(), positions)
        with torch.no_grad():
            outs.append((attn(x, position_embeddings=tables, attention_mask=None, cache=cache)[0], cache.keys))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
