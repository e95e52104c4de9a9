"""The GRPO recipe on GPUs with Qwen3.5-shaped policies (random bf16 weights, written with ``save_pretrained`` and
loaded back through ``model=pretrained``), G=8 completions per prompt: per run the step time, its rollout share,
rollout and training tokens/s, model FLOPs utilisation of the training part and peak GPU memory, for each
case, setting of the two switches and number of GPUs (DDP). Each run is
``python -m segki_lightning.train --config-name grpo ...`` in its own process.

    python benchmarks/grpo_gpu.py --out DIR --cases 0.8b:4x256 0.8b:16x1024:mb32 4b:8x512:mb16 [--runs segki off]
    python benchmarks/grpo_gpu.py --out DIR --cases 0.8b:4x256 --runs segki --devices 1 2
    python benchmarks/grpo_gpu.py --out DIR --cases 4b:8x512:mb32:ckpt --runs segki --devices 2 --strategy fsdp
    python benchmarks/grpo_gpu.py --out DIR --cases 0.8b:4x256 --runs segki --overrides algo.num_iterations=2
    python benchmarks/grpo_gpu.py --out DIR --cases 0.8b:4x256 --runs segki --overrides algo.num_iterations=2 \
        'rewards=[bench_rewards.even_token_fraction]' algo.reward_weights=null algo.learning_rate=1e-5

A case is ``SHAPE:PROMPTSxTOKENS[:mbROWS][:tokN][:ckpt][:mixed][:pad]``: prompts per step and rank (x8
completions), completion tokens, ``algo.micro_batch_size``, ``algo.micro_batch_tokens=N``,
``model.gradient_checkpointing=true``, completions cut at lengths drawn between 10 % and 100 % of the maximum
(``module=bench_modules.MixedLengthGRPO``: random weights never stop by themselves) and ``algo.padding_free=false``
(rows padded instead of packed). ``segki`` is
``rollout.use_segki=true rollout.graph_capture=true``; ``off`` is both false (the model's plain forward,
eager). The first ``--warm`` steps (extension load, graph capture) are left out of the medians. ``mfu_train``
counts ``6 x parameters x trained tokens`` (prompt + completion) over the step time minus the rollout, per GPU,
against 989 TFLOP/s (dense bf16); ``mfu`` the run's own ``time/train_tflops`` (model FLOPs on real tokens with the
attention and Gated-DeltaNet products counted, ``segki_lightning/rl/flops.py``) against the same peak. The step's
parts: ``update_s`` (micro-batches' forward and backward, optimizer step), in parts: ``forward_s`` (the forwards and
losses), ``optimizer_s`` (the gradient norm, clipping and step), ``backward_s`` (the rest); ``old_logprob_s``,
``reference_s``; ``*_by_step`` keep every step's value, the warm ones too.
"""
from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import qwen35_config, write_results  # noqa: E402

from segki_lightning.ops import train_fused  # noqa: E402
from segki_lightning.rollout import RolloutStats  # noqa: E402

SWITCHES = {"segki": "true", "off": "false"}
PEAK_FLOPS = 989e12
PROMPT_TOKENS = 4   # the synthetic task's "a+b="
# time/<part>_s of the training part; the update's forward, backward and optimizer parts add up to it
STEP_PARTS = ("update", "forward", "backward", "optimizer", "old_logprob", "reference")


@dataclass(frozen=True)
class Case:
    shape: str
    prompts: int
    tokens: int
    micro_batch: int | None = None
    checkpointing: bool = False
    micro_tokens: int | None = None
    mixed: bool = False
    padded: bool = False

    @classmethod
    def parse(cls, text: str) -> "Case":
        shape, size, *opts = text.split(":")
        prompts, tokens = (int(x) for x in size.split("x"))
        mb = next((int(o[2:]) for o in opts if o.startswith("mb")), None)
        tok = next((int(o[3:]) for o in opts if o.startswith("tok")), None)
        return cls(shape, prompts, tokens, mb, "ckpt" in opts, tok, "mixed" in opts, "pad" in opts)

    @property
    def name(self) -> str:
        return f"{self.shape}_{self.prompts}x{self.tokens}" + (f"_mb{self.micro_batch}" if self.micro_batch else "") + \
            (f"_tok{self.micro_tokens}" if self.micro_tokens else "") + ("_ckpt" if self.checkpointing else "") + \
            ("_mixed" if self.mixed else "") + ("_pad" if self.padded else "")


