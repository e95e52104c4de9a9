"""RolloutEngine on CUDA/bf16: graph == eager, one capture serves many calls, live weights inside a captured
graph, and no weight copies (memory grows by the cache and graph pool only)."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device", allow_module_level=True)

from segki_lightning import RolloutEngine, SamplingConfig, apply_segment_ki, remove_segment_ki

pytestmark = pytest.mark.gpu


def cuda_model(tmp_path, seed=0, **config):
    """A small Qwen3.5 hybrid whose shapes the native kernels take (head dims 64, 3 GDN + 1 attention; ``config``
    overrides)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=64, linear_value_head_dim=64,
                 layer_types=["linear_attention"] * 3 + ["full_attention"])
    cfg = Qwen3_5TextConfig(**{**shape, **config}, vocab_size=1024, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(tmp_path / "m")
    return AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).cuda().eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1024, (n,), generator=g).tolist() for n in lengths]


def test_graph_equals_eager_and_one_capture_serves_many_calls(tmp_path):
    model = cuda_model(tmp_path)
    graph = RolloutEngine(model, max_batch_size=8, max_seq_len=96, graph_capture=True, eos_token_id=[])
    eager = RolloutEngine(model, max_batch_size=8, max_seq_len=96, graph_capture=False, eos_token_id=[])
    assert graph.path == "graph+native" and eager.path == "eager+native"
    ps = prompts([5, 17, 40])
    cfg = SamplingConfig(max_new_tokens=24, temperature=0.0)
    a, b = graph.generate(ps, cfg), eager.generate(ps, cfg)
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-3)
    sampled = SamplingConfig(max_new_tokens=24, temperature=1.0, top_p=0.9, n=2, seed=4)
    c = graph.generate(ps[:2], sampled)
    d = graph.generate(ps[:2], sampled)
    assert torch.equal(c.completion_ids, d.completion_ids)
    assert graph.captures == 1  # buckets 4 and 4: one graph for three calls


def test_processors_in_the_captured_step_equal_eager_and_reach_the_native_sampler(tmp_path):
    """min-p and the repetition penalty inside the graph: graph == eager token for token (greedy with a penalty,
    sampled with both, min-p near 1), a penalty changes the tokens, the processors run natively and the processed
    logits stay bf16 so the native sampler (not the reference) draws from them."""
    from segki_lightning.ops import dispatch

    model = cuda_model(tmp_path, seed=3)
    graph = RolloutEngine(model, max_batch_size=8, max_seq_len=96, graph_capture=True, eos_token_id=[])
    eager = RolloutEngine(model, max_batch_size=8, max_seq_len=96, graph_capture=False, eos_token_id=[])
    ps = prompts([6, 21, 33], seed=3)
    plain = graph.generate(ps, SamplingConfig(max_new_tokens=40, temperature=0.0))
    pen = SamplingConfig(max_new_tokens=40, temperature=0.0, repetition_penalty=1.5)
    a, b = graph.generate(ps, pen), eager.generate(ps, pen)
    assert torch.equal(a.completion_ids, b.completion_ids) and not torch.equal(a.completion_ids, plain.completion_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-3)
    both = SamplingConfig(max_new_tokens=40, temperature=1.0, min_p=0.1, repetition_penalty=1.2, n=2, seed=7)
    assert torch.equal(graph.generate(ps, both).completion_ids, eager.generate(ps, both).completion_ids)
    # min-p near 1 keeps the tokens tied at the top (bf16 logits tie often, so not always plain greedy's choice;
    # the greedy equality is a CPU fp32 test): graph == eager again
    near = SamplingConfig(max_new_tokens=40, temperature=1.0, min_p=0.999, seed=1)
    assert torch.equal(graph.generate(ps, near).completion_ids, eager.generate(ps, near).completion_ids)
    calls = []
    real = dispatch.reference.sample_tokens, dispatch.reference.process_logits
    dispatch.reference.sample_tokens = lambda *a: calls.append("sampler") or real[0](*a)
    dispatch.reference.process_logits = lambda *a: calls.append("processors") or real[1](*a)
    try:
        eager.generate(ps, both)
    finally:
        dispatch.reference.sample_tokens, dispatch.reference.process_logits = real
    assert not calls, f"fell back to the reference {calls}"


