"""Multi-turn rollouts (RolloutEngine.generate_turns, rollout/turns.py) on CPU/fp32: a row continued from its
own cache (appended tokens fed by the decode step, no prefill) equals a fresh generation from its whole
conversation token for token (greedy, with and without the repetition penalty), an EOS among the appended tokens
ends nothing, appended tokens are in the sequence but not the model's (tool_mask 0, log-prob 0), rows end at
different turns, a huge observation is cut to the row's budget (counted), and a wrong answer from respond is one
clear error."""
from __future__ import annotations

import pytest
import torch

from segki_lightning import RolloutEngine, SamplingConfig

from .tiny_models import VOCAB, build_model

EOS = 7


class TurnEnds(RolloutEngine):
    """Samples EOS exactly at the completion indices in ``ends`` (a drawn EOS elsewhere becomes EOS + 1): turns of
    known lengths on a random model, which would end them at random or never."""

    ends: torch.Tensor | None = None

    def _sample(self, logits, st, procs=(False, False)):
        tok, lp = super()._sample(logits, st, procs)
        forced = torch.isin(st.offset, self.ends) if self.ends is not None else torch.zeros_like(tok, dtype=torch.bool)
        tok = torch.where(forced, torch.full_like(tok, EOS), torch.where(tok == EOS, tok + 1, tok))
        return tok, lp


def engine_for(tmp_path, ends=(5, 14, 24), family="qwen3_5", seq=96, engine=TurnEnds):
    model = build_model(family, tmp_path)
    e = engine(model, max_batch_size=16, max_seq_len=seq, graph_capture=False, eos_token_id=[EOS])
    e.ends = torch.tensor(ends) if ends else None
    return e


def random_ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, VOCAB, (k,), generator=g).tolist() for k in n]


@pytest.mark.parametrize("penalty", [1.0, 1.7])
def test_a_continued_row_equals_a_fresh_generation_from_its_whole_conversation(tmp_path, penalty):
    engine = engine_for(tmp_path, ends=(5,))   # turn 1: completion indices 0..5, EOS at 5
    prompts = random_ids([5, 11, 8], seed=int(torch.randint(0, 2**31 - 1, ())))
    observations = random_ids([3, 6, 1], seed=7)
    observations[1][2] = EOS   # an appended EOS (a chat template's end of turn) is fed, not an end
    asked = {}
    prefills = []
    forward = engine.prefiller.__call__
    engine.prefiller = lambda seqs, ptrs: prefills.append(len(seqs)) or forward(seqs, ptrs)

    def respond(rows, completions):
        for r in rows:
            asked[r] = asked.get(r, 0) + 1
        return [observations[r] if asked[r] == 1 else None for r in rows]

    cfg = SamplingConfig(max_new_tokens=30, temperature=0.0, repetition_penalty=penalty)
    batch = engine.generate_turns(prompts, cfg, respond, max_turns=3)
    assert set(asked) == {0, 1, 2} and batch.turns.tolist() == [2, 2, 2]
    assert prefills == [3]   # the prompts' prefill only: rows continue from their own cache
    engine.ends = None
    for r, p in enumerate(prompts):
        ids = batch.completion_ids[r][batch.completion_mask[r].bool()].tolist()
        first = engine.generate([p], SamplingConfig(max_new_tokens=5, temperature=0.0,
                                                    repetition_penalty=penalty)).completion_ids[0].tolist()
        assert ids[:5] == first and ids[5] == EOS, r
        conversation = p + ids[:6] + observations[r]
        a, b = 6, 6 + len(observations[r])
        fresh = engine.generate([conversation], SamplingConfig(max_new_tokens=30 - b, temperature=0.0,
                                                                repetition_penalty=penalty))
        assert ids[a:b] == observations[r]
        assert ids[b:] == fresh.completion_ids[0][:len(ids) - b].tolist(), r   # the second turn, token for token
        # the appended tokens: in the sequence, not the model's
        assert batch.tool_mask[r, a:b].eq(0).all() and batch.tool_mask[r, :a].eq(1).all()
        assert batch.tool_mask[r, b:len(ids)].eq(1).all() and batch.logprobs[r, a:b].eq(0).all()
        torch.testing.assert_close(batch.logprobs[r, b:len(ids)], fresh.logprobs[0, :len(ids) - b],
                                   rtol=1e-4, atol=1e-4)
    assert batch.stats.observation_tokens == sum(map(len, observations))
    assert batch.stats.tokens == int((batch.completion_mask * batch.tool_mask).sum())


