"""No silent fallbacks: each way a new user got a misleading run or a bare traceback is a clear error that names
what to change (or correct behaviour)."""
from __future__ import annotations

import json

import pytest

from segki_lightning.train import run

from .test_lightning import small, tiny_module


@pytest.mark.parametrize("group,key", [("task=jsonl", "task.path"), ("model=pretrained", "model.pretrained")])
def test_a_group_without_its_required_key_is_an_error(tmp_path, group, key):
    with pytest.raises(ValueError, match=f"missing required settings: {key}.*set {key}="):
        run(small(tmp_path, group))
    assert not (tmp_path / "checkpoints").exists()   # nothing trained on the defaults


def test_empty_and_short_prompt_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        run(small(tmp_path, "task=jsonl", f"task.path={empty}"))
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(json.dumps({"prompt": "1+2=", "answer": "3"}) for _ in range(3)))
    with pytest.raises(ValueError, match="prompts_per_step=8 but the prompts have only 3 rows"):
        run(small(tmp_path, "task=jsonl", f"task.path={short}", "task.prompts_per_step=8"))


def test_a_row_without_the_rewards_column_names_it(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps({"prompt": "1+2=", "solution": "3"}) for _ in range(4)))
    with pytest.raises(KeyError, match="needs the dataset column 'answer'.*'solution'"):
        run(small(tmp_path, "task=jsonl", f"task.path={rows}"))


def test_fit_on_a_bare_dataset_says_how_to_batch_it(tmp_path):
    import datasets
    import lightning.pytorch as pl

    data = datasets.Dataset.from_list([{"prompt": "1+2=", "answer": "3"}] * 4)
    trainer = pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         default_root_dir=tmp_path)
    with pytest.raises(TypeError, match="collate_fn=segki_lightning.rl.task.collate"):
        trainer.fit(tiny_module(), train_dataloaders=data)


@pytest.mark.parametrize("overrides, words", [
    (["algo.max_grad_norm=-1"], r"algo\.max_grad_norm must be > 0"),
    (["algo.loss_type=ppo"], r"algo\.loss_type must be one of"),
    (["algo.num_generations=1"], r"algo\.num_generations must be >= 2"),
    (["rollout.max_seq_len=40", "algo.max_completion_length=30"],
     r"rollout\.max_seq_len=40 is less than algo\.max_prompt_length \+ algo\.max_completion_length = 58 \+ 30"),
    (["algo.max_prompt_length=null"], r"algo\.max_prompt_length=null .* needs an explicit rollout\.max_seq_len"),
    (["algo.temperature=0"], r"algo\.temperature must be > 0: the log-probs .* unless algo\.num_generations_eval"),
    (["algo.top_p=0"], r"algo\.top_k must be >= 0 .* and algo\.top_p in \(0, 1\]"),
    (["algo.max_completion_length=0"], r"algo\.max_completion_length must be >= 1 token, got 0"),
    (["algo.learning_rate=-1"], r"algo\.learning_rate and algo\.weight_decay must be >= 0, got -1"),
    (["algo.beta=-0.1"], r"algo\.beta, algo\.epsilon and algo\.epsilon_high must be >= 0 .* got -0\.1"),
    (["algo.cliprange=-0.2", "name=ppo"], r"algo\.cliprange, algo\.cliprange_value, .* must be >= 0, got -0\.2"),
    (["rollout.max_batch_size=0"], r"rollout\.max_batch_size must be >= 1, got 0"),
    (["algo.reward_weights=[1,2,3]"], r"algo\.reward_weights has 3 values for the 2 entries of rewards"),
    (["checkpoint.every_n_train_steps=-1"], r"checkpoint\.every_n_train_steps must be >= 0"),
    (["task.prompts_per_step=0"], r"task\.prompts_per_step must be >= 1 prompt, got 0"),
    (["lora.r=-4"], r"lora\.r must be >= 0 \(0: full weights\)"),
    (["lora.r=4", "lora.lora_dropout=1.5"], r"lora\.lora_dropout in \[0, 1\), got 4, 1\.5"),
])
def test_a_bad_setting_names_its_key_before_the_model_loads(tmp_path, monkeypatch, overrides, words):
    import segki_lightning.train as train

    def no_model(cfg):
        raise AssertionError("the model loaded before the settings were checked")

    monkeypatch.setattr(train, "build_policy", no_model)
    name = [o[5:] for o in overrides if o.startswith("name=")] or ["grpo"]   # name=<recipe>: not grpo
    with pytest.raises(ValueError, match=words):
        run(small(tmp_path, *(o for o in overrides if not o.startswith("name=")), name=name[0]))
    assert not (tmp_path / "checkpoints").exists()


def test_a_longer_completion_alone_sizes_the_rollout(tmp_path):
    """``algo.max_completion_length`` alone is enough: ``rollout.max_seq_len`` follows it (TRL's way)."""
    from segki_lightning.train import rollout_settings
    from segki_lightning.rl import GRPOConfig

    cfg = small(tmp_path, "algo.max_completion_length=256")
    assert rollout_settings(cfg, GRPOConfig(max_prompt_length=58, max_completion_length=256))["max_seq_len"] == 314
    run(small(tmp_path, "algo.max_completion_length=12", "trainer.max_steps=1"))
