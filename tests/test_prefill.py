"""Bucketed prefill on CPU/fp32: bucket sizes, the masks built from padding, the copy into the static cache, and
that a prompt padded into a bucket leaves the state it leaves alone."""
from __future__ import annotations

import pytest
import torch

from segki_lightning.rollout.cache import StaticHybridCache, layer_layouts
from segki_lightning.rollout.graphs import pow2_bucket
from segki_lightning.rollout.prefill import Prefiller, additive_mask, bucketable, width_bucket

from .tiny_models import VOCAB, build_model


def test_buckets_cover_every_size_with_at_most_half_padding():
    for w in range(1, 5000):
        b = width_bucket(w)
        assert b >= w and (b <= 16 or b <= 1.5 * w), (w, b)
    assert [width_bucket(w) for w in (1, 16, 17, 24, 25, 33, 49, 65, 97, 129)] == \
        [16, 16, 24, 24, 32, 48, 64, 96, 128, 192]
    assert [pow2_bucket(r) for r in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]


def test_additive_mask_is_causal_over_real_keys_and_no_row_is_empty():
    rows, width = 5, 13
    mask = (torch.rand(rows, width) < 0.7).long()
    mask[-1] = 0                                                   # an all-pad row (a bucket's filler)
    got = additive_mask(mask, torch.float32)[:, 0]                 # [R, W, W]
    low = torch.finfo(torch.float32).min
    for r in range(rows):
        for i in range(width):
            for j in range(width):
                sees = (j <= i and mask[r, j] == 1) or i == j
                assert got[r, i, j] == (0.0 if sees else low), (r, i, j)


def test_bucketing_needs_masks_this_module_builds(tmp_path):
    assert bucketable(build_model("qwen3_5", tmp_path)) and bucketable(build_model("llama", tmp_path))
    assert not bucketable(build_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8))
    flash = build_model("llama", tmp_path)
    flash.config._attn_implementation = "flash_attention_2"
    assert not bucketable(flash)


def states_alone(model, prompt):
    """Each layer's cache after the prompt alone (no padding, no mask)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
    return out


@pytest.mark.parametrize("max_seq", [32, 20], ids=["cache_wider", "cache_narrower_than_bucket"])
@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_prompt_in_a_padded_bucket_leaves_the_state_it_leaves_alone(family, max_seq, tmp_path):
    """Prompts of 1, 7 and 19 tokens fill a 4-row x 24-token bucket; copied into cache rows (each prompt to two
    rows, in a shuffled order; the cache may hold fewer positions than the bucket) every row holds what its
    prompt alone gives, and the logits agree (fp32)."""
    model = build_model(family, tmp_path)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (1, 7, 19)]
    pre = Prefiller(model, pad=0, graphs=False)
    assert pre.shape(prompts) == (4, 24)
    with torch.no_grad():
        out = pre(prompts)
    assert out.pads == [23, 17, 5] and out.logits.shape == (4, VOCAB)
    layouts = layer_layouts(model)
    cache = StaticHybridCache(layouts, 8, max_seq, torch.float32, torch.device("cpu"))
    for t in (*cache.keys.values(), *cache.values.values(), *cache.conv.values(), *cache.recurrent.values()):
        t.fill_(float("nan"))
    src = torch.tensor([2, 0, 1, 2, 1, 0])
    rows = torch.tensor([0, 5, 3, 1, 2, 4])
    lengths = torch.tensor([len(prompts[s]) for s in src])
    cache.load_prompts(out.cache, src, rows, torch.tensor(out.pads)[src], lengths)
    assert torch.equal(cache.lengths[rows], lengths)
    tol = dict(rtol=1e-4, atol=1e-4)   # fp32; the chunked GDN rule sums a padded chunk in another order
    for s, r in zip(src.tolist(), rows.tolist()):
        alone = states_alone(model, prompts[s])
        torch.testing.assert_close(out.logits[s], alone.logits[0, -1], **tol)
        n = len(prompts[s])
        for i, lay in enumerate(layouts):
            if lay.kind == "attention":
                torch.testing.assert_close(cache.keys[i][r, :, :n], alone.cache.layers[i].keys[0], **tol)
                torch.testing.assert_close(cache.values[i][r, :, :n], alone.cache.layers[i].values[0], **tol)
            else:
                torch.testing.assert_close(cache.conv[i][r], alone.cache.get_conv_state(i)[0], **tol)
                torch.testing.assert_close(cache.recurrent[i][r], alone.cache.get_recurrent_state(i)[0], **tol)
    untouched = torch.tensor([6, 7])
    assert torch.isnan(next(iter(cache.keys.values()))[untouched]).all()
