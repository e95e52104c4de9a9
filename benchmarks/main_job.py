"""Evidence for the main job: run ``segki-train --config-name grpo`` (the README's first line, on the
embedded tiny default) and check that the mean ``train/reward`` of the last 10 % of steps exceeds the first
10 % by >= 0.2, within 10 minutes.

    python benchmarks/main_job.py --out benchmarks/results/main_job
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    run_dir = args.out / "run"
    cmd = ["segki-train", "--config-name", "grpo", "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
           *args.overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (args.out).mkdir(parents=True, exist_ok=True)
    (args.out / "train.log").write_text(proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode != 0:
        sys.exit(f"segki-train failed ({proc.returncode}); see {args.out / 'train.log'}")
    rows = list(csv.DictReader((run_dir / "logs" / "metrics.csv").open()))
    rewards = [float(r["train/reward"]) for r in rows if r.get("train/reward")]
    k = max(1, len(rewards) // 10)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    result = dict(command=" ".join(cmd), steps=len(rewards), wall_s=round(wall, 1), first_10pct_reward=round(first, 4),
                  last_10pct_reward=round(last, 4), rise=round(last - first, 4), passed=bool(last - first >= 0.2 and wall <= 600),
                  cpus=os.cpu_count(), machine=platform.machine(), python=platform.python_version())
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    (args.out / "rewards.csv").write_text("step,reward\n" + "\n".join(f"{i},{r}" for i, r in enumerate(rewards)) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
