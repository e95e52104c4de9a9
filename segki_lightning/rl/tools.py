"""Tool calling and environments in rollouts, in TRL's forms: ``tools`` (Python functions the model calls with
its chat template's tool-call format) and ``environment_factory`` (one environment per rollout; its public methods
are its tools, ``reset(**row)`` starts it and may add text to the last user message, ``get_reward()`` scores it).

:class:`ToolSession` is one batch's tool loop. The engine's ``generate_turns`` hands it each row that ended a turn
with EOS; it decodes that turn, reads the tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
the format of Qwen and the Hermes templates), runs them (an exception or an unknown tool becomes ``{"error": ...}``
for the model and counts as a failure; the run goes on), and returns the tool messages rendered by the chat
template up to the assistant's next turn -- or None when the turn called no tool, which ends the row."""
from __future__ import annotations

import inspect
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """The tool calls in one assistant turn: ``[{"name": str, "arguments": dict}]``; a call that is not a JSON
    object with a string ``name`` gives ``{"name": None, "error": ...}`` (answered to the model, counted)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            calls.append({"name": None, "error": f"the tool call is not valid JSON ({exc.msg})"})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"name": None, "error": 'a tool call is {"name": ..., "arguments": {...}}'})
            continue
        args = call.get("arguments") or {}
        if isinstance(args, str):   # some templates send the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        calls.append({"name": call["name"], "arguments": args})
    return calls


def environment_tools(env: Any) -> dict[str, Callable]:
    """An environment's tools: its public methods other than ``reset`` and ``get_reward`` (TRL's rule)."""
    return {name: m for name, m in inspect.getmembers(env, predicate=inspect.ismethod)
            if not name.startswith("_") and name not in ("reset", "get_reward")}


def check_environment(env: Any) -> None:
    if not callable(getattr(env, "reset", None)):
        raise ValueError(f"environment_factory built a {type(env).__name__} without a callable reset(**row): each "
                         "environment needs one (TRL's contract); it may return None or text for the prompt")


def environment_reward(prompts, completions, environments, **kwargs) -> list[float]:
    """The reward of an environment that owns it (TRL's ``get_reward``): one call per rollout, after its turns."""
    return [float(env.get_reward()) for env in environments]


def with_text(prompt: Any, text: str | None) -> Any:
    """A prompt with an environment's reset text added: to the last user message of a conversation (a copy),
    or to the end of a string; ``None`` or empty text leaves it as it is."""
    if not text:
        return prompt
    if isinstance(prompt, str):
        return prompt + text
    messages = [dict(m) for m in prompt]
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        raise ValueError("environment reset() returned text but the prompt has no user message to add it to")
    messages[last]["content"] = f"{messages[last]['content']}{text}"
    return messages


class ToolSession:
    """The tool loop of one rollout batch of ``n_rows`` rows. ``tools``: functions every row may call;
    ``environments``: one per row (or None), whose methods are that row's tools besides; ``parser``: a turn's
    text -> its calls (default: the Hermes/Qwen ``<tool_call>`` JSON); ``template_kwargs``: passed to the chat
    template with every rendering (TRL's ``chat_template_kwargs``)."""

    def __init__(self, tokenizer, tools: Sequence[Callable], environments: Sequence[Any] | None, n_rows: int,
                 parser: Callable[[str], list[dict[str, Any]]] = parse_tool_calls,
                 template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.parser = tokenizer, parser
        self.template_kwargs = dict(template_kwargs or {})   # TRL's chat_template_kwargs, for every rendering
        shared = {fn.__name__: fn for fn in tools}
        self.tools = [{**shared, **(environment_tools(environments[r]) if environments else {})}
                      for r in range(n_rows)]
        self.messages: list[list[dict]] = [[] for _ in range(n_rows)]   # per row: the turns after the prompt
        self.turn_start = [0] * n_rows       # completion index where each row's current assistant turn starts
        self.calls = self.failures = 0
        self.tool_s = 0.0

    def respond(self, rows: list[int], completions: list[list[int]]) -> list[list[int] | None]:
        """For :meth:`RolloutEngine.generate_turns`: each row's tool results as tokens, or None (no tool called)."""
        out = []
        for r, ids in zip(rows, completions):
            text = self.tokenizer.decode(ids[self.turn_start[r]:], skip_special_tokens=True)
            calls = self.parser(text)
            turn = {"role": "assistant", "content": text}
            if calls:
                turn["tool_calls"] = [{"type": "function", "function": {"name": c["name"] or "unknown",
                                                                         "arguments": c.get("arguments", {})}}
                                      for c in calls]
            self.messages[r].append(turn)
            if not calls:
                out.append(None)
                continue
            results = [self.call(r, c) for c in calls]
            self.messages[r].extend(results)
            suffix = self.suffix_ids(results)
            self.turn_start[r] = len(ids) + len(suffix)
            out.append(suffix)
        return out

    def call(self, row: int, call: dict) -> dict:
        """One tool call as a tool message; failures (bad call, unknown tool, an exception) as ``{"error": ...}``."""
        self.calls += 1
        name = call["name"] or "unknown"
        t0 = time.perf_counter()
        try:
            if "error" in call:
                raise ValueError(call["error"])
            fn = self.tools[row].get(name)
            if fn is None:
                raise ValueError(f"Tool {name} not found.")
            args = call["arguments"]
            result = fn(**args) if isinstance(args, dict) else fn(*args) if isinstance(args, list) else fn(args)
        except Exception as exc:   # the model gets the error; the run goes on
            self.failures += 1
            result = {"error": str(exc)}
        self.tool_s += time.perf_counter() - t0
        return {"role": "tool", "name": name, "content": result if isinstance(result, str) else str(result)}

    def suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """The tokens that follow an assistant turn ending in EOS when ``tool_messages`` answer it: the chat
        template's rendering of the tool messages and the next assistant generation prompt (the difference of
        two renderings of a short conversation, cut after the template's last EOS)."""
        tok = self.tokenizer
        calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        head = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
        prefix = tok.apply_chat_template(head, tokenize=True, add_generation_prompt=False, return_dict=False,
                                         **self.template_kwargs)
        full = tok.apply_chat_template(head + tool_messages, tokenize=True, add_generation_prompt=True,
                                       return_dict=False, **self.template_kwargs)
        ends = [i for i, t in enumerate(prefix) if t == tok.eos_token_id]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ValueError("the chat template renders a conversation with tool messages differently from the "
                             "same conversation without them: it cannot continue a turn with tool results")
        return list(full[len(prefix):])
