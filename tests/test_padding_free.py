"""Padding-free training passes (``algo.padding_free``): a micro-batch's rows packed end to end with ``cu_seqlens``
give each row's scores and gradients as the padded batch does (the tiny Qwen3.5 hybrid with segki injected, fp32
on CPU: its Gated-DeltaNet conv and chunk rule and its attention restart at every row), the packing probe says no
where the model's own layers would mix rows, and micro-batches by token budget."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.inject import apply_segment_ki, remove_segment_ki
from segki_lightning.ops import varlen
from segki_lightning.rl.logprobs import completion_logprobs, packs
from segki_lightning.rl.update import micro_batches

from .test_logprobs import TOL_LAYOUT, assert_scores_and_gradients_close, ragged_batch
from .tiny_models import build_model


@pytest.mark.parametrize("rows", [1, 5], ids=["one-row", "five-rows"])
def test_packed_scores_and_gradients_equal_padded(tmp_path, rows):
    torch.manual_seed(rows)
    model = build_model("qwen3_5", tmp_path).train()
    apply_segment_ki(model)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    batch = ragged_batch(rows=rows, prompt=9, completion=70)   # past one 64-token GDN chunk
    seed = int(torch.randint(0, 2**31 - 1, ()))
    want = completion_logprobs(model, *batch, value_head=head)
    got = completion_logprobs(model, *batch, value_head=head, packed=True)
    assert_scores_and_gradients_close(model, got, want, seed, TOL_LAYOUT)
    remove_segment_ki(model)


def test_the_probe_says_yes_injected_and_no_for_the_models_own_layers(tmp_path):
    model = build_model("qwen3_5", tmp_path)
    assert not packs(model, injected=False)   # transformers' torch conv and SDPA mix the packed rows
    apply_segment_ki(model)
    assert packs(model, injected=True)
    remove_segment_ki(model)
    assert not packs(model, injected=False)


def test_packed_conv_attention_and_chunk_rule_equal_each_row_alone():
    """The packed ops without a varlen kernel (CPU): the conv on rows spread apart, attention and the chunk rule on
    one right-padded batch, each row as if it ran alone (one row past a 64-token chunk)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    lengths = [3, 1, 70, 4]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = torch.randn(1, sum(lengths), 6, dtype=torch.float64)
    w, b = torch.randn(6, 1, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    got = varlen.causal_conv_silu(x, w, b, cu)
    want = torch.cat([varlen.causal_conv_silu(x[:, s:e], w, b) for s, e in zip(cu[:-1], cu[1:])], 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    q, k, v = torch.randn(sum(lengths), 4, 8), torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    out = varlen.varlen_attention(q, k, v, cu, max(lengths), 0.3)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = varlen.varlen_attention(q[s:e], k[s:e], v[s:e], torch.tensor([0, e - s]), e - s, 0.3)
        torch.testing.assert_close(out[s:e], alone)
    m = sum(lengths)
    q, k, v = torch.randn(1, m, 2, 8), torch.randn(1, m, 2, 8), torch.randn(1, m, 4, 8)
    g, beta = -torch.rand(1, m, 4), torch.rand(1, m, 4)
    out = varlen.gdn_chunk(q, k, v, g, beta, cu)
    assert out.shape == (1, m, 4, 8)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = varlen.gdn_chunk(*(t[:, s:e] for t in (q, k, v, g, beta)))
        torch.testing.assert_close(out[:, s:e], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("packed,want", [
    (True, [[0, 1], [2], [3, 4, 5]]),     # sums 7, 9, 7 within 9
    (False, [[0, 1], [2], [3, 4], [5]]),  # rows x the longest: 2 x 4, 9, 2 x 2, 4 (3 x 4 > 9)
])
def test_micro_batches_by_token_budget(packed, want):
    rows = torch.arange(6)
    lengths = torch.tensor([3, 4, 9, 2, 1, 4])
    got = micro_batches(rows, None, 9, lengths, packed)
    assert [p.tolist() for p in got] == want
    assert [p.tolist() for p in micro_batches(rows, 2, 9, lengths, packed)][0] == [0, 1]
    assert [p.tolist() for p in micro_batches(rows, 1, None)] == [[i] for i in range(6)]
    assert [p.tolist() for p in micro_batches(torch.arange(2), None, 1, torch.tensor([5, 5]))] == [[0], [1]]


@pytest.mark.parametrize("packed", [True, False])
def test_token_budget_pieces_are_balanced(packed):
    """As many pieces as filling to the budget gives, none of them short: ten rows of 3 tokens under a budget of 21
    fill to 7 + 3 rows, balanced to 5 + 5; fresh random lengths keep the count, the budget and every row once, and
    the largest piece is no larger than filling's."""
    from segki_lightning.rl.update import _cuts

    got = micro_batches(torch.arange(10), None, 21, torch.full((10,), 3), packed)
    assert [len(p) for p in got] == [5, 5]
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = torch.randint(1, 200, (64,), generator=gen)
    got = micro_batches(torch.arange(64), 16, 900, lengths, packed)
    cuts = _cuts(lengths.tolist(), 16, 900, packed)
    filled = [torch.arange(a, b) for a, b in zip(cuts, cuts[1:] + [64])]
    cost = (lambda p: int(lengths[p].sum())) if packed else (lambda p: len(p) * int(lengths[p].max()))
    assert len(got) == len(filled) and torch.cat(got).tolist() == list(range(64))
    assert all(len(p) <= 16 and (cost(p) <= 900 or len(p) == 1) for p in got)
    assert max(map(cost, got)) <= max(map(cost, filled))


@pytest.mark.parametrize("kind", ["grpo", "ppo"])
def test_an_rl_step_packed_equals_padded(kind):
    """One training step of the tiny policy with segki injected: packed micro-batches by a token budget give the
    padded whole batch's gradient (same rollout, fp32)."""
    from .test_training import assert_gradients_close, module, step_gradients

    batch = {"prompt": ["1+2=", "3+40=", "5+6="], "answer": ["3", "43", "11"]}
    got = {}
    for padding_free, tokens in ((False, None), (True, 40)):
        torch.manual_seed(0)
        m = module(kind, padding_free=padding_free, micro_batch_tokens=tokens)
        apply_segment_ki(m.policy)
        got[padding_free] = step_gradients(m, batch)
        assert m.packed(m.policy) is padding_free
    assert_gradients_close(got[True], got[False], tol=1e-5)
