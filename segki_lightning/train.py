"""``segki-train``: run a recipe (``recipes/*.yaml``) with Hydra overrides.

    segki-train --config-name grpo trainer.max_steps=20
    segki-train --config-name ppo
    python -m segki_lightning.train --config-name grpo trainer=gpu model=pretrained model.pretrained=/ckpt
"""
from __future__ import annotations

import importlib.resources
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("segki_lightning")


def shipped(name: str) -> Path:
    """The ``recipes``/``configs`` folder: installed as ``segki_lightning.<name>`` (package data of a wheel or an
    editable install), else beside the package in a source checkout."""
    try:
        return Path(str(importlib.resources.files(f"segki_lightning.{name}")))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / name


RECIPES, CONFIGS = shipped("recipes"), shipped("configs")


def build_policy(cfg):
    """``(policy, tokenizer)`` from ``cfg.model``."""
    from .rl.model import load_pretrained, tiny_qwen35
    from .rl.task import char_tokenizer

    if cfg.model.pretrained:
        t0 = time.perf_counter()
        model, tok = load_pretrained(cfg.model.pretrained, cfg.model.dtype, cfg.model.revision)
        log.info("segki: loaded %s (%.2f B parameters) in %.1f s", cfg.model.pretrained,
                 sum(p.numel() for p in model.parameters()) / 1e9, time.perf_counter() - t0)
    else:
        tok = char_tokenizer()
        model = tiny_qwen35(len(tok), tok.pad_token_id, tok.eos_token_id, cfg.model.hidden_size,
                            cfg.model.num_layers, cfg.model.dtype, cfg.model.seed)
    if cfg.model.gradient_checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    if cfg.lora.r > 0:
        from omegaconf import OmegaConf

        from .rl.lora import apply_lora

        targets = cfg.lora.target_modules
        targets = targets if isinstance(targets, str) else OmegaConf.to_container(targets)
        model = apply_lora(model, cfg.lora.r, cfg.lora.lora_alpha, cfg.lora.lora_dropout, targets)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("segki: LoRA r=%d on %s: %.2f M trainable parameters, the base frozen", cfg.lora.r, targets,
                 trainable / 1e6)
    return model, tok


def build_rewards(cfg) -> list:
    """Reward functions from ``cfg.rewards``: each a dotted path to a function (``my_pkg.rewards.correct``) or a
    Hydra node -- ``_target_`` a class (instantiated) or a function with ``_partial_: true`` -- or a
    :class:`~segki_lightning.rl.WeightedReward` node."""
    from hydra.errors import InstantiationException
    from hydra.utils import get_method, instantiate

    out = []
    for i, node in enumerate(cfg.rewards):
        try:
            fn = get_method(node) if isinstance(node, str) else instantiate(node)
        except InstantiationException as err:
            raise ValueError(f"rewards[{i}] could not be built ({err}). A reward function that takes "
                             "(prompts, completions, **kwargs) needs `_partial_: true` next to its `_target_`, or "
                             "give its dotted path as a plain string") from None
        out.append(fn)
    return out


def build_tools(cfg) -> tuple[list, Any, Any]:
    """TRL's ``tools`` (functions: dotted paths or Hydra nodes) and ``environment_factory`` (a dotted path of a class
    or function that builds one environment), and ``tool_call_parser`` (a dotted path), from the recipe; one error
    naming the key for a path that does not import."""
    from hydra.utils import get_method, instantiate

    tools = []
    for i, node in enumerate(cfg.get("tools") or []):
        try:
            fn = get_method(node) if isinstance(node, str) else instantiate(node)
        except Exception as err:
            raise ValueError(f"tools[{i}] could not be imported ({err}): give the dotted path of a function "
                             "(my_module.my_tool)") from None
        tools.append(fn)
    factory = _dotted(cfg, "environment_factory", "a class or function that returns one environment")
    return tools, factory, _dotted(cfg, "tool_call_parser", "a function text -> list of calls")


