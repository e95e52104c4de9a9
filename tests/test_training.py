"""Training at scale on CPU: micro-batches give the whole batch's gradient (every loss type, GRPO and PPO, with
Lightning's accumulation and clipping), fp32 master weights keep what bf16 cannot (and resume exactly),
activation checkpointing leaves gradients unchanged with the segments injected."""
from __future__ import annotations

import copy

import pytest
import torch

from segki_lightning.inject import apply_segment_ki
from segki_lightning.inject.verify import relative_error
from segki_lightning.rl import (GRPOConfig, GRPOModule, MasterWeightOptimizer, PPOConfig, PPOModule, Totals,
                                WeightedReward, grpo_loss)
from segki_lightning.rl.update import micro_batches

from .test_lightning import small
from .test_logprobs import ragged_batch
from .tiny_models import build_model


def letters(prompts, completions, **columns) -> list[float]:
    """A reward that differs between random completions: the share of letters a-m."""
    return [sum("a" <= c <= "m" for c in text) / max(len(text), 1) for text in completions]


def module(kind: str, **cfg):
    from segki_lightning.rl.model import tiny_qwen35
    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    policy = tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id, seed=int(torch.randint(0, 1000, ())))
    rewards = [WeightedReward(letters)]
    if kind == "grpo":
        return GRPOModule(policy, tok, rewards, GRPOConfig(num_generations=4, max_completion_length=8, **cfg))
    return PPOModule(policy, tok, rewards, PPOConfig(num_generations=4, max_completion_length=8, **cfg))


def assert_gradients_close(got: dict, want: dict, tol: float = 1e-6) -> None:
    """Every tensor's error within ``tol`` of the whole gradient's norm. (Per tensor, relative to its own norm,
    fp32 rounding would fail tensors whose gradient nearly cancels: Gated DeltaNet's A_log/dt_bias can sum to
    ~1e-9 in a tiny model, where 1e-11 of rounding is a large share.)"""
    assert got.keys() == want.keys()
    scale = torch.sqrt(sum(g.float().pow(2).sum() for g in want.values()))
    worst = max(((got[n].float() - g.float()).norm() / scale, n) for n, g in want.items())
    assert worst[0] <= tol, worst


def step_gradients(m, batch) -> dict[str, torch.Tensor]:
    """Gradients of one training step (micro-batches back-propagated inside, the returned loss here)."""
    m.train()
    m.zero_grad(set_to_none=True)
    m.training_step(batch, 0).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind,cfg", [
    pytest.param("grpo", dict(loss_type=t), id=f"grpo-{t}") for t in ("grpo", "bnpo", "dr_grpo", "dapo")
] + [pytest.param("grpo", dict(loss_type="dapo", beta=0.1), id="grpo-dapo-kl"),
     pytest.param("ppo", {}, id="ppo")])
def test_micro_batches_give_the_whole_batch_gradient(kind, cfg):
    """Same seed, same rollout: 1-, 3- and 5-row micro-batches (uneven last ones) vs all 8 rows at once."""
    whole = module(kind, **cfg)
    batch = {"prompt": ["1+2=", "3+4="], "answer": ["3", "7"]}
    want = step_gradients(whole, batch)
    assert len(want) > 10 and any(g.abs().sum() > 0 for g in want.values())
    for size in (1, 3, 5):
        split = copy.deepcopy(whole)
        split.cfg.micro_batch_size = size
        assert_gradients_close(step_gradients(split, batch), want)


