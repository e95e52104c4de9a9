"""Tools and environments in GRPO rollouts (rl/tools.py, TRL's forms): tool calls read from a turn, run, and
answered through the chat template (errors become messages to the model and are counted), environments reset per
row and scoring their rollouts, and a GRPO run whose rows get tool results trains on the model's tokens only."""
from __future__ import annotations

import math

import pytest
import torch

from segki_lightning.rl.tools import ToolSession, environment_tools, parse_tool_calls, with_text

from .test_lightning import small

TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
            "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
            "<eos>{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


def tool_tokenizer():
    """A character tokenizer over printable text (pad 0, eos 1) with a chat template that renders tool calls
    and tool messages, ending each message with EOS as Qwen's templates end theirs with <|im_end|>."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>"] + list(string.printable))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   chat_template=TEMPLATE)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("out of order")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_tool_calls_are_read_from_a_turn():
    calls = parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> y '
                             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}</tool_call>')
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 3, "b": 4}}]
    assert parse_tool_calls("no call") == []
    assert "not valid JSON" in parse_tool_calls("<tool_call>{oops</tool_call>")[0]["error"]
    assert parse_tool_calls('<tool_call>[1, 2]</tool_call>')[0]["name"] is None


def test_a_session_runs_the_calls_and_answers_through_the_chat_template():
    tok = tool_tokenizer()
    session = ToolSession(tok, [add, broken], None, n_rows=3)
    turns = [ids(tok, 'sum: <tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'),
             ids(tok, "just 7"),
             ids(tok, '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
                      '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad</tool_call>')]
    out = session.respond([0, 1, 2], turns)
    assert out[1] is None                                  # no tool called: the row ends
    assert tok.decode(out[0]) == "[tool]42<eos>[assistant]"   # the result, then the next assistant turn
    assert session.calls == 4 and session.failures == 3
    errors = [m["content"] for m in session.messages[2] if m["role"] == "tool"]
    assert "out of order" in errors[0] and "nope not found" in errors[1] and "JSON" in errors[2]
    assert session.messages[0][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 40}}
    # the next turn of row 0 starts after the appended tokens: only its own text is read
    second = turns[0] + out[0] + ids(tok, "the sum is 42")
    assert session.respond([0], [second]) == [None]
    assert session.messages[0][-1] == {"role": "assistant", "content": "the sum is 42"}


def test_a_session_renders_the_tool_turns_with_the_chat_template_kwargs():
    """The tokens appended after a tool call come from the template rendered with ``chat_template_kwargs``."""
    tok = tool_tokenizer()
    tok.chat_template = TEMPLATE.replace("[assistant]", "[assistant]{% if not thinking %}(no thinking){% endif %}")
    turn = ids(tok, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    plain = ToolSession(tok, [add], None, n_rows=1, template_kwargs={"thinking": True}).respond([0], [turn])
    quiet = ToolSession(tok, [add], None, n_rows=1, template_kwargs={"thinking": False}).respond([0], [turn])
    assert tok.decode(plain[0]) == "[tool]2<eos>[assistant]"
    assert tok.decode(quiet[0]) == "[tool]2<eos>[assistant](no thinking)"


class Guess:
    """A number-guessing game: the environment's public method is its tool; reset() adds text to the prompt."""

    def reset(self, answer: str = "0", **row) -> str:
        self.target, self.tries = int(answer) if str(answer).isdigit() else 0, 0
        return " guess"

    def guess(self, n: int) -> str:
        """Guess the number.

        Args:
            n: the guess
        """
        self.tries += 1
        return "yes" if n == self.target else ("up" if n < self.target else "down")

    def get_reward(self) -> float:
        return 1.0 / (1 + self.tries)


def test_an_environments_methods_are_its_tools_and_reset_text_joins_the_prompt():
    env = Guess()
    assert list(environment_tools(env)) == ["guess"]
    assert with_text([{"role": "user", "content": "3+4="}], " guess") == [{"role": "user", "content": "3+4= guess"}]
    assert with_text("3+4=", None) == "3+4="


def test_grpo_with_an_environment_that_owns_the_reward_runs(tmp_path):
    from segki_lightning.train import run

    metrics = run(small(tmp_path, "environment_factory=tests.test_tools.Guess", "rewards=[]",
                        "algo.max_tool_calling_iterations=2", "trainer.max_steps=1"))
    assert math.isfinite(metrics["train/loss"]) and metrics["train/rewards/Guess"] == 1.0   # no guess was made
    assert metrics["rollout/turns"] == 1.0 and metrics["tools/call_frequency"] == 0.0


