"""RolloutEngine: batched generation from the SAME model that trains.

Prefill runs the prompts through the model's own forward in left-padded groups whose result is what each
prompt alone gives (flash-linear-attention's chunked kernels for Gated DeltaNet when installed), padded to
fixed shapes and replayed as CUDA graphs (:mod:`.prefill`), and copies the state into a static hybrid cache,
replicated for the n samples. Decode is one step function -- model forward with the
injected segments and a rotary table, sampling, EOS bookkeeping, length/position updates -- captured once per batch-size
bucket as a CUDA graph and replayed; graphs survive optimizer steps because parameters are updated in
place (a change of parameter storage is detected and triggers a recapture).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .. import ops
from ..inject import apply_segment_ki, pack_projections
from ..ops.reference import valid_mask
from .attention import NAME as SEGKI_ATTENTION, attention_implementation, register
from .batch import RolloutBatch, RolloutStats, left_pad
from .cache import StaticHybridCache, layer_layouts
from .config import SamplingConfig
from .graphs import capture, parameter_ptrs, pow2_bucket
from .prefill import Prefiller
from .stops import CHECK_TOKENS, StopCheck, Tails
from .turns import Respond, StepKind, run_turns
from .processors import mark_seen, raw_logprob, remember
from .rope import RopeTable, rotary_module

log = logging.getLogger("segki_lightning")
CHECK_EVERY = CHECK_TOKENS  # decode steps between the (only) device-to-host reads of "all rows finished?"
PREFILL_GROUP = 16  # prompts per prefill forward (sorted by length, so padding stays small)


class _DecodeState:
    """Static per-row decode buffers for ``max_batch`` rows; ``rows(n)`` views the first n."""

    def __init__(self, max_batch: int, max_seq: int, device: torch.device, _views: dict | None = None):
        if _views is not None:
            self.__dict__.update(_views)
            return
        z = dict(device=device)
        self.token = torch.zeros(max_batch, dtype=torch.long, **z)           # [B] last sampled token
        self.finished = torch.zeros(max_batch, dtype=torch.bool, **z)        # [B]
        self.temperature = torch.zeros(max_batch, dtype=torch.float32, **z)  # [B]
        self.top_k = torch.zeros(max_batch, dtype=torch.long, **z)           # [B]
        self.top_p = torch.ones(max_batch, dtype=torch.float32, **z)         # [B]
        self.min_p = torch.zeros(max_batch, dtype=torch.float32, **z)        # [B]
        self.penalty = torch.ones(max_batch, dtype=torch.float32, **z)       # [B] repetition penalty
        self.seen = None      # [B, V] bool, with a penalty on: the tokens of each row's sequence so far
        self.anchor = torch.zeros(max_batch, dtype=torch.long, **z)          # [B] a token of the row's prompt
        self.seed = torch.zeros(max_batch, dtype=torch.long, **z)            # [B]
        self.offset = torch.zeros(max_batch, dtype=torch.long, **z)          # [B] = completion index
        self.limit = torch.zeros(max_batch, dtype=torch.long, **z)           # [B] max_new_tokens (turns' budget)
        self.force_end = torch.zeros(max_batch, dtype=torch.long, **z)       # [B] turns: indices < it are fed, not drawn
        self.out_tokens = torch.zeros(max_batch, max_seq, dtype=torch.long, **z)       # [B, S]
        self.out_logprobs = torch.zeros(max_batch, max_seq, dtype=torch.float32, **z)  # [B, S]
        self.out_mask = torch.zeros(max_batch, max_seq, dtype=torch.long, **z)         # [B, S]

    def rows(self, n: int) -> "_DecodeState":
        return _DecodeState(0, 0, None, _views={k: None if v is None else v[:n] for k, v in self.__dict__.items()})


class RolloutEngine:
    """Generate completions for batches of variable-length prompts with CUDA-graph decode.

    Args:
        model: a Hugging Face causal LM (the one being trained; it is injected in place when
            ``use_segki``).
        max_batch_size: most rows (prompts x samples) of one ``generate`` call; graphs are captured for
            power-of-two buckets up to it.
        max_seq_len: most tokens of prompt + completion; the cache is allocated for it once.
        use_segki: inject fused segments (and decode attention over valid prefixes only).
        graph_capture: capture the decode step in a CUDA graph (CUDA only; eager otherwise).
        pack_weights: with ``use_segki``, move each injected module's input-projection weights into one buffer
            (:func:`~segki_lightning.inject.pack_projections`: same Parameters, one storage move) so batches past
            the fused GEMVs' rows take one product per group (groups already laid out so, as FSDP's gathered
            copies are, and weights that do not own their storage are left alone). False: never, for comparisons.
        eos_token_id, pad_token_id: default to the model's generation config.

    Example:
        >>> engine = RolloutEngine(model, max_batch_size=64, max_seq_len=2048)
        >>> batch = engine.generate([[1, 2, 3], [4, 5]], SamplingConfig(max_new_tokens=32, n=8, seed=0))
        >>> batch.completion_ids.shape   # [16, 32]
    """

    def __init__(self, model: nn.Module, max_batch_size: int = 64, max_seq_len: int = 2048,
                 use_segki: bool = True, graph_capture: bool = True,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 pack_weights: bool = True):
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"max_batch_size must be >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        self.model, self.max_batch_size, self.max_seq_len = model, max_batch_size, max_seq_len
        self.use_segki = use_segki
        self.report = apply_segment_ki(model) if use_segki else None
        self.pack_weights = use_segki and pack_weights
        if self.pack_weights:
            pack_projections(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.graph_capture = graph_capture and self.device.type == "cuda"
        self.vocab_size = model.get_output_embeddings().out_features
        self.eos, self.pad = self._special_tokens(eos_token_id, pad_token_id)
        self.layouts = layer_layouts(model)
        self.prefiller = Prefiller(model, self.pad, self.graph_capture)
        if use_segki:
            register()
        native = ops.backend("gated_mlp_front", self.dtype, self.device) == "native"
        self.path = f"{'graph' if self.graph_capture else 'eager'}+{'native' if native else 'reference'}"
        if graph_capture and not self.graph_capture:
            log.warning("segki: CUDA-graph capture needs a CUDA model; decoding eagerly (%s)", self.path)
        log.debug("segki: rollout path %s", self.path)
        self.cache: StaticHybridCache | None = None
        self.state: _DecodeState | None = None
        self._rope: RopeTable | None = None      # cos/sin per cache position (use_segki; built with the cache)
        self._graphs: dict[tuple[int, StepKind], tuple[torch.cuda.CUDAGraph, tuple[int, ...]]] = {}
        self._packed_ptrs: tuple[int, ...] | None = None   # parameter addresses right after the last packing
        self.captures = 0          # graphs captured so far (tests and logs read it)
        self.capture_s = 0.0       # seconds spent warming up and capturing

    # ------------------------------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int] | Tensor], sampling: SamplingConfig,
                 stop: StopCheck | None = None) -> RolloutBatch:
        """Generate ``sampling.n`` completions per prompt; see :class:`RolloutBatch` for the layout. ``stop``:
        a check of the last ``stop.window`` tokens of each running row (``stop(tails) -> [bool]``), copied every
        CHECK_EVERY decode steps and run while the next CHECK_EVERY decode; rows it names finish after those, so
        that the loop ends when every row has (the caller cuts each row at its stop: the tokens generated past
        it are those the row would draw without a stop)."""
        return self._run(prompts, sampling, stop=stop)

    @torch.no_grad()
    def generate_turns(self, prompts: Sequence[Sequence[int] | Tensor], sampling: SamplingConfig,
                       respond: Respond, max_turns: int) -> RolloutBatch:
        """Multi-turn generation: each row generates until EOS, then ``respond(rows, completions)`` (row indices
        and each row's completion so far, token ids up to its EOS) returns per row the tokens to append (a tool
        result or an environment's observation, chat-templated up to where the model's next turn starts) or None
        to end the row. Appended tokens are part of the completion (``completion_mask`` 1) but not the model's
        (``tool_mask`` 0, log-prob 0); the captured decode step feeds them from the row's own cache (no prefill:
        :mod:`.turns`). Rows go on until ``respond`` ends them, ``max_turns`` turns ran, or
        ``sampling.max_new_tokens`` (the row's budget for generated and appended tokens together; an observation
        past it is cut, counted in ``stats.observations_cut``)."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        return self._run(prompts, sampling, respond, max_turns)

    def _run(self, prompts, sampling: SamplingConfig, respond: Respond | None = None, max_turns: int = 1,
             stop: StopCheck | None = None) -> RolloutBatch:
        started = time.perf_counter()
        prompts = self._check_prompts(prompts, sampling)
        n_rows = len(prompts) * sampling.n
        bucket = self._bucket(n_rows)
        ptrs = self._parameter_ptrs()
        self._allocate()
        was_training = self.model.training
        self.model.eval()
        kind = (*sampling.processors, respond is not None)   # (penalty, min-p, turns): one graph each
        tool_mask = turns = None
        try:
            groups = self._prefill_groups(prompts)
            if kind[0] and self.state.seen is None:
                self.state.seen = torch.zeros(self.max_batch_size, self.vocab_size, dtype=torch.bool,
                                              device=self.device)
            if self.graph_capture:
                self._ensure_graph(bucket, ptrs, kind)
                self.prefiller.prepare([[prompts[i] for i in g] for g in groups], ptrs)
            stats = RolloutStats(path=self.path, turns=1)
            state, cache = self._reset(bucket, n_rows, sampling)
            t0 = self._sync_time()
            self._prefill(prompts, groups, sampling, state.rows(n_rows), cache, ptrs)
            t1 = self._sync_time()
            stats.prefill_s = t1 - t0
            if respond is None:
                stats.steps = self._decode(bucket, kind, sampling.max_new_tokens - 1, n_rows, stop)
                stats.decode_s = self._sync_time() - t1
            else:   # turns: rows continue as they end theirs, step by step (run_turns adds its decode and
                # respond seconds to stats)
                tool_mask, turns = run_turns(self, prompts, sampling, respond, max_turns, bucket, kind, stats)
            t2 = time.perf_counter()
        finally:
            self.model.train(was_training)
        batch = self._collect(prompts, sampling, n_rows, stats, tool_mask, turns)
        stats.setup_s, stats.collect_s = t0 - started, time.perf_counter() - t2
        return batch

    def _decode(self, bucket: int, kind: StepKind, max_steps: int, n_rows: int, stop: StopCheck | None = None
                ) -> int:
        """Replay (or run) the decode step up to ``max_steps`` times, until rows [0, n_rows) have all finished
        (read every CHECK_EVERY steps: the loop's only device-to-host reads); returns the steps run. ``stop``: the
        tails copied after each stretch are checked while the next one decodes (:mod:`.stops`)."""
        steps, tails = 0, None
        while steps < max_steps:
            steps += self._replay(bucket, kind, min(CHECK_EVERY, max_steps - steps))
            if steps % CHECK_EVERY:
                continue
            if stop is None:
                if bool(self.state.finished[:n_rows].all()):
                    break
                continue
            if tails is not None:   # the stretch before this one: its stopped rows finish after this one
                rows, done = tails.stopped(stop)
                if rows:
                    self.state.finished[torch.tensor(rows, device=self.device)] = True
                if done:
                    break
            tails = Tails(self.state, n_rows, stop.window)
        return steps

    def _replay(self, bucket: int, kind: StepKind, steps: int) -> int:
        """``steps`` decode steps of rows [0, bucket), with no host read; returns ``steps``."""
        for _ in range(steps):
            if self.graph_capture:
                self._graphs[(bucket, kind)][0].replay()
            else:
                self._step(bucket, kind)
        return steps

    def free(self) -> None:
        """Release graphs, cache and decode buffers (they are rebuilt on the next ``generate``)."""
        self._graphs.clear()
        self.prefiller.free()
        self.cache = self.state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------------ checks
    def _special_tokens(self, eos, pad) -> tuple[list[int], int]:
        gen = getattr(self.model, "generation_config", None)
        cfg = getattr(self.model, "config", None)
        if eos is None:
            eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None and cfg is not None:
            eos = getattr(cfg, "eos_token_id", None)
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if pad is None:
            pad = next((getattr(o, "pad_token_id", None) for o in (gen, cfg) if o is not None
                        and getattr(o, "pad_token_id", None) is not None), None)
        if pad is None:
            pad = eos_list[0] if eos_list else 0
        return eos_list, int(pad)

    def _check_prompts(self, prompts, sampling: SamplingConfig) -> list[list[int]]:
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if isinstance(prompts, (str, bytes)) or any(isinstance(p, (str, bytes)) for p in prompts):
            raise TypeError("generate takes token ids (a list of lists of ints); tokenize strings first, or call "
                            "SegKIRolloutMixin.rollout, which takes strings and chat messages")
        if len(prompts) == 0:
            raise ValueError("prompts is empty: pass at least one list of token ids")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, Tensor) and (p.is_floating_point() or p.is_complex()):
                raise TypeError(f"prompt {i} is a {p.dtype} tensor: token ids must be integers")
            ids = p.tolist() if isinstance(p, Tensor) else list(p)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
                bad = next(t for t in ids if not isinstance(t, int) or isinstance(t, bool))
                raise TypeError(f"prompt {i} holds {bad!r} ({type(bad).__name__}): token ids must be Python ints")
            if not ids:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size})")
            if len(ids) + sampling.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens; with max_new_tokens={sampling.max_new_tokens} "
                                 f"that exceeds max_seq_len={self.max_seq_len}: shorten the prompt, lower "
                                 "max_new_tokens or build the engine with a larger max_seq_len")
            out.append(ids)
        rows = len(out) * sampling.n
        if rows > self.max_batch_size:
            raise ValueError(f"{len(out)} prompts x n={sampling.n} = {rows} rows exceed max_batch_size="
                             f"{self.max_batch_size}: pass fewer prompts per call or build the engine with a "
                             "larger max_batch_size")
        return out

    def _bucket(self, rows: int) -> int:
        return min(pow2_bucket(rows), self.max_batch_size)

    def _parameter_ptrs(self) -> tuple[int, ...]:
        """The parameters' addresses, read once per call (graphs were captured on them). The projections are packed
        again only when the addresses moved since the last packing (something gave the weights new storage, e.g.
        ``.to()``): walking the groups costs ~1-3 ms a call otherwise."""
        ptrs = parameter_ptrs(self.model)
        if self.pack_weights and ptrs != self._packed_ptrs:
            if pack_projections(self.model):
                ptrs = parameter_ptrs(self.model)
            self._packed_ptrs = ptrs
        return ptrs

    # ------------------------------------------------------------------------------------------ buffers
    def _allocate(self) -> None:
        if self.cache is None:
            self.cache = StaticHybridCache(self.layouts, self.max_batch_size, self.max_seq_len, self.dtype,
                                           self.device)
            self.state = _DecodeState(self.max_batch_size, self.max_seq_len, self.device)
            self._eos = torch.tensor(self.eos or [-1], dtype=torch.long, device=self.device)
            rotary = rotary_module(self.model) if self.use_segki else None
            self._rope = RopeTable(rotary, self.max_seq_len, self.dtype, self.device) if rotary else None
            self._graphs.clear()

    def _reset(self, bucket: int, n_rows: int, sampling: SamplingConfig):
        st, cache = self.state.rows(bucket), self.cache.rows(bucket)
        t = sampling.max_new_tokens
        st.out_tokens[:, :t] = self.pad
        st.out_logprobs[:, :t] = 0.0
        st.out_mask[:, :t] = 0
        st.finished.fill_(True)               # rows beyond n_rows are idle
        st.finished[:n_rows] = False
        st.token.fill_(self.pad)
        st.offset.zero_()
        st.limit.fill_(t)
        st.force_end.zero_()
        st.temperature.fill_(sampling.temperature)
        st.top_k.fill_(sampling.top_k)
        st.top_p.fill_(sampling.top_p)
        st.min_p.fill_(sampling.min_p)
        st.penalty.fill_(sampling.repetition_penalty)
        rows = torch.arange(bucket, device=self.device, dtype=torch.long)
        st.seed.copy_(rows + (sampling.seed & 0x7FFFFFFF) * 1_000_003)
        cache.lengths.zero_()
        return st, cache

    # ------------------------------------------------------------------------------------------ prefill
    @staticmethod
    def _prefill_groups(prompts: list[list[int]]) -> list[list[int]]:
        """Prompt indices in forwards of at most PREFILL_GROUP prompts, sorted by length so padding stays small."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        return [order[i:i + PREFILL_GROUP] for i in range(0, len(order), PREFILL_GROUP)]

    def _prefill(self, prompts: list[list[int]], groups: list[list[int]], sampling: SamplingConfig,
                 st: _DecodeState, cache: StaticHybridCache, ptrs: tuple[int, ...]) -> None:
        """Prefill each group (:class:`~segki_lightning.rollout.prefill.Prefiller`), copy each prompt's state
        into its n rows, then sample every row's first token from its prompt's last logits in one call."""
        n = sampling.n
        first = None                                                                    # [N, V]
        for group in groups:
            out = self.prefiller([prompts[i] for i in group], ptrs)
            index = torch.tensor([[j, i * n + k, out.pads[j], len(prompts[i])]
                                  for j, i in enumerate(group) for k in range(n)]).T.to(self.device)  # [4, g*n]
            src, rows, pads, lengths = index
            cache.load_prompts(out.cache, src, rows, pads, lengths)
            if first is None:
                first = out.logits.new_empty(len(prompts) * n, out.logits.shape[1])
            first.index_copy_(0, rows, out.logits.index_select(0, src))
        procs = sampling.processors
        if procs[0]:   # each row has seen its prompt
            mark_seen(st.seen, [p for p in prompts for _ in range(n)])
            st.anchor.copy_(torch.tensor([p[0] for p in prompts]).repeat_interleave(n).to(self.device))
        tok, lp = self._sample(first, st, procs)
        if procs[0]:
            remember(st.seen, tok, ~st.finished, st.anchor)
        self._record(st, tok, lp)
        st.offset.add_(1)

    # ------------------------------------------------------------------------------------------ decode
    def _record(self, st: _DecodeState, tok: Tensor, lp: Tensor, rows=slice(None), lengths: Tensor | None = None
                ) -> None:
        """Write one sampled token per row at its completion index; pad and mask after EOS. With ``lengths``
        (a decode step) each row then advances by one token."""
        ops.record_tokens(tok, lp, st.finished[rows], st.offset[rows], st.token[rows], st.out_tokens[rows],
                          st.out_logprobs[rows], st.out_mask[rows], self._eos, self.pad, lengths)

    def _sample(self, logits: Tensor, st: _DecodeState, procs: tuple[bool, bool] = (False, False)
                ) -> tuple[Tensor, Tensor]:
        """``(tokens, logprobs) [B]`` from ``logits [B, V]``. With processors on (``procs``: penalty, min-p; see
        :mod:`.processors`) the fused sampler draws from the processed logits, the log-probs stay the model's own
        (``log_softmax(logits / T)``); the caller marks the token seen (:func:`.processors.remember`)."""
        if not any(procs):
            return ops.sample_tokens(logits, st.temperature, st.top_k, st.top_p, st.seed, st.offset)
        x, lse = ops.process_logits(logits, st.seen if procs[0] else None, st.penalty,
                                    st.min_p if procs[1] else None, st.temperature)          # [B, V], [B]
        tok, _ = ops.sample_tokens(x, st.temperature, st.top_k, st.top_p, st.seed, st.offset)
        return tok, raw_logprob(logits, tok, st.temperature, lse)

    def _step(self, bucket: int, kind: StepKind = (False, False, False)) -> None:
        """One decode step for rows [0, bucket): the function that is captured."""
        st, cache = self.state.rows(bucket), self.cache.rows(bucket)
        torch.add(cache.lengths, 1, out=cache.attn_lengths)                            # [B] incl. this token
        if self.use_segki:
            kw = dict(segki_lengths=cache.attn_lengths)
        else:
            kw = dict(attention_mask=valid_mask(cache.lengths + 1, self.max_seq_len, self.dtype))
        rope = self._rope.installed() if self._rope is not None else contextlib.nullcontext()
        with attention_implementation(self.model, SEGKI_ATTENTION if self.use_segki else None), rope:
            logits = self.model(input_ids=st.token[:, None], position_ids=cache.lengths[:, None], cache=cache,
                                use_cache=True, **kw).logits[:, -1]                    # [B, V]
        tok, lp = self._sample(logits.contiguous(), st, kind[:2])
        if kind[2]:   # turns: a row's appended tokens (already in out_tokens) are fed as they are, not drawn
            forced = st.offset < st.force_end                                             # [B]
            tok = torch.where(forced, st.out_tokens.gather(1, st.offset[:, None])[:, 0], tok)
            lp = lp.masked_fill(forced, 0.0)
        if kind[0]:
            remember(st.seen, tok, ~st.finished, st.anchor)
        self._record(st, tok, lp, lengths=cache.lengths)   # then offset and lengths + 1
        if kind[2]:   # an appended EOS ends nothing; rows stop at their budget and never run past the buffers
            torch.logical_and(st.finished, forced.logical_not(), out=st.finished)
            torch.logical_or(st.finished, st.offset >= st.limit, out=st.finished)
            cache.lengths.clamp_(max=self.max_seq_len - 1)
            st.offset.clamp_(max=st.out_tokens.shape[1] - 1)

    def _ensure_graph(self, bucket: int, ptrs: tuple[int, ...], kind: StepKind = (False, False, False)) -> None:
        held = self._graphs.get((bucket, kind))
        if held is not None and held[1] == ptrs:
            return
        t0 = time.perf_counter()
        st, cache = self.state.rows(bucket), self.cache.rows(bucket)
        cache.lengths.zero_()
        st.finished.fill_(True)
        graph, _ = capture(lambda: self._step(bucket, kind), warmups=2)
        self._graphs[(bucket, kind)] = (graph, ptrs)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        log.info("segki: captured decode graph for batch bucket %d in %.2f s", bucket, time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------------ output
    def _collect(self, prompts, sampling: SamplingConfig, n_rows: int, stats: RolloutStats,
                 tool_mask: Tensor | None = None, turns: Tensor | None = None) -> RolloutBatch:
        t, n = sampling.max_new_tokens, sampling.n
        st = self.state.rows(n_rows)
        prompt_ids, prompt_mask = (t.repeat_interleave(n, dim=0) for t in left_pad(prompts, self.pad))  # [N, P]
        batch = RolloutBatch(prompt_ids=prompt_ids.to(self.device), prompt_mask=prompt_mask.to(self.device),
                             completion_ids=st.out_tokens[:, :t].clone(), completion_mask=st.out_mask[:, :t].clone(),
                             logprobs=st.out_logprobs[:, :t].clone(),
                             prompt_index=torch.arange(n_rows, device=self.device) // n, stats=stats,
                             tool_mask=tool_mask, turns=turns)
        stats.tokens = int(batch.model_mask.sum())   # the model's tokens (appended ones not counted)
        return batch

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
