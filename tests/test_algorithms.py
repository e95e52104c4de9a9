"""The GRPO/PPO loss family and the sampler/trainer correction against transcriptions of their formulas, rollout
reuse (old log-prob pass, schedules, clipping that acts), and exactness across two ranks.

Transcribed sources: TRL ``GRPOTrainer._compute_loss`` and ``_generate_and_score_completions`` (1.x: clipped
surrogate with ``epsilon_high`` (DAPO) and two-sided ``delta``, ``importance_sampling_level="sequence"``
(GSPO, arXiv 2507.18071), ``loss_type="cispo"`` (MiniMax-M1, arXiv 2506.13585), ``loss_type="sapo"`` (soft
adaptive policy optimisation), ``use_bias_correction_kl``, ``top_entropy_quantile`` (Wang et al., "Beyond the
80/20 rule", arXiv 2506.01939), ``vllm_importance_sampling_*``)."""
from __future__ import annotations

import math

import pytest
import torch

from segki_lightning.rl import GRPOConfig, grpo_loss
from segki_lightning.rl.advantages import high_entropy_mask
from segki_lightning.rl.buffer import schedule
from segki_lightning.rl.correction import importance_weights


def trl_grpo_loss(logp, old, ref, adv, mask, cfg, is_ratio=None, entropy_mask=None):
    """TRL's ``_compute_loss`` written out for one process, one micro-batch."""
    m = mask.float()
    log_ratio = logp - old
    if cfg.importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    eps_low, eps_high = cfg.epsilon, cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    a = adv.unsqueeze(1)
    if cfg.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * a * logp
    elif cfg.loss_type == "sapo":
        def gate(r, t):
            return torch.sigmoid(t * (r - 1)) * 4 / t
        per_token_loss = torch.where(a > 0, -gate(coef_1, cfg.sapo_temperature_pos) * a,
                                     -gate(coef_1, cfg.sapo_temperature_neg) * a)
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if cfg.delta is not None:
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if is_ratio is not None:
        per_token_loss = per_token_loss * is_ratio
    if ref is not None:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if cfg.use_bias_correction_kl:
            kl = kl * torch.exp(log_w)
        per_token_loss = per_token_loss + cfg.beta * kl
    if cfg.loss_type in ("grpo", "sapo"):
        return ((per_token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if cfg.loss_type == "dr_grpo":
        return (per_token_loss * m).sum() / (per_token_loss.size(0) * cfg.max_completion_length)
    return (per_token_loss * m).sum() / m.sum().clamp(min=1.0)   # bnpo; dapo/cispo with one process


def batch(n=6, t=7):
    logp = -torch.rand(n, t) * 3
    old = logp + 0.4 * torch.randn(n, t)
    ref = logp + 0.2 * torch.randn(n, t)
    mask = (torch.rand(n, t) > 0.25).long()
    mask[:, 0] = 1
    return logp, old, ref, torch.randn(n), mask


CASES = [dict(loss_type=t) for t in ("grpo", "bnpo", "dr_grpo", "dapo")] + [
    dict(loss_type="dapo", epsilon_high=0.28, delta=1.5),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="sapo"),
    dict(loss_type="dapo", beta=0.04, use_bias_correction_kl=True),
    dict(loss_type="bnpo", beta=0.04, importance_sampling_level="sequence"),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_grpo_loss_family_equals_trl(kw):
    logp, old, ref, adv, mask = batch()
    cfg = GRPOConfig(max_completion_length=7, **kw)
    weights = torch.rand(6, 7) * 2
    use_ref = ref if cfg.beta > 0 else None
    a = logp.clone().requires_grad_()
    b = logp.clone().requires_grad_()
    got, _ = grpo_loss(a, old, use_ref, adv, mask, cfg, weights=weights)
    want = trl_grpo_loss(b, old, use_ref, adv, mask, cfg, is_ratio=weights)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    got.backward()
    want.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_clip_ratio_parts_follow_trl():
    logp, old, _, adv, mask = batch()
    cfg = GRPOConfig(epsilon=0.2, epsilon_high=0.28)
    _, stats = grpo_loss(logp, old, None, adv, mask, cfg)
    coef, a, m = torch.exp(logp - old), adv[:, None], mask.float()
    low = ((coef < 0.8) & (a < 0)).float()
    high = ((coef > 1.28) & (a > 0)).float()
    mean = lambda x: (x * m).sum() / m.sum()   # noqa: E731
    torch.testing.assert_close(stats["clip_ratio/low"], mean(low))
    torch.testing.assert_close(stats["clip_ratio/high"], mean(high))
    torch.testing.assert_close(stats["clip_ratio"], mean(torch.maximum(low, high)))
    assert stats["clip_ratio"] > 0


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weights_equal_trl(mode):
    """TRL: ``exp((old - sampling) * mask)``, summed per sequence for ``sequence_*``; ``*_truncate`` clamps to
    [clip_min, clip_max], ``*_mask`` zeroes what falls outside."""
    trainer = -torch.rand(5, 6) * 2
    sampler = trainer + 0.6 * torch.randn(5, 6)
    mask = (torch.rand(5, 6) > 0.2).long()
    sampler[0], mask[0] = trainer[0] - 1.0, 1   # one row surely outside [0.5, 1.5] (ratio e per token)
    got, outside = importance_weights(trainer, sampler, mask, mode, 1.5, 0.5)
    diff = (trainer - sampler) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    want = ratio.clamp(0.5, 1.5) if mode.endswith("truncate") else ratio.masked_fill((ratio < 0.5) | (ratio > 1.5), 0)
    torch.testing.assert_close(got, want)
    assert outside.any() and torch.equal(outside, (ratio < 0.5) | (ratio > 1.5))


def test_high_entropy_mask_keeps_the_top_quantile():
    entropy = torch.arange(20, dtype=torch.float32).view(4, 5)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[3, 3:] = 0                                   # 19 and 18 are padding
    keep = high_entropy_mask(entropy, mask, 0.25)
    kept = entropy[keep.bool()]
    assert kept.min() >= torch.quantile(entropy[mask.bool()], 0.75) and keep[3, 3:].sum() == 0
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask.float())


def test_schedules_cover_each_row_once_per_pass():
    gen = torch.Generator().manual_seed(0)
    steps = schedule(10, 3, 2, False, gen, torch.device("cpu"))     # GRPO: 2 iterations x 3 slices
    assert len(steps) == 6 and all(torch.equal(a, b) for a, b in zip(steps[:3], steps[3:]))
    assert sorted(torch.cat(steps[:3]).tolist()) == list(range(10))
    ppo = schedule(10, 2, 3, True, gen, torch.device("cpu"))        # PPO: 3 epochs x 2 mini-batches, reshuffled
    assert len(ppo) == 6 and all(sorted(torch.cat(ppo[i:i + 2]).tolist()) == list(range(10)) for i in (0, 2, 4))
    assert not torch.equal(ppo[0], ppo[2])
    assert torch.equal(schedule(4, 1, 1, False, gen, torch.device("cpu"))[0], torch.arange(4))
    with pytest.raises(ValueError, match="steps_per_generation"):
        schedule(2, 3, 1, False, gen, torch.device("cpu"))


def test_config_errors_name_the_knob():
    with pytest.raises(ValueError, match="epsilon_high"):
        GRPOConfig(loss_type="cispo")
    with pytest.raises(ValueError, match="importance_sampling_mode"):
        GRPOConfig(importance_sampling_mode="sequence")
    with pytest.raises(ValueError, match="delta"):
        GRPOConfig(delta=0.5)
    with pytest.raises(ValueError, match="num_iterations"):
        GRPOConfig(num_iterations=0)


# -------------------------------------------------------------------------------------- rollout reuse
def _module(**cfg):
    from .test_training import module

    return module("grpo", **cfg)


def test_one_step_per_rollout_skips_the_old_pass_and_reuse_runs_it_once():
    m = _module()
    calls = []
    real = m.score_all
    m.score_all = lambda *a, **k: calls.append(1) or real(*a, **k)
    batch = {"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}
    m.train()
    m.training_step(batch, 0).backward()
    assert calls == [] and not m._buffer
    m2 = _module(num_iterations=2, steps_per_generation=2)
    real2 = m2.score_all
    m2.score_all = lambda *a, **k: calls.append(2) or real2(*a, **k)
    rolls = []
    real_roll = m2.rollout
    m2.rollout = lambda *a, **k: rolls.append(1) or real_roll(*a, **k)
    for _ in range(4):
        m2.training_step(batch, 0).backward()
    assert calls == [2] and rolls == [1] and not m2._buffer   # one rollout, one old pass, four steps
    m2.training_step(batch, 0)
    assert rolls == [1, 1]


def test_reused_rollout_steps_off_policy_and_clipping_acts(tmp_path):
    """The recipe with num_iterations=2 for 20 steps on the CPU eager path: one rollout per two steps, clipping
    acts on the second step of a rollout, the sampler/trainer mismatch is logged and ~0 (fp32 reference ops)."""
    import csv

    from segki_lightning.train import run

    from .test_lightning import small

    run(small(tmp_path, "trainer.max_steps=20", "algo.num_iterations=2", "algo.learning_rate=0.05",
              "algo.num_generations=4", "algo.max_completion_length=6",
              "rewards.0.fn._target_=tests.test_training.letters", "+rewards.0.fn._partial_=true"))
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    steps = [r for r in rows if r.get("train/loss")]
    assert len(steps) == 20
    assert sum(float(r["time/rollout_s"]) > 0 for r in steps) == 10     # a rollout every second step
    clip = [float(r["train/clip_ratio"]) for r in steps]
    assert max(clip) > 0 and all(c == 0 for c in clip[::2])              # on-policy first steps never clip
    diff = [float(r["rollout/logprob_diff_mean"]) for r in steps]
    assert max(diff) < 1e-4 and all(math.isfinite(d) for d in diff)
    for key in ("rollout/logprob_diff_max", "rollout/kl_sampler_trainer", "rollout/is_truncated_frac",
                "train/clip_ratio/low", "train/clip_ratio/high", "train/entropy", "train/rewards/letters"):
        assert key in steps[0], key
