"""Turns of a multi-turn rollout (:meth:`RolloutEngine.generate_turns`): between two turns the caller's ``respond``
returns the tokens to append to each row that ended its turn with EOS (a tool result, an environment's observation,
chat-templated up to where the model's next turn starts); those rows continue, the others end.

A continuing row is prefilled anew over its whole sequence (prompt + completion so far + the appended tokens) into
its own cache row, then decodes on with the others in the captured step. The decode step runs every row of the
bucket, so a row's cached state after its EOS is not its conversation's any more (it went on with pad tokens while
other rows finished their turn); the new prefill is what makes the continuation exact, equal token for token to a
fresh generation from the whole conversation (the tests' check). Its price is one prefill a turn of the rows that
continue, the cost an inference server pays too.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .batch import RolloutStats
    from .config import SamplingConfig
    from .engine import RolloutEngine

# (repetition penalty on, min-p on, turns): one captured decode graph each
StepKind = tuple[bool, bool, bool]
# respond(rows, completions) -> per row: tokens to append, or None to end the row
Respond = Callable[[list[int], list[list[int]]], Sequence[Sequence[int] | None]]


def run_turns(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig, respond: Respond,
              max_turns: int, bucket: int, kind: StepKind, ptrs: tuple[int, ...], stats: RolloutStats
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns 2.. ``max_turns`` after the first one ran; returns ``tool_mask [N, T]`` (0 on appended tokens) and
    ``turns [N]`` on the engine's device, and adds to ``stats`` (steps, decode and respond seconds, observation
    tokens, cuts)."""
    n, budget = sampling.n, sampling.max_new_tokens
    n_rows = len(prompts) * n
    st = engine.state.rows(n_rows)
    appended = torch.zeros(n_rows, budget, dtype=torch.bool)                       # [N, T] host
    turns = torch.ones(n_rows, dtype=torch.long)
    ended: set[int] = set()
    eos = set(engine.eos)
    for _ in range(1, max_turns):
        ids = st.out_tokens[:, :budget].cpu()                                      # [N, T]
        lengths = st.out_mask[:, :budget].sum(1).cpu()                              # [N] valid tokens (a prefix)
        ready = [r for r in range(n_rows) if r not in ended and 0 < lengths[r] < budget
                 and int(ids[r, lengths[r] - 1]) in eos]
        if not ready:
            break
        t0 = time.perf_counter()
        answers = list(respond(ready, [ids[r, :lengths[r]].tolist() for r in ready]))
        stats.respond_s += time.perf_counter() - t0
        if len(answers) != len(ready):
            raise ValueError(f"respond returned {len(answers)} answers for {len(ready)} rows: one per row (a list "
                             "of token ids, or None to end the row)")
        going = []
        for r, add in zip(ready, answers):
            if add is None:
                ended.add(r)
                continue
            add = check_tokens(add, engine.vocab_size, r)
            start = int(lengths[r])
            if len(add) > budget - start:   # a huge observation: cut to the row's budget, never past the cache
                add = add[:budget - start]
                stats.observations_cut += 1
            write_appended(st, r, start, add, engine.pad)
            appended[r, start:start + len(add)] = True
            ids[r, start:start + len(add)] = torch.tensor(add, dtype=torch.long)
            stats.observation_tokens += len(add)
            if start + len(add) < budget:
                going.append((r, start + len(add)))
            else:
                ended.add(r)
        if not going:
            break
        t0 = engine._sync_time()
        continue_rows(engine, prompts, n, going, ids, sampling, ptrs)
        t1 = engine._sync_time()
        stats.steps += engine._decode(bucket, kind, budget - 1, n_rows)
        stats.prefill_s += t1 - t0
        stats.decode_s += engine._sync_time() - t1
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


def write_appended(st, row: int, start: int, add: list[int], pad: int) -> None:
    """Appended tokens into the row's completion at ``[start, start + len(add))``: valid (mask 1), log-prob 0."""
    if not add:
        return
    end = start + len(add)
    st.out_tokens[row, start:end] = torch.tensor(add, dtype=torch.long, device=st.out_tokens.device)
    st.out_mask[row, start:end] = 1
    st.out_logprobs[row, start:end] = 0.0


def continue_rows(engine: RolloutEngine, prompts: list[list[int]], n: int, going: list[tuple[int, int]],
                  ids: torch.Tensor, sampling: SamplingConfig, ptrs: tuple[int, ...]) -> None:
    """Prefill each continuing row's sequence (its prompt + ``ids[r, :start]``) into its cache row, sample its
    next token at completion index ``start`` and mark it running again."""
    st, cache = engine.state.rows(len(prompts) * n), engine.cache.rows(len(prompts) * n)
    rows = [r for r, _ in going]
    seqs = [prompts[r // n] + ids[r, :start].tolist() for r, start in going]
    first = engine._prefill_rows(seqs, [[r] for r in rows], len(prompts) * n, cache, ptrs)  # [N, V]
    dev = engine.device
    index = torch.tensor(rows, device=dev)                                                    # [R]
    start = torch.tensor([s for _, s in going], device=dev)                                  # [R]
    sub = st.select(index)
    sub.offset.copy_(start)
    procs = sampling.processors
    if procs[0]:   # the penalty's history: the whole sequence, appended tokens too (transformers counts every id)
        width = sub.history.shape[1]
        sub.history.copy_(torch.tensor([q + q[:1] * (width - len(q)) for q in seqs], device=dev))   # [R, S]
    tok, lp = engine._sample(first.index_select(0, index).contiguous(), sub, procs)             # [R]
    st.out_tokens[index, start] = tok
    st.out_logprobs[index, start] = lp
    st.out_mask[index, start] = 1
    st.token[index] = tok
    st.offset[index] = start + 1
    done = torch.isin(tok, engine._eos) | (start + 1 >= sampling.max_new_tokens)
    st.finished[index] = done
    if procs[0]:
        st.history[index] = sub.history