@pytest.mark.parametrize("knobs", [[], ["algo.loss_type=vespo"],
                                   ["algo.importance_sampling_level=sequence", "algo.num_iterations=2"]],
                         ids=["dapo", "vespo", "gspo-reused"])
def test_tool_results_are_in_the_sequence_but_out_of_the_loss(tmp_path, monkeypatch, knobs):
    """Every row gets two appended tokens after its first turn: the step trains (whatever the loss type, with
    the sampler correction and a reused rollout), the loss mask is the model's tokens only, and the rollout
    metrics count the appended tokens."""
    from segki_lightning.rl.grpo import GRPOModule
    from segki_lightning.train import run

    monkeypatch.setattr(ToolSession, "respond", lambda self, rows, c: [[5, 6] if len(x) < 4 else None for x in c])
    seen = []
    real = GRPOModule.prepare

    def spy(self, batch):
        buf = real(self, batch)
        seen.append((buf.data["mask"].clone(), buf.scored.batch))
        return buf

    monkeypatch.setattr(GRPOModule, "prepare", spy)
    from segki_lightning.rollout import RolloutEngine

    # every character ends a turn, so that rows reach the tool loop on a random model
    monkeypatch.setattr(RolloutEngine, "_special_tokens", lambda self, eos, pad: (list(range(1, 60)), 0))
    metrics = run(small(tmp_path, "tools=[tests.test_tools.add]", "algo.max_completion_length=8",
                        "trainer.max_steps=2", *knobs))
    mask, ro = seen[0]
    assert ro.tool_mask is not None and (ro.tool_mask == 0).any()
    assert torch.equal(mask, ro.completion_mask * ro.tool_mask)
    assert metrics["rollout/observation_tokens"] > 0 and math.isfinite(metrics["train/loss"])
    assert 0 <= metrics["rollout/respond_share"] < 1


def test_ppo_refuses_tools_with_one_clear_line(tmp_path):
    from segki_lightning.train import run

    with pytest.raises(ValueError, match="algorithm=grpo"):
        run(small(tmp_path, "tools=[tests.test_tools.add]", name="ppo"))


def test_the_readme_environment_runs_as_written(tmp_path, monkeypatch):
    """The README's environment example, as it stands, is an environment_factory the GRPO recipe trains with."""
    import re
    from pathlib import Path

    from segki_lightning.train import run

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("### Tools and environments"):]
    (tmp_path / "readme_env.py").write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    metrics = run(small(tmp_path, "environment_factory=readme_env.Guess", "trainer.max_steps=1"))
    assert "train/rewards/Guess" in metrics and math.isfinite(metrics["train/loss"])


def test_the_toy_tool_recipe_pieces():
    from segki_lightning.rl.toy_tools import (Calculator, answer_digits, final_answer, last_turn,
                                              question_mark_calls, used_tool)

    assert question_mark_calls("12?") == [{"name": "calculate", "arguments": {}}] and question_mark_calls("12") == []
    env = Calculator()
    env.reset(prompt="23+45=", answer="68")
    assert env.calculate() == "68"
    texts = ["?tool: 68 assistant: 68", "?tool: 68 assistant: 61", "68"]
    assert [last_turn(t) for t in texts] == [" 68", " 61", "68"]
    assert final_answer(None, texts, ["68"] * 3) == [1.0, 0.0, 1.0]
    assert answer_digits(None, texts, ["68"] * 3) == [1.0, 0.5, 1.0]
    assert used_tool(None, texts) == [1.0, 1.0, 0.0]


def test_the_tool_recipe_runs_its_calculator(tmp_path):
    from segki_lightning.train import run

    from .test_lightning import small

    metrics = run(small(tmp_path, "trainer.max_steps=2", "algo.max_completion_length=24", name="grpo_tools"))
    assert math.isfinite(metrics["train/loss"]) and "tools/call_frequency" in metrics
    assert "train/rewards/used_tool" in metrics and metrics["tools/failure_frequency"] == 0.0


class CountedGuess(Guess):
    built = 0

    def __init__(self):
        CountedGuess.built += 1


def test_environments_are_built_once_and_reset_for_every_rollout(tmp_path, monkeypatch):
    """TRL's contract: a pool of environments, one per row of a rollout, built once and reset each time."""
    from segki_lightning.train import run

    resets = []
    monkeypatch.setattr(CountedGuess, "reset", lambda self, **row: resets.append(id(self)) or Guess.reset(self, **row))
    CountedGuess.built = 0
    run(small(tmp_path, "environment_factory=tests.test_tools.CountedGuess", "trainer.max_steps=3"))
    rows = 2 * 2   # task.prompts_per_step x algo.num_generations
    assert CountedGuess.built == rows and len(resets) >= 3 * rows and len(set(resets)) == rows
