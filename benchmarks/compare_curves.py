"""Step-by-step curves of two recipe runs (e.g. DDP and FSDP of one case), read from each run's own
``logs/metrics.csv``: writes ``curves.md/json`` (and ``curves_summary.json``) with both values of every metric per
step and a summary that puts their largest and root-mean-square differences beside the reference run's own
step-to-step spread (how much the metric moves between steps anyway). With ``--repeat`` (a second run of the
reference's own configuration) the summary also gives the repeat's differences from the reference: what the
metric varies between two identical runs, the yardstick for "the same curve" when runs are not bit-reproducible.

    python benchmarks/compare_curves.py --out DIR --runs DIR/grpo_ddp4b/runs/RUN DIR/grpo_fsdp4b/runs/RUN \
        [--repeat DIR2/grpo_ddp4b/runs/RUN] [--metrics train/loss train/reward train/grad_norm train/entropy]
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from common import write_results

METRICS = ["train/loss", "train/reward", "train/grad_norm", "train/entropy"]


def read_curves(run: Path, metrics: list[str]) -> dict[str, list[float]]:
    """``metric -> value per step`` of a run folder (or its ``metrics.csv``), over the rows that logged a step."""
    path = run if run.suffix == ".csv" else run / "logs" / "metrics.csv"
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.csv (pass a run folder of grpo_gpu.py's --out/runs, or the file)")
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/step_s")]
    missing = [m for m in metrics if m not in (rows[0] if rows else {})]
    if not rows or missing:
        raise SystemExit(f"{path}: no logged steps" if not rows else f"{path}: no column {missing}")
    return {m: [float(r[m] or "nan") for r in rows] for m in metrics}


def name_of(run: Path) -> str:
    """The run folder's name (``RUN/logs/metrics.csv`` -> ``RUN``; ``DIR/metrics.csv`` -> ``DIR``)."""
    if run.suffix != ".csv":
        return run.name
    return (run.parent.parent if run.parent.name == "logs" else run.parent).name


def differences(ref: list[float], other: list[float]) -> tuple[float, int, float]:
    """``(largest |difference|, its step (1-based), root-mean-square difference)``."""
    diffs = [abs(a - b) for a, b in zip(ref, other)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[worst], worst + 1, math.sqrt(sum(d * d for d in diffs) / len(diffs))


def summary(metric: str, ref: list[float], other: list[float], repeat: list[float] | None) -> dict:
    largest, at, rms = differences(ref, other)
    steps = [abs(b - a) for a, b in zip(ref, ref[1:])]
    out = dict(metric=metric, max_abs_diff=largest, at_step=at, rms_diff=rms,
               max_rel_diff=max(abs(a - b) / abs(a) if a else float("inf") for a, b in zip(ref, other)),
               ref_step_to_step_median=statistics.median(steps) if steps else float("nan"),
               ref_range=max(ref) - min(ref))
    if repeat is not None:
        out["repeat_max_abs_diff"], _, out["repeat_rms_diff"] = differences(ref, repeat)
    return out


def summary_table(sums: list[dict]) -> str:
    rep = "repeat_rms_diff" in sums[0]
    head = "| metric | largest difference | rms difference | largest relative |" + \
        (" repeat's largest | repeat's rms |" if rep else "") + " ref's median change between steps | ref's range |"
    lines = [head, "|" + "---|" * head.count(" |")]
    for s in sums:
        lines.append(f"| {s['metric']} | {s['max_abs_diff']:.3g} (step {s['at_step']}) | {s['rms_diff']:.3g} | "
                     f"{s['max_rel_diff']:.3g} |" + (f" {s['repeat_max_abs_diff']:.3g} | {s['repeat_rms_diff']:.3g} |"
                                                     if rep else "") +
                     f" {s['ref_step_to_step_median']:.3g} | {s['ref_range']:.3g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=Path, nargs=2, required=True, help="two run folders (reference, other)")
    ap.add_argument("--repeat", type=Path, help="a second run of the reference's configuration")
    ap.add_argument("--metrics", nargs="+", default=METRICS)
    args = ap.parse_args()
    runs = [*args.runs, *([args.repeat] if args.repeat else [])]
    names, curves = [name_of(r) for r in runs], [read_curves(r, args.metrics) for r in runs]
    steps = min(len(c[args.metrics[0]]) for c in curves)
    tags = ("ref", "other", "repeat")[:len(runs)]
    rows = [dict(step=i + 1, **{f"{m.split('/')[-1]}_{tag}": c[m][i] for m in args.metrics
                                for tag, c in zip(tags, curves)}) for i in range(steps)]
    sums = [summary(m, *(c[m][:steps] for c in curves[:2]), curves[2][m][:steps] if args.repeat else None)
            for m in args.metrics]
    header = (f"# Per-step curves: ref = {names[0]}, other = {names[1]}"
              + (", repeat = a second run of ref's configuration" if args.repeat else "")
              + f" ({steps} steps)\n\n{summary_table(sums)}")
    write_results(args.out, "curves", rows, list(rows[0]), header)
    (args.out / "curves_summary.json").write_text(json.dumps(sums, indent=1))
    print(header)


if __name__ == "__main__":
    main()
