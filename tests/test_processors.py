"""Repetition penalty and min-p in the decode loop (rollout/processors.py, ops.process_logits): the processed
logits equal transformers' own processors on fresh random logits, the raw log-sum-exp is torch's; greedy rollouts with a penalty equal transformers' generate
token for token; min-p near 1 samples the greedy tokens; the recorded log-probs stay the model's own."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.rollout import RolloutEngine, SamplingConfig
from segki_lightning.ops.reference import process_logits

from .test_rollout import build_model, random_prompts


@pytest.mark.parametrize("penalty, min_p, temperature", [(1.3, 0.0, 1.0), (0.8, 0.05, 0.7), (1.0, 0.2, 1.4),
                                                          (1.5, 0.1, 0.0), (0.5, 0.3, 2.0)])
def test_processed_logits_equal_transformers(penalty, min_p, temperature):
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper)

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    logits = torch.randn(3, 50, generator=gen) * 3
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    row = lambda v: torch.full((3,), float(v))   # noqa: E731
    seen = torch.zeros(3, 50, dtype=torch.bool).scatter_(1, ids, True)   # repeats mark a token once
    got, lse = process_logits(logits, seen if penalty != 1 else None, row(penalty), row(min_p) if min_p else None,
                              row(temperature))
    t = temperature if temperature > 0 else 1.0
    torch.testing.assert_close(lse, torch.logsumexp(logits / t, -1), rtol=0, atol=0)
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    kept = want.clone()
    if min_p > 0:   # min-p after temperature; the logits keep their scale (the sampler divides by T itself)
        scaled = TemperatureLogitsWarper(temperature)(ids, want.clone()) if temperature > 0 else want.clone()
        kept = want.masked_fill(MinPLogitsWarper(min_p)(ids, scaled) == float("-inf"), float("-inf"))
    assert torch.equal(got, kept)


def test_half_logits_stay_half_and_equal_the_fp32_result_rounded():
    """The fused sampler takes the model's dtype: processed bf16 logits are the fp32 rule's values rounded (the
    dropped set decided on the same rounded values), never a silent fp32 -> reference-sampler switch."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    logits = (torch.randn(4, 300, generator=gen) * 4).bfloat16()
    seen = torch.rand(4, 300, generator=gen) < 0.1
    row = lambda v: torch.full((4,), float(v))   # noqa: E731
    got, _ = process_logits(logits, seen, row(1.3), row(0.02), row(0.8))
    assert got.dtype == torch.bfloat16
    penalised = process_logits(logits.float(), seen, row(1.3), None, row(0.8))[0].bfloat16()
    want = process_logits(penalised, None, row(1.0), row(0.02), row(0.8))[0]
    assert torch.equal(got, want) and torch.isinf(got).any() and torch.isfinite(got).any(1).all()


def test_greedy_with_a_repetition_penalty_equals_generate(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=48, graph_capture=False, eos_token_id=[])
    prompts = random_prompts([3, 12, 6])
    batch = engine.generate(prompts, SamplingConfig(max_new_tokens=30, temperature=0.0, repetition_penalty=1.8))
    plain = engine.generate(prompts, SamplingConfig(max_new_tokens=30, temperature=0.0))
    assert not torch.equal(batch.completion_ids, plain.completion_ids), "the penalty changed nothing"
    for i, p in enumerate(prompts):
        want = model.generate(torch.tensor([p]), max_new_tokens=30, do_sample=False, repetition_penalty=1.8,
                              pad_token_id=0, eos_token_id=None)[0, len(p):]
        assert torch.equal(batch.completion_ids[i], want), i


def test_min_p_near_one_samples_the_greedy_tokens_and_logprobs_stay_raw(tmp_path):
    from segki_lightning.rl.logprobs import completion_logprobs

    model = build_model("qwen3_5", tmp_path)
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=48, graph_capture=False, eos_token_id=[])
    prompts = random_prompts([4, 9])
    greedy = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=0.0))
    near = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=1.0, min_p=0.999, seed=5))
    assert torch.equal(near.completion_ids, greedy.completion_ids)
    scores = completion_logprobs(model, near.prompt_ids, near.prompt_mask, near.completion_ids, near.completion_mask)
    torch.testing.assert_close(near.logprobs, scores.logp, rtol=1e-4, atol=1e-4)   # the model's, not renormalised
    assert (near.logprobs < -1e-3).any()


def test_bad_processor_settings_are_named():
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingConfig(min_p=1.0)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        SamplingConfig(repetition_penalty=0.0)


def test_the_recipe_passes_min_p_and_the_penalty_to_its_rollouts(tmp_path):
    import math

    from segki_lightning.train import run

    from .test_lightning import small

    seen = []
    real = RolloutEngine.generate

    def spy(self, prompts, sampling, *args, **kwargs):
        seen.append((sampling.min_p, sampling.repetition_penalty))
        return real(self, prompts, sampling, *args, **kwargs)

    RolloutEngine.generate = spy
    try:
        metrics = run(small(tmp_path, "algo.min_p=0.05", "algo.repetition_penalty=1.2", "trainer.max_steps=1"))
    finally:
        RolloutEngine.generate = real
    assert seen and set(seen) == {(0.05, 1.2)} and math.isfinite(metrics["train/loss"])