def write_checkpoint(shape: str, folder: Path) -> tuple[int, str]:
    """A random Qwen3.5-shaped policy with the synthetic task's character tokenizer; returns its parameter count
    and the GPU's name. Run it through :func:`in_own_process`: a CUDA context in this process would stay on the card
    (~0.6 GiB) beside every measured run, which a user's run does not have."""
    from transformers import Qwen3_5ForCausalLM

    from segki_lightning.rl.task import char_tokenizer

    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = qwen35_config(shape, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    with torch.device("cuda"):   # initialising billions of parameters on the CPU takes minutes
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return params, torch.cuda.get_device_name()


def build_extension() -> None:
    """The native extension built (or found in its cache) before any run is timed: otherwise a fresh machine's first
    segki run pays its JIT build (~2 minutes) inside its first step. Run it through :func:`in_own_process`."""
    from segki_lightning.ops.build import load

    load()


def in_own_process(fn, *args):
    """``fn(*args)`` in a fresh (spawned) Python process that exits afterwards, with its GPU memory and context."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def run_recipe(ckpt: Path, run_dir: Path, case: Case, mode: str, devices: int, args) -> tuple[int, float, str]:
    """Run the recipe in its own process; its command line and output go to ``args.out/<run>.log``."""
    on = SWITCHES[mode]
    here = str(Path(__file__).resolve().parent)   # so that overrides may name bench_rewards' functions
    stacks = run_dir.parent / f"{run_dir.name}.stacks.jsonl"
    python = ([sys.executable, f"{here}/stack_sampler.py", "--out", str(stacks), "--all-threads"] if args.stacks
              else [sys.executable])
    cmd = [*python, "-m", "segki_lightning.train", "--config-name", "grpo", "model=pretrained",
           f"model.pretrained={ckpt}", "trainer=gpu", f"trainer.devices={devices}",
           f"trainer.strategy={args.strategy if devices > 1 or args.strategy == 'fsdp' else 'auto'}", f"trainer.max_steps={args.steps[mode]}",
           "trainer.enable_progress_bar=false", "algo.num_generations=8", f"algo.max_completion_length={case.tokens}",
           "algo.learning_rate=1e-6", f"task.prompts_per_step={case.prompts}",
           f"rollout.max_batch_size={8 * case.prompts}", f"rollout.max_seq_len={case.tokens + PROMPT_TOKENS + 60}",
           f"rollout.use_segki={on}", f"rollout.graph_capture={on}", "checkpoint.save_last=false",
           "checkpoint.every_n_train_steps=100000", f"hydra.run.dir={run_dir}"]
    if case.micro_batch:
        cmd.append(f"algo.micro_batch_size={case.micro_batch}")
    if case.checkpointing:
        cmd.append("model.gradient_checkpointing=true")
    if case.micro_tokens:
        cmd.append(f"algo.micro_batch_tokens={case.micro_tokens}")
    if case.mixed:
        cmd.append("module=bench_modules.MixedLengthGRPO")
    if case.padded:
        cmd.append("algo.padding_free=false")
    cmd.extend(args.overrides)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
           "HYDRA_FULL_ERROR": "1"}   # the whole traceback in the run's log
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = args.out / f"{run_dir.name}.log"   # written as the run goes: a run stopped from outside leaves it
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=run_dir.parent, env=env)
    for path in (log, run_dir / "train.log"):
        drop_tips(path)
    return proc.returncode, time.perf_counter() - t0, log.read_text()[-20000:]


def drop_tips(path: Path) -> None:
    """Remove Lightning's install suggestions (lines starting with its tip marker) from a written log: they name
    packages and sites, not anything measured."""
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(ln for ln in lines if not ln.lstrip().startswith("\N{ELECTRIC LIGHT BULB}")))


def last_error(output: str) -> str:
    """The last line of ``output`` that raises an exception (``[rankN]: SomeError: ...``), else its last line."""
    lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
    raised = [ln for ln in lines if re.match(r"(\[rank\d+\]:\s*)?[\w.]+(Error|Exception|Interrupt)\b:?", ln)]
    return (raised or lines or [""])[-1][:300]


def per_rollout(rows: list[dict]) -> list[tuple[float, float]]:
    """(step time, rollout time) per step, averaged over each rollout and the steps that reuse it
    (``num_iterations``: only the first of them rolls out), one pair per rollout."""
    groups: list[list[float]] = []
    for r in rows:
        step, rollout = float(r["time/step_s"]), float(r["time/rollout_s"])
        if rollout > 0 or not groups:
            groups.append([0.0, 0.0, 0])
        groups[-1][0] += step
        groups[-1][1] += rollout
        groups[-1][2] += 1
    return [(s / n, r / n) for s, r, n in groups]


def summarize(run_dir: Path, warm: int, params: int, devices: int) -> dict:
    """Over the steps after the first ``warm``: the median step and rollout time per step (over rollouts, each
    with the steps that reuse it; the rollout share is their ratio), so one slow step (a collection, a flush)
    does not move the share, and the slowest step beside them; medians of the throughputs (summed over the
    ``devices`` ranks; MFU is per GPU)."""
    with open(run_dir / "logs" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("time/step_s")]
    keep = rows[warm:] or rows

    def med(key: str) -> float:  # over the steps that logged the key (some only on the steps that roll out)
        got = [float(r[key]) for r in keep if r.get(key)]
        return statistics.median(got) if got else float("nan")

    pairs = per_rollout(keep)
    step, rollout = statistics.median(s for s, _ in pairs), statistics.median(r for _, r in pairs)
    train_tok_s = med("time/train_tokens_per_s")
    out = dict(steps=len(rows), steps_measured=len(keep), step_s=round(step, 3), rollout_s=round(rollout, 3),
               slowest_step_s=round(max(float(r["time/step_s"]) for r in keep), 3),
               **{f"{part}_s": round(med(f"time/rollout_{part}_s"), 4) for part in RolloutStats.PARTS},
               train_s=round(step - rollout, 3), rollout_share=round(rollout / step, 3),
               **{f"{part}_s": round(med(f"time/{part}_s"), 3) for part in STEP_PARTS},
               mfu=round(med("time/train_tflops") * 1e12 / PEAK_FLOPS, 3),
               rollout_tok_s=round(med("rollout/tokens_per_s"), 1), train_tok_s=round(train_tok_s, 1),
               mfu_train=round(6 * params * train_tok_s / devices / PEAK_FLOPS, 3),
               peak_gib=round(max(float(r.get("memory/peak_gib") or "nan") for r in rows), 1),
               completion_len=round(med("train/completion_length"), 1),
               clip_ratio_max=round(max(float(r.get("train/clip_ratio") or 0) for r in rows), 4),
               logprob_diff_mean=round(med("rollout/logprob_diff_mean"), 4),
               logprob_diff_max=round(max(float(r.get("rollout/logprob_diff_max") or 0) for r in rows), 3),
               kl_sampler_trainer=round(med("rollout/kl_sampler_trainer"), 5),
               gc_s=round(med("time/gc_s"), 3),
               first_step_s=round(float(rows[0]["time/step_s"]), 2))   # per-step curves: compare_curves.py
    for key, name in (("time/step_s", "step_s"), ("time/update_s", "update_s"), ("time/forward_s", "forward_s"),
                      ("time/backward_s", "backward_s"), ("time/optimizer_s", "optimizer_s"),
                      ("time/gc_s", "gc_s"), ("memory/device_allocs", "device_allocs"),
                      ("memory/alloc_retries", "alloc_retries"),
                      ("train/completion_length", "completion_len")):   # every step, the warm ones too
        out[f"{name}_by_step"] = [round(float(r[key]), 3) if r.get(key) else None for r in rows]
    check = list(run_dir.rglob("rank_consistency.json"))
    if check:
        c = json.loads(check[0].read_text())
        out.update(world_size=c["world_size"], weights_identical=c["identical"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", nargs="+", type=Case.parse, default=[Case.parse("0.8b:4x256")])
    ap.add_argument("--runs", nargs="+", choices=list(SWITCHES), default=["segki", "off"])
    ap.add_argument("--devices", nargs="+", type=int, default=[1])
    ap.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp", help="for several devices (fsdp: also for one)")
    ap.add_argument("--segki-steps", type=int, default=10)
    ap.add_argument("--off-steps", type=int, default=4)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--stacks", action="store_true", help="sample each run's thread stacks (stack_sampler.py "
                    "--all-threads: the main thread's, and the autograd engine's during a backward) into "
                    "runs/<run>.stacks.jsonl; one GPU per run")
    ap.add_argument("--overrides", nargs="*", default=[], help="extra Hydra overrides for every run, e.g. "
                    "algo.num_iterations=2")
    args = ap.parse_args()
    args.steps = {"segki": args.segki_steps, "off": args.off_steps}
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rows: list[dict] = []
    if "segki" in args.runs:
        in_own_process(build_extension)
    with tempfile.TemporaryDirectory() as tmp:
        params: dict[str, int] = {}
        for case in args.cases:
            ckpt = Path(tmp) / f"qwen35-{case.shape}-shape"
            if case.shape not in params:
                params[case.shape], device = in_own_process(write_checkpoint, case.shape, ckpt)
            for devices in args.devices:
                for mode in args.runs:
                    name = f"{mode}_{devices}gpu" + ("_fsdp" if args.strategy == "fsdp" else "") + f"_{case.name}"
                    run_dir = args.out / "runs" / name   # the run's own logs/metrics.csv, also when it is stopped
                    rc, wall, err = run_recipe(ckpt, run_dir, case, mode, devices, args)
                    r = dict(run=name, case=case.name, mode=mode, devices=devices, rows_per_rank=8 * case.prompts,
                             tokens=case.tokens, micro_batch=case.micro_batch or 8 * case.prompts,
                             params_b=round(params[case.shape] / 1e9, 2), returncode=rc, wall_s=round(wall, 1),
                             device=device,
                             train_fused=train_fused.enabled(),
                             **({"overrides": " ".join(args.overrides)} if args.overrides else {}))
                    if rc == 0:
                        r.update(summarize(run_dir, min(args.warm, args.steps[mode] - 1), params[case.shape], devices))
                    else:
                        r["error"] = last_error(err) or f"exit {rc}"
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    compare(rows)
    import importlib.util

    fla = "installed" if importlib.util.find_spec("fla") else "not installed (chunked torch GDN prefill/training)"
    cmd = " ".join(sys.argv[1:]).replace(str(args.out), "DIR")
    header = (f"# GRPO recipe, Qwen3.5 shapes (random bf16), G=8, {rows[0]['device'] if rows else ''}, "
              f"flash-linear-attention {fla}\n\nCommand: `python benchmarks/grpo_gpu.py {cmd}`. Over the steps "
              f"after the first {args.warm}: median times per step (per rollout and the steps reusing it), median "
              "tokens/s (summed over ranks); mfu_train is the training part's per GPU (6 x parameters x trained "
              "tokens / (step - rollout time) / GPUs / 989 TFLOP/s), mfu the run's time/train_tflops (model FLOPs on "
              "real tokens, attention and Gated-DeltaNet products counted) / 989 TFLOP/s; update_s, old_logprob_s and "
              "reference_s are the step's training passes (forward_s, backward_s and optimizer_s add up to "
              "update_s); peak GiB is the largest per-step peak of allocated GPU memory.")
    cols = ["run", "rows_per_rank", "tokens", "micro_batch", "steps", "peak_gib", "step_s", "slowest_step_s",
            "rollout_s", *(f"{part}_s" for part in RolloutStats.PARTS), "train_s",
            *(f"{part}_s" for part in STEP_PARTS), "rollout_share", "rollout_tok_s", "train_tok_s", "mfu_train", "mfu",
            "tok_s_vs_off", "tok_s_vs_1gpu",
            "weights_identical", "first_step_s", "completion_len", "clip_ratio_max", "logprob_diff_mean",
            "logprob_diff_max", "kl_sampler_trainer", "error"]
    write_results(args.out, "grpo_gpu", rows, cols, header)
    print((args.out / "grpo_gpu.md").read_text())


def compare(rows: list[dict]) -> None:
    """Rollout tokens/s relative to the switches-off run of the same case, and to one GPU."""
    ok = [r for r in rows if "rollout_tok_s" in r]
    off = {(r["case"], r["devices"]): r for r in ok if r["mode"] == "off"}
    one = {(r["case"], r["mode"]): r for r in ok if r["devices"] == 1}
    for r in ok:
        if r["mode"] == "segki" and (r["case"], r["devices"]) in off:
            r["tok_s_vs_off"] = round(r["rollout_tok_s"] / off[(r["case"], r["devices"])]["rollout_tok_s"], 1)
        if r["devices"] > 1 and (r["case"], r["mode"]) in one:
            r["tok_s_vs_1gpu"] = round(r["rollout_tok_s"] / one[(r["case"], r["mode"])]["rollout_tok_s"], 2)


if __name__ == "__main__":
    main()
