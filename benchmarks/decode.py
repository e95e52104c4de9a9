"""Decode throughput on Qwen3.5-0.8B / 4B shapes (random bf16 weights): ours (segki + CUDA graph), ours
without segki (graph only), transformers eager ``generate``, transformers ``generate`` with a static cache
+ torch.compile, and the copy-bandwidth roofline -- all measured in one run.

    python benchmarks/decode.py --out benchmarks/results [--models 4b 0.8b] [--batches 1 16 64]
        [--hf-eager-batches 1 16] [--hf-compile-batches 1]

Decode tok/s counts generated tokens of all rows over the decode loop only (prefill excluded for every
system: transformers runs are timed as a full generate minus a 1-token generate).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, qwen35_config, write_results  # noqa: E402

from segki_lightning import RolloutEngine, SamplingConfig, remove_segment_ki  # noqa: E402
from segki_lightning.rollout.stops import StopStrings  # noqa: E402

PROMPT, NEW = 128, 256


def build(name: str):
    from transformers import Qwen3_5ForCausalLM

    cfg = qwen35_config(name, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()


def weight_bytes(model) -> int:
    """Bytes a decode step must read: every weight once (the tied embedding once, as lm_head)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


MODES = {"greedy": dict(temperature=0.0), "sample T=1": dict(temperature=1.0),
         # TRL's sampler knobs: min-p and the penalty inside the captured step (ops.process_logits), stop strings
         # as the host's check every 16 steps (rollout/stops.py)
         "sample T=1 min_p=0.05 rep=1.1": dict(temperature=1.0, min_p=0.05, repetition_penalty=1.1),
         "sample T=1 stop strings": dict(temperature=1.0)}
STOPS = {"sample T=1 stop strings": ["</answer>", "\n\nQuestion:"]}


