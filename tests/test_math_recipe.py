"""The real-task path on CPU: datasets from local files, folders and a Hub-layout cache (offline, built here), the
math answer reward, and the grpo_math recipe end to end on a tiny local Qwen-format checkpoint and a GSM8K-shaped
parquet file."""
from __future__ import annotations

import csv
import shutil

import pytest
import torch

from segki_lightning.rl.rewards import MathAnswer, final_answer
from segki_lightning.rl.task import PromptRows, load_rows
from segki_lightning.train import run

from .test_lightning import compose

ROWS = [{"question": f"what is {a} + {b}?", "answer": f"{a} plus {b} makes {a + b}.\n#### {a + b}"}
        for a in range(4) for b in range(3)]


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    import datasets

    out = tmp_path_factory.mktemp("data") / "train.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The embedded tiny Qwen3.5 and its character tokenizer (with a chat template) as a local folder."""
    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.task import char_tokenizer

    out = tmp_path_factory.mktemp("ckpt")
    tok = char_tokenizer()
    tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_final_answers_and_the_math_reward():
    assert final_answer(r"so \boxed{\frac{1}{2}} is it") == r"\frac{1}{2}"
    assert final_answer("steps... #### 1,234") == "1,234" and final_answer("then 3, then 1,000.") == "1000"
    assert final_answer("no digits") is None
    got = MathAnswer()(["p"] * 6, [r"it is \boxed{72}", "so 72.", r"\boxed{71}", "none", r"\boxed{1,000}",
                                   r"\boxed{x+1}"],
                       answer=["a #### 72", "#### 72", "#### 72", "#### 72", "1000", r"\boxed{x+1}"])
    assert got == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_columns_renamed_and_prompts_made_conversations(parquet):
    rows = PromptRows(str(parquet), columns={"question": "prompt"}, system_prompt="be brief")
    first = rows[0]
    assert first["prompt"] == [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": ROWS[0]["question"]}]
    assert first["answer"] == ROWS[0]["answer"] and len(rows) == len(ROWS)
    assert PromptRows(str(parquet), columns={"question": "prompt"}, conversational=True)[1]["prompt"] == [
        {"role": "user", "content": ROWS[1]["question"]}]
    with pytest.raises(ValueError, match=r"no column 'prompt' .*task.columns=\{<name>: prompt\}"):
        PromptRows(str(parquet))
    with pytest.raises(ValueError, match=r"task.columns renames \['query'\]"):
        PromptRows(str(parquet), columns={"query": "prompt"})
    with pytest.raises(FileNotFoundError, match=r"task.path=/no/such/file.parquet does not exist"):
        load_rows("/no/such/file.parquet")


@pytest.fixture
def hub_datasets(tmp_path, monkeypatch, parquet):
    """A Hub cache holding dataset ``segki-test/math`` (train and test parquet files), offline everywhere."""
    import datasets
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "datasets--segki-test--math"
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    data = repo / "snapshots" / commit / "data"
    data.mkdir(parents=True)
    shutil.copy(parquet, data / "train.parquet")
    datasets.Dataset.from_list(ROWS[:5]).to_parquet(str(data / "test.parquet"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets_cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_hub_dataset_id_loads_from_the_cache_offline(hub_datasets):
    assert len(load_rows("segki-test/math")) == len(ROWS)
    assert load_rows("segki-test/math", split="test")["question"] == [r["question"] for r in ROWS[:5]]
    with pytest.raises(FileNotFoundError, match=r"task.path=segki-test/other is neither .* local caches "
                                                r"\(HF_HUB_OFFLINE=1\)"):
        load_rows("segki-test/other")
    with pytest.raises(ValueError, match="task.split / task.config"):
        load_rows("segki-test/math", split="validation")


def test_the_math_recipe_runs_on_a_local_checkpoint_and_parquet(tmp_path, checkpoint, parquet):
    """``--config-name grpo_math model.pretrained=<folder> task.path=<parquet>`` with only CPU-size overrides:
    TRL's algorithm defaults, the rollout cache derived, the format reward's pattern as written in YAML, both
    rewards logged for every step."""
    cfg = compose(name="grpo_math", overrides=[
        f"model.pretrained={checkpoint}", f"task.path={parquet}", "trainer=cpu", f"trainer.default_root_dir={tmp_path}",
        "trainer.max_steps=2", "trainer.enable_progress_bar=false", "task.prompts_per_step=2",
        "algo.num_generations=2", "algo.max_completion_length=4", "algo.max_prompt_length=60",
        "algo.micro_batch_size=2"])
    assert cfg.rollout.max_seq_len is None and cfg.algo.learning_rate == 1e-6   # TRL's default
    from segki_lightning.train import build_rewards

    answer, fmt = build_rewards(cfg)
    assert fmt.fn(["p"] * 2, [r"so \boxed{3}", "3"]) == [1.0, 0.0] and answer.weight == 1.0 and fmt.weight == 0.2
    run(cfg)
    with open(tmp_path / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/loss")]
    assert len(rows) == 2 and {"train/rewards/math_answer", "train/rewards/format"} <= set(rows[0])
    assert torch.isfinite(torch.tensor([float(r["train/loss"]) for r in rows])).all()
