"""Training on CUDA/bf16: master-weight steps reach the captured rollout graph (no recapture, no copies), the
model's own forward (switches off) trains with flash-linear-attention installed, and chunked log-probs agree
with the plain computation while holding far less memory."""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():   # one skip line for the module, not one per case
    pytest.skip("needs a CUDA device", allow_module_level=True)

from segki_lightning import RolloutEngine, SamplingConfig
from segki_lightning.inject.gdn_training import guard_transformers_gdn
from segki_lightning.rl import MasterWeightOptimizer
from segki_lightning.rl.logprobs import completion_logprobs

from .test_rollout_gpu import cuda_model, prompts

pytestmark = pytest.mark.gpu


def batch_of(engine, lengths, new=16, seed=0):
    b = engine.generate(prompts(lengths, seed), SamplingConfig(max_new_tokens=new, temperature=1.0, seed=seed))
    return b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask


def test_master_weight_steps_reach_the_captured_graph(tmp_path):
    """Each optimizer step's new bf16 weights (rounded from the fp32 masters, written in place) are what the
    already-captured graph decodes with: equal to a fresh eager engine after every step, one capture."""
    model = cuda_model(tmp_path, seed=5)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=64, graph_capture=True, eos_token_id=[])
    ptrs = [p.data_ptr() for p in model.parameters()]
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=2e-2, fused=True)
    ps, greedy = prompts([12, 3]), SamplingConfig(max_new_tokens=16, temperature=0.0)
    seen = [engine.generate(ps, greedy).completion_ids]
    for step in range(3):
        model.train()
        completion_logprobs(model, *batch_of(engine, [7, 9], seed=step)).logp.sum().backward()
        opt.step()
        opt.zero_grad()
        seen.append(engine.generate(ps, greedy).completion_ids)
        fresh = RolloutEngine(model, max_batch_size=4, max_seq_len=64, graph_capture=False, eos_token_id=[])
        assert torch.equal(seen[-1], fresh.generate(ps, greedy).completion_ids), step
    assert engine.captures == 1 and [p.data_ptr() for p in model.parameters()] == ptrs
    assert not torch.equal(seen[0], seen[-1])
    for p, m in zip(model.parameters(), opt._flat_masters()):
        assert m.dtype == torch.float32 and torch.equal(p, m.to(p.dtype))