def test_turns_in_the_captured_step_equal_eager_and_follow_a_plain_forward(tmp_path):
    """generate_turns on the graph path: equal to the eager path token for token (greedy), and a continued row
    (its appended tokens fed by the decode step from its own cache) follows a plain forward over its whole
    conversation: each greedy token is that forward's argmax wherever its two best logits are more than 0.1
    apart (bf16 moves them by less), log-probs within the single-turn test's tolerance; the budget holds."""
    model = cuda_model(tmp_path, seed=4)
    eos = [t for t in range(2, 1024) if t % 5 == 0]
    graph = RolloutEngine(model, max_batch_size=8, max_seq_len=160, graph_capture=True, eos_token_id=eos)
    eager = RolloutEngine(model, max_batch_size=8, max_seq_len=160, graph_capture=False, eos_token_id=eos)
    ps = prompts([7, 19, 30], seed=4)
    obs = prompts([4, 9, 2], seed=5)
    respond = lambda rows, c: [obs[r] for r in rows]   # noqa: E731  (always continue)
    cfg = SamplingConfig(max_new_tokens=96, temperature=0.0)
    a, b = graph.generate_turns(ps, cfg, respond, 4), eager.generate_turns(ps, cfg, respond, 4)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.tool_mask, b.tool_mask)
    assert (a.completion_mask.sum(1) <= 96).all() and int(a.turns.max()) >= 2
    for r, p in enumerate(ps):
        if int(a.turns[r]) < 2:   # a greedy row that never drew an end token
            continue
        got = a.completion_ids[r][a.completion_mask[r].bool()]                     # [T]
        follows_a_plain_forward(model, p, got, a.logprobs[r, :len(got)], a.tool_mask[r, :len(got)].bool())


def follows_a_plain_forward(model, prompt: list[int], got, logprobs, own) -> None:
    """Greedy tokens ``got [T]`` (the model's where ``own``) and their recorded log-probs against one plain forward
    over prompt + got: each token is that forward's argmax wherever its two best logits are more than 0.1 apart
    (bf16 moves them by less), log-probs within the single-turn test's tolerance."""
    with torch.no_grad():
        seq = torch.cat([torch.tensor(prompt, device="cuda"), got])[None]
        logits = model(input_ids=seq).logits[0, len(prompt) - 1:-1].float()         # [T, V] predicting got
    best = logits.topk(2, -1).values
    clear = own & (best[:, 0] - best[:, 1] > 0.1)
    assert int(clear.sum()) >= int(own.sum()) // 2                                  # the check is not vacuous
    assert torch.equal(got[clear], logits.argmax(-1)[clear])
    want = torch.log_softmax(logits, -1).gather(-1, got[:, None])[:, 0]
    assert (logprobs[own] - want[own]).abs().mean() < 0.15


# the Qwen3.5-0.8B layer widths (four layers, a small vocabulary)
WIDTHS_08B = dict(hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                  linear_value_head_dim=128)


