"""Rewards for benchmark runs of randomly initialised policies, whose completions never solve the synthetic
task (every row scores 0, every advantage is 0 and nothing trains). A dense signal on the token ids makes the
policy move, so that clipping and the sampler/trainer correction act as in a real run. Passed to the recipe as
``'rewards=[bench_rewards.even_token_fraction]'`` with this folder on ``PYTHONPATH`` (grpo_gpu.py does so)."""
from __future__ import annotations


def even_token_fraction(prompts, completions, completion_ids, **columns) -> list[float]:
    """The fraction of a completion's tokens whose id is even: about 0.5 +- 0.03 for 256 random tokens, so
    every group of completions has a spread to learn from."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]
