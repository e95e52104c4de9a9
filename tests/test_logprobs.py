"""Chunked completion log-probs (rl/logprobs.py) against the plain [N, T, V] computation, fp32 on CPU:
values, entropy, value-head outputs and gradients within 1e-6, ragged left-padded prompts and completions,
temperature, tied and untied embeddings, several chunks, and the plain fallback for soft-capped logits."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.inject import apply_segment_ki, remove_segment_ki
from segki_lightning.rl.logprobs import _layout, completion_logprobs, token_logprobs

from .tiny_models import VOCAB, build_model

TOL = dict(rtol=1e-6, atol=1e-6)   # fp32: the values; gradients are compared by norm (below)
# Against the masked computation: batches whose padding can all follow the real tokens run the model unmasked, each
# row's left padding moved to its end, so the attention takes the causal path instead of the mask and the
# Gated-DeltaNet layers see no padding -- in fp32 within 1e-4 absolute (typically ~2.5e-6; one draw in a full run
# put one of 35 injected-model log-probs 3.7e-5 away; in fp64 the two differ by ~1e-6, the unmasked one being the
# rows' own scores, see below)
TOL_LAYOUT = dict(rtol=1e-5, atol=1e-4)


def assert_grad_close(got, want, name, tol=1e-5):
    """||got - want|| <= tol * ||want||. At the head (hidden states, weight, bias) the chunked backward
    matches the plain one within 1e-6 (``test_token_logprobs_fp32_gradients``); through the model's layers,
    whose Gated-DeltaNet backward amplifies fp32 reordering, parameters deep in the model differ by up to
    ~1e-6 of their norm, so the end-to-end bound is 1e-5."""
    err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert err <= tol, (name, err)


def plain(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, value_head=None,
          masked=False):
    """The computation the chunked path replaces: full logits, log_softmax, gather -- on the same layout of the
    batch (``rl.logprobs._layout``: unmasked where all padding can follow the real tokens), or ``masked``: the
    concatenated batch with its mask and cumulative positions, as the model would run it plainly."""
    if masked:
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        p = prompt_ids.shape[1]
        take = (p - 1 + torch.arange(completion_ids.shape[1])).expand(*completion_ids.shape)
        positions = (mask.cumsum(1) - 1).clamp_min(0)
    else:
        ids, mask, positions, take = _layout(prompt_ids, prompt_mask, completion_ids, completion_mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, output_hidden_states=True)
    at = (lambda x: x.gather(1, take[..., None].expand(*take.shape, x.shape[-1])))   # [N, T, ...] before each token
    logits = at(out.logits)
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    m = completion_mask.to(logp_all.dtype)
    logp = logp_all.gather(-1, completion_ids[..., None])[..., 0] * m
    entropy = -(logp_all.exp() * logp_all).sum(-1) * m
    values = value_head(at(out.hidden_states[-1]))[..., 0] * m if value_head is not None else None
    return logp, entropy, values


def ragged_batch(rows: int = 5, prompt: int = 6, completion: int = 7):
    """Left-padded prompts of 1..prompt tokens; completions that end (mask 0 after) at random lengths."""
    prompt_ids = torch.randint(2, VOCAB, (rows, prompt))
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.randint(2, VOCAB, (rows, completion))
    completion_mask = torch.ones_like(completion_ids)
    for r in range(rows):
        pad = int(torch.randint(0, prompt, ()))
        prompt_mask[r, :pad] = 0
        prompt_ids[r, :pad] = 0
        end = int(torch.randint(1, completion + 1, ()))
        completion_mask[r, end:] = 0
        completion_ids[r, end:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def grads(model, *tensors):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = sum((t * torch.randn_like(t) if t is not None else 0).sum() for t in tensors)
    return torch.autograd.grad(loss, params, allow_unused=True), loss


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("chunk", [None, 3], ids=["one-chunk", "chunk3"])
def test_chunked_equals_plain_values_and_gradients(tmp_path, tied, temperature, chunk):
    model = build_model("qwen3_5", tmp_path, tie_word_embeddings=tied).train()
    head = torch.nn.Linear(model.config.hidden_size, 1)
    batch = ragged_batch()
    seed = int(torch.randint(0, 2**31 - 1, ()))
    got = completion_logprobs(model, *batch, temperature=temperature, value_head=head, chunk=chunk)
    want = plain(model, *batch, temperature, head)
    assert_scores_and_gradients_close(model, got, want, seed, TOL)


def assert_scores_and_gradients_close(model, got, want, seed, tol):
    """Each score tensor within ``tol``; the parameter gradients of the same random weighting of both within
    :func:`assert_grad_close` (a parameter no score reaches gets none or a zero one)."""
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    torch.manual_seed(seed)
    g_got, _ = grads(model, *got)
    torch.manual_seed(seed)
    g_want, _ = grads(model, *want)
    assert sum(g is not None for g in g_want) > 10
    for (name, _), a, b in zip(model.named_parameters(), g_got, g_want):
        if b is None:
            assert a is None or not a.any(), name
            continue
        assert_grad_close(a, b, name)


def test_injected_model_gives_the_same_scores(tmp_path):
    model = build_model("qwen3_5", tmp_path).train()
    batch = ragged_batch()
    want = completion_logprobs(model, *batch)
    apply_segment_ki(model)
    got = completion_logprobs(model, *batch)
    remove_segment_ki(model)
    torch.testing.assert_close(got.logp, want.logp, **TOL)
    torch.testing.assert_close(got.entropy, want.entropy, **TOL)


def test_token_logprobs_with_a_biased_head_and_every_chunk_size():
    hidden = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 33).double()
    targets = torch.randint(0, 33, (9,))
    logits = head(hidden) / 1.3
    want_logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    want_ent = torch.distributions.Categorical(logits=logits).entropy()
    for chunk in (1, 2, 4, 9, 100):
        logp, ent = token_logprobs(hidden, head, targets, 1.3, chunk)
        torch.testing.assert_close(logp, want_logp)
        torch.testing.assert_close(ent, want_ent)
    # the exact backward, checked numerically in float64 (logp and entropy together)
    assert torch.autograd.gradcheck(lambda h, w, b: token_logprobs(h, _Head(w, b), targets, 1.3, 4),
                                    (hidden, head.weight.detach().clone().requires_grad_(),
                                     head.bias.detach().clone().requires_grad_()))


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_token_logprobs_fp32_gradients(temperature):
    """fp32 at the head: values and the gradients of hidden states, weight and bias within 1e-6 of the plain
    log_softmax over the whole [M, V] logits, both outputs used by the loss."""
    hidden = torch.randn(37, 24, requires_grad=True)
    head = torch.nn.Linear(24, 301)
    targets = torch.randint(0, 301, (37,))
    w_logp, w_ent = torch.randn(37), torch.randn(37)
    logp, ent = token_logprobs(hidden, head, targets, temperature, 5)
    got = torch.autograd.grad((logp * w_logp + ent * w_ent).sum(), [hidden, head.weight, head.bias])
    logp_all = torch.log_softmax(head(hidden).float() / temperature, -1)
    want_logp = logp_all.gather(-1, targets[:, None])[:, 0]
    want_ent = -(logp_all.exp() * logp_all).sum(-1)
    want = torch.autograd.grad((want_logp * w_logp + want_ent * w_ent).sum(), [hidden, head.weight, head.bias])
    torch.testing.assert_close(logp, want_logp, **TOL)
    torch.testing.assert_close(ent, want_ent, **TOL)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


class _Head(torch.nn.Module):
    """A Linear-like holder so gradcheck can pass weight and bias as inputs."""

    def __init__(self, weight, bias):
        super().__init__()
        self.weight, self.bias, self.out_features = weight, bias, weight.shape[0]


def test_soft_capped_logits_take_the_plain_path(tmp_path, caplog):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, final_logit_softcapping=2.0,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Gemma2ForCausalLM(cfg).train()
    batch = ragged_batch()
    with caplog.at_level("WARNING", logger="segki_lightning"):
        got = completion_logprobs(model, *batch)
    assert "not a plain lm_head" in caplog.text
    want = plain(model, *batch, 1.0)
    torch.testing.assert_close(got.logp, want[0], **TOL)


def test_memory_is_bounded_by_the_chunk():
    """No tensor made in the forward or backward is larger than one chunk of logits or the weight's gradient:
    a 50k vocabulary over 64 tokens in chunks of 4 never materializes the [64, V] logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.biggest = max(Largest.biggest, t.numel() * t.element_size())
            return out

    vocab, hid = 50_000, 8
    hidden = torch.randn(64, hid, requires_grad=True)
    head = torch.nn.Linear(hid, vocab, bias=False)
    targets = torch.randint(0, vocab, (64,))
    with Largest():
        logp, ent = token_logprobs(hidden, head, targets, 1.0, 4)
        (logp.sum() + ent.sum()).backward()
    assert Largest.biggest <= max(4 * vocab * 4, vocab * hid * 4), Largest.biggest
    assert Largest.biggest < 64 * vocab * 4 / 4