def _dotted(cfg, key: str, what: str):
    """The callable at ``cfg.<key>``'s dotted path (None when unset), or one error naming the key."""
    from hydra.utils import get_object

    path = cfg.get(key)
    if not path:
        return None
    try:
        obj = get_object(path)
    except Exception as err:
        raise ValueError(f"{key} {path!r} could not be imported ({err}): give the dotted path of {what}") from None
    if not callable(obj):
        raise ValueError(f"{key} {path!r} is not callable: give the dotted path of {what}")
    return obj


def prompts(cfg, path: str | None, size: int, seed: int, split: str | None = None, key: str = "task.path"):
    """Prompts of the dataset at ``path`` (a local file or folder or a Hub dataset id; ``task.*`` says which
    config, split, columns and chat form), else ``size`` synthetic ones."""
    from .rl.task import PromptRows, SyntheticAddition

    if not path:
        return SyntheticAddition(size, seed, cfg.task.get("digits", 1))
    t = cfg.task
    return PromptRows(path, t.prompt_column, t.config, split or t.split, t.revision, t.columns, t.system_prompt,
                      t.conversational, key)


def build_data(cfg, repeat: int = 1):
    """The prompt loader; each batch is handed out ``repeat`` times (the optimizer steps of one rollout)."""
    from .rl.loader import ResumableLoader
    from .rl.task import collate

    ds = prompts(cfg, cfg.task.path, cfg.task.size, cfg.task.seed)
    if len(ds) < cfg.task.prompts_per_step:
        raise ValueError(f"task.prompts_per_step={cfg.task.prompts_per_step} but the prompts have only {len(ds)} rows: "
                         "lower task.prompts_per_step or add prompts")
    gen = torch.Generator().manual_seed(cfg.task.seed)
    return ResumableLoader(ds, batch_size=cfg.task.prompts_per_step, shuffle=cfg.algo.shuffle_dataset, drop_last=True,
                           collate_fn=collate, generator=gen, repeat=repeat)


def build_loggers(cfg) -> Any:
    """The Trainer's ``logger``: ``trainer.logger`` when set (``false``: none), else every logger of the ``logger``
    config group (Lightning loggers by name); a logger whose package is missing is a clear error."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    if cfg.trainer.logger is not None:
        return cfg.trainer.logger
    loggers = []
    for name, node in cfg.logger.items():
        try:
            loggers.append(instantiate(node))
        except (InstantiationException, ModuleNotFoundError, ImportError) as err:
            raise RuntimeError(f"logger {name!r} could not be created ({err}); install its package (e.g. pip install "
                               f"{name}) or choose another: logger=csv|tensorboard|wandb|mlflow") from None
    return loggers


def build_eval_data(cfg):
    """Held-out prompts for validation: ``task.eval_path`` (its ``task.eval_split``), else ``task.eval_split`` of
    ``task.path``, else ``task.eval_size`` synthetic prompts (another seed) when the task is synthetic; None when
    there are none."""
    from torch.utils.data import DataLoader

    from .rl.task import collate

    t = cfg.task
    if t.eval_path:
        ds = prompts(cfg, t.eval_path, 0, 0, t.eval_split or "train", key="task.eval_path")
    elif t.eval_split and t.path:
        ds = prompts(cfg, t.path, 0, 0, t.eval_split)
    elif t.path or t.eval_size <= 0:
        return None
    else:
        ds = prompts(cfg, None, t.eval_size, t.seed + 1)
    return DataLoader(ds, batch_size=cfg.task.prompts_per_step, shuffle=False, collate_fn=collate)


HINTS = {"model.pretrained": "model.pretrained=/path/to/checkpoint (a folder saved with save_pretrained)",
         "task.path": "task.path=/path/to/prompts.jsonl (or .parquet, a dataset folder, a Hub dataset id)"}


class _NotOnCPU(logging.Filter):
    """Drops transformers' "falling back to the reference PyTorch implementation" notices: they name CUDA kernel
    packages, which a CPU run cannot use anyway."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "falling back to its reference PyTorch implementation" not in record.getMessage()


