"""Sample completions for the loggers -- a TensorBoard text table, a W&B table, else a ``completions.jsonl``
beside each logger's files -- and, with TRL's ``log_completions``, a table on the console."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("step", "prompt", "completion", "reward")


def write_completions(loggers: list, rows: list[dict], step: int) -> None:
    """``rows`` (``step``, ``prompt``, ``completion``, ``reward``) to every logger that can hold them."""
    for logger in loggers:
        exp = getattr(logger, "experiment", None)
        if hasattr(logger, "log_table"):   # W&B (TRL's completions table)
            logger.log_table(key="completions", columns=list(COLUMNS),
                             data=[[r["step"], str(r["prompt"]), r["completion"], r["reward"]] for r in rows], step=step)
        elif hasattr(exp, "add_text"):
            table = "\n".join(f"| {r['prompt']} | {r['completion']} | {r['reward']:.2f} |" for r in rows)
            exp.add_text("completions", "| prompt | completion | reward |\n|---|---|---|\n" + table, step)
        elif getattr(logger, "log_dir", None):
            path = Path(logger.log_dir) / "completions.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def completions_table(rows: list[dict], width: int = 60) -> str:
    """``rows`` as a plain-text table for the console (cells cut to ``width`` characters, newlines shown as
    ``\\n``)."""
    def cell(v) -> str:
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[:width - 3] + "..."

    table = [list(COLUMNS)] + [[cell(r[c]) for c in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    fmt = lambda line: " | ".join(v.ljust(w) for v, w in zip(line, widths))   # noqa: E731
    return "\n".join([fmt(table[0]), "-+-".join("-" * w for w in widths), *map(fmt, table[1:])])
