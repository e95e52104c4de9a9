"""Turns of a multi-turn rollout (:meth:`RolloutEngine.generate_turns`): the caller's ``respond`` returns the
tokens to append to each row that ended its turn with EOS (a tool result, an environment's observation,
chat-templated up to where the model's next turn starts), or None to end the row.

A row continues from its own cache, through the captured decode step: its appended tokens are written into its
completion and the step feeds them one by one instead of drawing (``force_end``: completion indices below it are
fed), so the Gated-DeltaNet state and the KV cache go on from where the turn ended, with no prefill, while the
other rows decode on. The price of an appended token is one decode step of its row, as a generated one's.

The one thing that must not happen is a waiting row stepping on a pad token (it would enter the row's state).
The host reads which rows finished after every step, one step behind the GPU: the copy of step k's flags is read
while step k + 1 runs. A row that drew EOS at step k feeds that EOS at step k + 1 (its conversation's next token)
and gets its first appended token before step k + 2 is launched: the host answers it in between. So the GPU runs
ahead of the host by one step and stalls only while ``respond`` runs.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .host import HostCopy

if TYPE_CHECKING:
    from .batch import RolloutStats
    from .config import SamplingConfig
    from .engine import RolloutEngine

# (repetition penalty on, min-p on, turns): one captured decode graph each
StepKind = tuple[bool, bool, bool]
# respond(rows, completions) -> per row: tokens to append, or None to end the row
Respond = Callable[[list[int], list[list[int]]], Sequence[Sequence[int] | None]]


def run_turns(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig, respond: Respond,
              max_turns: int, bucket: int, kind: StepKind, stats: RolloutStats) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode step by step from the first tokens on; the rows that ended a turn with EOS at the step before the one
    just launched get ``respond``'s answer and continue (the others decode on). Returns ``tool_mask [N, T]`` (0 on
    appended tokens) and ``turns [N]`` on the engine's device, and adds steps, decode / respond seconds,
    observation tokens and cuts to ``stats``."""
    n_rows, budget = len(prompts) * sampling.n, sampling.max_new_tokens
    st = engine.state.rows(n_rows)
    appended = torch.zeros(n_rows, budget, dtype=torch.bool)                       # [N, T] host
    turns = torch.ones(n_rows, dtype=torch.long)
    ended = torch.zeros(n_rows, dtype=torch.bool)                                   # [N] host: no more turns
    flags = HostCopy(st.finished)                                                   # after the prefill's token
    t0, respond_s = time.perf_counter(), stats.respond_s
    # every step moves every row's completion index on by one, and a row ends at its budget: budget + 1 steps
    # (the last row's end is read one step late) bound the loop
    while not bool(ended.all()) and stats.steps <= budget:
        stats.steps += engine._replay(bucket, kind, 1)
        new = (flags.get()[0] & ~ended).nonzero()[:, 0]                   # finished one step ago
        if len(new):
            answer_rows(engine, new.tolist(), prompts, sampling, respond, max_turns, appended, turns, ended,
                        stats)
        flags = HostCopy(st.finished)   # after this step and the answers: a continuing row reads as running
    stats.decode_s += time.perf_counter() - t0 - (stats.respond_s - respond_s)
    stats.turns = int(turns.max())
    return (~appended).long().to(engine.device), turns.to(engine.device)


def answer_rows(engine: RolloutEngine, rows: list[int], prompts: list[list[int]], sampling: SamplingConfig,
                respond: Respond, max_turns: int, appended: torch.Tensor, turns: torch.Tensor, ended: torch.Tensor,
                stats: RolloutStats) -> None:
    """Rows that finished at the step before the one in flight: those at EOS with turns left get ``respond``'s
    tokens and continue (fed from the next step on); the others (budget spent, no turn left, None) end."""
    st, budget = engine.state.rows(len(ended)), sampling.max_new_tokens
    index = torch.tensor(rows, device=engine.device)
    lengths = st.out_mask.index_select(0, index)[:, :budget].sum(1).cpu()          # [R] valid tokens (a prefix)
    ids = st.out_tokens.index_select(0, index)[:, :budget].cpu()                    # [R, T] (waits for the step)
    last = ids.gather(1, (lengths - 1).clamp_min(0)[:, None])[:, 0]
    at_eos = (lengths > 0) & (lengths < budget) & torch.isin(last, torch.tensor(engine.eos or [-1]))
    asked = [i for i, r in enumerate(rows) if at_eos[i] and turns[r] < max_turns]
    ended[rows] = True
    ended[[rows[i] for i in asked]] = False
    if not asked:
        return
    t0 = time.perf_counter()
    answers = list(respond([rows[i] for i in asked], [ids[i, :lengths[i]].tolist() for i in asked]))
    stats.respond_s += time.perf_counter() - t0
    if len(answers) != len(asked):
        raise ValueError(f"respond returned {len(answers)} answers for {len(asked)} rows: one per row (a list "
                         "of token ids, or None to end the row)")
    for i, add in zip(asked, answers):
        r = rows[i]
        if add is None:
            ended[r] = True
            continue
        add, start = check_tokens(add, engine.vocab_size, r), int(lengths[i])
        if len(add) > budget - start:   # a huge observation: cut to the row's budget, never past the cache
            add = add[:budget - start]
            stats.observations_cut += 1
        going = start + len(add) < budget
        feed_row(st, r, start, add, sampling.processors[0], going)
        appended[r, start:start + len(add)] = True
        stats.observation_tokens += len(add)
        turns[r] += going
        ended[r] = not going


def check_tokens(add: Sequence[int], vocab: int, row: int) -> list[int]:
    """``add`` as a non-empty list of Python ints inside the vocabulary, or one error naming the row."""
    out = add.tolist() if isinstance(add, torch.Tensor) else list(add)
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in out):
        raise ValueError(f"respond returned tokens for row {row} that are not token ids in [0, {vocab}): "
                         "return a list of ints (tokenize the observation), or None to end the row")
    if not out:
        raise ValueError(f"respond returned no tokens for row {row}: return at least one token (the chat "
                         "template's start of the next turn), or None to end the row")
    return out


def feed_row(st, row: int, start: int, add: list[int], penalty: bool, run: bool) -> None:
    """Row ``row`` ended its turn at completion index ``start - 1`` (EOS, fed by the step in flight, which records
    a pad at ``start``): its appended tokens go to ``[start, start + len(add))`` (valid, log-prob 0) and, with
    the ``penalty`` on, are seen. ``run``: the first one is the next step's input, the steps after feed the rest
    (``force_end``), and the row runs again."""
    end = start + len(add)
    ids = torch.tensor(add, dtype=torch.long).to(st.out_tokens.device, non_blocking=True)
    st.out_tokens[row, start:end] = ids
    st.out_mask[row, start:end] = 1
    st.out_logprobs[row, start:end] = 0.0
    if penalty:   # transformers' penalty counts every id of the sequence, appended ones too
        st.seen[row, ids] = True
    if run:
        st.token[row] = ids[0]
        st.force_end[row] = end
        st.finished[row] = False
