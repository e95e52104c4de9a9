"""Where one captured decode step spends its time: every kernel of the graph, grouped by name, with its
calls and GPU microseconds per step, against the step's wall time (the difference is launch gaps and
ramp/tail between dependent kernels). `profile_step_sequence.json` keeps one replay's kernels in launch order
with their start and duration, to read a step op by op (run it under SEGKI_PDL=0: under PDL a kernel starts
before its predecessor ends and its time includes the wait). With ``--lora R`` each model's step is profiled
again as a LoRA policy (peft, r = R on every projection, adapters non-zero, the native ``lora_add`` unless
``SEGKI_LORA_OP=0``), on the same machine: the rows' ``weights`` column tells the two apart, so the kernels a LoRA
step adds or gives up are read side by side.

    python benchmarks/profile_step.py --out benchmarks/results/profile [--models 4b 0.8b] [--batch 1] [--lora 16]
"""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import captured_step, step_args, write_results  # noqa: E402
from decode import build  # noqa: E402

REPLAYS = 20


def short(name: str) -> str:
    """A kernel's name without template arguments and parameter lists."""
    name = name.replace("(anonymous namespace)::", "").split("(")[0]
    depth, out = 0, []
    for ch in name:
        depth += ch == "<"
        if depth == 0:
            out.append(ch)
        depth -= ch == ">"
    return "".join(out).replace("void ", "").strip()[:80]


def one_replay(kernels: list, name: str, batch: int) -> list[dict]:
    """The first replay's kernels in launch order: start (us from the first) and duration."""
    per_replay = len(kernels) // REPLAYS
    first = sorted(kernels, key=lambda e: e.time_range.start)[:per_replay]
    t0 = first[0].time_range.start
    return [dict(model=name, batch=batch, i=i, kernel=short(e.name), start_us=round(e.time_range.start - t0, 2),
                 us=round(e.time_range.elapsed_us(), 2)) for i, e in enumerate(first)]


def profile_step(model, name: str, batch: int, weights: str) -> tuple[list[dict], list[dict]]:
    """The kernels of ``model``'s captured decode step at ``batch`` rows by name (calls and GPU us a step, the
    step's wall time, the gaps), and one replay's kernels in launch order; ``weights`` labels the rows."""
    engine, graph = captured_step(model, batch)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    step_us = (time.perf_counter() - t0) / REPLAYS * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for e in kernels:
        per[short(e.name)][0] += 1
        per[short(e.name)][1] += e.time_range.elapsed_us()
    busy = sum(v[1] for v in per.values()) / REPLAYS
    head = dict(model=name, weights=weights, batch=batch)
    rows = [dict(**head, kernel=k, calls_per_step=round(c / REPLAYS, 2), us_per_step=round(t / REPLAYS, 1),
                 pct_of_step=round(100 * t / REPLAYS / step_us, 1))
            for k, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])]
    rows.append(dict(**head, kernel="(step wall time)", calls_per_step=round(len(kernels) / REPLAYS, 1),
                     us_per_step=round(step_us, 1), pct_of_step=100.0))
    rows.append(dict(**head, kernel="(gaps: wall - kernel time)", us_per_step=round(step_us - busy, 1),
                     pct_of_step=round(100 * (step_us - busy) / step_us, 1)))
    sequence = [dict(weights=weights, **e) for e in one_replay(kernels, name, batch)]
    engine.free()
    del engine
    torch.cuda.empty_cache()
    return rows, sequence


def profile_model(name: str, batch: int, lora: int = 0) -> tuple[list[dict], list[dict]]:
    """:func:`profile_step` of model ``name`` with full weights, then (``lora`` > 0) as a LoRA policy of that rank."""
    model = build(name)
    rows, sequence = profile_step(model, name, batch, "full")
    if lora:
        from lora_decode import lora_policy

        from segki_lightning import remove_segment_ki

        remove_segment_ki(model)
        lora_policy(model, lora)
        more_rows, more_sequence = profile_step(model, name, batch, f"LoRA r={lora}")
        rows, sequence = rows + more_rows, sequence + more_sequence
    del model
    torch.cuda.empty_cache()
    return rows, sequence


def main() -> None:
    args = step_args(__doc__, ["4b", "0.8b"], lora=True)
    rows, sequence = [], []
    for name in args.models:
        model_rows, model_sequence = profile_model(name, args.batch, args.lora)
        rows += model_rows
        sequence += model_sequence
        print(json.dumps([r for r in model_rows if r["kernel"].startswith("(")]), flush=True)
    lora = f" --lora {args.lora}" if args.lora else ""
    header = (f"# One captured decode step, kernel by kernel (bf16, batch {args.batch}, {torch.cuda.get_device_name()})"
              f"\n\nCommand: `python benchmarks/profile_step.py --out DIR --models {' '.join(args.models)} "
              f"--batch {args.batch}{lora}`")
    write_results(args.out, "profile_step", rows, ["model", "weights", "batch", "kernel", "calls_per_step",
                                                   "us_per_step", "pct_of_step"], header)
    (args.out / "profile_step_sequence.json").write_text(json.dumps(sequence))
    print((args.out / "profile_step.md").read_text())


if __name__ == "__main__":
    main()
