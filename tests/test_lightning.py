"""Lightning integration on CPU: recipes compose, segki-train runs, the co-location contract, teardown,
checkpoints, resume and export."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from segki_lightning.lightning import SegKICallback
from segki_lightning.rl import ExactMatch, FormatRegex, GRPOConfig, GRPOModule, LengthPenalty, WeightedReward
from segki_lightning.rl import gae, group_advantages, grpo_loss, ppo_loss
from segki_lightning.rl import PPOConfig
from segki_lightning.train import CONFIGS, RECIPES, run

ROOT = Path(__file__).resolve().parent.parent


def compose(overrides=(), name="grpo"):
    from hydra import compose as hcompose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from segki_lightning.schema import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(RECIPES)):
        return hcompose(config_name=name, overrides=[f"hydra.searchpath=[file://{CONFIGS}]", *overrides])


def small(tmp_path, *extra, name="grpo"):
    return compose(name=name, overrides=[f"trainer.default_root_dir={tmp_path}", "trainer.enable_progress_bar=false",
                    "task.prompts_per_step=2", "algo.num_generations=2", "algo.max_completion_length=3",
                    "trainer.max_steps=2", *extra])


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_every_recipe_composes_and_instantiates(tmp_path, name):
    from hydra.utils import instantiate

    cfg = small(tmp_path, name=name)
    rewards = [instantiate(r) for r in cfg.rewards]
    assert [type(r.fn) for r in rewards] == [FormatRegex, ExactMatch] and [r.weight for r in rewards] == [0.5, 0.5]
    assert cfg.algo.reward_weights is None   # so `rewards=[my_fn]` alone replaces the recipe's two
    assert cfg.rollout.use_segki and cfg.rollout.graph_capture and cfg.algorithm == name
    assert (RECIPES / f"{name}.yaml").read_text().splitlines()[0] == f"# segki-train --config-name {name}"


def test_a_typo_fails_with_the_key_name(tmp_path):
    with pytest.raises(Exception, match="max_stepz"):
        small(tmp_path, "trainer.max_stepz=3")


@pytest.fixture(scope="module")
def three_step_runs(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """The GRPO and PPO recipes from the command line, both at once (each process imports on one core of its own):
    the console script, run in a folder holding a reward's module with no PYTHONPATH (the module imports from where
    it runs). By recipe: exit code, output, folder."""
    import os
    import shutil

    script = shutil.which("segki-train", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "segki_lightning.train"]   # (installed: the script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("OMP_NUM_THREADS", "1")   # two processes on two cores
    procs = {}
    for name in ("grpo", "ppo"):
        folder = tmp_path_factory.mktemp(name)
        (folder / "my_rewards.py").write_text("def short(prompts, completions, **kw):\n"
                                              "    return [float(len(str(c)) < 3) for c in completions]\n")
        out = open(folder / "output.txt", "w")
        args = ["--config-name", name, "trainer.max_steps=3", "task.prompts_per_step=2", "algo.num_generations=2",
                "algo.reward_weights=null",
                "rewards=[my_rewards.short,{_target_:segki_lightning.rl.rewards.ExactMatch,column:answer}]",
                f"hydra.run.dir={folder / 'run'}"]
        proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, cwd=folder, env=env)
        procs[name] = (proc, out, folder)
    runs = {}
    for name, (proc, out, folder) in procs.items():
        code = proc.wait(timeout=600)
        out.close()
        runs[name] = (code, (folder / "output.txt").read_text(), folder)
    return runs


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_segki_train_runs_three_steps(three_step_runs, name):
    """The recipe from the command line (:func:`three_step_runs`): the metrics a TRL user looks for, the update's
    parts adding up, one segment report and one rollout-path line a run, a progress bar in steps (not Lightning's
    epochs of -1 steps)."""
    code, text, folder = three_step_runs[name]
    assert code == 0, text[-3000:]
    assert text.count("injected segments") == 1 and text.count("rollout path") == 1
    assert "step: 100%" in text and "Epoch 0/-2" not in text
    assert "falling back to its reference PyTorch implementation" not in text   # CPU: does not apply
    metrics = (folder / "run" / "logs" / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    for key in ("train/reward", "train/reward_std", "train/kl", "train/clip_ratio", "train/completion_length",
                "train/loss", "rollout/tokens_per_s", "rollout/time_share", "time/step_s", "time/rollout_s",
                "time/rollout_setup_s", "time/rollout_prefill_s", "time/rollout_decode_s", "time/rollout_collect_s",
                "time/gc_s", "time/gc_full", "time/update_s", "time/optimizer_s", "time/forward_s", "time/backward_s",
                "train/rewards/exact_match", "train/rewards/short"):
        assert key in header, key
    assert len(metrics) >= 4
    steps = [r for r in csv.DictReader(metrics) if r["time/step_s"]]
    for r in steps:   # parts of the update that add up to it
        parts = [float(r[f"time/{p}_s"]) for p in ("forward", "backward", "optimizer")]
        assert all(v > 0 for v in parts) and sum(parts) == pytest.approx(float(r["time/update_s"]), rel=1e-6), r


def tiny_module(**cfg):
    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    policy = tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id, seed=int(torch.randint(0, 1000, ())))
    rewards = [WeightedReward(FormatRegex(), 0.5), WeightedReward(ExactMatch(), 0.5)]
    return GRPOModule(policy, tok, rewards, GRPOConfig(num_generations=4, max_completion_length=5, **cfg))


def test_colocation_contract(tmp_path):
    """Rollout, one optimizer step, rollout again with the same injected model."""
    module = tiny_module()
    cb = SegKICallback(max_batch_size=16, max_seq_len=32)
    cb.on_fit_start(None, module)
    engine, report = cb.engine, cb.engine.report
    ptrs = {n: p.data_ptr() for n, p in module.policy.named_parameters()}
    prompts = ["1+2=", "3+4="]
    from segki_lightning.rollout import SamplingConfig

    greedy = SamplingConfig(max_new_tokens=5, temperature=0.0, n=1)
    before = module.rollout(prompts, greedy).completion_ids
    opt = module.configure_optimizers()["optimizer"]
    module.train()
    loss = module.training_step({"prompt": prompts, "answer": ["3", "7"]}, 0)
    loss = loss + 0.0 * sum(p.sum() for p in module.policy.parameters())  # every parameter in the graph
    loss.backward()
    missing = [n for n, p in module.policy.named_parameters() if p.grad is None]
    assert not missing, missing
    opt.step()
    with torch.no_grad():  # a decisive update so the greedy rollout must move
        for p in module.policy.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    after = module.rollout(prompts, greedy).completion_ids
    assert not torch.equal(before, after)
    assert cb.engine is engine and engine.report is report  # no re-injection, same engine
    assert {n: p.data_ptr() for n, p in module.policy.named_parameters()} == ptrs  # no weight copies
    assert cb.state_dict()["rollouts"] == 3 and module.training
    cb.teardown(None, module, "fit")
    assert not any("forward" in m.__dict__ for m in module.policy.modules())


def test_checkpoint_keys_equal_a_plain_run_and_resume_continues(tmp_path):
    a, b = tmp_path / "segki", tmp_path / "plain"
    run(small(a, "checkpoint.every_n_train_steps=1"))
    run(small(b, "rollout.use_segki=false", "rollout.graph_capture=false"))
    ck_a = torch.load(a / "checkpoints" / "last.ckpt", weights_only=False)
    ck_b = torch.load(b / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck_a["state_dict"].keys() == ck_b["state_dict"].keys()
    assert ck_a["global_step"] == 2
    cb_state = next(v for k, v in ck_a["callbacks"].items() if "SegKICallback" in k)
    assert cb_state["rollouts"] == 2 and cb_state["tokens"] > 0
    run(small(a, f"ckpt_path={a / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=4",
              "checkpoint.every_n_train_steps=1"))
    resumed = torch.load(a / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == 4
    assert next(v for k, v in resumed["callbacks"].items() if "SegKICallback" in k)["rollouts"] == 4


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """A 4-step run resumed from its own step-2 checkpoint ends where it did, bit for bit: policy, optimizer
    moments, data order and the rollouts' sampling seeds all continue where they stopped (the same learning-rate
    schedule: a 2-step run resumed to 4 would have stepped on another one). A reward that random completions often
    earn (a letter a-m anywhere) keeps the advantages, hence the updates, non-zero on some steps."""
    reward = "rewards.0.fn.pattern='.*[a-m].*'"
    straight, a = tmp_path / "straight", tmp_path / "resumed"
    common = ["trainer.max_steps=4", "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=-1", reward]
    run(small(straight, *common))
    at_two = torch.load(straight / "checkpoints" / "step-000002.ckpt", weights_only=False)["state_dict"]
    run(small(a, f"ckpt_path={straight / 'checkpoints' / 'step-000002.ckpt'}", *common))
    resumed = torch.load(a / "checkpoints" / "last.ckpt", weights_only=False)
    want = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)
    assert resumed["global_step"] == want["global_step"] == 4
    assert any(not torch.equal(at_two[k], v) for k, v in resumed["state_dict"].items()), "steps 3-4 changed nothing"
    for key, value in want["state_dict"].items():
        assert torch.equal(resumed["state_dict"][key], value), key
    got_opt, want_opt = resumed["optimizer_states"][0]["state"], want["optimizer_states"][0]["state"]
    for i, st in want_opt.items():
        assert all(torch.equal(got_opt[i][name], v) for name, v in st.items() if torch.is_tensor(v)), i


def test_export_reloads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run(small(tmp_path, f"export_dir={tmp_path / 'export'}"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    tok = AutoTokenizer.from_pretrained(tmp_path / "export")
    assert tok("1+2=")["input_ids"] and model.config.model_type == "qwen3_5_text"


def test_sharded_strategy_fails_fast():
    class FSDPStrategy:  # what Lightning's FSDP strategy is called
        pass

    trainer = type("T", (), {"strategy": FSDPStrategy()})()
    with pytest.raises(RuntimeError, match="ddp"):
        SegKICallback().setup(trainer, tiny_module(), "fit")
    with pytest.raises(ValueError, match="max_batch_size"):
        SegKICallback(max_batch_size=0)


def test_rewards_and_advantages():
    assert ExactMatch()(["q"] * 3, ["so 12", "7", "x"], answer=["12", "8", "1"]) == [1.0, 0.0, 0.0]
    assert FormatRegex()([""] * 2, ["42", "4 2"]) == [1.0, 0.0]
    assert LengthPenalty(4)([""] * 3, ["abc", "abcdef", "a" * 20]) == [0.0, -0.5, -1.0]
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv = group_advantages(r, 2, "none")
    assert torch.equal(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert torch.allclose(group_advantages(r, 2, "group")[:2], torch.tensor([0.7071, -0.7071]), atol=1e-3)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_gradient_is_the_policy_gradient(loss_type):
    logp = torch.randn(4, 3, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    cfg = GRPOConfig(loss_type=loss_type, max_completion_length=3)
    loss, stats = grpo_loss(logp, logp.detach(), None, adv, mask, cfg)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all()
    signs = torch.sign(-logp.grad[:, 0])
    assert torch.equal(signs, torch.sign(adv))  # ascend on positive advantages
    assert stats["clip_ratio"] == 0


def test_gae_matches_a_hand_computation():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.9, 0.9]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    d2 = 1.0 - 0.3
    d1 = 0.0 + 0.9 * 0.3 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.1
    a1 = d1 + 0.45 * d2
    want0 = torch.tensor([d0 + 0.45 * a1, a1, d2])
    torch.testing.assert_close(adv[0], want0)
    torch.testing.assert_close(adv[1], torch.tensor([0.5 - 0.4, 0.0, 0.0]))  # ends after one token
    torch.testing.assert_close(ret, adv + values * mask)


def test_ppo_loss_clips_values_and_ratios():
    cfg = PPOConfig(cliprange=0.2, cliprange_value=0.1, vf_coef=0.5)
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.tensor([[0.0, -1.0]])            # second token: ratio e > 1 + 0.2 -> clipped
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    loss, stats = ppo_loss(logp, old, values, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]),
                           torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), cfg)
    loss.backward()
    assert logp.grad[0, 1] == 0 and logp.grad[0, 0] < 0      # clipped token gives no policy gradient
    assert stats["clip_ratio"] == 0.5
    # value 1.0 vs old 0 is clipped to 0.1, but the unclipped error is larger, so it is used (max)
    assert values.grad[0, 0] > 0


def test_weight_checksum_is_chunk_independent_and_sees_one_bit(monkeypatch):
    """The rank-consistency checksum: the same value whatever the chunking (so it may be computed in pieces on
    the parameters' device), and a single flipped bit changes it."""
    from segki_lightning.lightning import consistency

    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5)).bfloat16()
    whole_value = consistency.weight_checksum(model)
    monkeypatch.setattr(consistency, "CHUNK", 7)
    assert torch.equal(consistency.weight_checksum(model), whole_value)
    with torch.no_grad():
        bits = model[1].weight.view(torch.int16)
        bits[2, 3] ^= 1
    assert not torch.equal(consistency.weight_checksum(model), whole_value)


def one_reward(prompts, completions, **columns):
    return [1.0] * len(completions)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_overriding_rewards_alone_replaces_the_recipes(tmp_path, name):
    """`rewards=[my_fn]` with no other override: one reward at TRL's weight 1.0 (the recipes weight theirs in
    WeightedReward nodes, not in algo.reward_weights)."""
    from segki_lightning.rl.rewards import as_rewards
    from segki_lightning.train import build_rewards

    cfg = small(tmp_path, "rewards=[tests.test_lightning.one_reward]", name=name)
    (r,) = as_rewards(build_rewards(cfg), cfg.algo.reward_weights)
    assert r.fn is one_reward and r.weight == 1.0


