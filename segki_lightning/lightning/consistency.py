"""RankConsistency: after training, check that the policy weights are bit-identical on every rank."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from .fsdp import whole


CHUNK = 1 << 24   # elements per partial sum: bounds the int64 temporaries (3 x 128 MiB)


def weight_checksum(module: torch.nn.Module) -> torch.Tensor:
    """An int64 checksum of the raw bits of every parameter (equal bits -> equal checksum), computed where the
    parameter lives (a 4B policy's on the CPU took ~50 s); of the whole parameter where it is a shard (FSDP: a
    collective, every rank calls it). Integer sums wrap the same on every device, so the value does not depend
    on where it was computed."""
    total = torch.zeros((), dtype=torch.int64)
    for i, p in enumerate(module.parameters()):
        t = whole(p.detach()).contiguous()
        bits = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).flatten()
        part = torch.zeros((), dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), CHUNK):
            chunk = bits[start:start + CHUNK].to(torch.int64)
            weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=bits.device)
            part += (chunk * (weights % 1_000_003 + i + 1)).sum()
        total += part.cpu()
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
