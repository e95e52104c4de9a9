"""Packed projection weights (inject.packing): the same Parameters in one buffer per group, the joint product past
the GEMV rows, and everything that holds the Parameters (optimizer, gradients, checkpoints, export) unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from segki_lightning import RolloutEngine, SamplingConfig
from segki_lightning.inject import apply_segment_ki, pack_projections, remove_segment_ki, unpack_projections
from segki_lightning.inject.packing import projection_groups
from segki_lightning.ops import dispatch, joint_weight

from .tiny_models import VOCAB, build_model, padded_batch


def packed_model(tmp_path, seed=None):
    model = build_model("qwen3_5", tmp_path, seed=seed)
    apply_segment_ki(model)
    return model


def test_packing_moves_storage_only(tmp_path):
    """Every gate|up and GDN input-projection group becomes one buffer; the Parameters, their names, values and
    count are the same; packing twice moves nothing; removal gives each weight its own storage back."""
    model = packed_model(tmp_path)
    params = dict(model.named_parameters())
    values = {k: v.clone() for k, v in model.state_dict().items()}
    assert pack_projections(model) == 4 + 3 + 1      # 4 MLPs, 3 Gated-DeltaNet blocks, 1 attention block
    assert pack_projections(model) == 0
    assert all(joint_weight(*ws) is not None for ws in projection_groups(model))
    assert dict(model.named_parameters()) == params  # same objects under the same names
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())
    groups = projection_groups(model)
    remove_segment_ki(model)
    assert all(joint_weight(*ws) is None for ws in groups)
    assert all(w.untyped_storage().nbytes() == w.numel() * w.element_size() for ws in groups for w in ws)
    assert all(torch.equal(v, values[k]) for k, v in model.state_dict().items())


def test_only_owners_of_their_storage_are_packed(tmp_path):
    """A weight that is a view of a larger buffer (a shard, a gathered buffer, a tied weight) keeps its storage."""
    model = packed_model(tmp_path)
    mlp = model.model.layers[0].mlp
    big = torch.zeros(2 * mlp.up_proj.weight.numel() + 8)
    with torch.no_grad():
        mlp.up_proj.weight.data = big[8:8 + mlp.up_proj.weight.numel()].view_as(mlp.up_proj.weight).copy_(
            mlp.up_proj.weight)
    assert pack_projections(model) == 3 + 3 + 1
    assert joint_weight(mlp.gate_proj.weight, mlp.up_proj.weight) is None


def test_attention_projections_with_biases_stay_apart(tmp_path):
    """q|k|v with biases are not packed (one product would leave the biases out); the MLPs still are."""
    model = build_model("llama", tmp_path, attention_bias=True)
    apply_segment_ki(model)
    assert pack_projections(model) == 2
    attn = model.model.layers[0].self_attn
    assert joint_weight(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight) is None
    plain = build_model("llama", tmp_path)
    apply_segment_ki(plain)
    assert pack_projections(plain) == 2 + 2


def test_joint_product_only_without_autograd(tmp_path):
    """One product over the packed buffer only when no gradient is recorded (the joint view is not an autograd
    view of the Parameters), split into each weight's output."""
    model = packed_model(tmp_path)
    pack_projections(model)
    mlp = model.model.layers[0].mlp
    ws = (mlp.gate_proj.weight, mlp.up_proj.weight)
    x = torch.randn(3, 5, 64)
    assert dispatch._joint_product(x, ws) is None                       # grad mode, weights require grad
    with torch.no_grad():
        gate, up = dispatch._joint_product(x, ws)
    assert gate.shape == up.shape == (15, 128) and gate.stride() == (256, 1)
    torch.testing.assert_close(gate, F.linear(x, ws[0]).reshape(15, 128), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(up, F.linear(x, ws[1]).reshape(15, 128), rtol=1e-6, atol=1e-6)
    unpack_projections(model)
    with torch.no_grad():
        assert dispatch._joint_product(x, ws) is None


def test_packed_forward_gradients_and_optimizer_steps(tmp_path, monkeypatch):
    """Training through packed weights: the same loss and gradients as the unpacked model, gradients on each
    Parameter, and an optimizer step writes into the packed buffer (the joint view sees the new values). With
    SEGKI_JOINT=0 the no-grad forward takes one product per weight and gives the same logits."""
    model = packed_model(tmp_path, seed=3)
    twin = copy.deepcopy(model)
    pack_projections(model)
    ids, mask = padded_batch(seed=4)
    losses = []
    for m in (model, twin):
        m.train()
        out = m(input_ids=ids, attention_mask=mask).logits
        loss = out.float().logsumexp(-1).mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (n, p), p2 in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, p2.grad, rtol=1e-5, atol=1e-6, msg=n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.step()
    mlp = model.model.layers[1].mlp
    joint = joint_weight(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert joint is not None and torch.equal(joint[:128], mlp.gate_proj.weight)
    assert not torch.equal(mlp.gate_proj.weight, twin.model.layers[1].mlp.gate_proj.weight)
    model.eval()
    with torch.no_grad():
        joint_logits = model(input_ids=ids, attention_mask=mask).logits
        monkeypatch.setattr(dispatch, "JOINT", False)
        separate_logits = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(joint_logits, separate_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
@pytest.mark.parametrize("rows", [2, 20])
def test_packed_rollout_equals_unpacked(tmp_path, rows, family):
    """Greedy rollouts of a packed and an unpacked engine agree token for token (fp32: the joint product and the
    separate ones differ by summation order at most), for batches below and past the GEMV rows."""
    model = build_model(family, tmp_path, seed=11)
    twin = copy.deepcopy(model)
    packed = RolloutEngine(model, max_batch_size=32, max_seq_len=40, graph_capture=False, eos_token_id=[])
    plain = RolloutEngine(twin, max_batch_size=32, max_seq_len=40, graph_capture=False, eos_token_id=[],
                          pack_weights=False)
    assert all(joint_weight(*ws) is not None for ws in projection_groups(model))
    assert all(joint_weight(*ws) is None for ws in projection_groups(twin))
    g = torch.Generator().manual_seed(rows)
    lengths = torch.randint(1, 20, (rows,), generator=g).tolist()
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in lengths]
    greedy = SamplingConfig(max_new_tokens=12, temperature=0.0)
    a, b = packed.generate(prompts, greedy), plain.generate(prompts, greedy)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-4, atol=1e-4)


def test_the_engine_packs_again_after_the_weights_moved(tmp_path, monkeypatch):
    """Weights given new storage after the engine was built (as ``model.to()`` does) are packed again by the next
    rollout, and only then: rollouts on unmoved weights do not walk the groups; with ``pack_weights=False`` they are
    left alone."""
    from segki_lightning.rollout import engine as engine_module

    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=24, graph_capture=False, eos_token_id=[])
    assert all(joint_weight(*ws) is not None for ws in projection_groups(model))
    walks = []
    monkeypatch.setattr(engine_module, "pack_projections", lambda m: walks.append(m) or pack_projections(m))
    greedy = SamplingConfig(max_new_tokens=2, temperature=0.0)
    engine.generate([[3, 4, 5]], greedy)
    assert len(walks) == 1                     # the first rollout records the packed addresses
    engine.generate([[3, 4, 5]], greedy)
    assert len(walks) == 1
    unpack_projections(model)
    engine.generate([[3, 4, 5]], greedy)
    assert len(walks) == 2 and all(joint_weight(*ws) is not None for ws in projection_groups(model))
    engine.generate([[3, 4, 5]], greedy)
    assert len(walks) == 2
    engine.pack_weights = False
    unpack_projections(model)
    engine.generate([[3, 4, 5]], SamplingConfig(max_new_tokens=2, temperature=0.0))
    assert all(joint_weight(*ws) is None for ws in projection_groups(model))


def test_save_pretrained_while_packed_and_after_removal(tmp_path):
    """A packed model saves and reloads with the same weights (transformers clones disjoint views of one storage),
    and so does one after removal (each weight its own storage again)."""
    from transformers import AutoModelForCausalLM

    model = packed_model(tmp_path)
    pack_projections(model)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for name in ("packed", "removed"):
        if name == "removed":
            remove_segment_ki(model)
        model.save_pretrained(tmp_path / name)
        got = AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
