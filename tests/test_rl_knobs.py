"""The RL knobs beyond TRL's first GRPO: LUSPO and VESPO losses, the entropy bonus, the reference-model sync, the
RLOO and REINFORCE++-baseline advantage estimators and the soft overlong punishment -- each against a
transcription of the formula of the library that defines it (TRL 1.x's GRPOTrainer, RLOOTrainer and
get_soft_overlong_punishment; verl's REINFORCE++-baseline with its masked_whiten), on fresh random inputs."""
from __future__ import annotations

import copy
import csv
import math

import pytest
import torch

from segki_lightning.rl import GRPOConfig, PPOConfig
from segki_lightning.rl.advantages import reinforce_pp_advantages, rloo_advantages
from segki_lightning.rl.grpo import mix_into
from segki_lightning.rl.losses import Totals, entropy_bonus, grpo_loss
from segki_lightning.rl.rewards import get_soft_overlong_punishment

from .test_lightning import tiny_module


def rand_batch(n=6, t=9, seed=None):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())) if seed is None else seed)
    logp = -torch.rand(n, t, generator=gen, dtype=torch.float64) * 3
    old = logp + torch.randn(n, t, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    return logp, old, adv, mask, gen


# --- transcriptions (TRL 1.x GRPOTrainer._compute_loss / get_gamma_weights) ---------------------------------

def trl_luspo(logp, old, adv, mask, eps_lo, eps_hi):
    log_w = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)      # sequence level
    coef_1 = torch.exp(log_w.unsqueeze(-1))
    coef_2 = torch.clamp(coef_1, 1 - eps_lo, 1 + eps_hi)
    per_token_loss = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))   # (B, 1)
    return (per_token_loss * mask.sum(1, keepdim=True)).mean()