def test_micro_batch_losses_add_up_to_the_batch_loss():
    """The loss normalisations themselves (no model): each loss type's micro-batch losses sum to the batch's."""
    logp = torch.randn(6, 5)
    old = logp + 0.3 * torch.randn(6, 5)
    ref = logp + 0.1 * torch.randn(6, 5)
    adv = torch.randn(6)
    mask = (torch.rand(6, 5) > 0.3).long()
    mask[:, 0] = 1
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        cfg = GRPOConfig(loss_type=loss_type, beta=0.05, max_completion_length=5)
        want, want_stats = grpo_loss(logp, old, ref, adv, mask, cfg)
        totals = Totals.of(mask)
        parts = [grpo_loss(logp[r], old[r], ref[r], adv[r], mask[r], cfg, totals) for r in micro_batches(torch.arange(6), 4)]
        torch.testing.assert_close(sum(p[0] for p in parts), want, rtol=1e-6, atol=1e-7)
        for k, v in want_stats.items():
            torch.testing.assert_close(sum(p[1][k] for p in parts), v, rtol=1e-6, atol=1e-7)


def test_micro_batches_with_lightning_accumulation_and_clipping(tmp_path, monkeypatch):
    """With accumulate_grad_batches=2 and a clip that bites (gradient_clip_val=1e-3), 1-row micro-batches hand
    Lightning the same accumulated gradient (seen in on_before_optimizer_step, before clipping) as whole-batch
    steps, and both runs end on the same weights."""
    import lightning.pytorch as pl

    from segki_lightning.train import run

    seen: dict[str, list] = {}

    class Grads(pl.Callback):
        def __init__(self, name):
            self.name = name

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.setdefault(self.name, []).append(
                {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    runs = {}
    real_trainer = pl.Trainer
    for name, extra in {"whole": [], "micro": ["algo.micro_batch_size=1"]}.items():
        folder = tmp_path / name
        monkeypatch.setattr(pl, "Trainer", lambda *a, callbacks=(), name=name, **kw: real_trainer(
            *a, callbacks=[*callbacks, Grads(name)], **kw))
        run(small(folder, "trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=0.001",
                  "trainer.max_steps=2", "algo.num_generations=4", "algo.max_completion_length=6",
                  "rewards.0.fn._target_=tests.test_training.letters", "+rewards.0.fn._partial_=true", *extra))
        runs[name] = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=False)
    assert runs["whole"]["global_step"] == 2 and len(seen["whole"]) == len(seen["micro"]) == 2
    for got, want in zip(seen["micro"], seen["whole"]):
        assert torch.sqrt(sum(g.pow(2).sum() for g in want.values())) > 0.001   # the clip bites
        assert_gradients_close(got, want)
    for key, want in runs["whole"]["state_dict"].items():
        assert relative_error(runs["micro"]["state_dict"][key], want) < 1e-5, key


def test_lightning_clipping_reaches_the_master_weights():
    """Lightning clips the gradients of ``optimizer.param_groups``: with master weights those are the model's
    own parameters, so the masters are stepped with the clipped gradient."""
    from lightning.pytorch.plugins.precision import Precision
    from lightning.pytorch.utilities.enums import GradClipAlgorithmType

    net = torch.nn.Linear(16, 4).to(torch.bfloat16)
    twin = copy.deepcopy(net)
    opt = MasterWeightOptimizer(net.parameters(), torch.optim.SGD, lr=1.0)
    ref = MasterWeightOptimizer(twin.parameters(), torch.optim.SGD, lr=1.0)
    for p, q in zip(net.parameters(), twin.parameters()):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    Precision().clip_gradients(opt, 0.5, GradClipAlgorithmType.NORM)
    torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.5)
    opt.step()
    ref.step()
    for a, b in zip(opt._flat_masters(), ref._flat_masters()):
        assert torch.equal(a, b)
    assert torch.sqrt(sum(p.grad.float().pow(2).sum() for p in net.parameters())) < 0.51


# ------------------------------------------------------------------------------------------- master weights
def _same_grads(params_a, params_b, gen):
    """The same bf16-representable gradient on both sets (so bf16 and fp32 runs see identical inputs)."""
    for a, b in zip(params_a, params_b):
        g = (torch.randn(a.shape, generator=gen) * 1e-2).to(torch.bfloat16)
        a.grad, b.grad = g.to(a.dtype), g.to(b.dtype)


