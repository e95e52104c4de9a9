"""The benchmark scripts' own arithmetic, on CPU: what they report must be what the inputs say."""
from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def write_metrics(path: Path, columns: dict[str, list[float]]) -> Path:
    """A ``metrics.csv`` as Lightning's CSVLogger writes it: one row per step, plus a row of other keys."""
    path.parent.mkdir(parents=True)
    names = ["step", "time/step_s", *columns]
    steps = len(next(iter(columns.values())))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, names)
        w.writeheader()
        w.writerow({"step": 0})   # a row without time/step_s: not a step
        for i in range(steps):
            w.writerow({"step": i, "time/step_s": 1.0, **{k: v[i] for k, v in columns.items()}})
    return path


def test_compare_curves_reports_differences_and_the_repeat_yardstick(tmp_path):
    ref, other, repeat = (torch.randn(6).tolist() for _ in range(3))
    runs = [write_metrics(tmp_path / name / "logs" / "metrics.csv", {"train/loss": values})
            for name, values in (("ref", ref), ("other", other), ("repeat", repeat))]
    out = tmp_path / "curves"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compare_curves.py"), "--out", str(out), "--runs",
                    str(runs[0].parent.parent), str(runs[1]), "--repeat", str(runs[2]), "--metrics", "train/loss"],
                   check=True, capture_output=True, cwd=ROOT / "benchmarks")
    (got,) = json.loads((out / "curves_summary.json").read_text())
    diffs = [abs(a - b) for a, b in zip(ref, other)]
    assert got["max_abs_diff"] == max(diffs) and got["at_step"] == diffs.index(max(diffs)) + 1
    assert math.isclose(got["rms_diff"], math.sqrt(sum(d * d for d in diffs) / 6))
    assert got["repeat_max_abs_diff"] == max(abs(a - b) for a, b in zip(ref, repeat))
    assert got["ref_range"] == max(ref) - min(ref)
    rows = json.loads((out / "curves.json").read_text())
    assert [r["loss_other"] for r in rows] == other and [r["loss_repeat"] for r in rows] == repeat
