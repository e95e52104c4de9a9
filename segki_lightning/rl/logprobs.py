"""Per-token log-probabilities (and entropy, and value-head outputs) of completions under a causal LM,
computed from the final hidden states in chunks of tokens: peak memory is bounded by the chunk, never by
rows x tokens x vocabulary (Qwen3.5's 248k vocabulary makes [N, T, V] fp32 logits ~1 MB per token).

The output projection runs chunk by chunk with an exact custom backward that recomputes each chunk's
logits; only completion tokens (mask 1) are projected. A model whose logits are not a plain ``lm_head``
of the last hidden state (soft-capping, scaling) is detected by a one-time probe and takes the plain
computation instead, announced once."""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..lightning.fsdp import through_root
from ..ops import train_fused

log = logging.getLogger("segki_lightning")
CHUNK_BYTES = 1 << 30      # fp32 logits of one chunk: ~1 GiB (about 1080 tokens of a 248k vocabulary)
_PLAIN_HEAD = "_segki_plain_head"


class TokenScores(NamedTuple):
    """Per completion token, ``[N, T]`` fp32 (fp64 for an fp64 model) each, 0 where ``completion_mask`` is 0."""

    logp: Tensor                 # log_softmax(logits / temperature)[token]
    entropy: Tensor              # entropy of softmax(logits / temperature)
    values: Tensor | None        # value head on the hidden state before each token (PPO), else None


def chunk_scores(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor, Tensor]:
    """``logits [c, V]`` -> ``logp``, ``entropy``, ``lse`` ``[c]`` (fp32, fp64 for fp64) at ``temperature``."""
    z = (logits if logits.dtype == torch.float64 else logits.float()) / temperature          # [c, V]
    lse = z.logsumexp(-1)
    p = (z - lse[:, None]).exp()
    return z.gather(-1, targets[:, None])[:, 0] - lse, lse - (p * z).sum(-1), lse


def chunk_grad(logits: Tensor, targets: Tensor, lse: Tensor, entropy: Tensor, g_logp: Tensor, g_entropy: Tensor,
               temperature: float) -> Tensor:
    """d loss / d logits ``[c, V]`` in the logits' dtype, from the gradients of ``logp`` and ``entropy`` ``[c]``:
    d logp / d z_j = [j == target] - p_j and d H / d z_j = -p_j (log p_j + H), with z = logits / temperature."""
    log_p = logits.to(lse.dtype) / temperature - lse[:, None]                               # [c, V]
    p = log_p.exp()
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]           # [c, V]
    gz = hit * g_logp[:, None] - p * (g_logp[:, None] + g_entropy[:, None] * (log_p + entropy[:, None]))
    return (gz / temperature).to(logits.dtype)


_fused: dict[str, Callable] = {}


def _fused_on(device: torch.device, name: str) -> Callable:
    """``chunk_scores``/``chunk_grad`` compiled (one fused pass over the chunk's logits instead of ~8) on CUDA;
    the eager functions elsewhere, or if compiling fails (announced once)."""
    eager = {"scores": chunk_scores, "grad": chunk_grad}[name]
    if device.type != "cuda":
        return eager
    if name not in _fused:
        try:
            _fused[name] = torch.compile(eager, dynamic=True)
        except Exception as why:   # no compiler backend: the eager passes still give the same numbers
            log.warning("segki: torch.compile unavailable for the log-prob chunks (%s); running them eagerly", why)
            _fused[name] = eager
    return _fused[name]