@torch.no_grad()   # as TRL's: phi only scales the gradient
def trl_gamma_weights(adv, log_ratio, mask, is_ratio, k_pos, lam_pos, k_neg, lam_neg):
    lower = math.log(1e-8)
    seq = torch.sum(torch.clamp(log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    if is_ratio is not None:
        seq = seq + torch.sum(torch.clamp(torch.log(is_ratio), lower, 20.0), dim=-1, keepdim=True)
    log_w = torch.clamp(seq, lower, 20.0)
    w = torch.exp(log_w)
    nonneg = adv.unsqueeze(-1) >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lam_pos, lam_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def trl_vespo(logp, old, adv, mask, is_ratio, cfg):
    phi = trl_gamma_weights(adv, logp - old, mask, is_ratio, cfg.vespo_k_pos, cfg.vespo_lambda_pos,
                            cfg.vespo_k_neg, cfg.vespo_lambda_neg)
    per_token_loss = -phi * adv.unsqueeze(1) * logp
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)   # dapo's normaliser, one process


def test_luspo_equals_trl():
    logp, old, adv, mask, _ = rand_batch()
    cfg = GRPOConfig(loss_type="luspo", importance_sampling_level="sequence", epsilon_high=0.28)
    got, _ = grpo_loss(logp, old, None, adv, mask, cfg)
    assert torch.allclose(got, trl_luspo(logp, old, adv, mask, 0.2, 0.28), rtol=1e-12, atol=0)


@pytest.mark.parametrize("with_sampler", [False, True])
def test_vespo_equals_trl(with_sampler):
    logp, old, adv, mask, gen = rand_batch()
    cfg = GRPOConfig(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    ratio = None
    if with_sampler:   # token-level sampler correction, 1 on padding (as TRL's importance_sampling_ratio)
        ratio = torch.where(mask.bool(), torch.rand(mask.shape, generator=gen, dtype=torch.float64) + 0.5, 1.0)
    logp.requires_grad_(True)
    got, _ = grpo_loss(logp, old, None, adv, mask, cfg, sampler_ratio=ratio)
    want = trl_vespo(logp, old, adv, mask, ratio, cfg)
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
    g_got, = torch.autograd.grad(got, logp, retain_graph=True)
    g_want, = torch.autograd.grad(want, logp)
    assert torch.allclose(g_got, g_want, rtol=1e-12, atol=0)   # phi is a detached scale in both


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_entropy_bonus_is_the_steps_mean_token_entropy(loss_type):
    """TRL: ``loss - entropy_coef * H`` with H the mean per-token entropy of the step; dapo-like losses divide
    by the global token count, the others take the token mean. Summed over two micro-batches: the step's mean."""
    _, _, _, mask, gen = rand_batch()
    entropy = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    totals = Totals.of(mask)
    parts = sum(entropy_bonus(entropy[r], mask[r], loss_type, totals) for r in (slice(0, 2), slice(2, None)))
    assert torch.allclose(parts, (entropy * mask).sum() / mask.sum(), rtol=1e-12, atol=0)


def trl_nanstd(tensor, dim=None, keepdim=False):   # trl.trainer.utils.nanstd
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    return std if keepdim or dim is None else std.squeeze(dim)


def trl_normalize_then_sum(rewards_per_func, reward_weights, num_generations):   # GRPOTrainer, one process
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    grouped = rewards_per_func.view(-1, num_generations, rewards_per_func.shape[1])
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_nanstd(grouped, dim=1, keepdim=True)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, rewards_per_func.shape[1])
    rewards = (reward_k * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    std_rewards = trl_nanstd(rewards).expand_as(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def trl_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
    kl_div = sampling_per_token_logps - per_token_logps.detach()
    seq_kl_sum = (kl_div * mask).sum(dim=1, keepdim=True)
    avg_seq_kl = seq_kl_sum / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (avg_seq_kl <= off_policy_threshold)).to(dtype=mask.dtype)


def test_gdpo_advantages_equal_trls_normalize_then_sum():
    """Fresh random rewards of three functions, some not applying (NaN) to some rows and none to one row, one
    function constant within a group: the advantages equal TRL's ``normalize_then_sum`` (bit for bit)."""
    from segki_lightning.rl.advantages import gdpo_advantages

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    g, groups = 4, 5
    table = torch.randn(g * groups, 3, generator=gen) * torch.tensor([1.0, 10.0, 0.1])
    table[torch.rand(table.shape, generator=gen) < 0.2] = float("nan")
    table[3] = float("nan")             # a row no function applies to
    table[4:8, 0] = 2.0                 # a group where function 0 does not vary
    weights = torch.rand(3, generator=gen) + 0.5
    assert torch.equal(gdpo_advantages(table, weights, g), trl_normalize_then_sum(table, weights, g))


def test_a_normalize_then_sum_rollout_takes_each_functions_values():
    """The module forms GDPO's advantages from the ``[N, F]`` table its reward functions returned, whose
    weighted sum is the logged reward."""
    from segki_lightning.rl.advantages import gdpo_advantages

    module = tiny_module(multi_objective_aggregation="normalize_then_sum")
    buf = module.prepare({"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]})
    table = buf.scored.per_function
    weights = torch.tensor([r.weight for r in module.rewards])
    assert table.shape == (len(buf.scored.batch), len(module.rewards))
    assert torch.allclose(torch.nansum(table * weights, 1), buf.scored.rewards)
    assert torch.equal(buf.data["adv"], gdpo_advantages(table, weights, module.cfg.num_generations))


def test_the_off_policy_mask_equals_trls_and_drops_only_drifted_negative_rows():
    """The mask equals TRL's ``get_off_policy_mask`` on fresh random inputs; in a step, rows with a negative
    advantage whose sampler log-probs sit 1.0 a token above the current policy's (threshold 0.5) leave the policy
    term -- the loss equals the plain module's with their advantages zeroed -- and the other rows stay."""
    from segki_lightning.rl.losses import off_policy_mask

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    logp, sampler = -torch.rand(6, 9, generator=gen) * 3, -torch.rand(6, 9, generator=gen) * 3
    adv, mask = torch.randn(6, generator=gen), (torch.rand(6, 9, generator=gen) < 0.8).float()
    assert torch.equal(off_policy_mask(adv, logp, sampler, mask, 0.3),
                       trl_off_policy_mask(adv, logp, sampler, mask, 0.3))

    module = tiny_module(off_policy_mask_threshold=0.5, importance_sampling_correction=False)
    plain = tiny_module(importance_sampling_correction=False)
    plain.policy.load_state_dict(module.policy.state_dict())
    buf = module.prepare({"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]})
    n = len(buf.scored.batch)
    rows, totals = torch.arange(n), Totals.of(buf.data["mask"])
    sign = torch.tensor([-1.0, -1.0, 1.0, 1.0]).repeat(n // 4)
    buf.data["adv"] = (torch.rand(n, generator=gen) + 0.1) * sign
    drift = torch.arange(n) % 2 == 0
    current = module.scores(module.policy, buf.scored.batch, rows).logp.detach()
    buf.scored.batch.logprobs = torch.where(drift[:, None], current + 1.0, current)
    got, _ = module.step_loss(buf, rows, totals)
    dropped = drift & (buf.data["adv"] < 0)
    assert dropped.any() and ((buf.data["adv"] < 0) & ~drift).any()
    buf.data["adv"] = buf.data["adv"].masked_fill(dropped, 0.0)
    want, _ = plain.step_loss(buf, rows, totals)
    assert torch.equal(got, want)


def test_the_entropy_coef_moves_the_step_loss_by_the_bonus():
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    module = tiny_module(entropy_coef=0.3, importance_sampling_correction=False)
    plain = tiny_module(importance_sampling_correction=False)
    plain.policy.load_state_dict(module.policy.state_dict())
    buf = module.prepare({"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]})
    rows = torch.arange(len(buf.scored.batch))
    totals = Totals.of(buf.data["mask"])
    with_bonus, stats = module.step_loss(buf, rows, totals)
    without, _ = plain.step_loss(buf, rows, totals)
    assert torch.allclose(without - with_bonus, 0.3 * stats["entropy"], rtol=1e-5, atol=1e-7)


def test_the_reference_mixes_towards_the_policy_every_sync_steps():
    """TRL's SyncRefModelCallback: ``ref = alpha * policy + (1 - alpha) * ref`` on every
    ``ref_model_sync_steps``-th optimizer step."""
    ref, pol = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in ref.parameters()]
    mix_into(ref, pol, 0.6)
    for b, r, p in zip(before, ref.parameters(), pol.parameters()):
        assert torch.allclose(r, 0.6 * p + 0.4 * b)
    with pytest.raises(ValueError, match="sync_ref_model=True needs the reference model"):
        GRPOConfig(sync_ref_model=True)
    module = tiny_module(beta=0.04, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    ref0 = [p.detach().clone() for p in module.reference.parameters()]
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(1.0)

    from types import SimpleNamespace

    module._trainer = SimpleNamespace(global_step=1)   # what the hook reads of its Trainer
    optimizer = SimpleNamespace(step=lambda closure=None: None, zero_grad=lambda set_to_none=True: None)
    module.optimizer_step(0, 0, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(ref0, module.reference.parameters()))   # step 1: not yet
    module._trainer.global_step = 2
    module.optimizer_step(0, 1, optimizer)
    for a, r, p in zip(ref0, module.reference.parameters(), module.policy.parameters()):
        assert torch.allclose(r, 0.5 * p + 0.5 * a)


def test_rloo_equals_trl():
    rewards = torch.randn(12, dtype=torch.float64)
    g = 4
    grouped = rewards.view(-1, g)
    baselines = ((grouped.sum(1, keepdim=True) - grouped) / (g - 1)).view(-1)   # TRL's RLOOTrainer
    assert torch.allclose(rloo_advantages(rewards, g), rewards - baselines, rtol=1e-12, atol=0)


def test_reinforce_pp_equals_verls_baseline_estimator():
    """verl's REINFORCE++-baseline: scores minus the group mean, tiled over the response tokens, masked_whiten
    (unbiased variance) over the batch's response tokens."""
    _, _, _, mask, gen = rand_batch(n=8, t=7)
    rewards, g = torch.randn(8, generator=gen, dtype=torch.float64), 4
    scores = rewards.clone()
    for i in range(0, 8, g):
        scores[i:i + g] -= rewards[i:i + g].mean()
    tiled = scores.unsqueeze(-1).tile([1, mask.shape[1]]) * mask
    mean = (tiled * mask).sum() / mask.sum()
    var = (((tiled - mean) ** 2) * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    want = ((tiled - mean) * torch.rsqrt(var + 1e-8)) * mask
    got = reinforce_pp_advantages(rewards, g, mask.sum(1))
    assert torch.allclose(got[:, None] * mask, want, rtol=1e-10, atol=1e-12)


def test_soft_overlong_punishment_equals_trl():
    def trl(max_len, cache, completion_ids):
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_len - cache:
                out.append(0.0)
            elif max_len - cache < n <= max_len:
                out.append((max_len - cache - n) / cache)
            else:
                out.append(-1.0)
        return out

    ids = [[0] * n for n in (0, 5, 12, 13, 15, 16, 17, 40)]
    fn = get_soft_overlong_punishment(16, 4)
    assert fn(["p"] * len(ids), ["c"] * len(ids), completion_ids=ids) == trl(16, 4, ids)
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(8, 9)


@pytest.mark.parametrize("knobs, words", [
    ({"advantage_estimator": "gae"}, "advantage_estimator must be one of"),
    ({"vespo_lambda_neg": 0.0}, "vespo_lambda_pos and vespo_lambda_neg must be > 0"),
    ({"loss_type": "vespo", "importance_sampling_mode": "sequence_mask"}, "loss_type=vespo folds"),
    ({"beta": 0.1, "sync_ref_model": True, "ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha must be in"),
    ({"optim": "adafactor"}, "optim must be one of .*'adafactor'"),
    ({"adam_beta2": 1.0}, "adam_beta1 and adam_beta2 must be in"),
    ({"adam_epsilon": 0.0}, "adam_epsilon > 0"),
    ({"multi_objective_aggregation": "mean"}, "multi_objective_aggregation must be one of"),
    ({"multi_objective_aggregation": "normalize_then_sum", "advantage_estimator": "rloo"},
     "normalize_then_sum forms GRPO's advantages"),
    ({"off_policy_mask_threshold": 0.0}, "off_policy_mask_threshold must be > 0"),
])
def test_bad_knobs_are_named(knobs, words):
    with pytest.raises(ValueError, match=words):
        GRPOConfig(**knobs)


@pytest.mark.parametrize("knobs", [{"loss_type": "luspo", "importance_sampling_level": "sequence"},
                                   {"loss_type": "vespo"}, {"advantage_estimator": "rloo"},
                                   {"advantage_estimator": "reinforce_pp"}, {"entropy_coef": 0.01},
                                   {"optim": "adamw_torch", "adam_beta1": 0.8, "adam_beta2": 0.95,
                                    "adam_epsilon": 1e-6},
                                   {"multi_objective_aggregation": "normalize_then_sum"},
                                   {"off_policy_mask_threshold": 0.5, "num_iterations": 2}])
def test_each_knob_trains_a_step_of_the_recipe(tmp_path, knobs):
    from segki_lightning.train import run

    from .test_lightning import small

    overrides = [f"algo.{k}={v}" for k, v in knobs.items()]
    metrics = run(small(tmp_path, "trainer.max_steps=1", "rewards.0.fn.pattern='.*[a-m].*'", *overrides))
    assert math.isfinite(metrics["train/loss"])


@pytest.mark.parametrize("master", [False, True])
def test_the_adam_knobs_reach_the_optimizer_and_step_as_torchs_adamw(master):
    """``adam_beta1``/``adam_beta2``/``adam_epsilon`` are the optimizer's (the masters' inner one too): three steps
    from fresh random gradients equal torch's AdamW given the same hyper-parameters, bit for bit in fp32 (the masters
    of a bf16 copy: its weights are the rounded masters)."""
    from segki_lightning.rl.optim import build_optimizer

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref = torch.nn.Linear(16, 8)
    net = copy.deepcopy(ref).to(torch.bfloat16 if master else torch.float32)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), net.parameters()):
            p.copy_(q.float())
    hyper = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), eps=1e-3)
    opt = build_optimizer(net.parameters(), hyper["lr"], hyper["weight_decay"], True, "adamw_torch",
                          hyper["betas"], hyper["eps"])
    want = torch.optim.AdamW(ref.parameters(), **hyper)
    groups = opt.param_groups + (opt.inner.param_groups if master else [])
    assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-3 for g in groups)
    for _ in range(3):
        for p, q in zip(ref.parameters(), net.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.to(q.dtype)
        if master:   # the masters see the bf16 gradients: give the reference the same ones
            for p, q in zip(ref.parameters(), net.parameters()):
                p.grad = q.grad.float()
        opt.step()
        want.step()
    got = opt._flat_masters() if master else list(net.parameters())
    for p, m in zip(ref.parameters(), got):
        assert torch.equal(p, m)


def test_8bit_adamw_without_bitsandbytes_is_refused_by_name(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ValueError, match="optim=adamw_8bit is bitsandbytes' 8-bit AdamW, which is not installed"):
        GRPOConfig(optim="adamw_8bit")


def test_8bit_adamw_is_refused_on_fsdp_shards(monkeypatch):
    from segki_lightning.rl import optim

    monkeypatch.setattr(optim, "is_shard", lambda p: True)
    with pytest.raises(ValueError, match="does not step FSDP's sharded parameters: set optim=adamw_torch_fused"):
        optim.build_optimizer([torch.nn.Parameter(torch.zeros(2))], 1e-3, 0.0, optim="adamw_8bit")


def test_an_8bit_adamw_run_keeps_8bit_moments_and_resumes_exactly(tmp_path):
    """``algo.optim=adamw_8bit`` on the bf16 recipe: bitsandbytes' AdamW8bit steps the fp32 masters, its moments of
    the tensors of 4096 elements or more are one byte each (smaller ones fp32); resumed from step 2's checkpoint
    (which loads as weights only), step 3 equals the uninterrupted run's, policy and masters bit for bit."""
    pytest.importorskip("bitsandbytes", reason="the [bnb] extra (bitsandbytes) is not installed")
    from segki_lightning.rl.sizing import MIN_8BIT_SIZE
    from segki_lightning.train import run

    from .test_lightning import small

    common = ["algo.optim=adamw_8bit", "model.dtype=bfloat16", "trainer.precision=bf16-true", "trainer.max_steps=3",
              "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=-1", "algo.learning_rate=1e-3",
              "algo.num_generations=4",   # groups whose rewards differ: the first two steps have gradients
              "rewards.0.fn.pattern='.*[a-m].*'"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(small(straight, *common))
    run(small(resumed, f"ckpt_path={straight / 'checkpoints' / 'step-000002.ckpt'}", *common))
    want = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)
    got = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=True)
    assert got["global_step"] == want["global_step"] == 3
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    masters = want["optimizer_states"][0]["masters"]
    assert masters and all(torch.equal(got["optimizer_states"][0]["masters"][i], m) for i, m in masters.items())
    first = torch.load(straight / "checkpoints" / "step-000001.ckpt", weights_only=True)["optimizer_states"][0]
    assert any(not torch.equal(first["masters"][i], m) for i, m in masters.items())   # the masters moved
    inner = want["optimizer_states"][0]["inner"]["state"].values()
    states = [st.get("__bnb_optimizer_quant_state__", st) for st in inner]   # (bitsandbytes' nesting)
    moments = [v for st in states for k, v in st.items() if k in ("state1", "state2")]
    big = [m for m in moments if m.numel() >= MIN_8BIT_SIZE]
    assert big and all(m.dtype == torch.uint8 for m in big)
    assert all(m.dtype == torch.float32 for m in moments if m.numel() < MIN_8BIT_SIZE)


def test_scale_rewards_takes_trls_booleans():
    from .test_lightning import small

    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    from omegaconf import OmegaConf

    assert OmegaConf.to_object(small(".", "algo.scale_rewards=false").algo).scale_rewards == "none"


def trl_masked_whiten(values, mask, shift_mean=True):   # TRL's PPOTrainer (masked_mean / masked_var, unbiased)
    mean = (values * mask).sum() / mask.sum()
    variance = ((values - mean) ** 2 * mask).sum() / mask.sum()
    variance = variance * (mask.sum() / (mask.sum() - 1))
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened if shift_mean else whitened + mean


def test_ppo_kl_estimator_missing_eos_penalty_and_whiten_rewards_follow_trl():
    """TRL's PPO knobs: the k3 KL estimate per token, the penalty on the score of a completion with no EOS, the
    token rewards whitened with their mean kept (TRL's masked_whiten, unbiased) before GAE; the advantages the
    module keeps equal that construction, and whitening equals TRL's on fresh random inputs."""
    from segki_lightning.rl.advantages import gae, masked_whiten

    from .test_training import module

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    x, m = torch.randn(5, 7, generator=gen), (torch.rand(5, 7, generator=gen) < 0.7).float()
    for shift in (True, False):
        assert torch.allclose(masked_whiten(x, m, shift), trl_masked_whiten(x, m, shift), atol=1e-6)

    ppo = module("ppo", kl_coef=0.1, kl_estimator="k3", missing_eos_penalty=0.7, whiten_rewards=True,
                 whiten_advantages=False)
    buf = ppo.prepare({"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]})
    ro, d = buf.scored.batch, buf.data
    logr = ppo.reference_logp(ro) - d["old_logp"]
    mask = ro.completion_mask
    scores = buf.scored.rewards - 0.7 * (~(ro.completion_ids == ppo.eos_token_id).any(1)).float()
    rewards = -0.1 * ((logr.exp() - 1) - logr)
    last = mask.sum(1) - 1
    rewards[torch.arange(len(last)), last] += scores
    rewards = trl_masked_whiten(rewards, mask.float(), shift_mean=False) * mask
    adv, _ = gae(rewards, d["old_values"], mask, ppo.cfg.gamma, ppo.cfg.lam)
    assert torch.allclose(d["adv"], adv, atol=1e-6)
    with pytest.raises(ValueError, match="kl_estimator must be k1 or k3"):
        PPOConfig(kl_estimator="k2")


def test_disable_dropout_zeroes_every_dropout_of_the_policy_lora_included():
    """TRL's ``disable_dropout``: every ``nn.Dropout`` of the policy at p = 0 (a LoRA policy's adapter dropout
    too, so its rollouts take the fused path); off, they keep their p."""
    from segki_lightning.rl import GRPOModule
    from segki_lightning.rl.lora import apply_lora
    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.rewards import FormatRegex
    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    for off in (False, True):
        peft = apply_lora(tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id), r=2, lora_alpha=4,
                          lora_dropout=0.1)
        GRPOModule(peft, tok, [FormatRegex()], GRPOConfig(num_generations=2, disable_dropout=off))
        drops = [m for m in peft.modules() if isinstance(m, torch.nn.Dropout)]
        assert drops and all(m.p == (0.0 if off else 0.1) for m in drops)


def test_shuffle_dataset_false_hands_out_the_recipes_prompts_in_order(tmp_path):
    from segki_lightning.train import build_data

    from .test_lightning import small

    for shuffle in (True, False):
        loader = build_data(small(tmp_path, f"algo.shuffle_dataset={str(shuffle).lower()}"))
        first = [b["prompt"] for b, _ in zip(loader, range(3))]
        in_order = [[loader.dataset[i]["prompt"] for i in range(j * 2, j * 2 + 2)] for j in range(3)]
        assert (first == in_order) is not shuffle


def test_log_completions_prints_a_table_and_keeps_num_completions_to_print(tmp_path, capsys):
    import json

    from segki_lightning.train import run

    from .test_lightning import small

    run(small(tmp_path, "algo.log_completions=true", "algo.log_completions_every=1",
              "algo.num_completions_to_print=3", "trainer.max_steps=2"))
    out = capsys.readouterr().out
    assert out.count("step | prompt") == 2 and "completion" in out
    rows = [json.loads(line) for line in open(tmp_path / "logs" / "completions.jsonl")]
    assert [r["step"] for r in rows] == [0, 0, 0, 1, 1, 1]


def test_a_wandb_logger_gets_the_completions_table():
    from segki_lightning.rl.metrics import completions_table, write_completions

    class Wandb:   # WandbLogger's log_table signature
        def log_table(self, key, columns, data, step):
            self.got = (key, columns, data, step)

    w = Wandb()
    rows = [dict(step=3, prompt="1+2=", completion="3\nok", reward=1.0)]
    write_completions([w], rows, 3)
    assert w.got == ("completions", ["step", "prompt", "completion", "reward"], [[3, "1+2=", "3\nok", 1.0]], 3)
    assert "3\\nok" in completions_table(rows) and "1.000" in completions_table(rows)
    rows[0]["judge"] = "fine"   # a column a reward function added (TRL's log_extra)
    write_completions([w], rows, 3)
    assert w.got[1][-1] == "judge" and w.got[2][0][-1] == "fine" and "judge" in completions_table(rows)

    class Board:   # TensorBoardLogger: its experiment's add_text
        def __init__(self):
            self.experiment = self

        def add_text(self, tag, text, step):
            self.got = (tag, text, step)

    b = Board()
    write_completions([b], rows, 3)
    assert b.got == ("completions", "| prompt | completion | reward | judge |\n|---|---|---|---|\n"
                                    "| 1+2= | 3\nok | 1.00 | fine |", 3)


SEEN_STATES: list = []


def progress_reward(prompts, completions, trainer_state, log_metric, log_extra, **kwargs):
    """A reward that reads TRL's ``trainer_state`` and logs through ``log_metric`` / ``log_extra``."""
    SEEN_STATES.append((trainer_state.global_step, trainer_state.max_steps))
    log_metric("length_seen", float(sum(len(c) for c in completions)) / len(completions))
    log_extra("chars", [len(c) for c in completions])
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)


def test_rewards_get_trls_trainer_state_and_log_metrics_and_columns(tmp_path):
    import json

    from segki_lightning.train import run

    from .test_lightning import small

    SEEN_STATES.clear()
    run(small(tmp_path, "rewards=[tests.test_rl_knobs.progress_reward]", "algo.reward_weights=null",
              "trainer.max_steps=3", "algo.log_completions_every=1"))
    assert SEEN_STATES == [(0, 3), (1, 3), (2, 3)]
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    seen = [float(r["train/length_seen"]) for r in rows if r.get("train/length_seen")]
    assert len(seen) == 3 and all(v >= 0 for v in seen)
    table = [json.loads(line) for line in open(tmp_path / "logs" / "completions.jsonl")]
    assert table and all(r["chars"] == len(r["completion"]) for r in table)


@pytest.mark.parametrize("n_eval, want", [(None, (1, True)), (3, (3, False))])
def test_num_generations_eval_samples_that_many_per_held_out_prompt(n_eval, want):
    module = tiny_module(num_generations_eval=n_eval)
    calls = []
    real = module.rollout_and_score

    def spy(batch, n, greedy=False):
        calls.append((n, greedy))
        return real(batch, n, greedy)

    module.rollout_and_score = spy
    module.log = lambda *a, **k: None
    module.validation_step({"prompt": ["1+2="], "answer": ["3"]}, 0)
    assert calls == [want]


def test_stop_strings_cut_a_completion_after_the_first_stop():
    from segki_lightning.rl.task import char_tokenizer, cut_at_stop_strings

    tok = char_tokenizer()
    texts = ["ab+3cd+3", "no stop here", "x=1", "=1"]
    rows = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    cut = cut_at_stop_strings(ids, mask, tok, ["+3", "=1"])
    assert cut.tolist() == [True, False, True, True]
    kept = [tok.decode(r[m.bool()].tolist()) for r, m in zip(ids, mask)]
    assert kept == ["ab+3", "no stop here", "x=1", "=1"]
    with pytest.raises(ValueError, match="stop_strings must be a list of non-empty strings"):
        GRPOConfig(stop_strings="+3")


def test_a_run_with_stop_strings_counts_them_as_ended(tmp_path):
    from segki_lightning.train import run

    from .test_lightning import small

    metrics = run(small(tmp_path, "algo.stop_strings=[a,'1']", "algo.mask_truncated_completions=true",
                        "algo.max_completion_length=6", "trainer.max_steps=2", "rewards.0.fn.pattern='.*[a-m].*'"))
    assert math.isfinite(metrics["train/loss"])


def test_adaptive_entropy_follows_trls_controller():
    """TRL's rule, written out: the bonus applies only when the previous step's entropy <= entropy_target (none
    before the first step); after each step the coefficient moves by entropy_coef_delta towards more bonus when
    the entropy is at or below the target, less otherwise, within [entropy_coef_min, entropy_coef_max]."""
    from segki_lightning.rl.grpo import AdaptiveEntropy

    cfg = GRPOConfig(entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_delta=0.02, entropy_coef_max=0.05,
                     entropy_target=0.5)
    ctl, coef, last = AdaptiveEntropy(cfg), 0.01, math.inf
    for world in [0.9, 0.3, 0.2, 0.1, 0.1, 0.7, 0.4]:
        assert ctl.coef_now() == (coef if last <= 0.5 else 0.0)
        ctl.add(torch.full((2, 3), world), torch.ones(2, 3))
        ctl.step()
        coef = min(coef + 0.02, 0.05) if world <= 0.5 else max(coef - 0.02, 0.0)
        last = world
        assert ctl.coef == pytest.approx(coef) and ctl.last == pytest.approx(world)
    again = AdaptiveEntropy(cfg)
    again.load_state_dict(ctl.state_dict())
    assert again.coef_now() == ctl.coef_now() and again.last == ctl.last
    with pytest.raises(ValueError, match="use_adaptive_entropy needs"):
        GRPOConfig(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1)


def test_an_adaptive_entropy_run_logs_its_coefficient(tmp_path):
    import csv

    from segki_lightning.train import run

    from .test_lightning import small

    run(small(tmp_path, "algo.use_adaptive_entropy=true", "algo.entropy_coef=0.01", "algo.entropy_target=100",
              "trainer.max_steps=3", "checkpoint.every_n_train_steps=1"))
    with open(tmp_path / "logs" / "metrics.csv") as f:
        coefs = [float(r["train/entropy_coef"]) for r in csv.DictReader(f) if r.get("train/entropy_coef")]
    assert coefs == pytest.approx([0.015, 0.02, 0.025])   # entropy far below the target: up by 0.005 a step
    ck = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ck["adaptive_entropy"]["entropy_coef"] == pytest.approx(0.025)


def test_generation_batch_size_is_checked_against_the_prompts_per_step(tmp_path):
    """TRL's generation_batch_size (completions of one rollout): equal to prompts x num_generations x processes
    runs; otherwise one error naming the setting that makes them agree, before any step."""
    from segki_lightning.train import run

    from .test_lightning import small

    metrics = run(small(tmp_path / "ok", "algo.generation_batch_size=4", "trainer.max_steps=1"))   # 2 prompts x 2
    assert math.isfinite(metrics["train/loss"])
    with pytest.raises(ValueError, match=r"task.prompts_per_step=4"):
        run(small(tmp_path / "bad", "algo.generation_batch_size=8", "trainer.max_steps=1"))
    with pytest.raises(ValueError, match="positive multiple of num_generations"):
        GRPOConfig(num_generations=4, generation_batch_size=6)
