"""Shape/dtype ("fake") implementations of the ops, for tracing and torch.compile (in-place ops return None)."""
from __future__ import annotations

import torch


def _out(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


@torch.library.register_fake("segki::linear")
def _linear(x, w, b, residual=None):
    return _out(x, w.shape[0])


@torch.library.register_fake("segki::skinny_linear")
def _skinny(x, w, residual=None, gated=False, norm_w=None, norm_eps=0.0, norm_unit_offset=False):
    return _out(x, w.shape[0] // 2 if gated else w.shape[0])


@torch.library.register_fake("segki::skinny_linear_sums")
def _skinny_sums(x, w):
    from .dispatch import skinny_plan   # the segments of K the native op plans

    plan = skinny_plan(x.numel() // max(x.shape[-1], 1), x.shape[-1], w.shape[0], x.element_size())
    return x.new_empty((plan[1] if plan else 1, *x.shape[:-1], w.shape[0]), dtype=torch.float32)


@torch.library.register_fake("segki::timeline_stamps")
def _timeline_stamps(buf, stamp):
    return torch.empty((0, 9), dtype=torch.int64)


@torch.library.register_fake("segki::gated_mlp_front")
def _gated(x, wg, wu, norm_w=None, norm_eps=0.0, norm_unit_offset=False):
    return _out(x, wg.shape[0])


@torch.library.register_fake("segki::qkv_proj")
def _qkv(x, wq, wk, wv, bq, bk, bv, norm_w=None, norm_eps=0.0, norm_unit_offset=False):
    return _out(x, wq.shape[0]), _out(x, wk.shape[0]), _out(x, wv.shape[0])


@torch.library.register_fake("segki::gdn_in_proj")
def _gdn_in(x, wqkv, wz, wb, wa, norm_w=None, norm_eps=0.0, norm_unit_offset=False):
    return tuple(_out(x, w.shape[0]) for w in (wqkv, wz, wb, wa))


@torch.library.register_fake("segki::gdn_in_proj_conv")
def _gdn_in_conv(x, wqkv, wz, wb, wa, conv_state, conv_weight, conv_bias, norm_w=None, norm_eps=0.0,
                 norm_unit_offset=False):
    return tuple(_out(x, w.shape[0]) for w in (wqkv, wz, wb, wa))


@torch.library.register_fake("segki::rms_norm")
def _rms(x, w, eps, unit_offset):
    return torch.empty_like(x)


@torch.library.register_fake("segki::add_rms_norm")
def _add_rms(x, res, w, eps, unit_offset):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.register_fake("segki::add_rms_norm_sums")
def _add_rms_sums(sums, res, w, eps, unit_offset):
    return torch.empty_like(res), torch.empty_like(res)


@torch.library.register_fake("segki::decode_attention")
def _attn(q, k, v, lengths, scale, gate=None):
    return torch.empty_like(q)


@torch.library.register_fake("segki::attention_prologue")
def _attn_prologue(q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, eps, unit_offset, gated):
    b, d = k_cache.shape[0], k_cache.shape[-1]
    return q.new_empty((b, q.shape[-1] // (2 * d if gated else d), d))


@torch.library.register_fake("segki::decode_attention_step")
def _attn_step(q, k, v, cos, sin, q_w, k_w, k_cache, v_cache, positions, lengths, eps, unit_offset, gated, scale):
    b, d = k_cache.shape[0], k_cache.shape[-1]
    return q.new_empty((b, q.shape[-1] // (2 * d if gated else d), d))


@torch.library.register_fake("segki::silu_mul")
def _silu_mul(gate, up):
    return gate.new_empty(gate.shape)   # contiguous, whatever gate's row stride


@torch.library.register_fake("segki::lora_add")
def _lora_add(x, outs, a, b, scales):
    return [out.new_empty(out.shape) for out in outs]   # contiguous, whatever each output's row stride


@torch.library.register_fake("segki::gdn_decode_step")
def _gdn_step(qkv, z, b, a, conv_state, conv_weight, conv_bias, state, a_log, dt_bias, norm_w, eps, hk, dk, dv):
    return z.new_empty(z.shape)


@torch.library.register_fake("segki::gdn_recurrent_step")
def _gdn_recurrent(mixed, z, b, a, state, a_log, dt_bias, norm_w, eps, hk, dk, dv):
    return z.new_empty(z.shape)


@torch.library.register_fake("segki::sample_tokens")
def _sample(logits, temperature, top_k, top_p, seed, offset):
    b = logits.shape[0]
    return logits.new_empty((b,), dtype=torch.long), logits.new_empty((b,), dtype=torch.float32)


@torch.library.register_fake("segki::process_logits")
def _process(logits, seen, penalty, min_p, temperature):
    return torch.empty_like(logits), logits.new_empty((logits.shape[0],), dtype=torch.float32)


@torch.library.register_fake("segki::record_tokens")
def _record(tok, lp, finished, offset, token, out_tokens, out_logprobs, out_mask, eos, pad, lengths=None):
    return None   # in place only