def quiet_known_warnings(cfg) -> None:
    """Third-party notices that do not apply to a segki-train run (the README lists them)."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")   # Lightning vs newer torch
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")          # the frozen reference model
    if cfg.trainer.accelerator == "cpu":
        logging.getLogger("transformers.integrations.hub_kernels").addFilter(_NotOnCPU())


def check_complete(cfg) -> None:
    """Every ``???`` filled in, else one error naming the keys and how to set them."""
    from omegaconf import OmegaConf

    missing = OmegaConf.missing_keys(cfg)
    if missing:
        raise ValueError("missing required settings: " + "; ".join(
            f"{k} (set {HINTS.get(k, k + '=...')})" for k in sorted(missing)))


def run(cfg) -> dict:
    """Build policy, data, module and trainer from a composed config; fit; optionally export."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omegaconf import OmegaConf

    from lightning.pytorch.strategies import ModelParallelStrategy

    from .lightning import GracefulStop, RankConsistency, SafeCheckpointIO, SegKICallback, StepProgressBar
    from .rl import GRPOConfig, GRPOModule, PPOConfig, PPOModule

    check_complete(cfg)
    quiet_known_warnings(cfg)
    algorithms = {"grpo": (GRPOConfig, GRPOModule), "ppo": (PPOConfig, PPOModule)}
    if cfg.algorithm not in algorithms:
        raise ValueError(f"algorithm must be one of {sorted(algorithms)}, got {cfg.algorithm!r}")
    conf_cls, module_cls = algorithms[cfg.algorithm]
    module_cls = module_class(cfg.module, module_cls)
    algo = build_algo(cfg, conf_cls)   # settings checked before the model loads
    check_groups(cfg, algo)
    rollout_kw = rollout_settings(cfg, algo)
    segki = named("rollout", list(rollout_kw), lambda: SegKICallback(**rollout_kw))
    tools, environment_factory, parser = build_tools(cfg)   # imports checked before the model loads
    pl.seed_everything(cfg.seed, workers=True)
    policy, tokenizer = build_policy(cfg)
    rewards = build_rewards(cfg)
    extra = (dict(tools=tools, environment_factory=environment_factory, tool_call_parser=parser)
             if tools or environment_factory else {})
    module = module_cls(policy, tokenizer, rewards, algo, **extra)
    root = cfg.trainer.default_root_dir
    if cfg.export_dir:
        check_writable(cfg.export_dir, "export_dir")
    ckpt_dir = Path(root) / "checkpoints"
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, filename="step-{step:06d}", auto_insert_metric_name=False,
                           enable_version_counter=False,
                           every_n_train_steps=cfg.checkpoint.every_n_train_steps, save_last=cfg.checkpoint.save_last,
                           save_top_k=cfg.checkpoint.save_top_k, monitor="step", mode="max")
    callbacks = [segki, ckpt, GracefulStop(ckpt_dir), RankConsistency()]
    trainer_kw = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_kw["logger"] = build_loggers(cfg)
    use_strategy(trainer_kw)
    if trainer_kw["enable_progress_bar"]:
        callbacks.append(StepProgressBar())
    if not isinstance(trainer_kw.get("strategy"), ModelParallelStrategy):   # FSDP writes distributed checkpoints
        trainer_kw["plugins"] = [SafeCheckpointIO()]
    trainer = pl.Trainer(**trainer_kw, callbacks=callbacks)
    trainer.fit(module, train_dataloaders=build_data(cfg, algo.steps_per_rollout), val_dataloaders=build_eval_data(cfg),
                ckpt_path=cfg.ckpt_path)
    if cfg.export_dir:
        export(module, cfg.export_dir, merged=cfg.lora.export_merged)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def build_algo(cfg, conf_cls: type):
    """The algorithm's config from ``cfg.algo``; a bad value is one error naming its key (``algo.<name>``)."""
    import dataclasses

    from omegaconf import OmegaConf

    names = [f.name for f in dataclasses.fields(conf_cls)]
    return named("algo", names, lambda: conf_cls(**OmegaConf.to_container(cfg.algo, resolve=True)))


def named(group: str, names: list[str], build):
    """``build()``, its ValueError or TypeError raised again with each of ``names`` it mentions as the key to set:
    "max_grad_norm must be > 0" -> "algo.max_grad_norm must be > 0"."""
    try:
        return build()
    except (ValueError, TypeError) as err:
        msg = str(err)
        for name in names:
            msg = re.sub(rf"(?<![\w.]){name}(?![\w])", f"{group}.{name}", msg)
        raise type(err)(msg) from None


