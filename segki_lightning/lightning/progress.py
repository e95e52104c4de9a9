"""StepProgressBar: training progress in optimizer steps of ``max_steps``."""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar counts the batches of an epoch (and reads "Epoch 0/-2" when a run is bounded by
    ``max_steps``); an RL run is bounded by optimizer steps, so this one shows ``step n/max_steps`` across epochs.
    Runs bounded by epochs get Lightning's bar unchanged.

    Example:
        >>> Trainer(max_steps=200, callbacks=[StepProgressBar()])
    """

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if trainer.max_steps > 0:
            bar = self.train_progress_bar
            bar.total, bar.n = trainer.max_steps, trainer.global_step
            bar.set_description("step")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        if bar is not None and (trainer.global_step % max(self.refresh_rate, 1) == 0
                                or trainer.global_step >= trainer.max_steps):
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()
