"""Conversational prompts (TRL's format) through the chat template, max_prompt_length, and validation with greedy
rollouts of held-out prompts."""
from __future__ import annotations

import csv
import json

import pytest

from segki_lightning.lightning.mixin import render_chat
from segki_lightning.rl.task import char_tokenizer
from segki_lightning.train import run

from .test_lightning import small, tiny_module

CHAT = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]
SEEN: dict[str, list] = {}


def spy(prompts, completions, **kwargs):
    """Records what a reward function receives."""
    SEEN["prompts"], SEEN["completions"] = list(prompts), list(completions)
    return [1.0 if "3" in c[0]["content"] else 0.0 for c in completions]


def test_chat_prompts_render_with_the_template_and_a_generation_prompt():
    tok = char_tokenizer()
    assert render_chat(tok, CHAT) == "system: add user: 1+2= assistant: "
    m = tiny_module()
    assert m._prompt_ids(CHAT) == tok("system: add user: 1+2= assistant: ", add_special_tokens=False)["input_ids"]
    tok.chat_template = None
    m.tokenizer = tok
    with pytest.raises(ValueError, match="chat template"):
        m._prompt_ids(CHAT)


# Qwen3's switch, in the form its template reads it: no thinking block unless enable_thinking is left on
THINKING = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}"
            "assistant: {% if enable_thinking is defined and not enable_thinking %}nothink {% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template():
    """TRL's ``chat_template_kwargs`` (here ``enable_thinking``) are passed to the chat template of every prompt;
    the Hydra form is ``+algo.chat_template_kwargs.enable_thinking=false``."""
    tok = char_tokenizer()
    tok.chat_template = THINKING
    assert render_chat(tok, CHAT) == "system: add user: 1+2= assistant: "
    m = tiny_module(chat_template_kwargs={"enable_thinking": False})
    m.tokenizer = tok
    assert m._prompt_ids(CHAT) == tok("system: add user: 1+2= assistant: nothink ", add_special_tokens=False)[
        "input_ids"]
    cfg = small(".", "+algo.chat_template_kwargs.enable_thinking=false")
    from omegaconf import OmegaConf

    assert OmegaConf.to_object(cfg.algo).chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="chat_template_kwargs must be a mapping"):
        tiny_module(chat_template_kwargs=["enable_thinking"])


def test_max_prompt_length_cuts_from_the_left():
    m = tiny_module(max_prompt_length=3)
    assert m.prompt_ids(["12+34=", [5, 6]]) == [m._prompt_ids("12+34=")[-3:], [5, 6]]


def test_a_conversational_jsonl_trains_and_rewards_get_trls_shapes(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": CHAT, "answer": "3"}) for _ in range(4)))
    SEEN.clear()
    run(small(tmp_path, "task=jsonl", f"task.path={path}", "task.prompts_per_step=2", "rewards=[tests.test_chat_eval.spy]",
              "algo.reward_weights=null"))
    assert SEEN["prompts"][0] == CHAT                                   # prompts as the dataset gives them
    assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in SEEN["completions"])
    header = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()[0]
    assert "train/rewards/spy" in header


def test_validation_logs_greedy_rewards_every_val_check_interval(tmp_path):
    run(small(tmp_path, "trainer.max_steps=4", "trainer.val_check_interval=2", "task.eval_size=6"))
    rows = list(csv.DictReader(open(tmp_path / "logs" / "metrics.csv")))
    val = [r for r in rows if r.get("val/reward")]
    assert len(val) == 2                                                 # after steps 2 and 4
    for key in ("val/rewards/exact_match", "val/rewards/format", "val/completion_length"):
        assert all(r[key] != "" for r in val), key