def test_master_weights_keep_rl_sized_updates_that_bf16_loses():
    """lr=1e-6 for 5 steps: plain bf16 AdamW leaves the weights exactly where they were; the master weights
    follow an fp32 run within 1e-7 and the bf16 parameters are their rounding."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    ref32 = torch.nn.Linear(64, 64).float()
    with torch.no_grad():   # bf16-representable weights of magnitude >= 0.02 (bf16 ulp >= 1.2e-4)
        for p in ref32.parameters():
            p.copy_(((p.abs() + 0.02) * p.sign()).to(torch.bfloat16).float())
    bf16 = copy.deepcopy(ref32).to(torch.bfloat16)
    plain = copy.deepcopy(bf16)
    opt32 = torch.optim.AdamW(ref32.parameters(), lr=1e-6)
    opt_m = MasterWeightOptimizer(bf16.parameters(), torch.optim.AdamW, lr=1e-6)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    start = [p.detach().clone() for p in plain.parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        state = gen.get_state()
        _same_grads(list(ref32.parameters()), list(bf16.parameters()), gen)
        gen.set_state(state)
        _same_grads(list(ref32.parameters()), list(plain.parameters()), gen)
        for o in (opt32, opt_m, opt_plain):
            o.step()
            o.zero_grad()
    for p, s in zip(plain.parameters(), start):
        assert torch.equal(p, s)   # every update rounded away
    masters = [m for m in opt_m._flat_masters()]
    for p32, m, p in zip(ref32.parameters(), masters, bf16.parameters()):
        assert (m - p32).abs().max() <= 1e-7
        assert torch.equal(p, m.to(torch.bfloat16))
    moved = sum(float((m - s.float()).abs().max()) for m, s in zip(masters, start))
    assert moved > 1e-6   # the masters did move (5 steps x ~1e-6)


def test_master_weights_write_in_place_and_resume_exactly():
    """Parameters keep their storage (graphs stay valid); 2 steps + state_dict round trip + 2 steps equals 4
    steps bit for bit (masters and moments); an LR scheduler's rate reaches the inner optimizer."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    net[1].float()   # mixed: fp32 parameters are stepped in place too
    ptrs = [p.data_ptr() for p in net.parameters()]

    def run(model, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(4, 8, generator=gen).to(torch.bfloat16)
            model[1](model[0](x).float()).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    straight = copy.deepcopy(net)
    opt_s = MasterWeightOptimizer(straight.parameters(), lr=1e-2)
    run(straight, opt_s, 2, 0)
    run(straight, opt_s, 2, 1)
    opt = MasterWeightOptimizer(net.parameters(), lr=1e-2)
    run(net, opt, 2, 0)
    saved = copy.deepcopy(opt.state_dict())
    resumed = MasterWeightOptimizer(net.parameters(), lr=1e-2)
    resumed.load_state_dict(saved)
    run(net, resumed, 2, 1)
    assert [p.data_ptr() for p in net.parameters()] == ptrs
    for a, b in zip(net.parameters(), straight.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(resumed._flat_masters(), opt_s._flat_masters()):
        assert (a is None and b is None) or torch.equal(a, b)
    sched = torch.optim.lr_scheduler.LambdaLR(resumed, lambda step: 0.5)
    resumed.step()
    assert resumed.inner.param_groups[0]["lr"] == 0.5e-2 and sched.get_last_lr()[0] == 0.5e-2


def test_bf16_recipe_resumes_bit_identically_with_master_weights(tmp_path):
    """The recipe with a bf16 policy (master weights on by default): 2 steps + resume + 2 steps == 4 steps,
    policy and fp32 masters bit for bit; the masters moved where the bf16 weights could not."""
    from segki_lightning.train import run

    bf16 = ["model.dtype=bfloat16", "trainer.precision=bf16-true", "rewards.0.fn.pattern='.*[a-m].*'",
            "algo.learning_rate=1e-5"]
    a, straight = tmp_path / "resumed", tmp_path / "straight"
    run(small(a, "checkpoint.every_n_train_steps=1", *bf16))
    run(small(a, f"ckpt_path={a / 'checkpoints' / 'last.ckpt'}", "trainer.max_steps=4",
              "checkpoint.every_n_train_steps=1", *bf16))
    run(small(straight, "trainer.max_steps=4", "checkpoint.every_n_train_steps=1", *bf16))
    got = torch.load(a / "checkpoints" / "last.ckpt", weights_only=False)
    want = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=False)
    assert got["global_step"] == want["global_step"] == 4
    for key, value in want["state_dict"].items():
        assert value.dtype == torch.bfloat16 and torch.equal(got["state_dict"][key], value), key
    masters_got, masters_want = got["optimizer_states"][0]["masters"], want["optimizer_states"][0]["masters"]
    assert masters_want and masters_got.keys() == masters_want.keys()
    assert all(torch.equal(masters_got[i], m) and m.dtype == torch.float32 for i, m in masters_want.items())
    params = list(want["state_dict"].values())
    assert any((m - p.float()).abs().max() > 0 for m, p in zip(masters_want.values(), params)
               if m.shape == p.shape)


# ------------------------------------------------------------------------------------ activation checkpointing
def test_gradient_checkpointing_keeps_gradients_with_injected_segments(tmp_path):
    from segki_lightning.rl.logprobs import completion_logprobs

    model = build_model("qwen3_5", tmp_path).train()
    apply_segment_ki(model)
    batch = ragged_batch()
    weights = torch.randn(batch[2].shape)

    def grads():
        model.zero_grad(set_to_none=True)
        (completion_logprobs(model, *batch).logp * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = []   # forward runs of a norm inside each decoder layer: 1 per step, 2 when recomputed
    for layer in model.model.layers:
        layer.input_layernorm.register_forward_hook(lambda *a: calls.append(1))
    grads()   # the first call also runs the plain-head probe's two forwards
    calls.clear()
    want = grads()
    plain_calls, calls[:] = len(calls), []
    model.activation_checkpointing_enable({"use_reentrant": False})
    assert_gradients_close(grads(), want)
    assert plain_calls == len(model.model.layers) and len(calls) == 2 * plain_calls   # recomputed in backward


# ------------------------------------------------------------------------- GDN training without fla's backward
def test_gdn_guard_routes_the_models_own_training_to_the_torch_rule(tmp_path, monkeypatch):
    """Stand-in for flash-linear-attention refusing its backward (Hopper, Triton < 3.7.1): the model's own
    (uninjected) GDN forward dispatches to a rule that raises when gradients are recorded. With the guard the
    training forward/backward runs the torch rule and gives the unguarded torch result; no-grad passes keep
    the dispatching rule; undo restores it."""
    import functools
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as mq

    from segki_lightning.inject.gdn_training import RULE, guard_transformers_gdn
    from segki_lightning.rl.logprobs import completion_logprobs

    torch_rule = inspect.unwrap(getattr(mq, RULE))
    calls = {"fla": 0}

    @functools.wraps(torch_rule)
    def refusing(*args, **kwargs):
        calls["fla"] += 1
        if torch.is_grad_enabled():
            raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results")
        return torch_rule(*args, **kwargs)

    model = build_model("qwen3_5", tmp_path).train()
    batch = ragged_batch()
    want = completion_logprobs(model, *batch).logp
    want_grads = torch.autograd.grad(want.sum(), list(model.parameters()), allow_unused=True)
    monkeypatch.setattr(mq, RULE, refusing)
    with pytest.raises(RuntimeError, match="Hopper"):
        completion_logprobs(model, *batch)
    undo = guard_transformers_gdn(force=True)
    try:
        got = completion_logprobs(model, *batch).logp
        got_grads = torch.autograd.grad(got.sum(), list(model.parameters()), allow_unused=True)
        before = calls["fla"]
        with torch.no_grad():
            completion_logprobs(model, *batch)
        assert calls["fla"] > before       # no-grad passes still take the dispatching rule
    finally:
        undo()
    assert getattr(mq, RULE) is refusing
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


def test_a_pretrained_policy_trains_in_train_mode():
    """``from_pretrained`` gives eval-mode models and Lightning keeps submodule modes: the module switches the
    policy to train mode when training starts (else activation checkpointing would be silently off)."""
    m = module("grpo")
    m.policy.eval()
    m.on_train_start()
    assert m.policy.training and all(x.training for x in m.policy.modules())


@pytest.mark.parametrize("part,patched", [("rollout", "prepare"), ("reference", "score_all"), ("update", "accumulate")])
def test_out_of_memory_names_the_part_and_the_settings_to_change(monkeypatch, part, patched):
    """A CUDA out-of-memory error inside a step comes out as one (the same type, the original chained) that names
    the part it hit and the settings that lower that part's memory, with their current values."""
    m = module("grpo", micro_batch_size=2, beta=0.1)
    m.keep_reference()
    m.train()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 130.00 MiB")

    monkeypatch.setattr(m, patched, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError) as info:
        m.training_step({"prompt": ["ab", "cd"], "answer": ["3", "7"]}, 0)
    message = str(info.value)
    assert f"step 0: CUDA out of memory in the {part} pass" in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "trainer.strategy=fsdp" in message and "algo.optim=adamw_8bit (now adamw_torch_fused" in message
    if part == "rollout":
        assert "rollout.max_batch_size" in message and "micro_batch" not in message
    else:
        assert "algo.micro_batch_size (now 2)" in message and "algo.micro_batch_tokens (now null)" in message
        assert "model.gradient_checkpointing=true" in message


def test_replicated_state_is_16_bytes_per_parameter_and_warns_past_the_gpu():
    """The sizing rule the README gives for DDP: bf16 with fp32 masters and fp32 both keep 16 bytes per trainable
    parameter (a frozen reference only its weights); past 90 % of the GPU the warning names the fix."""
    from segki_lightning.rl.sizing import replicated_state_bytes, replicated_state_warning

    bf16, fp32 = torch.nn.Linear(64, 32).bfloat16(), torch.nn.Linear(64, 32)
    frozen = torch.nn.Linear(64, 32).bfloat16().requires_grad_(False)
    n = 64 * 32 + 32
    assert replicated_state_bytes(bf16, master_weights=True) == 16 * n
    assert replicated_state_bytes(fp32, master_weights=True) == 16 * n
    assert replicated_state_bytes(bf16, master_weights=False) == 12 * n
    assert replicated_state_bytes(frozen, master_weights=True) == 2 * n
    assert replicated_state_warning(bf16, True, gpu_bytes=16 * n * 2) is None
    message = replicated_state_warning(bf16, True, gpu_bytes=16 * n)
    assert message is not None and "trainer.strategy=fsdp" in message and "out-of-memory" in message
    assert "algo.optim=adamw_8bit" in message


def test_8bit_adamw_keeps_10_bytes_per_parameter_of_large_tensors():
    """With ``algo.optim=adamw_8bit`` the moments of tensors of MIN_8BIT_SIZE elements or more take 2 bytes (one
    each), smaller tensors keep fp32 moments: a bf16 policy with fp32 masters keeps 10 bytes per parameter of the
    former, 16 of the latter; the warning counts that and no longer suggests the 8-bit optimizer."""
    from segki_lightning.rl.sizing import MIN_8BIT_SIZE, replicated_state_bytes, replicated_state_warning

    big, small = torch.nn.Linear(64, 64, bias=False).bfloat16(), torch.nn.Linear(8, 8, bias=False).bfloat16()
    assert big.weight.numel() >= MIN_8BIT_SIZE > small.weight.numel()
    both = torch.nn.Sequential(big, small)
    assert replicated_state_bytes(both, True, "adamw_8bit") == 10 * 64 * 64 + 16 * 8 * 8
    assert replicated_state_bytes(both, True, "adamw_torch") == 16 * (64 * 64 + 8 * 8)
    message = replicated_state_warning(big, True, gpu_bytes=10 * 64 * 64, optim="adamw_bnb_8bit")
    assert message is not None and "10 bytes per parameter" in message and "adamw_8bit" not in message