@pytest.mark.parametrize("prompts", ["unpadded", "left_padded"])
@pytest.mark.parametrize("injected", [False, True], ids=["plain_model", "injected"])
def test_padding_that_can_follow_the_real_tokens_runs_the_model_without_a_mask(tmp_path, monkeypatch, injected,
                                                                                 prompts):
    """Completions that end early, prompts unpadded or left-padded: the model gets no attention mask (each row's
    left padding moves to its end; a causal model never lets a real token see what follows it) and transformers
    builds none from the positions either; the scores are the masked computation's within fp32 reordering, and (fp64,
    the model's own layers) exactly those each row gets by itself with its prompt padding dropped, to 1e-12. A
    completion mask that turns back on keeps the mask."""
    model = build_model("qwen3_5", tmp_path).train()
    if injected:
        apply_segment_ki(model)
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    if prompts == "unpadded":
        prompt_mask = torch.ones_like(prompt_ids)
        prompt_ids = torch.randint(2, VOCAB, prompt_ids.shape)
    masks, sdpa_masks = [], []
    forward = type(model.model).forward
    monkeypatch.setattr(type(model.model), "forward",
                        lambda self, *a, **kw: (masks.append(kw.get("attention_mask")), forward(self, *a, **kw))[1])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **kw: (
        sdpa_masks.append((kw.get("attn_mask"), kw.get("is_causal"))), sdpa(*a, **kw))[1])
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    completion_logprobs(model, *batch)            # the first call also probes the head (two unmasked forwards)
    masks.clear()
    sdpa_masks.clear()
    got = completion_logprobs(model, *batch)
    assert masks == [None]
    # nor does transformers build one from the positions (a position that stops growing reads as a packed sequence)
    assert sdpa_masks and all(m is None and causal for m, causal in sdpa_masks), sdpa_masks
    want = plain(model, *batch, 1.0, masked=True)
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g, w, **TOL_LAYOUT)
    holes = completion_mask.clone()
    holes[0, 0], holes[0, -1] = 0, 1
    masks.clear()
    completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, holes)
    assert len(masks) == 1 and torch.equal(masks[0], torch.cat([prompt_mask, holes], 1))
    if injected:   # their fp32 gates (as transformers computes them) round differently with the batch on CPU
        return
    model.double()
    got = completion_logprobs(model, *batch)
    for r in range(len(prompt_ids)):
        keep = prompt_mask[r].bool()
        own = completion_logprobs(model, prompt_ids[r:r + 1, keep], prompt_mask[r:r + 1, keep], completion_ids[r:r + 1],
                                  completion_mask[r:r + 1])
        torch.testing.assert_close(got.logp[r:r + 1], own.logp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.entropy[r:r + 1], own.entropy, rtol=1e-12, atol=1e-12)


