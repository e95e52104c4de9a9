"""Step-by-step loss and reward of two runs of ``grpo_gpu.py`` (e.g. DDP and FSDP of one case): writes
``curves.md/json`` with both curves and their largest differences.

    python benchmarks/compare_curves.py --out DIR --runs DIR/grpo_ddp/grpo_gpu.json DIR/grpo_fsdp/grpo_gpu.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import write_results


def curves(path: Path) -> dict:
    """The first successful run in a ``grpo_gpu.json``."""
    runs = [r for r in json.loads(path.read_text()) if "loss_curve" in r]
    if not runs:
        raise SystemExit(f"{path}: no finished run with a loss curve")
    return runs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=Path, nargs=2, required=True, help="two grpo_gpu.json files: reference, other")
    args = ap.parse_args()
    a, b = (curves(p) for p in args.runs)
    steps = min(len(a["loss_curve"]), len(b["loss_curve"]))
    rows = [dict(step=i + 1, **{f"loss_{r['run']}": r["loss_curve"][i] for r in (a, b)},
                 loss_diff=abs(a["loss_curve"][i] - b["loss_curve"][i]),
                 **{f"reward_{r['run']}": r["reward_curve"][i] for r in (a, b)},
                 reward_diff=abs(a["reward_curve"][i] - b["reward_curve"][i])) for i in range(steps)]
    worst = max(rows, key=lambda r: r["loss_diff"])
    header = (f"# Loss and reward per step: {a['run']} vs {b['run']}\n\n"
              f"Largest loss difference {worst['loss_diff']:.3g} (step {worst['step']}), largest reward difference "
              f"{max(r['reward_diff'] for r in rows):.3g}, over {steps} steps.")
    write_results(args.out, "curves", rows, list(rows[0]), header)
    print((args.out / "curves.md").read_text())


if __name__ == "__main__":
    main()
