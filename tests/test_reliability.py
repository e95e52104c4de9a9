"""Nothing lost, nothing let in (CPU): a checkpoint URL whose pickle would run code is refused and the code never
runs; SIGTERM/SIGINT at a random step leave a checkpoint of the last finished step that resumes exactly, with exit
status 128 + the signal; an infinite reward and a NaN gradient end the run with the step and the quantity named
and nothing non-finite on disk; a checkpoint with flipped bits is refused; a save killed mid-write (``$TMPDIR``
elsewhere) leaves a loadable ``last.ckpt`` and no orphans after the next save; the last ``save_top_k`` checkpoints
are kept, a resumed run appends to ``metrics.csv``, and an unwritable ``export_dir`` fails before training."""
from __future__ import annotations

import csv
import http.server
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from segki_lightning.lightning import CheckpointError, SafeCheckpointIO, TrainingInterrupted
from segki_lightning.lightning.checkpoint_io import atomic_save
from segki_lightning.rl import GRPOModule
from segki_lightning.rl.nonfinite import NonFiniteError
from segki_lightning.rl.rewards import FormatRegex
from segki_lightning.train import run

from .test_lightning import small

REWARD = "rewards.0.fn.pattern='.*[a-m].*'"   # random completions earn it often: updates are never all zero
ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this creates the file at ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **k)   # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_a_checkpoint_url_never_runs_its_pickle(tmp_path):
    marker = tmp_path / "payload_ran"
    served = tmp_path / "served"
    served.mkdir()
    with open(served / "evil.ckpt", "wb") as f:
        torch.save({"state_dict": {}, "surprise": _Payload(str(marker))}, f)
    with open(served / "raw.pkl", "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    server, url = _serve(served)
    try:
        for name in ("evil.ckpt", "raw.pkl"):
            with pytest.raises(CheckpointError, match="cannot be loaded as weights only"):
                SafeCheckpointIO().load_checkpoint(f"{url}/{name}")
        with pytest.raises(CheckpointError):
            run(small(tmp_path / "run", f"ckpt_path={url}/evil.ckpt"))
    finally:
        server.shutdown()
    assert not marker.exists()
    assert not (tmp_path / "run" / "checkpoints").exists()   # refused before any step


_fired = {"calls": 0}


def signal_at(prompts, completions, **columns):
    """A reward that sends this process ``SEGKI_TEST_SIGNAL`` on its ``SEGKI_TEST_SIGNAL_AT``-th call (mid-step)."""
    _fired["calls"] += 1
    if _fired["calls"] == int(os.environ["SEGKI_TEST_SIGNAL_AT"]):
        os.kill(os.getpid(), int(os.environ["SEGKI_TEST_SIGNAL"]))
    return FormatRegex(".*[a-m].*")(prompts, completions)


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_checkpoints_the_last_step_and_the_resume_is_exact(tmp_path, monkeypatch, signum):
    at = random.Random(int(signum)).randint(1, 4)
    monkeypatch.setenv("SEGKI_TEST_SIGNAL_AT", str(at))
    monkeypatch.setenv("SEGKI_TEST_SIGNAL", str(int(signum)))
    _fired["calls"] = 0
    rewards = "rewards=[tests.test_reliability.signal_at]"
    a, straight = tmp_path / "stopped", tmp_path / "straight"
    common = ("trainer.max_steps=5", "checkpoint.every_n_train_steps=100", "algo.reward_weights=null", rewards)
    with pytest.raises(TrainingInterrupted) as stop:
        run(small(a, *common))
    assert stop.value.code == 128 + signum and stop.value.step == at
    assert signal.getsignal(signum) is not None and _state(a / "checkpoints" / "last.ckpt")["global_step"] == at
    monkeypatch.setenv("SEGKI_TEST_SIGNAL_AT", "0")   # no more signals
    run(small(a, *common, f"ckpt_path={a / 'checkpoints' / 'last.ckpt'}"))
    run(small(straight, *common))
    got, want = _state(a / "checkpoints" / "last.ckpt"), _state(straight / "checkpoints" / "last.ckpt")
    assert got["global_step"] == want["global_step"] == 5
    for key, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key


def infinite_reward(prompts, completions, **columns):
    return [float("inf")] + [0.5] * (len(completions) - 1)


def _no_nan_on_disk(root: Path) -> None:
    for path in root.rglob("*.ckpt"):
        for t in _state(path)["state_dict"].values():
            assert torch.isfinite(t).all(), path


def test_an_infinite_reward_stops_the_run_naming_it(tmp_path):
    export = tmp_path / "export"
    with pytest.raises(NonFiniteError, match=r"step 0: reward function infinite_reward returned inf for 1 of 4"):
        run(small(tmp_path, "rewards=[tests.test_reliability.infinite_reward]", "algo.reward_weights=null",
                  f"export_dir={export}", "checkpoint.every_n_train_steps=1"))
    _no_nan_on_disk(tmp_path)
    assert not list(export.iterdir())


def test_skip_step_skips_and_counts(tmp_path):
    run(small(tmp_path, "rewards=[tests.test_reliability.infinite_reward]", "algo.reward_weights=null",
              "algo.on_nonfinite=skip_step", "checkpoint.every_n_train_steps=1"))
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/nonfinite_skipped")]
    assert [float(r["train/nonfinite_skipped"]) for r in rows] == [1.0, 2.0]
    _no_nan_on_disk(tmp_path)


class NaNGrad(GRPOModule):
    """The recipe's GRPO module whose second step's gradients get a NaN (``module=tests.test_reliability.NaNGrad``)."""

    def on_after_backward(self) -> None:
        if self.global_step == 1:
            p = next(p for p in self.parameters() if p.grad is not None)
            p.grad.view(-1)[0] = float("nan")


def test_a_nan_gradient_stops_the_run_before_the_optimizer_step(tmp_path):
    with pytest.raises(NonFiniteError, match="step 1: the gradient norm is not finite"):
        run(small(tmp_path, "module=tests.test_reliability.NaNGrad", "checkpoint.every_n_train_steps=1",
                  "trainer.max_steps=3", REWARD))
    assert _state(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 1
    _no_nan_on_disk(tmp_path)


def test_a_checkpoint_with_flipped_bits_is_refused(tmp_path):
    run(small(tmp_path, "checkpoint.every_n_train_steps=1", REWARD))
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    with zipfile.ZipFile(ckpt) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(ckpt.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)   # the record's data
    size = min(4096, info.file_size)
    raw[start:start + size] = bytes(b ^ 0xFF for b in raw[start:start + size])
    ckpt.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="is damaged"):
        SafeCheckpointIO().load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="is damaged"):
        run(small(tmp_path / "resumed", f"ckpt_path={ckpt}", "trainer.max_steps=3"))


