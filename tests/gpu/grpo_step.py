"""One GRPO-loss step of four Qwen3.5-0.8B-shape layers (3 GDN + 1 attention, segki injected) and a judge of its
parameter gradients against the same step in fp32.

Why fp32 as the judge: two bf16 paths that round at different places give gradients that differ by bf16 noise,
and a parameter whose gradient is a sum of many cancelling terms (``A_log``: one value a head, summed over every
token) differs by O(1) in relative terms between ANY two bf16 paths. So a path is judged by its distance from the
fp32 gradient, against the distance of the reference bf16 path from it: no worse than ``FACTOR`` times, plus a
floor for gradients both paths get right."""
from __future__ import annotations

import copy
from contextlib import nullcontext
from unittest import mock

import torch

FACTOR, FLOOR = 3.0, 2e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def models(seed: int):
    """The same random weights in fp32 and in bf16, each injected: ``(fp32, bf16)``."""
    from transformers import Qwen3_5ForCausalLM

    from segki_lightning.inject import apply_segment_ki

    from ..tiny_models import qwen35_config

    cfg = qwen35_config(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                        linear_value_head_dim=128, vocab_size=4096)
    torch.manual_seed(seed)
    fp32 = Qwen3_5ForCausalLM(cfg).cuda().train()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    for m in (fp32, bf16):
        apply_segment_ki(m)
    return fp32, bf16


def batch(prompt: list[int], completion: list[int], seed: int):
    """``(prompt ids, prompt mask, completion ids, completion mask)`` on CUDA (prompts left-padded) and advantages."""
    gen = torch.Generator().manual_seed(seed)
    pm = torch.zeros(len(prompt), max(prompt), dtype=torch.long)
    cm = torch.zeros(len(prompt), max(completion), dtype=torch.long)
    for r, (p, c) in enumerate(zip(prompt, completion)):
        pm[r, -p:], cm[r, :c] = 1, 1
    ids_p, ids_c = (torch.randint(2, 4096, m.shape, generator=gen) * m for m in (pm, cm))
    return [t.cuda() for t in (ids_p, pm, ids_c, cm)], torch.randn(len(prompt), generator=gen).cuda()


def step(model, inputs, adv, packed: bool, old: torch.Tensor | None = None):
    """One GRPO (dapo) loss backward: ``(log-probs, old log-probs used, {name: gradient})``; ``old`` defaults to
    this pass's own no-grad scoring (the old-log-prob pass). An fp32 model (the judge's truth) runs transformers'
    torch chunk rule for Gated-DeltaNet: an oracle independent of fla, and no fp32 tuning of fla's kernels (minutes
    on a fresh machine)."""
    from segki_lightning.ops import gdn_chunk

    torch_rule = next(model.parameters()).dtype == torch.float32
    with mock.patch.object(gdn_chunk, "fla_runs", lambda needs_grad: False) if torch_rule else nullcontext():
        return _step(model, inputs, adv, packed, old)


def _step(model, inputs, adv, packed: bool, old: torch.Tensor | None):
    """:func:`step` on the model's own path."""
    from segki_lightning.rl import GRPOConfig
    from segki_lightning.rl.logprobs import completion_logprobs
    from segki_lightning.rl.losses import Totals, grpo_loss

    model.zero_grad()
    if old is None:
        with torch.no_grad():
            old = completion_logprobs(model, *inputs, packed=packed).logp
    s = completion_logprobs(model, *inputs, packed=packed)
    mask = inputs[3]
    grpo_loss(s.logp, old.to(s.logp.dtype), None, adv, mask, GRPOConfig(), Totals.of(mask))[0].backward()
    return s.logp.detach(), old, {n: p.grad.clone() for n, p in model.named_parameters()}


def judge(truth: dict, ref: dict, got: dict) -> None:
    """Every parameter's gradient in ``got`` is within ``FACTOR`` x ``ref``'s distance from the fp32 ``truth``
    (+ ``FLOOR``); the whole gradient too."""
    bad = []
    for n, t in truth.items():
        if t.norm() > 0:
            e_ref, e_got = rel(ref[n], t), rel(got[n], t)
            if e_got > FACTOR * e_ref + FLOOR:
                bad.append((n, round(e_got, 4), round(e_ref, 4)))
    flat = lambda g: torch.cat([g[n].float().flatten() for n in truth])   # noqa: E731
    e_ref, e_got = rel(flat(ref), flat(truth)), rel(flat(got), flat(truth))
    assert e_got <= FACTOR * e_ref + FLOOR, (e_got, e_ref)
    assert not bad, f"(parameter, error, reference's error) against fp32: {bad}"
