"""LoRA against full-weight GRPO on the embedded tiny model and the synthetic addition task (CPU): the reward curve
of each, from the same seed, so the README can say whether LoRA learns the default task as the full weights do.

    python benchmarks/lora_cpu.py --out DIR --steps 150

Writes ``DIR/lora_cpu.json`` (per-step train/reward of each run, first/last-window means) and ``DIR/lora_cpu.md``."""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

LORA = ["lora.r=8", "lora.lora_alpha=16"]
PROJECTIONS = "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_a,in_proj_b,out_proj,gate_proj,up_proj,down_proj"
RUNS = {"full weights (lr 3e-3)": [],
        "LoRA r=8, alpha 16, all-linear (lr 3e-3)": LORA,
        # the tied embedding / output head, which all-linear leaves out (peft's rule), adapted too
        "LoRA r=8, alpha 16, all-linear + lm_head (lr 3e-3)": [*LORA, f"lora.target_modules=[{PROJECTIONS},lm_head]"]}


def rewards(run_dir: Path, key: str = "train/reward") -> list[float]:
    with open(run_dir / "logs" / "metrics.csv") as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--window", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {}
    for i, (name, extra) in enumerate(RUNS.items()):
        run_dir = args.out / "runs" / f"run{i}"
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "segki_lightning.train", "--config-name", "grpo",
                        f"trainer.max_steps={args.steps}", "trainer.enable_progress_bar=false",
                        "trainer.val_check_interval=1000000", "checkpoint.save_last=false",
                        "checkpoint.every_n_train_steps=1000000", f"hydra.run.dir={run_dir}", *extra],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r, exact = rewards(run_dir), rewards(run_dir, "train/rewards/exact_match")
        result[name] = dict(overrides=extra, wall_s=round(time.perf_counter() - t0, 1), rewards=r,
                            first=round(statistics.mean(r[:args.window]), 3),
                            last=round(statistics.mean(r[-args.window:]), 3),
                            exact_last=round(statistics.mean(exact[-args.window:]), 3))
    (args.out / "lora_cpu.json").write_text(json.dumps(result, indent=1))
    lines = [f"# GRPO on the synthetic addition task, tiny Qwen3.5, CPU, {args.steps} steps", "",
             f"| run | mean reward, first {args.window} steps | last {args.window} steps | exact match, last "
             f"{args.window} | wall s |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {v['first']} | {v['last']} | {v['exact_last']} | {v['wall_s']} |" for n, v in result.items()]
    (args.out / "lora_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
