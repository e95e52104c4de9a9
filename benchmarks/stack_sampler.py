"""A sampling profiler of a Python process's threads, for stalls that no recompile or autotuning log explains.

Run a module under it: every ``--every`` seconds the main thread's stack is written as one JSON line (the time
and the innermost frames first). A wait on the GPU shows as the call that synchronizes; a gap between two
samples longer than the interval means something held the interpreter lock.

    python benchmarks/stack_sampler.py --out stacks.jsonl -m segki_lightning.train --config-name grpo ...
    python benchmarks/stack_sampler.py --summary stacks.jsonl --split-at rollout_and_score

The summary cuts the samples into segments where a run of samples inside ``--split-at`` begins (one GRPO step
each: its rollout, then its training; segment 0 is the start-up before it), and prints each segment's length
and, for the longest one after the start-up, the stacks seen most often outside the split function against their
count in the median segment. ``--parts backward,step_loss,optimizer_step`` splits each segment's time outside the
split function by the first of those functions its stack holds; ``--inside step_loss --warm 3`` lists the
innermost frames seen inside one function over the segments after the first ``--warm`` steps:

    python benchmarks/stack_sampler.py --summary run.stacks.jsonl --parts backward,step_loss --inside step_loss

A backward's host work runs on the autograd engine's own thread while the main thread waits in ``backward``:
record with ``--all-threads`` (every thread's stack while it runs Python code) and ``--others`` summarizes those
stacks, e.g. the recomputed checkpointed forwards against the custom functions' backwards.
"""
from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
import threading
import time


