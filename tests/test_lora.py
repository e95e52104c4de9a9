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
