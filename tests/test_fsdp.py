"""FSDP2 (Lightning's ModelParallelStrategy, ``trainer.strategy=fsdp``) on 2 CPU processes over gloo, started
together as torchrun starts them (``launch.py``): the same weights as DDP after 3 steps (both runs' ranks identical,
metrics logged once a step), an exact resume from the sharded checkpoint, and -- in one process -- the gathered
rollout weights: equal to the shards' full tensors, swapped in with FSDP's hooks set aside, refilled in place (the
pointers a captured graph holds stay valid), everything restored afterwards."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from .launch import train_ranks

RUN = ["trainer.max_steps=3", "trainer.devices=2", "trainer.enable_progress_bar=false", "task.prompts_per_step=2",
       "algo.num_generations=2", "rewards.0.fn.pattern='.*[a-m].*'"]   # a reward random completions often earn


def recipe(folder, *extra, name="grpo"):
    return train_ranks(folder, "--config-name", name, *RUN, *extra)


def exported(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "export" / "model.safetensors")


# the settings of the 3-step runs compared with DDP and with a resumed run (a constant schedule: a linear one's
# horizon is max_steps, which the resumed run's first part changes)
SHARED = ["algo.learning_rate=3e-4", "algo.lr_scheduler_type=constant", "checkpoint.every_n_train_steps=1"]


@pytest.fixture(scope="module")
def fsdp_grpo(tmp_path_factory):
    """The 3-step FSDP GRPO run that the DDP comparison and the resume test both read (each 2-process run costs
    ~9 s)."""
    folder = tmp_path_factory.mktemp("fsdp_grpo")
    return recipe(folder, "trainer.strategy=fsdp", *SHARED, f"export_dir={folder / 'export'}")


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_fsdp_trains_the_same_weights_as_ddp(tmp_path, name, fsdp_grpo):
    """3 steps of the recipe, fp32: every exported tensor within 1e-6 of DDP's, the weights moved, and the export
    is a normal transformers folder (one copy of a tied weight). The two reduce gradients in different orders;
    AdamW divides by a gradient's running RMS, so where a gradient is ~0 that rounding noise moves a weight by up
    to ~lr: at the recipe's 3e-3 PPO's value-driven updates differ by up to 2.8e-6 after 3 steps, hence 3e-4."""
    ddp = recipe(tmp_path / "ddp", "trainer.strategy=ddp", *SHARED, f"export_dir={tmp_path / 'ddp' / 'export'}",
                 name=name)
    fsdp = fsdp_grpo if name == "grpo" else recipe(tmp_path / "fsdp", "trainer.strategy=fsdp", *SHARED,
                                                   f"export_dir={tmp_path / 'fsdp' / 'export'}", name=name)
    for run in (ddp, fsdp):   # the ranks kept identical weights; metrics logged once a step (rank zero)
        check = json.loads((run / "logs" / "rank_consistency.json").read_text())
        assert check["world_size"] == 2 and check["identical"], check
        lines = (run / "logs" / "metrics.csv").read_text().splitlines()
        assert "train/reward" in lines[0] and len(lines) == 4   # header + 3 steps
    want, got = exported(ddp), exported(fsdp)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and (got[key] - value).abs().max() <= 1e-6, key
    rows = list(csv.DictReader(open(fsdp / "logs" / "metrics.csv")))
    assert any(float(r.get("train/grad_norm") or 0) > 0 and float(r.get("train/learning_rate") or 0) > 0
               for r in rows), "no step changed the weights"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(fsdp / "export")   # loads with the library's own code


def test_fsdp_resumes_exactly_from_its_sharded_checkpoint(tmp_path, fsdp_grpo):
    """The 3-step run's step-2 checkpoint + resume + 1 step == the 3 steps, bit for bit. Each rank wrote its own
    shard of the checkpoint."""
    mid = fsdp_grpo / "checkpoints" / "step-000002.ckpt"
    assert mid.is_dir() and len(list(mid.glob("*.distcp"))) == 2
    part = recipe(tmp_path / "resumed", "trainer.strategy=fsdp", *SHARED, f"ckpt_path={mid}",
                  f"export_dir={tmp_path / 'resumed' / 'export'}")
    want, got = exported(fsdp_grpo), exported(part)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_fsdp_bf16_with_validation_checkpointing_micro_batches_reuse_a_reference_and_freed_weights(tmp_path):
    """The rest of the recipe under FSDP, in one run (each 2-process run costs ~9 s): a bf16 policy with
    bf16-true -- the run switches to 32-true (and says so), the shards train in fp32 while the layers and the
    rollout compute in bf16, the export is bf16 (FSDP's mixed precision, on CPU too) --, validation rollouts,
    activation checkpointing of the injected layers, micro-batches, a reused rollout, the KL reference (sharded like
    the policy: each rank's checkpoint holds its own piece of every reference weight) and
    rollout.keep_gathered=false."""
    run = recipe(tmp_path / "all", "trainer.strategy=fsdp", "model.dtype=bfloat16", "trainer.precision=bf16-true",
                 f"export_dir={tmp_path / 'all' / 'export'}", "trainer.val_check_interval=2",
                 "model.gradient_checkpointing=true", "algo.micro_batch_size=1", "algo.num_iterations=2",
                 "algo.beta=0.04", "rollout.keep_gathered=false")
    assert "precision bf16-true -> 32-true" in (run / "train.log").read_text()
    assert {t.dtype for t in exported(run).values()} == {torch.bfloat16}
    rows = list(csv.DictReader(open(run / "logs" / "metrics.csv")))
    assert any(r.get("val/reward") for r in rows) and all(r.get("train/kl") for r in rows if r.get("train/loss"))
    assert json.loads((run / "logs" / "rank_consistency.json").read_text())["identical"]
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    saved = FileSystemReader(run / "checkpoints" / "last.ckpt").read_metadata().state_dict_metadata
    reference = {k: v for k, v in saved.items() if ".reference." in f".{k}" and len(getattr(v, "size", ())) == 2}
    assert reference and all(len(v.chunks) == 2 for v in reference.values()), \
        {k: len(v.chunks) for k, v in reference.items()}
    dcp_to_torch_save(run / "checkpoints" / "last.ckpt", tmp_path / "full.pt")   # the sharded checkpoint, whole
    whole = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]
    assert {v.dtype for k, v in whole.items() if k.startswith("policy.")} == {torch.float32}   # the masters


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gathered_weights_swap_in_and_out_and_keep_their_storage(one_rank_group, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from segki_lightning.inject.packing import projection_groups
    from segki_lightning.lightning.fsdp import GatheredWeights, decoder_layers, shard_policy, through_root
    from segki_lightning.ops import joint_weight

    from .tiny_models import build_model

    model = build_model("qwen3_5", tmp_path)   # saved and loaded back: the real loading code
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert len(decoder_layers(model)) == model.config.num_hidden_layers
    shard_policy(model, init_device_mesh("cpu", (1,)))
    assert through_root(torch.nn.Linear(2, 2), lambda: 5) == 5   # not sharded: just the call
    head = model.get_output_embeddings()
    seen = []   # FSDP's root pre-forward of some torch versions (on CUDA) indexes the inputs: never call it with none
    probe = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(len(args) + len(kwargs)),
                                            with_kwargs=True)
    assert isinstance(head.weight, DTensor) and not through_root(model, lambda: isinstance(head.weight, DTensor))
    probe.remove()
    assert seen == [1]
    hooks = {id(m): (list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()}
    gathered = GatheredWeights(model, torch.float32)
    gathered.gather()
    ptrs = {k: v.data_ptr() for k, v in gathered.full.items()}
    groups = projection_groups(model, injected_only=False)
    assert len(groups) == 4 + 3 + 1     # each group's full copies are rows of one buffer: one product past 16 rows
    assert all(joint_weight(*(gathered.full[id(w)] for w in ws)) is not None for ws in groups)
    with gathered.swapped(), torch.no_grad():
        params = dict(model.named_parameters())
        assert not any(isinstance(p, DTensor) for p in params.values())
        assert all(torch.equal(params[n], plain[n]) for n in plain)
        assert all(not m._forward_pre_hooks and not m._forward_hooks for m in decoder_layers(model))
        assert torch.equal(model(input_ids=ids).logits, want)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert hooks == {id(m): (list(m._forward_pre_hooks), list(m._forward_hooks)) for m in model.modules()}
    first = next(model.parameters())
    with torch.no_grad():
        first.add_(1.0)          # an optimizer step changed a shard
    gathered.gather()            # refilled in place: the same storage (a captured graph stays valid), new values
    assert {k: v.data_ptr() for k, v in gathered.full.items()} == ptrs
    assert torch.equal(gathered.full[id(first)], first.full_tensor())
    once = GatheredWeights(model, torch.float32, keep=False)
    with once.for_rollout():
        assert not isinstance(next(model.parameters()), DTensor)
    assert not once.full and all(isinstance(p, DTensor) for p in model.parameters())
