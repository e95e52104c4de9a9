"""Sample completions for the loggers -- a TensorBoard text table, a W&B table, else a ``completions.jsonl``
beside each logger's files -- and, with TRL's ``log_completions``, a table on the console."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ("step", "prompt", "completion", "reward")


def columns_of(rows: list[dict]) -> list[str]:
    """The table's columns: ``COLUMNS``, then those the reward functions added (TRL's ``log_extra``)."""
    return list(COLUMNS) + [k for k in (rows[0] if rows else {}) if k not in COLUMNS]


def write_completions(loggers: list, rows: list[dict], step: int) -> None:
    """``rows`` (``step``, ``prompt``, ``completion``, ``reward`` and any added columns) to every logger that can
    hold them."""
    cols = columns_of(rows)
    for logger in loggers:
        exp = getattr(logger, "experiment", None)
        if hasattr(logger, "log_table"):   # W&B (TRL's completions table)
            logger.log_table(key="completions", columns=cols,
                             data=[[str(r["prompt"]) if c == "prompt" else r.get(c) for c in cols] for r in rows],
                             step=step)
        elif hasattr(exp, "add_text"):
            shown = cols[1:]   # the step is the text's own
            fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)   # noqa: E731
            table = "\n".join("| " + " | ".join(fmt(r.get(c)) for c in shown) + " |" for r in rows)
            exp.add_text("completions", "| " + " | ".join(shown) + " |\n|" + "---|" * len(shown) + "\n" + table, step)
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

    cols = columns_of(rows)
    table = [cols] + [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    fmt = lambda line: " | ".join(v.ljust(w) for v, w in zip(line, widths))   # noqa: E731
    return "\n".join([fmt(table[0]), "-+-".join("-" * w for w in widths), *map(fmt, table[1:])])