@pytest.mark.parametrize("lora_op", ["0", "1"], ids=["peft-path", "lora_add-op"])   # SEGKI_LORA_OP
@pytest.mark.parametrize("widths", [{}, WIDTHS_08B], ids=["small", "0.8b-widths"])
def test_a_lora_policy_rolls_out_fused_and_follows_peft(tmp_path, widths, lora_op, monkeypatch):
    """LoRA on every projection (non-zero adapters, fp32 as peft keeps them over a bf16 base) inside the captured
    fused decode, the low-rank paths as peft's composition or the native lora_add op: no segment left to peft,
    graph == eager, an optimizer step on the adapters reaches the captured graph without a recapture, and each row
    follows peft's own forward (the model with its adapters, unfused) within bf16 tolerance."""
    from segki_lightning.rl.lora import apply_lora

    monkeypatch.setenv("SEGKI_LORA_OP", lora_op)

    model = cuda_model(tmp_path, seed=6, **widths)
    peft_model = apply_lora(model, r=8, lora_alpha=16)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    graph = RolloutEngine(model, max_batch_size=8, max_seq_len=96, graph_capture=True, eos_token_id=[])
    eager = RolloutEngine(model, max_batch_size=8, max_seq_len=96, graph_capture=False, eos_token_id=[])
    assert not [r for rs in graph.report.skipped.values() for r in rs]
    ps = prompts([6, 21, 33], seed=6)
    cfg = SamplingConfig(max_new_tokens=40, temperature=0.0)
    a, b = graph.generate(ps, cfg), eager.generate(ps, cfg)
    assert torch.equal(a.completion_ids, b.completion_ids)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in adapters:   # a step's gradients without a backward (fla's first-call tuning of it: minutes on a fresh GPU)
        p.grad = torch.randn_like(p) * 0.05
    torch.optim.SGD(adapters, lr=0.5).step()
    after = graph.generate(ps, cfg)   # the captured graph reads the adapters the step updated in place
    assert graph.captures == 1 and not torch.equal(after.completion_ids, a.completion_ids)
    assert torch.equal(after.completion_ids, eager.generate(ps, cfg).completion_ids)
    remove_segment_ki(model)   # peft's own forward from here
    for r, p in enumerate(ps):
        follows_a_plain_forward(model, p, after.completion_ids[r], after.logprobs[r],
                                torch.ones(40, dtype=torch.bool, device="cuda"))


def test_logprobs_match_a_plain_forward_within_bf16_tolerance(tmp_path):
    model = cuda_model(tmp_path, seed=1)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=64, eos_token_id=[])
    batch = engine.generate(prompts([9, 23]), SamplingConfig(max_new_tokens=16, temperature=0.8, seed=2))
    for r in range(len(batch)):
        p = batch.prompt_ids[r][batch.prompt_mask[r].bool()]
        seq = torch.cat([p, batch.completion_ids[r]])[None]
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1:-1].float()
        want = torch.log_softmax(logits / 0.8, -1).gather(-1, batch.completion_ids[r][:, None])[:, 0]
        # bf16: the fused ops round at other points than the unfused model (fp32 equality is a CPU test);
        # on this random 4-layer model that moves log-probs by ~0.07 nats on average
        assert (batch.logprobs[r] - want).abs().mean() < 0.15


def test_optimizer_step_reaches_the_captured_graph_without_recapture(tmp_path):
    model = cuda_model(tmp_path, seed=2)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=64, graph_capture=True, eos_token_id=[])
    ps = prompts([12, 3])
    cfg = SamplingConfig(max_new_tokens=16, temperature=0.0)
    before = engine.generate(ps, cfg).completion_ids
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    x = torch.randint(2, 1024, (2, 20), device="cuda")
    model(input_ids=x, labels=x, use_cache=False).loss.backward()  # training forward: no cache
    opt.step()
    after = engine.generate(ps, cfg).completion_ids
    assert engine.captures == 1
    assert not torch.equal(before, after)
    fresh = RolloutEngine(model, max_batch_size=4, max_seq_len=64, graph_capture=False, eos_token_id=[])
    assert torch.equal(after, fresh.generate(ps, cfg).completion_ids)


def test_memory_grows_only_by_cache_and_graph_pool(tmp_path):
    model = cuda_model(tmp_path, seed=3)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    apply_segment_ki(model)
    assert torch.cuda.memory_allocated() == base  # injection copies no weights
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=128, eos_token_id=[])
    engine.generate(prompts([30, 60]), SamplingConfig(max_new_tokens=32, temperature=1.0, n=4))
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - base
    state = sum(t.numel() * t.element_size() for t in engine.state.__dict__.values())
    # the graph pools (the decode step's, the prefill buckets') hold cuBLAS workspaces (32 MiB each on sm_90),
    # temporaries and the prefill's outputs: 66.6 MiB past base measured on an H200 with this 2.1 MiB cache (the
    # bound was cache + 64 MiB before prefill graphs); a copy of the weights (6 MiB) would not fit the slack
    assert grown < engine.cache.nbytes() + state + 68 * 2**20, (grown, engine.cache.nbytes(), state)


