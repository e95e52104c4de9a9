"""Step-by-step curves of two recipe runs (e.g. DDP and FSDP of one case), read from each run's own
``logs/metrics.csv``: writes ``curves.md/json`` (and ``curves_summary.json``) with both values of every metric per step, their difference, and a
summary that puts the largest difference beside the reference run's own step-to-step spread (how much the metric
moves between steps anyway).

    python benchmarks/compare_curves.py --out DIR --runs DIR/grpo_ddp4b/runs/RUN DIR/grpo_fsdp4b/runs/RUN \
        [--metrics train/loss train/reward train/grad_norm train/entropy]
"""
from __future__ import annotations

import argparse
import csv
import json
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


def summary(metric: str, ref: list[float], other: list[float]) -> dict:
    diffs = [abs(a - b) for a, b in zip(ref, other)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    steps = [abs(b - a) for a, b in zip(ref, ref[1:])]
    return dict(metric=metric, max_abs_diff=diffs[worst], at_step=worst + 1,
                max_rel_diff=max(d / abs(a) if a else float("inf") for d, a in zip(diffs, ref)),
                ref_step_to_step_median=statistics.median(steps) if steps else float("nan"),
                ref_range=max(ref) - min(ref))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=Path, nargs=2, required=True, help="two run folders (reference, other)")
    ap.add_argument("--metrics", nargs="+", default=METRICS)
    args = ap.parse_args()
    (a_name, b_name), (a, b) = [name_of(r) for r in args.runs], [read_curves(r, args.metrics) for r in args.runs]
    steps = min(len(a[args.metrics[0]]), len(b[args.metrics[0]]))
    rows = [dict(step=i + 1, **{f"{m.split('/')[-1]}_{tag}": v[m][i] for m in args.metrics for tag, v in
                                (("ref", a), ("other", b))}) for i in range(steps)]
    sums = [summary(m, a[m][:steps], b[m][:steps]) for m in args.metrics]
    lines = "\n".join(f"| {s['metric']} | {s['max_abs_diff']:.3g} (step {s['at_step']}) | {s['max_rel_diff']:.3g} | "
                      f"{s['ref_step_to_step_median']:.3g} | {s['ref_range']:.3g} |" for s in sums)
    header = (f"# Per-step curves: ref = {a_name}, other = {b_name} ({steps} steps)\n\n"
              "| metric | largest difference | largest relative | ref's median change between steps | ref's range |\n"
              f"|---|---|---|---|---|\n{lines}")
    write_results(args.out, "curves", rows, list(rows[0]), header)
    (args.out / "curves_summary.json").write_text(json.dumps(sums, indent=1))
    print(header)


if __name__ == "__main__":
    main()