def test_layout_moves_each_rows_left_padding_to_its_end_and_keeps_its_tokens_and_positions():
    """Exact: in the unmasked layout every row holds its real prompt tokens, then its completion, then padding;
    the real tokens' positions are those the masked layout gives them; ``take`` points at the token before each
    completion token. A completion mask with a hole keeps the masked layout as it was."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch(rows=6, prompt=5, completion=6)
    lay = _layout(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert lay.mask is None
    ids = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1).bool()
    masked_positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    for r in range(len(ids)):
        n = int(mask[r].sum())
        assert torch.equal(lay.ids[r, :n], ids[r][mask[r]])
        assert torch.equal(lay.positions[r, :n], masked_positions[r][mask[r]])
        assert torch.equal(lay.positions[r], torch.arange(ids.shape[1]))
    sel = completion_mask.bool()
    assert torch.equal(lay.ids.gather(1, lay.take + 1)[sel], completion_ids[sel])
    holes = completion_mask.clone()
    holes[0, 0], holes[0, -1] = 0, 1
    kept = _layout(prompt_ids, prompt_mask, completion_ids, holes)
    assert torch.equal(kept.ids, ids) and torch.equal(kept.mask, torch.cat([prompt_mask, holes], 1))
    assert torch.equal(kept.take, (prompt_ids.shape[1] - 1 + torch.arange(6)).expand(6, 6))
