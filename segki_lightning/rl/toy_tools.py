"""The tool-use recipe's pieces for the embedded tiny model (``recipes/grpo_tools.yaml``). Its character vocabulary
has no ``<``, ``{`` or ``"`` for Qwen's tool-call JSON, so a turn that holds ``?`` asks the calculator; the
environment knows its own prompt's sum (TRL's ``environment_factory``: one per rollout, reset with the row)."""
from __future__ import annotations

from typing import Any

TOOL_MARK = "tool:"        # how the character chat template renders a tool message ("tool: 68 assistant: ")


def question_mark_calls(text: str) -> list[dict[str, Any]]:
    """A turn's tool calls: one call of ``calculate`` when the turn holds ``?``."""
    return [{"name": "calculate", "arguments": {}}] if "?" in text else []


class Calculator:
    """One rollout's calculator: ``reset`` keeps the row's answer; ``calculate()`` is the tool."""

    def reset(self, answer: str = "", **row: Any) -> None:
        self.answer = str(answer)

    def calculate(self) -> str:
        """Add the two numbers of the prompt.

        Returns:
            Their sum.
        """
        return self.answer


def final_answer(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 when the model's last turn (the text after the last tool result, else the whole completion) is the
    answer."""
    return [float(last_turn(c).strip() == str(a)) for c, a in zip(completions, answer)]


def answer_digits(prompts, completions, answer, **kwargs) -> list[float]:
    """The share of the answer's digits the last turn has at their places (partial credit on the way to
    copying the calculator's result)."""
    out = []
    for c, a in zip(completions, answer):
        got, want = last_turn(c).strip(), str(a)
        out.append(sum(x == y for x, y in zip(got, want)) / max(len(want), len(got), 1))
    return out


def used_tool(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion holds a tool result (the model asked the calculator)."""
    return [float(TOOL_MARK in text(c)) for c in completions]


def text(completion) -> str:
    return completion if isinstance(completion, str) else " ".join(str(m["content"]) for m in completion)


def last_turn(completion) -> str:
    if not isinstance(completion, str):
        return str(completion[-1]["content"]) if completion else ""
    if TOOL_MARK not in completion:
        return completion
    return completion.rsplit(TOOL_MARK, 1)[1].split("assistant:", 1)[-1]