def word_tokenizer(vocab: int):
    """A fast tokenizer of ``vocab`` whole-word tokens ("t0", "t1", ...) for the stop-string rows: random ids never
    spell a stop string, so every row runs its full length and the rows measure the check's own cost (a gather of
    each running row's last tokens, one copy to the host, a batched decode)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)},
                                                                               unk_token="t0")))


def ours(model, batch: int, sampling: dict, use_segki: bool, stops: list[str] | None = None) -> dict:
    engine = RolloutEngine(model, max_batch_size=max(batch, 1), max_seq_len=PROMPT + NEW + 8,
                           use_segki=use_segki, graph_capture=True, eos_token_id=[])
    g = torch.Generator().manual_seed(batch)
    # one 128-token prompt sampled `batch` times: one prefill, `batch` independent decode rows
    prompts = [torch.randint(10, 1000, (PROMPT,), generator=g).tolist()]
    cfg = SamplingConfig(max_new_tokens=NEW, n=batch, seed=0, **sampling)
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingConfig(max_new_tokens=8, n=batch, **sampling))  # capture
    warm = time.perf_counter() - t0
    stop = StopStrings(word_tokenizer(engine.vocab_size), stops) if stops else None
    runs = [engine.generate(prompts, cfg, stop=stop).stats for _ in range(2)]
    s = min(runs, key=lambda r: r.decode_s)
    out = dict(decode_tok_s=round(batch * s.steps / s.decode_s, 1), step_ms=round(s.decode_s / s.steps * 1e3, 3),
               prefill_s=round(s.prefill_s, 3), capture_s=round(engine.capture_s + engine.prefiller.capture_s, 2),
               warmup_s=round(warm, 2), path=s.path)
    engine.free()
    return out


def hf(model, batch: int, compile_static: bool, new: int = NEW) -> dict:
    ids = torch.randint(10, 1000, (batch, PROMPT), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if compile_static:
        kw["cache_implementation"] = "static"
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=16, min_new_tokens=16, **kw)
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    full, one = run(new), run(1)
    return dict(decode_tok_s=round(batch * (new - 1) / (full - one), 1),
                step_ms=round((full - one) / (new - 1) * 1e3, 3), warmup_s=round(warm, 1), new_tokens=new)


def plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, len({r["model"] for r in rows}), figsize=(11, 4), squeeze=False)
    for ax, model in zip(axes[0], sorted({r["model"] for r in rows})):
        for system in sorted({r["system"] for r in rows if r["model"] == model}):
            pts = sorted((r["batch"], r["decode_tok_s"]) for r in rows if r["model"] == model
                         and r["system"] == system and r.get("decode_tok_s") and r["mode"] == "greedy")
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set(title=f"Qwen3.5-{model} decode (greedy, bf16, H200)", xlabel="batch", ylabel="tok/s",
               xscale="log", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["0.8b", "4b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 32, 64])
    ap.add_argument("--hf-eager-batches", nargs="*", type=int, default=[1, 16])
    ap.add_argument("--hf-eager-tokens", type=int, default=128, help="new tokens for the (slow) eager baseline")
    ap.add_argument("--hf-compile-batches", nargs="*", type=int, default=[1])
    ap.add_argument("--skip-ours", action="store_true", help="only the transformers baselines and the roofline")
    ap.add_argument("--no-graph-only", action="store_true", help="leave out the 'graph only' rows (the plain "
                    "forward captured): halves the time of our rows")
    ap.add_argument("--processors", action="store_true", help="add rows sampled with min_p and repetition_penalty, "
                    "and with stop strings, beside the plain sampler's")
    args = ap.parse_args()
    modes = list(MODES) if args.processors else list(MODES)[:2]
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    bw = copy_bandwidth_gbps()
    rows: list[dict] = []

    def add(**r):
        rows.append(r)
        print(json.dumps(r), flush=True)
        (args.out / "decode.json").write_text(json.dumps(rows, indent=1))

    for name in args.models:
        model = build(name)
        wb = weight_bytes(model)
        roof = bw * 1e9 / wb
        add(model=name, system="roofline (weights once / copy BW)", batch=1, mode="-", decode_tok_s=round(roof, 1),
            weight_gb=round(wb / 1e9, 3), copy_gbps=round(bw, 1))
        for batch in args.batches:
            for mode in modes:
                for segki in () if args.skip_ours else (True,) if args.no_graph_only else (True, False):
                    system = "ours: segki + graph" if segki else "ours: graph only"
                    if not segki:
                        remove_segment_ki(model)  # graph only: the model's plain forward
                    # a run stopped from outside still shows where it was (the first row of a fresh machine also
                    # compiles the Triton prefill kernels)
                    print(f"[{time.perf_counter() - started:.0f} s] {name} b={batch} {mode} {system}", flush=True)
                    try:
                        r = ours(model, batch, MODES[mode], segki, STOPS.get(mode))
                    except Exception as exc:  # keep measuring the rest; the row says what failed
                        r = dict(error=f"{type(exc).__name__}: {exc}"[:300])
                    add(model=name, system=system, batch=batch, mode=mode, **r,
                        pct_roofline=round(100 * r.get("decode_tok_s", 0) / batch / roof, 1))
        remove_segment_ki(model)
        for batch in args.hf_eager_batches:
            add(model=name, system="HF eager generate", batch=batch, mode="greedy",
                **hf(model, batch, False, args.hf_eager_tokens))
        for batch in args.hf_compile_batches:
            try:
                r = hf(model, batch, True)
            except Exception as exc:
                r = dict(error=f"{type(exc).__name__}: {exc}"[:300])
            add(model=name, system="HF static cache + compile", batch=batch, mode="greedy", **r)
        del model
        torch.cuda.empty_cache()
    cols = ["model", "system", "batch", "mode", "decode_tok_s", "step_ms", "pct_roofline", "prefill_s", "capture_s",
            "warmup_s", "path", "error"]
    header = (f"# Decode throughput (bf16, prompt {PROMPT}, {NEW} new tokens, {torch.cuda.get_device_name()}, "
              f"copy bandwidth {bw:.0f} GB/s)\n\nCommand: `python benchmarks/decode.py {' '.join(sys.argv[1:])}`")
    write_results(args.out, "decode", rows, cols, header)
    plot(rows, args.out)
    print("\n".join(open(args.out / "decode.md").read().splitlines()[4:]))


if __name__ == "__main__":
    main()