def test_rope_table_equals_the_models_rotary_on_cuda(tmp_path):
    """The decode step's rotary table is bit-equal to the module's own cos/sin on CUDA (bf16), for positions
    across the whole cache."""
    from segki_lightning.rollout.rope import RopeTable, rotary_module

    model = cuda_model(tmp_path)
    rotary = rotary_module(model)
    table = RopeTable(rotary, 4096, torch.bfloat16, torch.device("cuda"))
    pos = torch.randint(0, 4096, (33, 1), device="cuda")
    x = torch.randn(33, 1, 256, device="cuda", dtype=torch.bfloat16)
    want = rotary(x, pos[None].expand(3, -1, -1))
    got = table.lookup(x, pos[None].expand(3, -1, -1))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_prefill_graph_replays_the_eager_prefill_exactly_on_live_inputs_and_weights(tmp_path):
    """A captured prefill bucket gives the eager bucketed forward's logits and cache bit for bit, for new prompts
    of the same bucket (live inputs) and after an in-place weight update (live weights), without recapture."""
    from segki_lightning.rollout.cache import layer_layouts
    from segki_lightning.rollout.prefill import Prefiller

    model = cuda_model(tmp_path, seed=4)
    graph, eager = Prefiller(model, 0, graphs=True), Prefiller(model, 0, graphs=False)
    kinds = [lay.kind for lay in layer_layouts(model)]

    def same(a, b):
        assert torch.equal(a.logits, b.logits) and a.pads == b.pads
        for i, kind in enumerate(kinds):
            if kind == "attention":
                assert torch.equal(a.cache.layers[i].keys, b.cache.layers[i].keys)
                assert torch.equal(a.cache.layers[i].values, b.cache.layers[i].values)
            else:
                assert torch.equal(a.cache.get_conv_state(i), b.cache.get_conv_state(i))
                assert torch.equal(a.cache.get_recurrent_state(i), b.cache.get_recurrent_state(i))

    first, second = prompts([3, 20, 11], seed=1), prompts([17, 2, 24], seed=2)   # both 4 rows x 24 tokens
    graph.prepare([first])
    assert graph.captures == 1
    with torch.no_grad():
        same(graph(first), eager(first))
        same(graph(second), eager(second))
        for p in model.parameters():
            p.mul_(1.01)
        graph.prepare([second])
        same(graph(second), eager(second))
    assert graph.captures == 1 and graph.graphs


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_norms_inside_the_projections_give_the_decode_of_the_separate_norms_bit_for_bit(tmp_path, monkeypatch, rows):
    """Decode where both norms of each layer run inside the projections after them (the first residual add then in
    the mixer's output projection) equals decode with the norms as their own kernels, tokens and log-probs exactly:
    the same roundings in the same order. 5 rows: past the fold's rows nothing folds (the same run twice)."""
    from segki_lightning import ops
    from segki_lightning.ops import dispatch

    model = cuda_model(tmp_path, seed=3)
    ps = prompts([7, 12, 30, 5, 9, 16][:rows], seed=5)
    cfg = SamplingConfig(max_new_tokens=20, temperature=1.0, seed=7)
    x = torch.zeros(rows, 1, 256, dtype=torch.bfloat16, device="cuda")
    w = model.model.layers[0].mlp.gate_proj.weight
    assert ops.folds_norm(x, w, w, gated=True) == (rows <= dispatch.FOLD_ROWS)
    folded = RolloutEngine(model, max_batch_size=8, max_seq_len=64, eos_token_id=[]).generate(ps, cfg)
    monkeypatch.setattr(ops, "folds_norm", lambda *a, **k: False)
    monkeypatch.setattr(dispatch, "folds_norm", lambda *a, **k: False)
    separate = RolloutEngine(model, max_batch_size=8, max_seq_len=64, eos_token_id=[]).generate(ps, cfg)
    assert torch.equal(folded.completion_ids, separate.completion_ids)
    assert torch.equal(folded.logprobs, separate.logprobs)


