"""The GRPO recipe under Lightning's DDP strategy: 2 CPU processes over gloo, 3 steps with micro-batches inside each
step, a rollout reused for two steps and dapo's global token count; the ranks started together as torchrun starts
them (``launch.py``; Lightning's own launcher runs in test_reliability.py). The plain DDP run is test_fsdp.py's (the
run FSDP is compared with: the same checks on it)."""
from __future__ import annotations

import json

import pytest

from .launch import train_ranks


@pytest.mark.parametrize("extra", [["algo.micro_batch_size=1", "algo.num_iterations=2"]], ids=["micro-batches+reuse"])
def test_ddp_two_processes_keep_identical_weights(tmp_path, extra):
    train_ranks(tmp_path, "--config-name", "grpo", "trainer.max_steps=3", "trainer.strategy=ddp", "trainer.devices=2",
                "trainer.enable_progress_bar=false", "task.prompts_per_step=2", "algo.num_generations=2", *extra)
    check = json.loads(next(tmp_path.rglob("rank_consistency.json")).read_text())
    assert check["world_size"] == 2 and check["identical"], check
    rows = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    assert "train/reward" in rows[0] and len(rows) == 4  # header + 3 steps, logged once (rank zero)
