"""RankConsistency: after training, check that the policy weights are bit-identical on every rank."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from .fsdp import whole


def weight_checksum(module: torch.nn.Module) -> torch.Tensor:
    """An int64 checksum of the raw bits of every parameter (equal bits -> equal checksum); of the whole
    parameter where it is a shard (FSDP: a collective, every rank calls it)."""
    total = torch.zeros((), dtype=torch.int64)
    for i, p in enumerate(module.parameters()):
        t = whole(p.detach()).contiguous().cpu()
        bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        bits = bits.flatten().to(torch.int64)
        weights = torch.arange(bits.numel(), dtype=torch.int64) % 1_000_003 + i + 1
        total += (bits * weights).sum()
    return total


class RankConsistency(pl.Callback):
    """Gathers a weight checksum of ``pl_module.<policy_attr>`` from every rank at the end of training;
    rank zero reports it and writes ``rank_consistency.json`` into the trainer's log folder."""

    def __init__(self, policy_attr: str = "policy"):
        self.policy_attr = policy_attr
        self.identical: bool | None = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = weight_checksum(getattr(pl_module, self.policy_attr)).to(pl_module.device)
        gathered = trainer.strategy.all_gather(local).reshape(-1).tolist()
        self.identical = len(set(gathered)) == 1
        folder = Path(trainer.log_dir or trainer.default_root_dir)  # a collective: every rank asks
        if trainer.is_global_zero:
            rank_zero_info(f"segki: policy weights identical on all {len(gathered)} ranks: {self.identical}")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "rank_consistency.json").write_text(json.dumps(
                {"world_size": trainer.world_size, "checksums": gathered, "identical": self.identical}))