def check_groups(cfg, algo) -> None:
    """The task's batch, the reward weights' count (``algo``'s against ``cfg.rewards``), the checkpoint and LoRA
    settings, checked before the model loads (each error names its key)."""
    weights = algo.reward_weights
    if weights is not None and len(weights) != len(cfg.rewards):
        raise ValueError(f"algo.reward_weights has {len(weights)} values for the {len(cfg.rewards)} entries of "
                         "rewards: give one weight per reward (or algo.reward_weights=null: 1.0 each)")
    if cfg.checkpoint.every_n_train_steps < 0 or cfg.checkpoint.save_top_k < -1:
        raise ValueError(f"checkpoint.every_n_train_steps must be >= 0 (0: no step checkpoints) and "
                         f"checkpoint.save_top_k >= -1 (-1: keep all), got {cfg.checkpoint.every_n_train_steps}, "
                         f"{cfg.checkpoint.save_top_k}")
    if cfg.task.prompts_per_step < 1:
        raise ValueError(f"task.prompts_per_step must be >= 1 prompt, got {cfg.task.prompts_per_step}")
    if cfg.lora.r < 0 or (cfg.lora.r > 0 and not 0 <= cfg.lora.lora_dropout < 1):
        raise ValueError(f"lora.r must be >= 0 (0: full weights) and lora.lora_dropout in [0, 1), got {cfg.lora.r}, "
                         f"{cfg.lora.lora_dropout}")


def rollout_settings(cfg, algo) -> dict:
    """``cfg.rollout`` for the SegKICallback, ``max_seq_len`` derived as ``algo.max_prompt_length +
    algo.max_completion_length`` when unset (TRL sizes its generation that way), else checked against them, so
    that no rollout can outgrow the engine's cache."""
    from omegaconf import OmegaConf

    kw = OmegaConf.to_container(cfg.rollout, resolve=True)
    need = None if algo.max_prompt_length is None else algo.max_prompt_length + algo.max_completion_length
    if kw["max_seq_len"] is None:
        if need is None:
            raise ValueError("algo.max_prompt_length=null (no prompt limit) needs an explicit rollout.max_seq_len "
                             "(most prompt + completion tokens)")
        kw["max_seq_len"] = need
    elif need is not None and kw["max_seq_len"] < need:
        raise ValueError(f"rollout.max_seq_len={kw['max_seq_len']} is less than algo.max_prompt_length + "
                         f"algo.max_completion_length = {algo.max_prompt_length} + {algo.max_completion_length}: "
                         "raise rollout.max_seq_len (or leave it unset: null derives it), or lower those")
    elif kw["max_seq_len"] <= algo.max_completion_length:
        raise ValueError(f"rollout.max_seq_len={kw['max_seq_len']} leaves no room for a prompt before "
                         f"algo.max_completion_length={algo.max_completion_length} tokens: raise it")
    return kw


def check_writable(path: str, key: str) -> None:
    """Create ``path`` and write a file in it now, so that a folder the run cannot write fails before training,
    naming the setting."""
    import tempfile

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as err:
        raise ValueError(f"{key}={path} is not a writable folder ({err.strerror}): choose another {key}") from None


def module_class(path: str | None, base: type) -> type:
    """The LightningModule class to train: ``base``, or the subclass of it at the dotted ``path`` (``module=...``:
    your own rollouts, logging or losses on top of the algorithm's)."""
    if not path:
        return base
    from hydra.utils import get_class

    try:
        cls = get_class(path)
    except Exception as err:
        raise ValueError(f"module={path} could not be imported ({err}); give the dotted path of a class importable "
                         "from the working directory or PYTHONPATH") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"module={path} must be a subclass of {base.__name__} (the algorithm's module)")
    return cls