class _ChunkedLogProbs(torch.autograd.Function):
    """``hidden [M, H]``, ``weight [V, H]``, ``bias [V] | None``, ``targets [M]`` -> ``logp [M]``,
    ``entropy [M]`` (fp32) of ``softmax(linear(hidden) / temperature)``, ``chunk`` rows at a time."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                chunk: int) -> tuple[Tensor, Tensor]:
        scores = _fused_on(hidden.device, "scores")
        parts = [scores(F.linear(hidden[s:s + chunk], weight, bias), targets[s:s + chunk], temperature)
                 for s in range(0, hidden.shape[0], chunk)]                                 # [c] x3 each
        logp, entropy, lse = (torch.cat(t) for t in zip(*parts))
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        g_entropy = torch.zeros_like(lse) if g_entropy is None else g_entropy
        grad = _fused_on(hidden.device, "grad")
        acc = _acc(hidden)
        g_hidden = torch.empty_like(hidden) if need_h else None
        g_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        g_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk):
            h, rows = hidden[s:s + chunk], slice(s, s + chunk)                            # [c, H]
            gz = grad(F.linear(h, weight, bias), targets[rows], lse[rows], entropy[rows], g_logp[rows],
                      g_entropy[rows], t)                                                 # [c, V] d loss / d logits
            if need_h:
                g_hidden[rows] = gz @ weight
            if need_w:
                add_product(g_weight, gz.t(), h)                                          # [V, H] += [V, c] [c, H]
            if need_b:
                g_bias += gz.to(acc).sum(0)
        cast = (lambda g, like: g.to(like.dtype) if g is not None else None)
        return g_hidden, cast(g_weight, weight), cast(g_bias, bias), None, None, None


_DTYPE_MM = [True]   # whether this torch has the half-in, fp32-out product on CUDA (torch >= 2.8)


def add_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a, b`` bf16/fp16: on CUDA one cuBLAS product accumulating into
    ``acc`` in fp32, instead of a half ``[V, H]`` product rounded, cast and added (two passes over the fp32
    accumulator per chunk: ~55 ms of a 0.8B 32-row micro-batch, measured); elsewhere that sum."""
    if acc.is_cuda and a.dtype != acc.dtype and _DTYPE_MM[0]:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (TypeError, RuntimeError):   # torch < 2.8: no out_dtype
            _DTYPE_MM[0] = False
    acc += (a @ b).to(acc.dtype)


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs (gradient checks)."""
    return torch.promote_types(t.dtype, torch.float32)


def token_logprobs(hidden: Tensor, head: nn.Linear, targets: Tensor, temperature: float = 1.0,
                   chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """``logp``, ``entropy`` ``[M]`` fp32 of ``targets [M]`` under ``softmax(head(hidden [M, H]) / temperature)``,
    never holding more than ``chunk`` rows of logits (default: ~1 GiB of fp32 logits per chunk)."""
    if chunk is None:
        chunk = max(1, CHUNK_BYTES // (4 * head.out_features))
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    return _ChunkedLogProbs.apply(hidden, head.weight, head.bias, targets, temperature, chunk)


def completion_logprobs(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor,
                        completion_mask: Tensor, temperature: float = 1.0, value_head: nn.Module | None = None,
                        chunk: int | None = None, packed: bool = False) -> TokenScores:
    """Scores of each completion token: ``[N, P]`` + ``[N, T]`` -> :class:`TokenScores` of ``[N, T]``.

    Positions count only real tokens (left padding does not shift them), so each row sees what it saw
    alone during the rollout. ``temperature <= 0`` (greedy rollouts) scores at temperature 1. ``packed``: the rows'
    real tokens run end to end as one sequence (:func:`packs` says where the model's forward takes that), padding
    none; rows with padding inside a completion run padded either way."""
    t = temperature if temperature > 0 else 1.0
    sel = completion_mask.bool()                                               # [N, T]
    lay = _layout(prompt_ids, prompt_mask, completion_ids, completion_mask)
    if not _plain_head(model, torch.cat([prompt_ids[:1], completion_ids[:1]], 1)[:, -8:]):
        return _plain_scores(model, lay, completion_ids, sel, t, value_head)
    pack = _pack(lay, prompt_mask, completion_mask) if packed else None

    def chunked() -> TokenScores:
        if pack is not None:
            hidden = _packed_forward(model, pack)                                       # [M, H]
            take = pack.take                                                            # [N, T] in [M]
        else:
            hidden = model.base_model(input_ids=lay.ids, attention_mask=lay.mask, position_ids=lay.positions,
                                      use_cache=False).last_hidden_state                # [N, L, H]
            take = torch.arange(len(lay.ids), device=hidden.device)[:, None] * hidden.shape[1] + lay.take
            hidden = hidden.flatten(0, 1)                                               # [N * L, H]
        logp_m, ent_m = token_logprobs(hidden[take[sel]], model.get_output_embeddings(), completion_ids[sel], t, chunk)
        zeros = torch.zeros(sel.shape, dtype=logp_m.dtype, device=hidden.device)   # fp32 (fp64 for fp64 models)
        values = _values(value_head, hidden[take.clamp(0, len(hidden) - 1)], sel) if value_head is not None else None
        return TokenScores(zeros.masked_scatter(sel, logp_m), zeros.masked_scatter(sel, ent_m), values)

    with train_fused.scoring():
        return through_root(model, chunked)


class _Packed(NamedTuple):
    """Rows laid end to end, real tokens only: ``ids`` and ``positions`` (each token's place in its row) ``[1, M]``,
    ``cu [R + 1]`` int64 row offsets (flash-attention's ``cu_seqlens``; one tensor for every layer of a pass, which
    fla's varlen kernels key their chunk plans on), the longest row, and ``take [N, T]``: where the hidden state that
    predicts each completion token sits in ``M``."""

    ids: Tensor
    positions: Tensor
    cu: Tensor
    max_len: int
    take: Tensor


def _pack(lay: _Layout, prompt_mask: Tensor, completion_mask: Tensor) -> _Packed | None:
    """The packed form of an unmasked layout (each row's real tokens first, :func:`_layout`); None for a layout
    that keeps its mask (padding inside a completion). One host sync."""
    if lay.mask is not None:
        return None
    lengths = prompt_mask.sum(1) + completion_mask.sum(1)                       # [N]
    keep = torch.arange(lay.ids.shape[1], device=lay.ids.device)[None, :] < lengths[:, None]   # [N, L]
    cu = F.pad(lengths.cumsum(0), (1, 0))                                       # [N + 1] int64
    return _Packed(lay.ids[keep][None], lay.positions[keep][None], cu, int(lengths.max()), cu[:-1, None] + lay.take)


def no_masks(model: nn.Module) -> dict[str, None]:
    """An attention-mask mapping that tells transformers' models (those that take the mapping per layer type) to
    build no mask: packed rows are kept apart by ``cu_seq_lens_*``, not by a ``[M, M]`` mask."""
    kinds = set(getattr(model.config, "layer_types", None) or ()) | {"full_attention", "sliding_attention"}
    return dict.fromkeys(kinds)


def _packed_forward(model: nn.Module, pack: _Packed) -> Tensor:
    """The last hidden states ``[M, H]`` of packed rows."""
    out = model.base_model(input_ids=pack.ids, position_ids=pack.positions, attention_mask=no_masks(model),
                           cu_seq_lens_q=pack.cu, cu_seq_lens_k=pack.cu, max_length_q=pack.max_len,
                           max_length_k=pack.max_len, use_cache=False)
    return out.last_hidden_state[0]


_PACKS = "_segki_packs"
# the worst token's relative error of the probe, fp32/fp64 and half precision: a row that sees the row before it
# (a conv window, attention or a recurrent state reaching across) is off by O(1) at its first tokens; kernels that
# differ only in rounding stay within ~1e-6 (fp32) and a few % (bf16, 24 layers)
_PACK_TOL = {True: 1e-3, False: 0.1}


@torch.no_grad()
def packs(model: nn.Module, injected: bool) -> bool:
    """Whether ``model``'s forward runs packed rows as if each ran alone: two random rows (7 and 12 tokens) packed
    against each one by itself, once per model and injection state (eval mode), every token's last hidden state
    within the rounding of its dtype (:data:`_PACK_TOL`).
    Transformers' own layers keep packed rows apart only with flash-attention and fla's varlen kernels, so where
    it says no (the switches off, a model this package does not fuse), training pads; one line says so."""
    known = model.__dict__.get(_PACKS)
    if known is not None and known[0] == injected:
        return known[1]
    head = model.get_output_embeddings()
    device = head.weight.device
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, min(head.out_features, 1000), (n,), generator=gen).to(device) for n in (7, 12)]
    was_training = model.training
    model.eval()
    try:
        def alone(ids: Tensor) -> Tensor:
            return model.base_model(input_ids=ids[None], use_cache=False).last_hidden_state[0]

        want = torch.cat([through_root(model, lambda r=r: alone(r)) for r in rows]).float()
        cu = torch.tensor([0, 7, 19], device=device)
        pack = _Packed(torch.cat(rows)[None], torch.cat([torch.arange(7), torch.arange(12)]).to(device)[None], cu, 12,
                       cu[:-1, None])
        got = through_root(model, lambda: _packed_forward(model, pack)).float()
        err = ((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).max().item()   # the worst token
        ok, why = err <= _PACK_TOL[head.weight.dtype in (torch.float32, torch.float64)], (
            f"its packed rows differ from the rows alone (a token's relative error {err:.2g})")
    except Exception as err:   # a forward that refuses the keywords or the mask mapping
        ok, why = False, f"its forward refuses packed rows ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    if ok:
        log.info("segki: training passes run each micro-batch's rows packed into one sequence (padding-free)")
    else:
        log.warning("segki: padding-free training is off for %s: %s%s; micro-batches run padded",
                    type(model).__name__, why, "" if injected else " (rollout.use_segki=false leaves the model's "
                    "own layers, which keep packed rows apart only with flash-attention kernels)")
    model.__dict__[_PACKS] = (injected, ok)
    return ok


class _Layout(NamedTuple):
    """What the model runs on: ``ids``, ``mask`` (None: no padding before any real token) and ``positions``,
    ``[N, L]`` each, and ``take [N, T]``: where the hidden state that predicts each completion token sits."""

    ids: Tensor
    mask: Tensor | None
    positions: Tensor
    take: Tensor


def _layout(prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> _Layout:
    """The prompt and completion side by side, run without a mask where every row's padding can come after its last
    real token: each row's left padding is moved to its end (a causal model never lets a real token see what
    follows it, so every real token's score is the same). That keeps SDPA on its causal path instead of a
    materialized ``[N, 1, L, L]`` mask -- whose first use at each new length also builds a new attention plan, ~3 s
    once in the 0.8B GRPO benchmark -- and the GDN layers unmasked. Positions then count on through the trailing
    padding: transformers reads a position that stops growing as the start of a packed sequence, for which it
    builds the explicit mask after all. Batches with padding inside a completion keep the mask. One host sync."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                       # [N, L = P+T]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)                    # [N, L]
    p, t, length = prompt_ids.shape[1], completion_ids.shape[1], ids.shape[1]
    cols = torch.arange(length, device=ids.device)
    pad = (prompt_mask == 0).sum(1)                                            # [N] left padding per row
    left = (prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all() & (pad < p).all()   # a real prompt token ends each
    trailing = (completion_mask[:, 1:] <= completion_mask[:, :-1]).all()
    if p == 0 or not bool((left & trailing).item()):
        return _Layout(ids, mask, (mask.cumsum(1) - 1).clamp_min(0), (p - 1 + cols[:t]).expand(len(ids), t))
    roll = (cols + pad[:, None]) % length                                      # [N, L]: real tokens first
    return _Layout(ids.gather(1, roll), None, cols.expand_as(ids), p - 1 - pad[:, None] + cols[:t])


def _predictors(x: Tensor, take: Tensor) -> Tensor:
    """``x [N, L, ...]`` at ``take [N, T]`` along the sequence: ``[N, T, ...]``."""
    index = take.reshape(*take.shape, *(1,) * (x.dim() - 2)).expand(*take.shape, *x.shape[2:])
    return x.gather(1, index)


def _values(value_head: nn.Module | None, hidden: Tensor, sel: Tensor) -> Tensor | None:
    """``[N, T]`` fp32 value-head outputs on ``hidden [N, T, H]``, 0 where ``sel`` is False (what follows a row's
    end depends on how the batch was laid out)."""
    if value_head is None:
        return None
    return value_head(hidden.to(value_head.weight.dtype))[..., 0].float() * sel


def _plain_scores(model, lay: _Layout, completion_ids, sel, t, value_head) -> TokenScores:
    """The whole ``[N, T, V]`` logits at once (models whose logits are more than ``lm_head(hidden)``)."""
    out = model(input_ids=lay.ids, attention_mask=lay.mask, position_ids=lay.positions, use_cache=False,
                output_hidden_states=value_head is not None)
    logits = _predictors(out.logits, lay.take).float() / t                      # [N, T, V]
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, completion_ids[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = sel.float()
    values = _values(value_head, _predictors(out.hidden_states[-1], lay.take), sel) if value_head is not None else None
    return TokenScores(logp * m, entropy * m, values)


@torch.no_grad()
def _plain_head(model: nn.Module, ids: Tensor) -> bool:
    """Whether ``model``'s logits are exactly ``lm_head(base_model(...).last_hidden_state)``: a plain
    ``nn.Linear`` head, checked once per model by one tiny forward both ways (eval mode) and cached."""
    known = model.__dict__.get(_PLAIN_HEAD)
    if known is not None:
        return known
    head, base = model.get_output_embeddings(), getattr(model, "base_model", model)
    ok = type(head) is nn.Linear and base is not model
    if ok:
        was_training = model.training
        model.eval()
        try:
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = through_root(model, lambda: head(base(input_ids=ids, use_cache=False).last_hidden_state)).float()
        finally:
            model.train(was_training)
        ok = bool(((got - want).norm() <= 1e-3 * want.norm()).item())
    if not ok:
        log.warning("segki: %s's logits are not a plain lm_head of its last hidden state; log-probs take the "
                    "whole [rows, tokens, vocabulary] logits (memory grows with it: lower micro_batch_size)",
                    type(model).__name__)
    model.__dict__[_PLAIN_HEAD] = ok
    return ok
