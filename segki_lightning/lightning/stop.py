"""GracefulStop: SIGTERM and SIGINT end a fit with a checkpoint of the last finished step and a non-zero exit.

A scheduler's SIGTERM (pre-emption, a job's time limit) or a first Ctrl+C lets the current optimizer step finish;
right after it (``on_train_batch_end``, where ``ModelCheckpoint`` saves too, so the resume is exact) the callback
writes ``<dirpath>/last.ckpt`` and raises :class:`TrainingInterrupted`, which ``segki-train`` turns into a line
saying where the checkpoint is and exit status 128 + the signal (143 for SIGTERM, 130 for SIGINT). A second
signal abandons the step at once (KeyboardInterrupt, Lightning's own shutdown). Under several processes the
ranks agree at each step's end (one small collective) and save together. SLURM's requeue signal stays with
Lightning's ``SLURMEnvironment(auto_requeue=True)``, which saves its own checkpoint.

An exception (a reward function that raises, an out-of-memory error) also leaves ``last.ckpt``, holding the last
FINISHED step: when the step that raised had not reached its optimizer step, the prompt loader is rewound by
that step's batch, so the resume runs it again (one process, ``accumulate_grad_batches=1``; elsewhere a line
says why nothing is written, and the periodic checkpoints remain). A failure INSIDE an optimizer step -- after the
step's forward and backward, while the optimizer moves weights and its state one tensor or bucket at a time (an
out-of-memory error as AdamW allocates its moments) -- writes nothing either: some weights may already have moved,
so that checkpoint would be neither the last finished step nor the next one; a line says so.
"""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class TrainingInterrupted(SystemExit):
    """A fit stopped by a signal after its last finished step was checkpointed (``code`` is 128 + the signal)."""

    def __init__(self, signum: int, step: int, path: str):
        super().__init__(128 + signum)
        self.signum, self.step, self.path = signum, step, path

    def __str__(self) -> str:
        return (f"segki: stopped by {signal.Signals(self.signum).name} after step {self.step}; its checkpoint is "
                f"{self.path} (resume with ckpt_path={self.path})")


class GracefulStop(Checkpoint):
    """Checkpoint the last finished step and stop when SIGTERM or SIGINT arrives (see the module docstring).

    Args:
        dirpath: folder of the checkpoint (``last.ckpt`` there).
        signals: the signals to handle.

    Example:
        >>> trainer = Trainer(callbacks=[ModelCheckpoint(dirpath="ckpt"), GracefulStop("ckpt")])
    """

    def __init__(self, dirpath: str | Path, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        super().__init__()
        self.dirpath = Path(dirpath)
        self.signals = tuple(signals)
        self._received: int | None = None
        self._previous: dict[int, Any] = {}
        self._step_at_batch_start: int | None = None
        self._moving = False   # an optimizer is moving weights: its closure returned, its step has not
        self._hooks: list[Any] = []

    @property
    def ckpt_path(self) -> Path:
        return self.dirpath / "last.ckpt"

    def _handle(self, signum: int, frame: Any) -> None:
        if self._received is not None:   # the second one: do not wait for the step
            self._restore()
            raise KeyboardInterrupt
        self._received = signum
        rank_zero_info(f"segki: {signal.Signals(signum).name} received: finishing this step, then checkpointing "
                       "(send it again to stop at once)")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Install the handlers (Lightning installs its own SIGTERM notifier before this; ours replaces it for the
        fit, and ``teardown`` puts back whatever was there) and watch the optimizers' steps."""
        self._received = None
        for opt in trainer.optimizers:
            self._hooks += [opt.register_step_pre_hook(self._before_step), opt.register_step_post_hook(self._after_step)]
        if threading.current_thread() is not threading.main_thread():
            return   # signal handlers can only be set from the main thread
        for s in self.signals:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)

    def _before_step(self, optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The weights start moving once the step's closure (Lightning's: forward, backward, the
        ``on_before_optimizer_step`` hooks, clipping) has returned, or at once for a step without one."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)   # args: (optimizer, *step's args)
        if closure is None:
            self._moving = True
            return None

        def closure_then_move() -> Any:
            loss = closure()
            self._moving = True
            return loss

        return args[:1], {**kwargs, "closure": closure_then_move}

    def _after_step(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        self._moving = False

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        self._moving = False

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Checkpoint the last finished step when a fit fails (see the module docstring)."""
        if isinstance(exception, TrainingInterrupted) or self._step_at_batch_start is None:
            return   # already saved by a signal, or no step started
        if trainer.world_size > 1 or trainer.accumulate_grad_batches > 1:
            rank_zero_info("segki: no checkpoint of the failed run (written for one process and "
                           "accumulate_grad_batches=1 only); the periodic checkpoints remain")
            return
        if self._moving:
            rank_zero_info(f"segki: no checkpoint of the failed run: it failed inside step {trainer.global_step}'s "
                           "optimizer step, after some weights or optimizer state may have moved; the periodic "
                           "checkpoints remain")
            return
        if trainer.global_step == self._step_at_batch_start:   # the failing batch did not step: hand it out again
            loader = trainer.train_dataloader
            if not hasattr(loader, "unyield"):
                rank_zero_info("segki: no checkpoint of the failed run: its prompt loader cannot hand the failed "
                               "step's batch out again (use segki_lightning.rl.loader.ResumableLoader)")
                return
            loader.unyield()
        trainer.save_checkpoint(str(self.ckpt_path))
        rank_zero_info(f"segki: {type(exception).__name__} after step {trainer.global_step}; that step's checkpoint "
                       f"is {self.ckpt_path} (resume with ckpt_path={self.ckpt_path})")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        received = self._received is not None
        if trainer.world_size > 1:
            received = trainer.strategy.reduce_boolean_decision(received, all=False)
        if not received:
            return
        signum = self._received or signal.SIGTERM   # a rank that got none stops with the one another rank got
        keeper = trainer.checkpoint_callback
        if isinstance(keeper, ModelCheckpoint) and keeper.save_last and Path(keeper.dirpath or "") == self.dirpath:
            keeper.last_model_path = str(self.ckpt_path)   # its own "last": a resume then keeps writing it
        trainer.save_checkpoint(str(self.ckpt_path))
        raise TrainingInterrupted(int(signum), trainer.global_step, str(self.ckpt_path))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            if handler is not None:
                signal.signal(s, handler)
        self._previous = {}