def test_rows_end_at_different_turns_and_max_turns_holds(tmp_path):
    engine = engine_for(tmp_path, ends=(3, 8, 13, 18, 23, 28))   # turns end within 3 tokens of an answer
    prompts = random_ids([4, 9, 6, 12], seed=3)
    calls = {r: 0 for r in range(4)}

    def respond(rows, completions):
        out = []
        for r in rows:
            calls[r] += 1
            out.append([5, 6] if calls[r] <= r else None)   # row r asks for r more turns
        return out

    batch = engine.generate_turns(prompts, SamplingConfig(max_new_tokens=60, temperature=0.0), respond,
                                  max_turns=3)
    assert batch.turns.tolist() == [1, 2, 3, 3]            # row 3 wanted 4 turns: max_turns stops it
    assert calls == {0: 1, 1: 2, 2: 2, 3: 2}                # never asked after the last allowed turn
    for r in range(4):
        assert int((1 - batch.tool_mask[r]).sum()) == 2 * (int(batch.turns[r]) - 1)


def test_a_huge_observation_is_cut_to_the_budget_and_counted(tmp_path):
    engine = engine_for(tmp_path)
    prompts = random_ids([6, 7], seed=11)
    batch = engine.generate_turns(prompts, SamplingConfig(max_new_tokens=30, temperature=0.0),
                                  lambda rows, c: [[7] * 10_000 for _ in rows], max_turns=4)
    assert batch.stats.observations_cut == 2
    assert batch.completion_mask.sum(1).tolist() == [30, 30]   # the budget, filled by the cut observation
    assert torch.isfinite(batch.logprobs).all()


def test_sampled_turns_keep_the_seeded_draws_and_stay_in_the_budget(tmp_path):
    engine = engine_for(tmp_path, ends=tuple(range(4, 50, 9)))
    prompts = random_ids([5, 9], seed=5)
    cfg = SamplingConfig(max_new_tokens=50, temperature=1.0, n=3, seed=9)
    respond = lambda rows, c: [[3, 9, 11] for _ in rows]   # noqa: E731  (always continue)
    a = engine.generate_turns(prompts, cfg, respond, max_turns=5)
    b = engine.generate_turns(prompts, cfg, respond, max_turns=5)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.tool_mask, b.tool_mask)
    assert (a.completion_mask.sum(1) <= 50).all() and a.turns.max() <= 5


@pytest.mark.parametrize("answer, match", [(lambda rows: [None], "answers for"),
                                           (lambda rows: [[VOCAB + 3]] * len(rows), "not token ids"),
                                           (lambda rows: [["a"]] * len(rows), "not token ids"),
                                           (lambda rows: [[]] * len(rows), "no tokens")])
def test_a_wrong_answer_from_respond_is_one_clear_error(tmp_path, answer, match):
    engine = engine_for(tmp_path)
    with pytest.raises(ValueError, match=match):
        engine.generate_turns(random_ids([5, 8], seed=2), SamplingConfig(max_new_tokens=30, temperature=0.0),
                              lambda rows, c: answer(rows), max_turns=2)
    with pytest.raises(ValueError, match="max_turns"):
        engine.generate_turns([[3, 4]], SamplingConfig(max_new_tokens=4), lambda rows, c: [], max_turns=0)
