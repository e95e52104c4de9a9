"""Structured-config schemas of ``segki-train``: a key that is not declared here fails with its name. Keys a
config group must fill (``model.pretrained`` for ``model=pretrained``, ``task.path`` for ``task=jsonl``) are
``???`` here, so forgetting them is an error instead of a silent fallback to the defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from .rl.config import GRPOConfig, PPOConfig


@dataclass
class ModelConf:
    pretrained: str | None = MISSING   # local checkpoint folder or Hub id; null (model=tiny_qwen35): the embedded tiny
    dtype: str = "float32"             # auto: the checkpoint's own; float32 | bfloat16 | float16 cast
    revision: str | None = None        # a Hub id's branch, tag or commit
    hidden_size: int = 64
    num_layers: int = 4
    seed: int = 0
    gradient_checkpointing: bool = False   # transformers' activation checkpointing of the decoder layers


@dataclass
class LoraConf:
    """LoRA adapters through peft (its names): ``r=0`` trains the full weights; ``lora.r=16`` alone turns LoRA on."""

    r: int = 0
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    target_modules: Any = "all-linear"   # peft's: "all-linear" or a list of module names
    export_merged: bool = False          # export_dir gets the merged model instead of the adapter folder


@dataclass
class RolloutConf:
    use_segki: bool = True
    graph_capture: bool = True
    max_batch_size: int = 64
    max_seq_len: int | None = None   # most prompt + completion tokens; null: algo.max_prompt_length + max_completion_length
    keep_gathered: bool = True   # trainer.strategy=fsdp: keep the gathered full weights between rollouts


@dataclass
class TaskConf:
    path: str | None = MISSING      # a local .jsonl/.json/.parquet/.csv file or dataset folder, or a Hub dataset id;
                                    # null (task=synthetic): the synthetic addition task
    config: str | None = None       # the dataset's configuration (datasets.load_dataset's name, e.g. gsm8k's main)
    split: str = "train"
    revision: str | None = None     # a Hub dataset's branch, tag or commit
    columns: dict[str, str] = field(default_factory=dict)   # renames, e.g. {question: prompt}
    prompt_column: str = "prompt"
    system_prompt: str | None = None   # given: text prompts become [system, user] conversations (chat template)
    conversational: bool = False    # text prompts become [user] conversations (the policy's chat template renders them)
    size: int = 4096
    digits: int = 1                 # synthetic task: digits of each operand (1: a + b <= 9)
    prompts_per_step: int = 8
    eval_path: str | None = None    # held-out prompts for validation (a file, folder or Hub id, its eval_split)
    eval_split: str | None = None   # validation split of eval_path, else of path (e.g. test)
    eval_size: int = 64             # synthetic held-out prompts (0: no validation on the synthetic task)
    seed: int = 0


@dataclass
class TrainerConf:
    accelerator: str = "cpu"
    devices: Any = 1
    strategy: str = "auto"          # auto | ddp | fsdp (FSDP2 through ModelParallelStrategy) | any Lightning name
    precision: str = "32-true"
    max_steps: int = 200
    log_every_n_steps: int = 1
    gradient_clip_val: float | None = None   # Lightning's; algo.max_grad_norm (TRL's, 1.0) clips when this is null
    accumulate_grad_batches: int = 1
    val_check_interval: Any = 50              # validate every N training steps (greedy rollouts of held-out prompts)
    check_val_every_n_epoch: int | None = None
    num_sanity_val_steps: int = 0
    enable_progress_bar: bool = True
    default_root_dir: str = "."
    logger: Any = None                        # false: no loggers; null: the `logger` group's


@dataclass
class CheckpointConf:
    every_n_train_steps: int = 100
    save_last: bool = True
    save_top_k: int = 3             # the most recent checkpoints kept (step-NNNNNN.ckpt); -1: all, 0: only last.ckpt


@dataclass
class Recipe:
    """Fields every recipe has; ``algorithm`` picks the LightningModule."""

    algorithm: str = "grpo"
    module: str | None = None       # dotted path of a subclass of the algorithm's LightningModule to train instead
    model: ModelConf = field(default_factory=ModelConf)
    lora: LoraConf = field(default_factory=LoraConf)
    rollout: RolloutConf = field(default_factory=RolloutConf)
    task: TaskConf = field(default_factory=TaskConf)
    trainer: TrainerConf = field(default_factory=TrainerConf)
    rewards: list[Any] = field(default_factory=list)   # [{_target_: ..., weight: ...}]
    tools: list[Any] = field(default_factory=list)     # TRL's tools: dotted paths of functions (multi-turn rollouts)
    environment_factory: str | None = None   # TRL's: dotted path of a class/callable; one environment per rollout
    tool_call_parser: str | None = None      # dotted path of text -> [{"name", "arguments"}]; null: <tool_call> JSON
    checkpoint: CheckpointConf = field(default_factory=CheckpointConf)
    ckpt_path: str | None = None    # resume from this Lightning checkpoint
    export_dir: str | None = None   # save_pretrained the trained policy here
    logger: dict[str, Any] = field(default_factory=dict)   # Lightning loggers by name ({_target_: ...}), `logger=` group
    seed: int = 0


@dataclass
class GRPORecipe(Recipe):
    algorithm: str = "grpo"
    algo: GRPOConfig = field(default_factory=GRPOConfig)


@dataclass
class PPORecipe(Recipe):
    algorithm: str = "ppo"
    algo: PPOConfig = field(default_factory=PPOConfig)


def register() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="grpo_schema", node=GRPORecipe)
    ConfigStore.instance().store(name="ppo_schema", node=PPORecipe)
