"""A learned reward model as a reward function (TRL's ``reward_funcs`` given a model): a tiny sequence-classification
model built from a config and saved to a temporary folder scores prompt + completion as its own forward does on each
text alone (right padding, no special tokens, the first logit), conversations through its chat template, in chunks
or at once; by folder in the Python API and in a Hydra recipe that trains with it."""
from __future__ import annotations

import csv

import pytest
import torch

from segki_lightning.rl import RewardModel
from segki_lightning.rl.rewards import as_rewards
from segki_lightning.rl.task import char_tokenizer
from segki_lightning.train import run

from .test_lightning import small


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    """A 2-layer Qwen2 sequence classifier over the character tokenizer, saved with it (``num_labels=1``)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tok = char_tokenizer()
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id, num_labels=1)
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    folder = tmp_path_factory.mktemp("scorer")
    Qwen2ForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def alone(rm: RewardModel, text: str) -> float:
    ids = rm.tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return float(rm.model(**ids).logits[0, 0])


def test_a_reward_model_scores_each_text_as_its_forward_does_alone(scorer):
    rm = RewardModel(str(scorer))
    prompts, completions = ["1+2=", "3+4=", "9+0="], ["3", "7 and more", ""]
    got = rm(prompts, completions)
    want = [alone(rm, p + c) for p, c in zip(prompts, completions)]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    assert RewardModel(str(scorer), batch_size=2)(prompts, completions) == pytest.approx(got, abs=1e-5)
    chat = [[{"role": "user", "content": "1+2="}]] * 2
    answers = [[{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]]
    texts = rm.texts(chat, answers)
    assert texts[0] == "user: 1+2= assistant: 3 "          # the whole conversation, no generation prompt
    assert rm(chat, answers) == pytest.approx([alone(rm, t) for t in texts], abs=1e-5)
    assert rm.__name__ == scorer.name and not any(p.requires_grad for p in rm.model.parameters())
    rm.tokenizer.chat_template = None
    with pytest.raises(ValueError, match=f"reward model {scorer.name}: conversational prompts .* has none"):
        rm(chat, answers)


def test_a_reward_model_is_a_reward_by_folder_and_trains_a_recipe(scorer, tmp_path):
    (reward,) = as_rewards([str(scorer)])
    assert isinstance(reward.fn, RewardModel) and reward.label == scorer.name and reward.weight == 1.0
    node = f"rewards=[{{_target_:segki_lightning.rl.RewardModel,model:'{scorer}'}}]"
    run(small(tmp_path, node, "algo.reward_weights=null", "trainer.max_steps=2"))
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    assert all(r[f"train/rewards/{scorer.name}"] for r in rows if r.get("train/loss"))


def test_a_missing_reward_model_is_named(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="RewardModel model=segki-test/no-such-scorer is not a local folder"):
        RewardModel("segki-test/no-such-scorer")
    with pytest.raises(ValueError, match="needs its tokenizer"):
        from transformers import Qwen2Config, Qwen2ForSequenceClassification

        RewardModel(Qwen2ForSequenceClassification(Qwen2Config(hidden_size=8, intermediate_size=8,
                                                               num_hidden_layers=1, num_attention_heads=1,
                                                               num_key_value_heads=1, vocab_size=16)))