def test_non_finite_weights_in_a_checkpoint_are_refused(tmp_path):
    path = tmp_path / "c.ckpt"
    SafeCheckpointIO().save_checkpoint({"state_dict": {"w": torch.tensor([1.0, float("nan")])}}, path)
    with pytest.raises(CheckpointError, match="non-finite values in state_dict.w"):
        SafeCheckpointIO().load_checkpoint(path)


_WRITER = """
import sys, torch
from pathlib import Path
from segki_lightning.lightning.checkpoint_io import atomic_save
path, i = Path(sys.argv[1]), 0
print("ready", flush=True)
while True:
    i += 1
    atomic_save({"step": i, "w": torch.full((5_000_000,), float(i))}, path)
"""


def test_a_save_killed_mid_write_leaves_a_loadable_last_ckpt(tmp_path):
    """SIGKILL at random moments while a 20 MB checkpoint is saved over and over, with $TMPDIR on another folder:
    last.ckpt always loads complete, nothing lands in $TMPDIR, and the next save removes the killed one's leftover.
    Three runs, each saving into a folder of its own, started together (one start-up's wait, not three)."""
    targets, tmpdir = [tmp_path / f"run{i}" / "last.ckpt" for i in range(3)], tmp_path / "elsewhere"
    tmpdir.mkdir()
    for target in targets:
        atomic_save({"step": 0, "w": torch.zeros(5_000_000)}, target)
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(t)], env=env, stdout=subprocess.PIPE, text=True)
             for t in targets]
    try:
        assert all(p.stdout.readline().strip() == "ready" for p in procs)
        rng, start = random.Random(0), time.monotonic()
        for proc, at in zip(procs, sorted(rng.uniform(0.2, 0.8) for _ in procs)):   # kill times after the start
            threading.Event().wait(max(0.0, at - (time.monotonic() - start)))
            proc.kill()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for target in targets:
        got = torch.load(target, weights_only=True)
        assert got["w"].shape == (5_000_000,) and bool((got["w"] == got["step"]).all())
    assert not list(tmpdir.iterdir())
    for target in targets:
        atomic_save({"step": -1, "w": torch.zeros(1)}, target)
        assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_the_last_checkpoints_are_kept_and_a_resume_appends_metrics(tmp_path):
    run(small(tmp_path, "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=2", REWARD))
    run(small(tmp_path, "checkpoint.every_n_train_steps=1", "checkpoint.save_top_k=2", "trainer.max_steps=4",
              f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}", REWARD))
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.ckpt", "step-000003.ckpt", "step-000004.ckpt"]
    with open(tmp_path / "logs" / "metrics.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("train/loss")]
    assert steps == [0, 1, 2, 3]


def test_an_unwritable_export_dir_fails_before_training(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(ValueError, match="export_dir=.* is not a writable folder"):
        run(small(tmp_path / "run", f"export_dir={blocked / 'out'}"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_export_refuses_non_finite_weights(tmp_path):
    from types import SimpleNamespace

    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.task import char_tokenizer
    from segki_lightning.train import export

    tok = char_tokenizer()
    policy = tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id)
    with torch.no_grad():
        next(policy.parameters()).view(-1)[3] = float("inf")
    with pytest.raises(ValueError, match="non-finite weights .* nothing is exported"):
        export(SimpleNamespace(policy=policy, tokenizer=tok, global_rank=0), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def signal_on_rank0_at(prompts, completions, **columns):
    """:func:`signal_at`, on global rank 0 only: the other rank learns of it at the step's end."""
    if os.environ.get("RANK", "0") == "0" and os.environ.get("LOCAL_RANK", "0") == "0":
        return signal_at(prompts, completions)
    return FormatRegex(".*[a-m].*")(prompts, completions)


def test_under_ddp_a_signal_to_one_rank_stops_both_after_the_same_step(tmp_path):
    """segki-train under Lightning's own DDP launcher, SIGTERM to rank 0 at step 2: both ranks stop after step 2,
    the command exits 143 and says where the checkpoint is (one process takes the same exit: the in-process signal
    tests above check its checkpoint and code)."""
    env = {**os.environ, "SEGKI_TEST_SIGNAL_AT": "2", "SEGKI_TEST_SIGNAL": str(int(signal.SIGTERM)),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "segki_lightning.train", "--config-name", "grpo", "trainer.max_steps=5",
           "trainer.strategy=ddp", "trainer.devices=2", "trainer.enable_progress_bar=false", "task.prompts_per_step=2",
           "algo.num_generations=2", "algo.max_completion_length=3", "algo.reward_weights=null",
           "rewards=[tests.test_reliability.signal_on_rank0_at]", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert proc.returncode == 143, proc.stderr[-3000:]   # segki-train's exit status: 128 + the signal
    assert f"stopped by SIGTERM after step 2; its checkpoint is {ckpt}" in proc.stderr   # where to resume from
    assert _state(ckpt)["global_step"] == 2


def _weights(path: Path) -> dict:
    return torch.load(path, weights_only=False)["state_dict"]


@pytest.mark.parametrize("prompts", [4, 6])   # epochs of 2 and 3 steps (2 prompts a step)
def test_a_resume_from_any_step_equals_the_uninterrupted_run(tmp_path, prompts):
    """Resumed from each step's checkpoint of one run -- epoch boundaries (a checkpoint after an epoch's last
    batch) and mid-epoch -- with the same ``max_steps``: the same weights, bit for bit, and the same epoch."""
    common = [f"task.size={prompts}", "task.eval_size=0", "checkpoint.every_n_train_steps=1",
              "checkpoint.save_top_k=-1", f"trainer.max_steps={prompts + 1}", REWARD]
    run(small(tmp_path / "straight", *common))
    ckpts = tmp_path / "straight" / "checkpoints"
    want = torch.load(ckpts / "last.ckpt", weights_only=False)
    assert any(not torch.equal(v, _weights(ckpts / "step-000001.ckpt")[k]) for k, v in want["state_dict"].items())
    for step in (prompts // 2, prompts // 2 + 1, prompts):   # the first boundary, one past it, the second
        out = tmp_path / f"from{step}"
        run(small(out, f"ckpt_path={ckpts / f'step-{step:06d}.ckpt'}", *common))
        got = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
        assert (got["global_step"], got["epoch"]) == (want["global_step"], want["epoch"]), step
        for k, v in want["state_dict"].items():
            assert torch.equal(got["state_dict"][k], v), (step, k)


def test_a_finished_run_resumed_with_more_steps_continues_its_schedule(tmp_path):
    """A linear schedule ends at 0.0 on a finished run; resumed with a larger ``max_steps`` the schedule is the
    new run's: its first new step trains at ``lr * (1 - 3/6)``, not at the 0.0 the optimizer was saved with."""
    run(small(tmp_path, "checkpoint.every_n_train_steps=1", "trainer.max_steps=3", REWARD))
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["param_groups"][0]["lr"] == 0.0
    run(small(tmp_path, "checkpoint.every_n_train_steps=1", "trainer.max_steps=6", REWARD,
              f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"))
    with open(tmp_path / "logs" / "metrics.csv") as f:
        lrs = {int(r["step"]): float(r["train/learning_rate"]) for r in csv.DictReader(f)
               if r.get("train/learning_rate")}
    base = lrs[0]
    assert lrs[3] == pytest.approx(base * 0.5) and lrs[4] == pytest.approx(base * 2 / 6) and lrs[5] > 0


@pytest.mark.parametrize("fail_at", [2, 3])   # mid-epoch, and the last batch of an epoch (4 prompts, 2 a step)
def test_a_step_that_raises_leaves_the_last_finished_step_and_the_resume_is_exact(tmp_path, monkeypatch, fail_at):
    """A reward function raising in step ``fail_at`` (before its optimizer step), no periodic checkpoint due:
    ``last.ckpt`` holds step ``fail_at``'s start, and resuming from it equals the uninterrupted run bit for bit
    (the failed step's prompts are handed out again)."""
    common = ["task.size=4", "task.eval_size=0", "trainer.max_steps=5", REWARD]
    run(small(tmp_path / "straight", *common))
    calls = [0]
    plain = FormatRegex.__call__

    def flaky(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at + 1:
            raise RuntimeError("the reward service is down")
        return plain(self, *args, **kwargs)

    monkeypatch.setattr(FormatRegex, "__call__", flaky)
    with pytest.raises(RuntimeError, match="reward service is down"):
        run(small(tmp_path / "failed", *common))
    monkeypatch.setattr(FormatRegex, "__call__", plain)
    last = tmp_path / "failed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == fail_at
    run(small(tmp_path / "failed", f"ckpt_path={last}", *common))
    got = _weights(last)
    want = _weights(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_failure_inside_the_optimizer_step_writes_no_checkpoint(tmp_path, monkeypatch, caplog):
    """Step 1's optimizer raises after its closure ran and one weight moved (what an out-of-memory error as AdamW
    allocates its moments, or between master buckets, leaves): no ``last.ckpt`` mixing two steps, a line saying
    why. (A failure inside the closure still writes one: the test above.)"""
    plain, calls = torch.optim.AdamW.step, [0]

    def fails_midway(self, closure=None):
        calls[0] += 1
        if calls[0] == 1:
            return plain(self, closure)
        with torch.enable_grad():
            closure()
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1.0)
        raise RuntimeError("allocating the optimizer state failed")

    monkeypatch.setattr(torch.optim.AdamW, "step", fails_midway)
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="optimizer state failed"):
        run(small(tmp_path, "trainer.max_steps=3", REWARD))
    assert calls[0] == 2
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert any("inside step 1's optimizer step" in r.getMessage() for r in caplog.records)
