"""ResumableCSVLogger: Lightning's CSVLogger, but a run resumed into the same folder appends to ``metrics.csv``
instead of deleting it. The first metrics the resumed run logs (at the step after its checkpoint) drop the rows
the interrupted run had logged from that step on, so every step appears once."""
from __future__ import annotations

import csv
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from typing_extensions import override


class _AppendingWriter(ExperimentWriter):
    """Keeps an existing ``metrics.csv``; trims it once, at the first logged step."""

    def __init__(self, log_dir: str) -> None:
        self._trimmed = False
        super().__init__(log_dir)

    @override
    def _check_log_dir_exists(self) -> None:
        """Unlike Lightning's writer, nothing is deleted: the earlier rows stay."""
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = sorted(csv.DictReader(f).fieldnames or [])

    @override
    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        if not self._trimmed and step is not None:
            self._trimmed = True
            self._drop_rows_from(step)
        super().log_metrics(metrics_dict, step)

    def _drop_rows_from(self, step: int) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            reader = csv.DictReader(f)
            keys, rows = reader.fieldnames or [], list(reader)
        kept = [r for r in rows if not r.get("step") or int(float(r["step"])) < step]
        if len(kept) != len(rows):
            with self._fs.open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=keys)
                writer.writeheader()
                writer.writerows(kept)


class ResumableCSVLogger(CSVLogger):
    """:class:`~lightning.pytorch.loggers.CSVLogger` whose ``metrics.csv`` survives a resume into the same folder
    (see the module docstring).

    Example:
        >>> trainer = Trainer(logger=ResumableCSVLogger("runs", name="logs", version=""))
    """

    @property
    @rank_zero_experiment
    @override
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
