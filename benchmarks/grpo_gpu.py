"""The GRPO recipe on GPUs with a Qwen3.5-0.8B-shaped policy (random bf16 weights, written with
``save_pretrained`` and loaded back through ``model=pretrained``), G=8 completions of 256 tokens: step time,
its rollout/train split and rollout tokens/s, for each requested setting of the two switches and number of
GPUs (DDP). Each run is ``python -m segki_lightning.train --config-name grpo ...`` in its own process.

    python benchmarks/grpo_gpu.py --out benchmarks/results/grpo_gpu [--runs segki off] [--devices 1] [--prompts 4 8]
    python benchmarks/grpo_gpu.py --out benchmarks/results/grpo_ddp --runs segki --devices 1 2

``segki`` is ``rollout.use_segki=true rollout.graph_capture=true``; ``off`` is both false (the model's plain
forward, eager). The first ``--warm`` steps (extension load, graph capture) are left out of the medians.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import qwen35_config, write_results  # noqa: E402

SWITCHES = {"segki": "true", "off": "false"}


def write_checkpoint(folder: Path) -> None:
    """A random Qwen3.5-0.8B-shaped policy with the synthetic task's character tokenizer."""
    from transformers import Qwen3_5ForCausalLM

    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = qwen35_config("0.8b", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)


def run_recipe(ckpt: Path, run_dir: Path, mode: str, devices: int, prompts: int, args) -> tuple[int, float, str]:
    """Run the recipe in its own process; its command line and output go to ``args.out/<run>.log``."""
    on = SWITCHES[mode]
    cmd = [sys.executable, "-m", "segki_lightning.train", "--config-name", "grpo", "model=pretrained",
           f"model.pretrained={ckpt}", "trainer=gpu", f"trainer.devices={devices}",
           f"trainer.strategy={'ddp' if devices > 1 else 'auto'}", f"trainer.max_steps={args.steps[mode]}",
           "trainer.enable_progress_bar=false", "algo.num_generations=8", "algo.max_completion_length=256",
           f"task.prompts_per_step={prompts}", f"rollout.max_batch_size={8 * prompts}",
           "rollout.max_seq_len=320", f"rollout.use_segki={on}", f"rollout.graph_capture={on}",
           "checkpoint.save_last=false", "checkpoint.every_n_train_steps=100000", f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=run_dir.parent)
    log = " ".join(cmd) + "\n\n" + proc.stdout + proc.stderr
    (args.out / f"{run_dir.name}.log").write_text(log[-200_000:])
    return proc.returncode, time.perf_counter() - t0, proc.stderr[-2000:]


def summarize(run_dir: Path, warm: int) -> dict:
    """Medians over the steps after the first ``warm`` of the metrics the recipe logs every step."""
    with open(run_dir / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/step_s")]
    keep = rows[warm:] or rows

    def med(key: str) -> float:
        return statistics.median(float(r[key]) for r in keep)

    step, rollout = med("time/step_s"), med("time/rollout_s")
    out = dict(steps_measured=len(keep), step_s=round(step, 3), rollout_s=round(rollout, 3),
               train_s=round(step - rollout, 3), rollout_share=round(med("rollout/time_share"), 3),
               rollout_tok_s=round(med("rollout/tokens_per_s"), 1), completion_len=round(med("train/completion_length"), 1),
               first_step_s=round(float(rows[0]["time/step_s"]), 2))
    check = list(run_dir.rglob("rank_consistency.json"))
    if check:
        c = json.loads(check[0].read_text())
        out.update(world_size=c["world_size"], weights_identical=c["identical"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", nargs="+", choices=list(SWITCHES), default=["segki", "off"])
    ap.add_argument("--devices", nargs="+", type=int, default=[1])
    ap.add_argument("--prompts", nargs="+", type=int, default=[4], help="prompts per step and rank (x8 completions)")
    ap.add_argument("--segki-steps", type=int, default=10)
    ap.add_argument("--off-steps", type=int, default=4)
    ap.add_argument("--warm", type=int, default=2)
    args = ap.parse_args()
    args.steps = {"segki": args.segki_steps, "off": args.off_steps}
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "qwen35-0.8b-shape"
        write_checkpoint(ckpt)
        for prompts in args.prompts:
            for devices in args.devices:
                for mode in args.runs:
                    name = f"{mode}_{devices}gpu_{prompts}p"
                    run_dir = Path(tmp) / name
                    rc, wall, err = run_recipe(ckpt, run_dir, mode, devices, prompts, args)
                    r = dict(run=name, mode=mode, devices=devices, rows_per_rank=8 * prompts, returncode=rc,
                             wall_s=round(wall, 1))
                    if rc == 0:
                        r.update(summarize(run_dir, min(args.warm, args.steps[mode] - 1)))
                    else:
                        r["error"] = err
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    base = {(r["devices"], r["rows_per_rank"]): r for r in rows if r["mode"] == "off" and "rollout_tok_s" in r}
    one_gpu = {(r["mode"], r["rows_per_rank"]): r for r in rows if r["devices"] == 1 and "rollout_tok_s" in r}
    for r in rows:
        if "rollout_tok_s" not in r:
            continue
        if r["mode"] == "segki" and (r["devices"], r["rows_per_rank"]) in base:
            r["tok_s_vs_off"] = round(r["rollout_tok_s"] / base[(r["devices"], r["rows_per_rank"])]["rollout_tok_s"], 1)
        if r["devices"] > 1 and (r["mode"], r["rows_per_rank"]) in one_gpu:
            r["tok_s_vs_1gpu"] = round(r["rollout_tok_s"] / one_gpu[(r["mode"], r["rows_per_rank"])]["rollout_tok_s"], 2)
    import importlib.util

    fla = "installed" if importlib.util.find_spec("fla") else "not installed (chunked torch GDN prefill/training)"
    header = (f"# GRPO recipe, Qwen3.5-0.8B shape (random bf16), G=8, 256-token completions, "
              f"{'/'.join(map(str, args.prompts))} prompts per step and rank, {torch.cuda.get_device_name()}, "
              f"flash-linear-attention "
              f"{fla}\n\nCommand: "
              f"`python benchmarks/grpo_gpu.py --out DIR --runs {' '.join(args.runs)} --devices "
              f"{' '.join(map(str, args.devices))} --prompts {' '.join(map(str, args.prompts))}`. Medians over the "
              f"steps after the first {args.warm}; rollout tokens/s is summed over ranks.")
    cols = ["run", "devices", "rows_per_rank", "step_s", "rollout_s", "train_s", "rollout_share", "rollout_tok_s",
            "tok_s_vs_off", "tok_s_vs_1gpu", "weights_identical", "first_step_s", "completion_len", "error"]
    write_results(args.out, "grpo_gpu", rows, cols, header)
    print((args.out / "grpo_gpu.md").read_text())


if __name__ == "__main__":
    main()
