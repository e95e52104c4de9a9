"""Gated-DeltaNet chunk rule for training, forward + backward of one layer at the Qwen3.5 shapes, per
implementation: transformers' torch rule (what trained before), the training path (flash-linear-attention's fused
kernels; on Hopper with Triton < 3.7.1 with segki's torch dq/dk/dw/dg for the one kernel fla refuses), and -- to
price that replacement -- fla's own Triton kernel for it forced past fla's guard (measurement only: fla refuses it
because Triton miscompiles it at 64-wide key blocks; the Qwen3.5 shapes use 128-wide ones). Each variant's outputs
and gradients are compared with the torch rule's (relative norm error), its time is the median of CUDA-event timed
repeats and its peak the extra memory of one forward + backward.

    python benchmarks/gdn_train.py --out DIR [--shapes 0.8b 4b] [--rows 8] [--length 1028]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

SHAPES = {"0.8b": (16, 16), "4b": (16, 32)}   # (key heads, value heads); head dims 128


def inputs(rows: int, length: int, hk: int, hv: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device="cuda", generator=gen)   # noqa: E731
    q, k, v = rand(rows, length, hk, 128), rand(rows, length, hk, 128), rand(rows, length, hv, 128)
    g = -torch.nn.functional.softplus(rand(rows, length, hv)) * 0.5
    beta = torch.sigmoid(rand(rows, length, hv))
    return [q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16()]


def run(fn, xs: list[torch.Tensor], dout: torch.Tensor):
    xs = [x.detach().requires_grad_(True) for x in xs]
    out = fn(*xs)
    out.backward(dout)
    return out.detach(), [x.grad for x in xs]


def timed(fn, xs, dout, repeats: int) -> tuple[float, float]:
    """(median ms of forward + backward, peak extra GiB)."""
    run(fn, xs, dout)   # warm-up: autotuning, compilation
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(fn, xs, dout)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--length", type=int, default=1028)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import fla.ops.common.chunk_o as chunk_o

    from segki_lightning.ops import varlen
    from segki_lightning.ops.gdn_chunk import training_path
    from segki_lightning.ops.reference import gdn_chunked

    path = training_path()

    variants = {"torch_rule": gdn_chunked, "training_path": varlen.gdn_chunk}
    rows = []
    for shape in args.shapes:
        hk, hv = SHAPES[shape]
        xs = inputs(args.rows, args.length, hk, hv)
        dout = torch.randn(args.rows, args.length, hv, 128, device="cuda").bfloat16()
        want_out, want_grads = run(lambda *t: gdn_chunked(*(x.float() for x in t)), xs, dout.float())
        for name, fn in variants.items():
            out, grads = run(fn, xs, dout)
            ms, gib = timed(fn, xs, dout, args.repeats)
            errs = {"out": rel(out, want_out), **{f"d{n}": rel(a, b) for n, a, b in zip("qkvgb", grads, want_grads)}}
            r = dict(shape=shape, variant=name, rows=args.rows, length=args.length, ms=round(ms, 3),
                     tokens_per_ms=round(args.rows * args.length / ms, 1), peak_extra_gib=round(gib, 3),
                     max_rel_err=round(max(errs.values()), 5), **{k: round(v, 5) for k, v in errs.items()})
            rows.append(r)
            print(json.dumps(r), flush=True)
        # the replaced kernel alone: segki's torch dq/dk/dw/dg against fla's Triton one (guard lifted)
        rows.extend(dqkwg_alone(shape, xs, chunk_o, args.repeats))
    header = (f"# Gated-DeltaNet chunk rule, forward + backward of one layer, {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}, training path: {path}\n")
    lines = [header, "| shape | variant | rows x length | ms | tokens/ms | peak extra GiB | max rel err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['variant']} | {r.get('rows', '')} x {r.get('length', '')} | {r['ms']} | "
                     f"{r.get('tokens_per_ms', '')} | {r.get('peak_extra_gib', '')} | {r.get('max_rel_err', '')} |")
    (args.out / "gdn_train.md").write_text("\n".join(lines) + "\n")
    (args.out / "gdn_train.json").write_text(json.dumps(dict(path=path, rows=rows), indent=1))
    print("\n".join(lines))


def dqkwg_alone(shape: str, xs, chunk_o, repeats: int) -> list[dict]:
    """Time segki's torch dq/dk/dw/dg and fla's Triton kernel on the inputs fla's backward gives them."""
    import inspect

    from fla.modules.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd

    from segki_lightning.ops.gdn_chunk import chunk_bwd_dqkwg

    q, k, v, g, beta = xs
    q, k = l2norm_fwd(q)[0], l2norm_fwd(k)[0]
    scale = q.shape[-1] ** -0.5
    gc, _, _, _, _, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, False)
    nt = -(-q.shape[1] // 64)
    hv = v.shape[2]
    h = torch.randn(q.shape[0], nt, hv, 128, 128, device="cuda").bfloat16()
    dh = torch.randn_like(h)
    w, do, dv = torch.randn_like(q.repeat_interleave(hv // q.shape[2], 2)), torch.randn_like(v), torch.randn_like(v)
    kw = dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=gc, dv=dv, scale=scale)
    out = []
    saved = chunk_o.TRITON_ABOVE_3_7_1
    chunk_o.TRITON_ABOVE_3_7_1 = True
    try:
        triton_fn = inspect.unwrap(chunk_o.chunk_bwd_dqkwg)   # fla's default (Triton) function, past its dispatch
        fns = {"dqkwg_segki_torch": lambda: chunk_bwd_dqkwg(**kw),
               "dqkwg_fla_triton_unguarded": lambda: triton_fn(**kw)}
        results = {}
        for name, fn in fns.items():
            results[name] = fn()
            fn()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            out.append(dict(shape=shape, variant=name, ms=round(statistics.median(times), 3)))
        if len(results) == 2:
            mine, theirs = results.values()
            out[-1]["max_rel_err"] = round(max(rel(a, b) for a, b in zip(mine, theirs) if a is not None), 5)
    finally:
        chunk_o.TRITON_ABOVE_3_7_1 = saved
    for r in out:
        print(json.dumps(r), flush=True)
    return out


if __name__ == "__main__":
    main()
