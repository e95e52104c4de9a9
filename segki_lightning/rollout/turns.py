"""Turns of a multi-turn rollout (:meth:`RolloutEngine.generate_turns`): the caller's ``respond`` returns the
tokens to append to each row that ended its turn with EOS (a tool result, an environment's observation,
chat-templated up to where the model's next turn starts), or None to end the row.

The decode loop runs in stretches of TURN_CHECK_EVERY captured steps; after each, rows that ended a turn since are
answered and continue at once while the others decode on, so no turn waits for the batch's slowest row (rows wait
at most one stretch). A continuing row is prefilled anew over its whole sequence (prompt + completion so far + the
appended tokens) into its own cache row: the decode step runs every row of the bucket, so a row's cached state
after its EOS is not its conversation's any more (it stepped on with pad tokens); the new prefill makes the
continuation exact, equal token for token to a fresh generation from the whole conversation (the tests' check).
Its price is one prefill of the continuing rows a turn, the cost an inference server pays too.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .processors import history_rows

if TYPE_CHECKING:
    from .batch import RolloutStats
    from .config import SamplingConfig
    from .engine import RolloutEngine

# padded tokens of one eager prefill forward of continuing rows: 64 rows of 448 tokens took 4 forwards of 16 rows
# and ~240 ms a turn at the 0.8B shape (H100); one forward is the same FLOPs at a quarter of the launches
CONTINUE_TOKENS = 32768
TURN_CHECK_EVERY = 8   # decode steps between reads of which rows ended a turn (a row waits at most this many)
# (repetition penalty on, min-p on, turns): one captured decode graph each
StepKind = tuple[bool, bool, bool]
# respond(rows, completions) -> per row: tokens to append, or None to end the row
Respond = Callable[[list[int], list[list[int]]], Sequence[Sequence[int] | None]]


def run_turns(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig, respond: Respond,
              max_turns: int, bucket: int, kind: StepKind, ptrs: tuple[int, ...], stats: RolloutStats
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode from the first tokens on, in stretches of TURN_CHECK_EVERY steps; after each, the rows that ended a turn
    with EOS since get ``respond``'s answer and continue at once (the others decode on: no turn waits for the
    slowest row). Returns ``tool_mask [N, T]`` (0 on appended tokens) and ``turns [N]`` on the engine's device,
    and adds steps, decode / prefill / respond seconds, observation tokens and cuts to ``stats``."""
    n, budget = sampling.n, sampling.max_new_tokens
    n_rows = len(prompts) * n
    st = engine.state.rows(n_rows)
    appended = torch.zeros(n_rows, budget, dtype=torch.bool)                       # [N, T] host
    turns = torch.ones(n_rows, dtype=torch.long)
    ended = torch.zeros(n_rows, dtype=torch.bool)                                   # [N] host: no more turns
    eos = torch.tensor(engine.eos or [-1])
    while True:
        t0 = time.perf_counter()
        stats.steps += engine._replay(bucket, kind, TURN_CHECK_EVERY)
        finished = st.finished.cpu()                                                 # [N] (syncs)
        stats.decode_s += time.perf_counter() - t0
        lengths = st.out_mask[:, :budget].sum(1).cpu()                               # [N] valid tokens (a prefix)
        last = st.out_tokens.gather(1, (lengths - 1).clamp_min(0)[:, None].to(engine.device))[:, 0].cpu()
        at_eos = finished & ~ended & (lengths > 0) & (lengths < budget) & torch.isin(last, eos)
        ended |= finished & ~at_eos                        # finished otherwise: the budget is spent
        ended |= at_eos & (turns >= max_turns)             # no turn left
        ready = (at_eos & ~ended).nonzero()[:, 0].tolist()
        if not ready:
            if bool(finished.all()):
                break
            continue
        ids = st.out_tokens[ready, :budget].cpu()                                    # [R, T]
        t0 = time.perf_counter()
        answers = list(respond(ready, [ids[i, :lengths[r]].tolist() for i, r in enumerate(ready)]))
        stats.respond_s += time.perf_counter() - t0
        if len(answers) != len(ready):
            raise ValueError(f"respond returned {len(answers)} answers for {len(ready)} rows: one per row (a list "
                             "of token ids, or None to end the row)")
        going, seqs = [], []
        for i, (r, add) in enumerate(zip(ready, answers)):
            if add is None:
                ended[r] = True
                continue
            add = check_tokens(add, engine.vocab_size, r)
            start = int(lengths[r])
            if len(add) > budget - start:   # a huge observation: cut to the row's budget, never past the cache
                add = add[:budget - start]
                stats.observations_cut += 1
            write_appended(st, r, start, add)
            appended[r, start:start + len(add)] = True
            stats.observation_tokens += len(add)
            if start + len(add) < budget:
                going.append((r, start + len(add)))
                seqs.append(prompts[r // n] + ids[i, :start].tolist() + add)
            else:
                ended[r] = True
        if not going:
            if bool(finished.all()):   # nothing runs and nothing continues
                break
            continue
        t0 = engine._sync_time()
        continue_rows(engine, n_rows, going, seqs, sampling, ptrs)
        stats.prefill_s += engine._sync_time() - t0
        turns[[r for r, _ in going]] += 1
    stats.turns = int(turns.max())
    return (~appended).long().to(engine.device), turns.to(engine.device)


def check_tokens(add: Sequence[int], vocab: int, row: int) -> list[int]:
    """``add`` as a list of Python ints inside the vocabulary, or one error naming the row."""
    out = add.tolist() if isinstance(add, torch.Tensor) else list(add)
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in out):
        raise ValueError(f"respond returned tokens for row {row} that are not token ids in [0, {vocab}): "
                         "return a list of ints (tokenize the observation), or None to end the row")
    return out


def write_appended(st, row: int, start: int, add: list[int]) -> None:
    """Appended tokens into the row's completion at ``[start, start + len(add))``: valid (mask 1), log-prob 0."""
    if not add:
        return
    end = start + len(add)
    st.out_tokens[row, start:end] = torch.tensor(add, dtype=torch.long, device=st.out_tokens.device)
    st.out_mask[row, start:end] = 1
    st.out_logprobs[row, start:end] = 0.0


def continue_rows(engine: RolloutEngine, n_rows: int, going: list[tuple[int, int]], seqs: list[list[int]],
                  sampling: SamplingConfig, ptrs: tuple[int, ...]) -> None:
    """Prefill each continuing row's whole sequence ``seqs[i]`` (prompt + completion so far) into its cache row,
    sample its next token at completion index ``start`` and mark it running again. ``going``: ``(row, start)``."""
    st, cache = engine.state.rows(n_rows), engine.cache.rows(n_rows)
    rows = [r for r, _ in going]
    groups = engine._prefill_groups(seqs, rows=len(seqs), tokens=CONTINUE_TOKENS)   # few eager forwards
    first = engine._prefill_rows(seqs, [[r] for r in rows], n_rows, cache, ptrs, groups)  # [N, V]
    dev = engine.device
    index = torch.tensor(rows, device=dev)                                                    # [R]
    start = torch.tensor([s for _, s in going], device=dev)                                  # [R]
    sub = st.select(index)
    sub.offset.copy_(start)
    procs = sampling.processors
    if procs[0]:   # the penalty's history: the whole sequence, appended tokens too (transformers counts every id)
        sub.history.copy_(history_rows(seqs, sub.history.shape[1], dev))                      # [R, S]
    tok, lp = engine._sample(first.index_select(0, index).contiguous(), sub, procs)             # [R]
    st.out_tokens[index, start] = tok
    st.out_logprobs[index, start] = lp
    st.out_mask[index, start] = 1
    st.token[index] = tok
    st.offset[index] = start + 1
    st.finished[index] = torch.isin(tok, engine._eos) | (start + 1 >= sampling.max_new_tokens)
    if procs[0]:
        st.history[index] = sub.history
