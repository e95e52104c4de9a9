"""DAPO's dynamic sampling (algo.dynamic_sampling): zero-variance groups dropped, refill rollouts until the batch
has prompts_per_step informative groups or max_num_gen_batches rollouts, zero-variance fillers past that, and a
resume that draws the same refills."""
from __future__ import annotations

import csv

import torch

from segki_lightning.rl.base import Scored
from segki_lightning.rl.dynamic import fill, informative_groups
from segki_lightning.rollout import RolloutBatch
from segki_lightning.train import run

from .test_lightning import small

REWARD = "rewards.0.fn.pattern='.*[a-m].*'"


def scored(rewards: list[float], prompt_width: int, tag: str, group: int = 2) -> Scored:
    from segki_lightning.rl.rewards import RewardLogs

    n = len(rewards)
    logs = RewardLogs({"judged": [float(n)]}, {"note": [f"{tag}{i}" for i in range(n)]})
    pm = torch.zeros(n, prompt_width, dtype=torch.long)
    pm[:, -1] = 1
    return Scored(RolloutBatch(prompt_ids=torch.full((n, prompt_width), 7) * pm, prompt_mask=pm,
                               completion_ids=torch.arange(n)[:, None].repeat(1, 3), completion_mask=torch.ones(n, 3),
                               logprobs=torch.zeros(n, 3), prompt_index=torch.arange(n) // group),
                  [f"{tag}{i // group}" for i in range(n)], [f"{tag}{i}" for i in range(n)],
                  torch.tensor(rewards), {"r": sum(rewards) / n}, 1.0, reward_logs=logs)


def test_informative_groups_first_then_fillers():
    assert informative_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), 2).tolist() == [False, True, False]
    first = scored([1.0, 1.0, 0.0, 1.0], 1, "a")            # group a1 informative
    second = scored([0.0, 0.0, 3.0, 1.0, 5.0, 2.0], 3, "b")  # b1, b2 informative; wider prompts
    s, m = fill([first, second], 2, 2, pad_token_id=0)
    assert s.prompts == ["a1", "a1", "b1", "b1"] and s.texts == ["a2", "a3", "b2", "b3"]
    assert s.rewards.tolist() == [0.0, 1.0, 3.0, 1.0] and s.rollout_s == 2.0
    assert s.reward_logs.columns == {"note": s.texts} and s.reward_logs.metrics == {"judged": [4.0, 6.0]}
    assert s.batch.prompt_ids.shape == (4, 3) and s.batch.prompt_mask[:2].tolist() == [[0, 0, 1], [0, 0, 1]]
    assert s.batch.prompt_index.tolist() == [0, 0, 1, 1]
    assert m == {"rollout/dynamic_sampling/generation_batches": 2.0, "rollout/dynamic_sampling/informative_groups": 3.0,
                 "rollout/dynamic_sampling/dropped_groups": 2.0, "rollout/dynamic_sampling/filled_groups": 0.0}
    s, m = fill([scored([1.0, 1.0, 2.0, 2.0], 1, "c")], 2, 2, 0)   # nothing informative: the first two fill
    assert s.prompts == ["c0", "c0", "c1", "c1"] and m["rollout/dynamic_sampling/filled_groups"] == 2.0


def metrics(folder):
    with open(folder / "logs" / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("rollout/dynamic_sampling/generation_batches")]


def test_a_run_refills_up_to_the_limit_and_fills(tmp_path):
    """A reward no completion earns: every group has zero variance, every step makes max_num_gen_batches rollouts
    and trains on fillers."""
    run(small(tmp_path, "algo.dynamic_sampling=true", "algo.max_num_gen_batches=3", "rewards.0.fn.pattern=zzz",
              "rewards.1.weight=0.0", "trainer.max_steps=2"))
    rows = metrics(tmp_path)
    assert len(rows) == 2
    assert all(float(r["rollout/dynamic_sampling/generation_batches"]) == 3.0 for r in rows)
    assert all(float(r["rollout/dynamic_sampling/filled_groups"]) == 2.0 for r in rows)


def test_a_resume_draws_the_same_refills(tmp_path):
    """Resumed from step 2's checkpoint of a 4-step run (the same schedule): the same weights at the end, and the
    refill loader at the same place."""
    common = ["algo.dynamic_sampling=true", "algo.max_num_gen_batches=3", "checkpoint.every_n_train_steps=1",
              "checkpoint.save_top_k=-1", "trainer.max_steps=4", REWARD]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(small(straight, *common))
    run(small(resumed, f"ckpt_path={straight / 'checkpoints' / 'step-000002.ckpt'}", *common))
    assert any(float(r["rollout/dynamic_sampling/generation_batches"]) > 1 for r in metrics(straight)[2:]), \
        "no step after the resume refilled: the test would not see the refill state"
    want = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)
    got = torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False)
    assert want["dynamic_sampling_refill"]["yielded"] == got["dynamic_sampling_refill"]["yielded"]
    for k, v in want["state_dict"].items():
        assert torch.equal(got["state_dict"][k], v), k
