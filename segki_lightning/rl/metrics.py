"""Sample completions for the loggers: a TensorBoard text table where a TensorBoard logger is present, else a
``completions.jsonl`` beside each logger's files."""
from __future__ import annotations

import json
from pathlib import Path


def write_completions(loggers: list, rows: list[dict], step: int) -> None:
    """``rows`` (``step``, ``prompt``, ``completion``, ``reward``) to every logger that can hold them."""
    for logger in loggers:
        exp = getattr(logger, "experiment", None)
        if hasattr(exp, "add_text"):
            table = "\n".join(f"| {r['prompt']} | {r['completion']} | {r['reward']:.2f} |" for r in rows)
            exp.add_text("completions", "| prompt | completion | reward |\n|---|---|---|\n" + table, step)
        elif getattr(logger, "log_dir", None):
            path = Path(logger.log_dir) / "completions.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