def use_strategy(trainer_kw: dict) -> None:
    """``trainer.strategy=fsdp``: FSDP2 through Lightning's ``ModelParallelStrategy`` over all devices. Its shards
    are fp32 (the master weights) and the layers compute in the policy's dtype, so a ``bf16-true``/``16-true``
    precision becomes ``32-true`` (the policy, loaded in bf16, still computes in bf16)."""
    if trainer_kw.get("strategy") != "fsdp":
        return
    from lightning.pytorch.strategies import ModelParallelStrategy

    devices = trainer_kw.get("devices", 1)
    n = len(devices) if isinstance(devices, (list, tuple)) else int(devices)
    if n < 1:
        raise ValueError(f"trainer.strategy=fsdp needs trainer.devices >= 1 (a number or a list), got {devices!r}")
    trainer_kw["strategy"] = ModelParallelStrategy(data_parallel_size=n * trainer_kw.get("num_nodes", 1),
                                                   tensor_parallel_size=1)
    if trainer_kw.get("precision") in ("bf16-true", "16-true"):
        log.info("segki: FSDP keeps fp32 shards as the master weights and computes in the policy's dtype: "
                 "precision %s -> 32-true", trainer_kw["precision"])
        trainer_kw["precision"] = "32-true"


def nonfinite_weights(model: torch.nn.Module, sharded: bool) -> str:
    """Which floating-point weights of ``model`` hold inf or NaN ('' for none). Each rank reads its own shards
    (no gathering); under FSDP the ranks then agree (a collective: every rank calls this), so all raise or none."""
    from torch.distributed.tensor import DTensor

    tensors = [*model.named_parameters(), *model.named_buffers()]
    bad = [n for n, t in tensors if t.is_floating_point()
           and not bool(torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all())]
    total = len(bad)
    if sharded:
        import torch.distributed as dist

        count = torch.tensor([total], device=next(model.parameters()).device)
        dist.all_reduce(count)
        total = int(count)
    return f"{total} tensors" + (f", first {bad[0]}" if bad else " on other ranks") if total else ""


def export(module, path: str, merged: bool = False) -> None:
    """Write the trained policy (and tokenizer) with ``save_pretrained``; it reloads with
    ``AutoModelForCausalLM.from_pretrained``. A LoRA policy writes peft's adapter folder (``PeftModel.
    from_pretrained(base, path)``), or with ``merged`` the base with the adapters folded in. A sharded (FSDP)
    policy is gathered first (a collective: every rank calls this) and written by rank zero, in the dtype it
    computes in."""
    from .inject import remove_segment_ki
    from .lightning.fsdp import full_state_dict, is_sharded

    remove_segment_ki(module.policy)
    sharded = is_sharded(module.policy)
    bad = nonfinite_weights(module.policy, sharded)
    if bad:
        raise ValueError(f"the trained policy holds non-finite weights ({bad}): nothing is exported to {path}; "
                         "resume from an earlier checkpoint")
    if getattr(module, "peft_model", None) is not None:
        from .rl.lora import export_adapters

        if module.global_rank == 0:
            export_adapters(module.peft_model, module.tokenizer, path, merged)
            log.info("segki: exported the LoRA %s to %s", "merged model" if merged else "adapters", path)
        return
    state = full_state_dict(module.policy, getattr(module, "compute_dtype", None)) if sharded else None
    if module.global_rank == 0:   # every rank holds (or has just gathered) the same weights; one writes them
        module.policy.save_pretrained(path, state_dict=state)
        module.tokenizer.save_pretrained(path)
        log.info("segki: exported the policy to %s", path)
    if sharded:
        import torch.distributed as dist

        dist.barrier()   # the folder is complete on every rank's return


def main() -> None:
    import hydra

    from .schema import register

    register()
    sys.argv[1:1] = ["--config-dir", str(CONFIGS)]   # the config groups (also listed by --help)
    if os.getcwd() not in sys.path:   # rewards=[my_module.fn] and module=... import from where the command ran, as
        sys.path.insert(0, os.getcwd())   # under python -m (a console script's sys.path starts at its own folder)

    @hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="grpo")
    def _entry(cfg) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        from .lightning import TrainingInterrupted

        try:
            metrics = run(cfg)
        except TrainingInterrupted as stop:
            if rank_zero_only.rank == 0:
                print(stop, file=sys.stderr, flush=True)
            raise SystemExit(stop.code) from None
        if rank_zero_only.rank == 0:   # once, not once per rank
            log.info("segki: final metrics %s", metrics)

    _entry()


if __name__ == "__main__":
    main()
