"""LoRA RL through peft on CPU: `lora.r` turns it on, only the adapters train (the optimizer holds them alone), the
KL reference is the base with the adapters off (no copy), the export is peft's adapter folder (or the merged
model) and reloads, and a resume is bit-identical."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.train import run

from .test_lightning import small

REWARD = "rewards.0.fn.pattern='.*[a-m].*'"


def lora_names(state: dict) -> list[str]:
    return [k for k in state if "lora_" in k]


HEAD_TOO = ("lora.target_modules=[q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj,"
            "gate_proj,up_proj,down_proj,lm_head]")   # the tied output head adapted too (what the toy task needs)


@pytest.mark.parametrize("targets", [[], [HEAD_TOO]], ids=["all-linear", "and-lm_head"])
def test_only_the_adapters_train_and_the_export_reloads_with_peft(tmp_path, targets):
    from peft import PeftModel
    from transformers import AutoTokenizer

    from segki_lightning.rl.model import tiny_qwen35

    run(small(tmp_path, "lora.r=4", "lora.lora_alpha=8", "algo.learning_rate=0.05", "trainer.max_steps=4",
              "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=-1", f"export_dir={tmp_path / 'adapter'}",
              REWARD, *targets))
    first = torch.load(tmp_path / "checkpoints" / "step-000001.ckpt", weights_only=False)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    changed = [k for k, v in last["state_dict"].items() if not torch.equal(first["state_dict"][k], v)]
    assert changed and all("lora_" in k for k in changed), changed
    assert len(last["optimizer_states"][0]["param_groups"][0]["params"]) == len(lora_names(last["state_dict"]))
    folder = tmp_path / "adapter"
    assert (folder / "adapter_config.json").exists() and (folder / "adapter_model.safetensors").exists()
    tok = AutoTokenizer.from_pretrained(folder)
    reloaded = PeftModel.from_pretrained(tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id), folder)
    trained = {k.removeprefix("policy."): v for k, v in last["state_dict"].items()}
    for k, v in reloaded.get_base_model().state_dict().items():
        assert torch.equal(v, trained[k]), k
    out = reloaded.generate(**tok("1+2=", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert 4 < out.shape[1] <= 4 + 3   # the prompt, then at least one generated token


def test_the_merged_export_is_a_plain_checkpoint_with_the_same_outputs(tmp_path):
    from transformers import AutoModelForCausalLM

    run(small(tmp_path, "lora.r=4", "lora.export_merged=true", "algo.learning_rate=0.05", "trainer.max_steps=2",
              f"export_dir={tmp_path / 'merged'}", REWARD))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    from segki_lightning.rl.lora import apply_lora
    from segki_lightning.rl.model import tiny_qwen35

    peft_model = apply_lora(tiny_qwen35(merged.config.vocab_size, merged.config.pad_token_id,
                                        merged.config.eos_token_id), 4, 32)
    peft_model.get_base_model().load_state_dict({k.removeprefix("policy."): v for k, v in last.items()})
    ids = torch.randint(3, merged.config.vocab_size, (2, 9))
    torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_kl_reference_of_a_lora_policy_is_its_base_without_a_copy():
    from segki_lightning.rl import GRPOConfig, GRPOModule, WeightedReward
    from segki_lightning.rl.lora import apply_lora
    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.rewards import FormatRegex
    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    base_copy = tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id)
    policy = apply_lora(tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id), 4, 8)
    with torch.no_grad():   # non-zero adapters: the policy now differs from its base
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    m = GRPOModule(policy, tok, [WeightedReward(FormatRegex(), 1.0)], GRPOConfig(num_generations=2, beta=0.1,
                                                                                 max_completion_length=4))
    assert m.reference is None and m.has_reference
    ro = m.rollout(m.prompt_ids(["1+2=", "3+4="]), m.sampling(2))
    ref = m.reference_logp(ro)
    want = m.score_all(base_copy, ro).logp
    torch.testing.assert_close(ref, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(m.score_all(m.policy, ro).logp, want, atol=1e-3)
    with pytest.raises(ValueError, match="sync_ref_model=True with a LoRA policy"):
        GRPOModule(policy, tok, [WeightedReward(FormatRegex(), 1.0)], GRPOConfig(beta=0.1, sync_ref_model=True))


def test_a_lora_run_resumes_bit_identically(tmp_path):
    common = ["lora.r=4", "algo.learning_rate=0.05", "trainer.max_steps=4", "checkpoint.every_n_train_steps=1",
              "checkpoint.save_top_k=-1", REWARD]
    run(small(tmp_path / "straight", *common))
    ck = tmp_path / "straight" / "checkpoints"
    run(small(tmp_path / "resumed", f"ckpt_path={ck / 'step-000002.ckpt'}", *common))
    want = torch.load(ck / "last.ckpt", weights_only=False)["state_dict"]
    got = torch.load(tmp_path / "resumed" / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def lora_policy(tmp_path, **lora):
    """The tiny hybrid (fp32) under peft LoRA on every projection, its adapters made non-zero (peft starts B at
    zero): ``(PeftModel, the transformers model inside it)``."""
    from segki_lightning.rl.lora import apply_lora

    from .tiny_models import build_model

    peft_model = apply_lora(build_model("qwen3_5", tmp_path), **{"r": 4, "lora_alpha": 8, **lora})
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return peft_model, peft_model.get_base_model()


def test_lora_layers_run_in_the_fused_segments_and_equal_peft(tmp_path):
    """LoRA projections no longer leave their segments unfused: the engine's greedy rollouts and log-probs, the
    training path's log-probs and the adapters' gradients equal peft's own forward (fp32, CPU), and with the
    adapters off (the KL reference) the injected model is the base."""
    from segki_lightning import RolloutEngine, SamplingConfig, apply_segment_ki, remove_segment_ki
    from segki_lightning.rl.logprobs import completion_logprobs

    from .test_rollout import random_prompts

    peft_model, model = lora_policy(tmp_path)
    prompts = random_prompts([5, 11, 8])
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.0)
    plain = RolloutEngine(model, max_batch_size=8, max_seq_len=40, use_segki=False, graph_capture=False,
                          eos_token_id=[]).generate(prompts, cfg)
    args = (plain.prompt_ids, plain.prompt_mask, plain.completion_ids, plain.completion_mask)
    want = completion_logprobs(model, *args).logp
    loss = -want.sum()
    loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with peft_model.disable_adapter():
        base = completion_logprobs(model, *args).logp.detach()

    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=40, graph_capture=False, eos_token_id=[])
    skipped = [r for rs in engine.report.skipped.values() for r in rs]
    assert engine.report.replaced["gated_mlp"] > 0 and engine.report.replaced["gdn"] > 0 and not skipped, skipped
    fused = engine.generate(prompts, cfg)
    assert torch.equal(fused.completion_ids, plain.completion_ids)
    torch.testing.assert_close(fused.logprobs, want.detach(), rtol=1e-4, atol=1e-4)
    got = completion_logprobs(model, *args).logp
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (-got.sum()).backward()
    assert want_grads and all("lora_" in n for n in want_grads)   # the base is frozen
    for n, p in model.named_parameters():   # fp32, two chunk forms of the GDN rule: relative to each gradient's norm
        if n in want_grads:
            assert (p.grad - want_grads[n]).norm() <= 1e-4 * want_grads[n].norm(), n
    with peft_model.disable_adapter():
        torch.testing.assert_close(completion_logprobs(model, *args).logp.detach(), base, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(base, want.detach(), atol=1e-3)   # the adapters matter
    remove_segment_ki(model)
    report = apply_segment_ki(model)
    assert not [r for rs in report.skipped.values() for r in rs]


def test_lora_dropout_runs_fused_and_is_off_in_rollouts(tmp_path):
    """With lora_dropout > 0 the segments stay fused (peft's dropout module sits in the low-rank path): in eval
    mode (rollouts, log-prob passes) the injected model equals peft's forward; in training mode dropout acts."""
    from segki_lightning import apply_segment_ki

    peft_model, model = lora_policy(tmp_path, lora_dropout=0.3)
    ids = torch.randint(2, 50, (2, 9))
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        report = apply_segment_ki(model)
        assert not [r for rs in report.skipped.values() for r in rs]
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        model.train()
        assert not torch.allclose(model(input_ids=ids).logits, want, atol=1e-3)


def test_a_lora_variant_stays_unfused_and_is_named(tmp_path):
    """DoRA (a LoRA variant the segments do not run): its MLPs are left to peft, one report line each, and the
    model's outputs are peft's."""
    from peft import LoraConfig, get_peft_model

    from segki_lightning import apply_segment_ki

    from .tiny_models import build_model

    cfg = LoraConfig(r=4, use_dora=True, target_modules=["gate_proj", "up_proj", "down_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(build_model("qwen3_5", tmp_path), cfg).get_base_model()
    ids = torch.randint(2, 50, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = apply_segment_ki(model)
    reasons = [why for _, why in report.skipped["gated_mlp"]]
    assert len(reasons) == model.config.num_hidden_layers and all("LoRA variant" in why for why in reasons)
    assert report.replaced["gdn"] > 0   # the rest of each layer stays fused
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)


def test_a_groups_plain_paths_take_one_op_and_equal_peft(tmp_path, monkeypatch):
    """The GDN in-projections' four LoRA paths go through one ``ops.lora_add`` (two launches on a GPU), whose
    reference is peft's forward bit for bit; with dropout live (training mode) or a second active adapter, peft's
    own modules run instead."""
    from segki_lightning import ops
    from segki_lightning.inject import adapters
    from segki_lightning.inject.forwards import GDN_IN

    peft_model, model = lora_policy(tmp_path, lora_dropout=0.2)
    layer = next(m for m in model.modules() if hasattr(m, "in_proj_qkv"))
    lins = [getattr(layer, n) for n in GDN_IN]
    x = torch.randn(3, lins[0].in_features)
    calls = []
    monkeypatch.setattr(ops, "lora_add", lambda x, outs, *rest: calls.append(len(outs)) or
                        ops.dispatch.lora_add(x, outs, *rest))
    model.eval()
    with torch.no_grad():
        want = [lin(x) for lin in lins]   # peft's lora.Linear.forward
        got = adapters.add_loras(lins, x, [lin.base_layer(x) for lin in lins])
    assert calls == [4] and all(torch.equal(g, w) for g, w in zip(got, want))
    model.train()   # dropout acts: peft's modules, not the op
    assert all(adapters.plain_path(lin) is None for lin in lins)
    model.eval()
    peft_model.add_adapter("second", peft_model.peft_config["default"])
    peft_model.base_model.set_adapter(["default", "second"])
    assert all(adapters.plain_path(lin) is None for lin in lins)


def test_the_flop_count_leaves_out_the_frozen_base_weight_gradients(tmp_path):
    """MFU of a LoRA run: the frozen base computes no weight gradients, so forward + backward counts three forwards
    less ``2 x`` each frozen weight per token (full weights: exactly three forwards)."""
    from segki_lightning.rl.flops import FlopShape

    from .tiny_models import build_model

    lengths, scored = [int(n) for n in torch.randint(3, 40, (5,))], 50
    full = FlopShape.of(build_model("qwen3_5", tmp_path / "full"))
    assert full.frozen_body == full.frozen_head == 0 and full.body > 0
    assert full.training(lengths, scored) == 3 * full.forward(lengths, scored)
    peft_model, model = lora_policy(tmp_path)
    lora = FlopShape.of(model)
    base = sum(m.base_layer.weight.numel() for m in model.modules() if hasattr(m, "base_layer"))
    assert lora.frozen_body == base > 0 and lora.body == base + sum(
        p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert lora.frozen_head == lora.head > 0   # the output head is not among all-linear's targets
    want = 3 * lora.forward(lengths, scored) - 2 * base * sum(lengths) - 2 * lora.head * scored
    assert lora.training(lengths, scored) == want


def test_an_8bit_adamw_lora_run_trains_only_the_adapters(tmp_path):
    """``algo.optim=adamw_8bit`` with LoRA: bitsandbytes' optimizer steps the fp32 adapters directly (no masters),
    their moments 8-bit where an adapter has 4096 elements or more; the base stays as it was."""
    pytest.importorskip("bitsandbytes", reason="the [bnb] extra (bitsandbytes) is not installed")
    run(small(tmp_path, "lora.r=64", "algo.optim=adamw_8bit", "algo.learning_rate=0.05", "trainer.max_steps=2",
              "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=-1", "algo.num_generations=4", REWARD))
    first = torch.load(tmp_path / "checkpoints" / "step-000001.ckpt", weights_only=True)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    changed = [k for k, v in last["state_dict"].items() if not torch.equal(first["state_dict"][k], v)]
    assert changed and all("lora_" in k for k in changed), changed
    states = [s.get("__bnb_optimizer_quant_state__", s) for s in last["optimizer_states"][0]["state"].values()]
    assert any(s["state1"].dtype == torch.uint8 for s in states)
