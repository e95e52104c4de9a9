"""The GRPO recipe under Lightning's DDP strategy: 2 CPU processes over gloo, 3 steps with micro-batches inside each
step, a rollout reused for two steps and dapo's global token count. The plain DDP run is test_fsdp.py's (the run
FSDP is compared with: the same checks on it)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("extra", [["algo.micro_batch_size=1", "algo.num_iterations=2"]], ids=["micro-batches+reuse"])
def test_ddp_two_processes_keep_identical_weights(tmp_path, extra):
    out = subprocess.run([sys.executable, "-m", "segki_lightning.train", "--config-name", "grpo",
                          "trainer.max_steps=3", "trainer.strategy=ddp", "trainer.devices=2",
                          "trainer.enable_progress_bar=false", "task.prompts_per_step=2", "algo.num_generations=2",
                          f"hydra.run.dir={tmp_path}", *extra], capture_output=True, text=True, cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    check = json.loads(next(tmp_path.rglob("rank_consistency.json")).read_text())
    assert check["world_size"] == 2 and check["identical"], check
    rows = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    assert "train/reward" in rows[0] and len(rows) == 4  # header + 3 steps, logged once (rank zero)
