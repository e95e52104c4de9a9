"""What a Lightning/TRL user sets on the command line: the learning-rate schedule and warmup, max_grad_norm,
loggers (the group, trainer.logger). The progress bar in steps and the one segment report a run are checked on the
console run of test_lightning.py."""
from __future__ import annotations

import csv
import importlib.util

import pytest

from segki_lightning.train import run

from .test_lightning import small


def metrics(folder) -> list[dict]:
    return [r for r in csv.DictReader(open(folder / "logs" / "metrics.csv")) if r.get("train/learning_rate")]


@pytest.mark.parametrize("kind,warmup,want", [
    ("linear", [], [3e-3, 2e-3, 1e-3]),
    ("constant", [], [3e-3, 3e-3, 3e-3]),
    ("linear", ["algo.warmup_steps=1"], [0.0, 3e-3, 1.5e-3]),
    ("cosine", ["algo.warmup_ratio=0.25"], [0.0, 3e-3, 1.5e-3]),   # ceil(0.25 x 3) = 1 warmup step
])
def test_lr_schedule_and_warmup_follow_transformers(tmp_path, kind, warmup, want):
    run(small(tmp_path, "trainer.max_steps=3", f"algo.lr_scheduler_type={kind}", *warmup))
    got = [float(r["train/learning_rate"]) for r in metrics(tmp_path)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-9)


def test_max_grad_norm_clips_and_the_norm_is_logged(tmp_path, monkeypatch):
    import torch

    seen = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda params, max_norm, *a, **k: seen.append(max_norm) or real(params, max_norm, *a, **k))
    run(small(tmp_path, "algo.max_grad_norm=0.5"))
    assert seen == [0.5, 0.5] and all(float(r["train/grad_norm"]) >= 0 for r in metrics(tmp_path))
    seen.clear()
    run(small(tmp_path / "lightning", "trainer.gradient_clip_val=0.25"))   # the Trainer's value wins
    assert seen == [0.25, 0.25]
    seen.clear()
    run(small(tmp_path / "off", "algo.max_grad_norm=null"))
    assert seen == []


def test_trainer_logger_override_and_missing_logger_packages(tmp_path):
    run(small(tmp_path, "trainer.logger=false"))
    assert not (tmp_path / "logs").exists() and (tmp_path / "checkpoints").exists()
    for name in ("wandb", "mlflow"):
        if importlib.util.find_spec(name) is None:
            with pytest.raises(RuntimeError, match="install its package.*logger=csv"):
                run(small(tmp_path / name, f"logger={name}"))


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_logger_group(tmp_path):
    run(small(tmp_path, "logger=tensorboard"))
    assert (tmp_path / "logs" / "metrics.csv").exists() and list((tmp_path / "tb").glob("events.*"))