@pytest.mark.parametrize("rows", [12, 32])
def test_next_norms_computed_ahead_give_the_decode_of_their_own_calls_bit_for_bit(tmp_path, rows):
    """Past the rows where the MLP front takes norm2 inside its launch, each layer's MLP residual add computes the
    next layer's input norm (after the last layer the final norm) ahead: at 12 rows after the skinny down, at 32
    after cuBLAS's, where it replaces a PyTorch add. Tokens and log-probs equal those of each norm computing its
    own call exactly."""
    from segki_lightning.inject.forwards import SPEC

    from ..tiny_models import cut_norm_links

    model = cuda_model(tmp_path, seed=6)
    ps = prompts([4 + i % 9 for i in range(rows)], seed=8)
    cfg = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=4)
    ahead = RolloutEngine(model, max_batch_size=rows, max_seq_len=48, eos_token_id=[]).generate(ps, cfg)
    specs = [layer.__dict__[SPEC] for layer in model.model.layers]
    assert all(s.next_norm is not None for s in specs)
    cut_norm_links(model)
    own = RolloutEngine(model, max_batch_size=rows, max_seq_len=48, eos_token_id=[]).generate(ps, cfg)
    assert torch.equal(ahead.completion_ids, own.completion_ids)
    assert torch.equal(ahead.logprobs, own.logprobs)


# Qwen3.5-4B's layer widths, one GDN and one attention layer: at 16 rows its o_proj / out_proj (K = 4096) and down
# (K = 9216) run in deferred segments of K
QWEN35_4B_LAYERS = dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=2, num_attention_heads=16,
                        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128,
                        layer_types=["linear_attention", "full_attention"])


def test_decode_at_16_rows_in_deferred_segments_matches_a_plain_forward(tmp_path, monkeypatch):
    """16 rows of 4B-wide layers: the output projections and the down in deferred segments of K (two and six, x in
    registers), the output projections' sums straight into the residual add + norm kernel. Log-probs within bf16
    tolerance of a plain forward, and the bits of the same decode with the sums through the product's own sum
    kernel first."""
    from segki_lightning.ops import dispatch

    model = cuda_model(tmp_path, seed=4, **QWEN35_4B_LAYERS)
    assert dispatch.skinny_plan(16, 4096, 2560, 2)[1] == 2 and dispatch.skinny_plan(16, 9216, 2560, 2)[1] == 6
    ps = prompts([3 + 2 * i for i in range(16)], seed=6)
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.8, seed=2)
    fused = RolloutEngine(model, max_batch_size=16, max_seq_len=64, eos_token_id=[]).generate(ps, cfg)
    for r in range(0, 16, 5):
        p = fused.prompt_ids[r][fused.prompt_mask[r].bool()]
        seq = torch.cat([p, fused.completion_ids[r]])[None]
        with torch.no_grad():
            logits = model(input_ids=seq).logits[0, len(p) - 1:-1].float()
        want = torch.log_softmax(logits / 0.8, -1).gather(-1, fused.completion_ids[r][:, None])[:, 0]
        assert (fused.logprobs[r] - want).abs().mean() < 0.15   # as test_logprobs_match_a_plain_forward_...
    monkeypatch.setattr(dispatch, "_skinny_defers", lambda *a: False)   # the sums added by their own launch first
    apart = RolloutEngine(model, max_batch_size=16, max_seq_len=64, eos_token_id=[]).generate(ps, cfg)
    assert torch.equal(fused.completion_ids, apart.completion_ids)
    assert torch.equal(fused.logprobs, apart.logprobs)
