"""Reward functions the way TRL users write them: plain callables, ``None`` for "not applicable", weights, Hydra
nodes and dotted paths, metrics named after the function, clear errors."""
from __future__ import annotations

import functools
import math

import pytest

from segki_lightning.rl.rewards import ExactMatch, FormatRegex, WeightedReward, as_rewards, reward_name, score


def correct(prompts, completions, answer, **kwargs):
    """A TRL-style reward: 1.0 when the completion is the answer."""
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def only_short(prompts, completions, completion_ids, **kwargs):
    """Applies to short completions only (None elsewhere); sees the completion token ids."""
    return [1.0 if len(ids) <= 2 else None for ids in completion_ids]


def test_plain_functions_none_and_weights_follow_trl():
    rewards = as_rewards([correct, only_short], [2.0, 0.5])
    prompts, completions = ["1+2="] * 3, ["3", "4", "345"]
    total, means = score(rewards, prompts, completions, {"answer": ["3", "3", "3"]},
                         completion_ids=[[5], [6], [5, 6, 7]])
    assert total == [2.0 + 0.5, 0.5, 0.0]            # None leaves the weighted sum
    assert means == {"correct": 1 / 3, "only_short": 1.0}   # None leaves the mean


def test_a_row_no_function_applies_to_scores_zero_with_a_warning(caplog):
    never = lambda prompts, completions, **kw: [None] * len(completions)  # noqa: E731
    with caplog.at_level("WARNING", logger="segki_lightning"):
        total, means = score(as_rewards([never]), ["p"], ["c"], {})
    assert total == [0.0] and math.isnan(means["<lambda>"]) and "returned None" in caplog.text


def test_metric_names_come_from_the_function():
    assert reward_name(functools.partial(correct, answer=["1"])) == "correct"
    assert reward_name(ExactMatch()) == "exact_match" and reward_name(FormatRegex()) == "format"
    assert as_rewards([WeightedReward(correct, 0.3, name="mine")])[0].label == "mine"


@pytest.mark.parametrize("bad,match", [
    (lambda p, c, **k: [1.0], "returned 1 values for 2 completions"),
    (lambda p, c, **k: None, "returned None for 2 completions"),
    (lambda p, c, **k: ["high", "low"], "return a number .or None"),
])
def test_bad_reward_outputs_say_what_to_return(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        score(as_rewards([bad]), ["a", "b"], ["x", "y"], {})


def test_missing_column_names_the_column_and_what_exists():
    with pytest.raises(KeyError, match="needs the dataset column 'answer'.*'solution'"):
        score(as_rewards([ExactMatch()]), ["p"], ["3"], {"solution": ["3"]})


def test_bad_reward_lists_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="at least one"):
        as_rewards([])
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        as_rewards([correct, correct], [1.0])
    with pytest.raises(TypeError, match="not a callable"):
        as_rewards([3])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")   # a string is a reward model's id (TRL's): never reach the Hub here
    with pytest.raises(FileNotFoundError, match="reward 0: RewardModel model=correct .* give a reward function as"):
        as_rewards(["correct"])


def test_conversational_completions_are_scored_on_their_text():
    chat = [[{"role": "assistant", "content": " 3"}], [{"role": "assistant", "content": "x"}]]
    assert ExactMatch()(["p", "p"], chat, answer=["3", "3"]) == [1.0, 0.0]
    assert FormatRegex(r"\d+")(["p", "p"], chat) == [1.0, 0.0]


def test_hydra_takes_dotted_paths_and_partial_functions(tmp_path):
    from segki_lightning.train import build_rewards

    from .test_lightning import small

    cfg = small(tmp_path, "rewards=[tests.test_rewards.correct]")
    assert build_rewards(cfg) == [correct]
    cfg = small(tmp_path, "rewards.0.fn._target_=tests.test_rewards.only_short", "~rewards.0.fn.pattern",
                "+rewards.0.fn._partial_=true")
    (w, _) = build_rewards(cfg)   # the recipe's first reward node, its function replaced, its weight kept
    assert w.label == "only_short" and w.weight == 0.5 and w.fn(["p"], ["c"], completion_ids=[[1]]) == [1.0]
    cfg = small(tmp_path, "rewards.0.fn._target_=tests.test_rewards.only_short", "~rewards.0.fn.pattern")
    with pytest.raises(ValueError, match="_partial_: true"):
        build_rewards(cfg)


@pytest.mark.parametrize("bad, error, words", [("1.0", TypeError, "returned '1.0' .str."),
                                               ([1.0], TypeError, r"returned \[1.0\] .list."),
                                               (float("nan"), ValueError, "returned NaN for completion 1")])
def test_a_reward_value_that_is_not_a_number_names_the_function(bad, error, words):
    def my_reward(prompts, completions, **kw):
        return [1.0, bad]

    with pytest.raises(error, match="reward my_reward " + words):
        score(as_rewards([my_reward]), ["p", "p"], ["a", "b"], {})


def test_numbers_of_other_types_and_none_are_taken():
    import numpy as np
    import torch

    total, means = score(as_rewards([lambda p, c, **k: [np.float32(0.5), torch.tensor(2.0), True, None]]),
                         ["p"] * 4, ["a"] * 4, {})
    assert total == [0.5, 2.0, 1.0, 0.0]


def test_async_reward_functions_run_together_beside_the_plain_ones():
    """``async def`` rewards (TRL's) are awaited together: the first waits for an event only the second sets, so run
    one after the other they would time out; their values land in their own places among the plain ones', also
    when the caller runs an event loop of its own."""
    import asyncio

    from segki_lightning.rl.rewards import reward_table

    state: dict = {}

    async def waits(prompts, completions, **kwargs):
        state.setdefault("ev", asyncio.Event())
        await asyncio.wait_for(state["ev"].wait(), timeout=10)
        return [1.0] * len(completions)

    class Sets:
        async def __call__(self, prompts, completions, **kwargs):
            state.setdefault("ev", asyncio.Event()).set()
            return [None, 2.0]

    def plain(prompts, completions, **kwargs):
        return [3.0, 4.0]

    rewards = as_rewards([waits, plain, functools.partial(Sets()), correct])
    table = reward_table(rewards, ["p", "p"], ["1", "2"], {"answer": ["1", "3"]})
    assert table[0] == [1.0, 1.0] and table[1] == [3.0, 4.0] and math.isnan(table[2][0]) and table[2][1] == 2.0
    assert table[3] == [1.0, 0.0]
    state.clear()

    async def inside_a_loop():   # a caller with a running loop (a notebook) still gets the values
        return reward_table(rewards, ["p", "p"], ["1", "2"], {"answer": ["1", "3"]})

    assert asyncio.run(inside_a_loop())[:2] == table[:2]