def test_switches_off_train_with_flash_linear_attention(tmp_path):
    """The uninjected model's own GDN training forward/backward (what ``use_segki=false`` trains), under the
    guard the callback installs: finite gradients on every parameter."""
    model = cuda_model(tmp_path, seed=6)
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=64, use_segki=False, graph_capture=False,
                           eos_token_id=[])
    batch = batch_of(engine, [5, 11])
    undo = guard_transformers_gdn()
    try:
        model.train()
        completion_logprobs(model, *batch).logp.sum().backward()
    finally:
        undo()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_chunked_logprobs_match_and_hold_less_memory(tmp_path):
    """bf16 on a 128k vocabulary (the logits, not the small model, dominate the plain peak): log-probs within
    bf16 rounding of log_softmax over the whole logits; the chunked forward + backward peaks far below the
    plain one (its first call, which compiles the chunk math on CUDA, is not counted)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                            linear_key_head_dim=64, linear_value_head_dim=64, vocab_size=131072,
                            layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0,
                            eos_token_id=1, bos_token_id=None)
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).cuda().train()
    ids = torch.randint(2, 131072, (32, 65), device="cuda")
    ones = torch.ones_like(ids)
    args = (ids[:, :1], ones[:, :1], ids[:, 1:], ones[:, 1:])

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        out.float().sum().backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return out.detach(), torch.cuda.max_memory_allocated() - base

    undo = guard_transformers_gdn()   # the model's own GDN layers: fla's backward may refuse this Triton
    try:
        peak(lambda: completion_logprobs(model, *args, chunk=64).logp)   # compiles the chunk math: not counted
        got, chunked = peak(lambda: completion_logprobs(model, *args, chunk=64).logp)
        plain_logits = lambda: torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)  # noqa: E731
        want, plain = peak(lambda: plain_logits().gather(-1, ids[:, 1:, None])[..., 0])
    finally:
        undo()
    err = (got - want).abs().max().item()
    assert err < 0.05, err   # bf16 logits are rounded the same way on both paths
    assert chunked < plain / 4, (chunked, plain)


def test_the_head_gradient_accumulates_in_fp32_without_a_half_product():
    """``add_product``: bf16 chunks of the output projection's gradient summed into an fp32 accumulator by one
    cuBLAS product each (torch >= 2.8), equal to the fp32 products of the same bf16 values up to summation order;
    the half product it replaces rounds each chunk to bf16 first."""
    from segki_lightning.rl import logprobs

    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    acc = torch.randn(4096, 1024, device="cuda", generator=gen)
    want = acc.double()
    for _ in range(3):   # three chunks of 700 tokens
        a = torch.randn(4096, 700, device="cuda", generator=gen).bfloat16()
        b = torch.randn(700, 1024, device="cuda", generator=gen).bfloat16()
        logprobs.add_product(acc, a, b)
        want += a.double() @ b.double()
    assert logprobs._DTYPE_MM[0] or torch.__version__ < (2, 8), "the fp32-out product fell back"
    assert ((acc.double() - want).norm() / want.norm()).item() < 1e-5


def test_8bit_adamw_steps_cuda_masters_near_fp32_adamw():
    """``algo.optim=adamw_8bit`` on CUDA: bitsandbytes' AdamW8bit steps the fp32 masters of bf16 weights (its
    moments of a 4096-element tensor in one byte each), and after 20 steps from fresh random gradients the masters
    stay within 10 % (relative, of the largest move) of fp32 AdamW's trajectory: block-wise 8-bit moments round,
    they do not drift."""
    pytest.importorskip("bitsandbytes", reason="the [bnb] extra (bitsandbytes) is not installed")
    from segki_lightning.rl.optim import build_optimizer

    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref = torch.nn.Linear(256, 128, bias=False, device="cuda")
    net = torch.nn.Linear(256, 128, bias=False, device="cuda").bfloat16()
    with torch.no_grad():
        ref.weight.copy_(net.weight.float())
    start = ref.weight.detach().clone()
    opt = build_optimizer(net.parameters(), 1e-3, 0.0, True, "adamw_8bit")
    want = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(20):
        g = torch.randn(128, 256, device="cuda") + 0.5   # a steady direction under the noise
        net.weight.grad, ref.weight.grad = g.bfloat16(), g.bfloat16().float()
        opt.step()
        want.step()
    state = opt.inner.state[opt._flat_masters()[0]]
    assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    master = opt._flat_masters()[0]
    moved = (ref.weight - start).abs().max()
    assert moved > 1e-3 and (master - ref.weight).abs().max() <= 0.1 * moved
    assert torch.equal(net.weight, master.bfloat16())


def test_a_reward_model_scores_on_the_modules_gpu(tmp_path):
    """A reward model given by folder follows the module onto its GPU at the first rollout and scores there as it
    does on the CPU (fp32, within 1e-4)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from segki_lightning.rl import GRPOConfig, GRPOModule, RewardModel
    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id, num_labels=1)
    Qwen2ForSequenceClassification(cfg).save_pretrained(tmp_path / "scorer")
    tok.save_pretrained(tmp_path / "scorer")
    policy = tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id)
    module = GRPOModule(policy, tok, [str(tmp_path / "scorer")], GRPOConfig(num_generations=2,
                                                                           max_completion_length=4)).cuda()
    s = module.rollout_and_score({"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}, 2)
    rm = module.rewards[0].fn
    assert rm.device.type == "cuda"
    on_cpu = RewardModel(str(tmp_path / "scorer"))(s.prompts, s.texts)
    assert torch.allclose(s.rewards.cpu(), torch.tensor(on_cpu), atol=1e-4)