def frames(frame, depth: int) -> list[str]:
    """``file:function:line`` of ``frame`` and its callers, innermost first, at most ``depth``."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return out


def sample(path: str, every: float, depth: int, main_id: int, stop: threading.Event, others: bool = False) -> None:
    """Every ``every`` seconds one line: the main thread's stack, and with ``others`` the stacks of the other
    threads running Python code then (the autograd engine's thread runs a backward's Python: recomputed checkpointed
    forwards, custom functions' backwards), innermost frames first."""
    t0, me = time.perf_counter(), threading.get_ident()
    with open(path, "w") as f:
        while not stop.wait(every):
            now = sys._current_frames()
            line = {"t": round(time.perf_counter() - t0, 4), "stack": frames(now.get(main_id), depth)}
            if others:
                line["others"] = [frames(fr, depth) for tid, fr in now.items() if tid not in (main_id, me)]
            f.write(json.dumps(line) + "\n")


def run(args, rest: list[str]) -> None:
    stop = threading.Event()
    thread = threading.Thread(target=sample, args=(args.out, args.every, args.depth, threading.get_ident(), stop,
                                                   args.all_threads), daemon=True)
    thread.start()
    sys.argv = [args.module, *rest]
    try:
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
    finally:
        stop.set()
        thread.join()


def segments(samples: list[dict], split_at: str) -> list[list[dict]]:
    """Samples cut where a run of samples with ``split_at`` in the stack begins; the first segment holds those
    before the first such run (it may be empty)."""
    out: list[list[dict]] = [[]]
    inside = False
    for s in samples:
        now = any(f":{split_at}:" in fr for fr in s["stack"])
        if now and not inside:
            out.append([])
        out[-1].append(s)
        inside = now
    return out


def summary(args, segs: list[list[dict]]) -> None:
    spans = [seg[-1]["t"] - seg[0]["t"] if seg else 0.0 for seg in segs]
    for i, (seg, span) in enumerate(zip(segs, spans)):
        gap = max((b["t"] - a["t"] for a, b in zip(seg, seg[1:])), default=0.0)
        start = f"from t={seg[0]['t']:.2f}" if seg else "(empty)"
        print(f"segment {i}: {span:7.3f} s {start}, {len(seg)} samples, longest gap {gap:.3f} s")

    def counts(seg):
        return collections.Counter(" <- ".join(s["stack"][:args.show]) for s in seg
                                   if not any(f":{args.split_at}:" in fr for fr in s["stack"]))
    steps = range(1, len(segs)) if len(segs) > 1 else range(len(segs))   # segment 0: start-up, before any split
    slow = max(steps, key=spans.__getitem__)
    usual = sorted(steps, key=spans.__getitem__)[len(steps) // 2]
    c_slow, c_usual = counts(segs[slow]), counts(segs[usual])
    print(f"\nlongest segment {slow} ({spans[slow]:.3f} s) against the median segment {usual} ({spans[usual]:.3f} s): "
          f"samples outside {args.split_at}")
    for stack, n in c_slow.most_common(args.top):
        print(f"{n:5d} {c_usual.get(stack, 0):5d}  {stack}")


def parts(args, segs: list[list[dict]]) -> None:
    """Each segment's seconds outside the split function by the first of ``--parts`` in a sample's stack (the
    sampling interval's worth a sample), then the innermost frames inside ``--inside`` after ``--warm`` steps."""
    names = args.parts.split(",") if args.parts else []
    print(f"\nseconds outside {args.split_at} per segment, by the first of {names} in the stack:")
    inner = collections.Counter()
    for i, seg in enumerate(segs):
        got = collections.Counter()
        for s in seg:
            funcs = {f.split(":")[1] for f in s["stack"] if f.count(":") >= 2}
            if args.split_at in funcs:
                continue
            got[next((n for n in names if n in funcs), "other")] += args.every
            if args.inside and args.inside in funcs and i > args.warm:
                inner[s["stack"][0].rsplit(":", 1)[0]] += 1
        print(f"segment {i}: " + ", ".join(f"{n} {got[n]:.2f}" for n in [*names, "other"]))
    if args.inside:
        print(f"\ninnermost frames inside {args.inside}, segments after {args.warm} (samples):")
        for frame, n in inner.most_common(args.top):
            print(f"{n:5d}  {frame}")


def other_threads(args, segs: list[list[dict]]) -> None:
    """The other threads' stacks (recorded with ``--all-threads``) over the segments after ``--warm``: how many
    samples found one in Python code, and the innermost ``--show`` frames seen most often."""
    seen, stacks = 0, collections.Counter()
    for seg in segs[args.warm + 1:]:
        for s in seg:
            for other in s.get("others", []):
                if other:
                    seen += 1
                    stacks[" <- ".join(other[:args.show])] += 1
    print(f"\nother threads in Python code, segments after {args.warm}: {seen} stacks in "
          f"{sum(len(seg) for seg in segs[args.warm + 1:])} samples")
    for stack, n in stacks.most_common(args.top):
        print(f"{n:5d}  {stack}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where to write the samples (JSON lines)")
    ap.add_argument("-m", dest="module", help="the module to run, as python -m does; its arguments follow")
    ap.add_argument("--every", type=float, default=0.02, help="seconds between samples")
    ap.add_argument("--depth", type=int, default=400, help="frames kept per sample")
    ap.add_argument("--summary", help="samples to summarize instead of running anything")
    ap.add_argument("--split-at", default="rollout_and_score")
    ap.add_argument("--show", type=int, default=8, help="innermost frames per stack in the summary")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--parts", help="comma-separated function names: each segment's time by the first one held")
    ap.add_argument("--inside", help="a function: the innermost frames of the samples inside it")
    ap.add_argument("--warm", type=int, default=0,
                    help="segments (after the start-up) --inside and --others leave out")
    ap.add_argument("--all-threads", action="store_true",
                    help="also record the other threads' stacks (the autograd engine's, a backward's Python)")
    ap.add_argument("--others", action="store_true", help="summarize the other threads' recorded stacks")
    args, rest = ap.parse_known_args()
    if args.summary:
        segs = segments([json.loads(line) for line in open(args.summary)], args.split_at)
        summary(args, segs)
        if args.parts or args.inside:
            parts(args, segs)
        if args.others:
            other_threads(args, segs)
    elif args.module and args.out:
        run(args, rest)
    else:
        ap.error("give --out and -m MODULE [args], or --summary FILE")


if __name__ == "__main__":
    main()
