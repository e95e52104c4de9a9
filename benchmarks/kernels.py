"""Per-kernel decode benchmark on the real Qwen3.5-4B and 0.8B shapes: native segki op vs the PyTorch
composition it replaces (cuBLAS + elementwise), both timed as CUDA-graph replays in the same run, with
achieved GB/s over the bytes each op must move and % of the measured copy bandwidth. Past a multi-weight
projection's native rows, a "packed" row times what the library runs there instead (one cuBLAS product over
the packed weights).

    python benchmarks/kernels.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbps, graph_time_us, write_results  # noqa: E402

from segki_lightning import ops  # noqa: E402
from segki_lightning.ops import reference as R  # noqa: E402
from segki_lightning.ops.dispatch import native_rows  # noqa: E402
from segki_lightning.ops.extension import native_ops  # noqa: E402

DT = torch.bfloat16
# GEMV family | norm, prologue, GDN, sampling | decode attention | a step's attention in one launch and in three
GROUPS = ("proj", "small", "attention", "step")
L2_BYTES = 60e6
MODELS = {  # hidden, intermediate, (Hk, Hv, Dk, Dv), (Hq, Hkv, D), vocab
    "4b": (2560, 9216, (16, 32, 128, 128), (16, 4, 256), 248320),
    "0.8b": (1024, 3584, (16, 16, 128, 128), (8, 2, 256), 248320),
}


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def rand(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def copies_for(nb: int) -> int:
    return max(1, min(8, int(3 * L2_BYTES // max(nb, 1)) + 1))


def proj_cases(model):
    h, inter, (hk, hv, dk, dv), (hq, hkv, d), vocab = MODELS[model]
    gdn_qkv = 2 * hk * dk + hv * dv
    return {
        "gate_up (gated_mlp_front)": (h, [inter, inter]),
        "gdn_in_proj": (h, [gdn_qkv, hv * dv, hv, hv]),
        "qkv_proj": (h, [2 * hq * d, hkv * d, hkv * d]),
        "o_proj (linear)": (hq * d, [h]),
        "gdn out_proj (linear)": (hv * dv, [h]),
        "down_proj (linear)": (inter, [h]),
        "lm_head (linear)": (h, [vocab]),
    }


def bench_projection(model, name, k, ns, batch, bw):
    x = rand(batch, k)
    sets = [[rand(n, k, scale=k**-0.5) for n in ns] for _ in range(copies_for(sum(n * k * 2 for n in ns)))]
    if len(ns) == 2:
        native = [lambda w=w: torch.ops.segki.gated_mlp_front(x, *w) for w in sets]
        torch_ = [lambda w=w: R.gated_mlp_front(x, *w) for w in sets]
        out_bytes = batch * ns[0] * 2
    elif len(ns) == 1:
        native = [lambda w=w: torch.ops.segki.linear(x, w[0], None) for w in sets]
        torch_ = [lambda w=w: R.linear(x, w[0]) for w in sets]
        out_bytes = batch * ns[0] * 2
    else:
        op = torch.ops.segki.qkv_proj if len(ns) == 3 else torch.ops.segki.gdn_in_proj
        ref = R.qkv_proj if len(ns) == 3 else R.gdn_in_proj
        extra = (None, None, None) if len(ns) == 3 else ()
        native = [lambda w=w: op(x, *w, *extra) for w in sets]
        torch_ = [lambda w=w: ref(x, *w) for w in sets]
        out_bytes = batch * sum(ns) * 2
    moved = nbytes(x, *sets[0]) + out_bytes
    return row(model, name, batch, moved, graph_time_us(native), graph_time_us(torch_), bw)


def row(model, name, batch, moved, us_native, us_torch, bw, **extra):
    gbps = moved / us_native / 1e3
    return dict(model=model, kernel=name, batch=batch, mbytes=round(moved / 1e6, 3), us=round(us_native, 2),
                gbps=round(gbps, 1), pct_copy=round(100 * gbps / bw, 1), torch_us=round(us_torch, 2),
                speedup=round(us_torch / us_native, 2), **extra)


def bench_norm(model, batch, bw):
    h = MODELS[model][0]
    x, res, w = rand(batch, h), rand(batch, h), rand(h, scale=0.3)
    moved = nbytes(x, res, w) + 2 * nbytes(x)
    return row(model, "add_rms_norm (1+w)", batch, moved,
               graph_time_us([lambda: torch.ops.segki.add_rms_norm(x, res, w, 1e-6, True)]),
               graph_time_us([lambda: R.add_rms_norm(x, res, w, 1e-6, True)]), bw)


def bench_attention(model, batch, valid, cache, bw):
    _, _, _, (hq, hkv, d), _ = MODELS[model]
    q = rand(batch, hq, d)
    k, v = rand(batch, hkv, cache, d), rand(batch, hkv, cache, d)
    lengths = torch.full((batch,), valid, device="cuda", dtype=torch.int32)
    moved = batch * 2 * valid * hkv * d * 2 + nbytes(q) * 2
    return row(model, f"decode_attention {valid / 1024:g}k valid / {cache / 1024:g}k cache", batch, moved,
               graph_time_us([lambda: torch.ops.segki.decode_attention(q, k, v, lengths, d**-0.5)]),
               graph_time_us([lambda: R.decode_attention(q, k, v, lengths, d**-0.5)], calls=8), bw)


def bench_attention_prologue(model, batch, bw):
    """q/k norm + partial RoPE + cache write of one attention layer (Qwen3.5: gated, R = D / 4) against the
    torch composition the model's attention code runs for the same step."""
    _, _, _, (hq, hkv, d), _ = MODELS[model]
    r, s = d // 4, 4096
    q, k, v = rand(batch, 2 * hq * d), rand(batch, hkv * d), rand(batch, hkv * d)
    cos, sin, qw, kw = rand(batch, r), rand(batch, r), rand(d, scale=0.3), rand(d, scale=0.3)
    kc, vc = rand(batch, hkv, s, d), rand(batch, hkv, s, d)
    pos = torch.randint(0, s, (batch,), device="cuda")
    a = (q, k, v, cos, sin, qw, kw, kc, vc, pos, 1e-6, True, True)
    moved = nbytes(q, k, v) + 2 * nbytes(k) + batch * hq * d * 2
    return row(model, "attention_prologue (q/k norm, RoPE, cache write)", batch, moved,
               graph_time_us([lambda: torch.ops.segki.attention_prologue(*a)]),
               graph_time_us([lambda: R.attention_prologue(*a)]), bw)


@contextmanager
def kernel_switch(name: str, value: str):
    """The kernel switch set while the block runs (the native ops read it at each call, so a graph captured inside
    takes that path), then restored."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def bench_attention_step(model, batch, valid, cache, bw):
    """One decode step's attention from the projections (prologue, attention, output gate; Qwen3.5: gated,
    R = D / 4) at ``valid`` positions of a ``cache``-position cache: as one launch (``us``, forced where the size rule
    would not take it) and as three (``split_us``), to find the valid length where one launch stops paying."""
    _, _, _, (hq, hkv, d), _ = MODELS[model]
    r = d // 4
    q, k, v = rand(batch, 2 * hq * d), rand(batch, hkv * d), rand(batch, hkv * d)
    cos, sin, qw, kw = rand(batch, r), rand(batch, r), rand(d, scale=0.3), rand(d, scale=0.3)
    kc, vc = rand(batch, hkv, cache, d), rand(batch, hkv, cache, d)
    lengths = torch.full((batch,), valid, device="cuda", dtype=torch.int32)
    a = (q, k, v, cos, sin, qw, kw, kc, vc, lengths.long() - 1, lengths, 1e-6, True, True, d**-0.5)
    moved = batch * 2 * valid * hkv * d * 2 + nbytes(q, k, v) + batch * hq * d * 2
    us = {}
    for path in ("fused", "split"):
        with kernel_switch("SEGKI_ATTN_STEP", path):
            us[path] = graph_time_us([lambda: torch.ops.segki.decode_attention_step(*a)])
    return row(model, f"decode_attention_step {valid} valid / {cache} cache", batch, moved, us["fused"],
               graph_time_us([lambda: R.decode_attention_step(*a)], calls=8), bw, split_us=round(us["split"], 2))


# the multi-weight projections: dispatch entry point, reference, op name (for the native row limit)
PACKED = {2: (ops.gated_mlp_front, R.gated_mlp_front, "gated_mlp_front"),
          3: (ops.qkv_proj, R.qkv_proj, "qkv_proj"), 4: (ops.gdn_in_proj, R.gdn_in_proj, "gdn_in_proj")}


def beyond_native_rows(k, ns, batch) -> bool:
    """Whether ``batch`` rows of this multi-weight projection leave the native kernel (meta weights: no memory)."""
    op = PACKED[len(ns)][2]
    return batch > native_rows(op, *(torch.empty(n, k, dtype=DT, device="meta") for n in ns))


def bench_packed(model, name, k, ns, batch, bw):
    """Past the native rows, what dispatch runs on weights packed as the rollout engine packs them (one cuBLAS
    product over the group, then the SiLU-mul for gate|up) vs the reference composition (one product per weight)."""
    fn, ref, _ = PACKED[len(ns)]
    x = rand(batch, k)
    sets = [list(rand(sum(ns), k, scale=k**-0.5).split(ns)) for _ in range(copies_for(sum(ns) * k * 2))]
    out_bytes = batch * (ns[0] if len(ns) == 2 else sum(ns)) * 2
    moved = nbytes(x, *sets[0]) + out_bytes
    with torch.no_grad():
        return row(model, f"{name.split(' ')[0]} (packed: one cuBLAS product)", batch, moved,
                   graph_time_us([lambda w=w: fn(x, *w) for w in sets]),
                   graph_time_us([lambda w=w: ref(x, *w) for w in sets]), bw)


def bench_gdn(model, batch, bw):
    h, _, (hk, hv, dk, dv), _, _ = MODELS[model]
    c = 2 * hk * dk + hv * dv
    args = [rand(batch, c), rand(batch, hv * dv), rand(batch, hv), rand(batch, hv), rand(batch, c, 4),
            rand(c, 4, scale=0.5), None, torch.randn(batch, hv, dk, dv, device="cuda") * 0.1,
            rand(hv, scale=0.5), rand(hv, scale=0.5), rand(dv)]
    tail = (1e-6, hk, dk, dv)
    moved = nbytes(*args) + nbytes(args[7]) + nbytes(args[4]) + batch * hv * dv * 2  # states read + written
    return row(model, "gdn_decode_step", batch, moved,
               graph_time_us([lambda: torch.ops.segki.gdn_decode_step(*args, *tail)]),
               graph_time_us([lambda: R.gdn_decode_step(*args, *tail)], calls=8), bw)


def bench_sampling(model, batch, temperature, bw):
    vocab = MODELS[model][4]
    logits = rand(batch, vocab, scale=3.0)
    a = (torch.full((batch,), temperature, device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda"),
         torch.ones(batch, device="cuda"), torch.arange(batch, device="cuda"),
         torch.zeros(batch, dtype=torch.long, device="cuda"))
    name = "sample_tokens greedy" if temperature == 0 else f"sample_tokens T={temperature}"
    return row(model, name, batch, nbytes(logits),
               graph_time_us([lambda: torch.ops.segki.sample_tokens(logits, *a)]),
               graph_time_us([lambda: R.sample_tokens(logits, *a)], calls=4), bw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for kernels.json / kernels.md")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 32])
    ap.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS),
                    help="kernel groups to measure (default: all)")
    ap.add_argument("--attn-valid", nargs="+", type=int, default=None,
                    help="decode attention (at each of --batches) at these valid lengths in a cache of "
                         "--attn-cache positions (default: 8k and 32k valid in 8k and 32k caches, and 512 valid in "
                         "a 32k cache; the step group: 128 and 392 valid in a 392-position cache, 1k, 2k and 4k "
                         "valid in caches of their size)")
    ap.add_argument("--attn-cache", type=int, default=32768, help="cache positions for --attn-valid")
    args = ap.parse_args()
    if args.attn_valid and not all(0 <= n <= args.attn_cache for n in args.attn_valid):
        ap.error(f"--attn-valid {args.attn_valid}: each length must fit the cache (0-{args.attn_cache})")
    if native_ops() is None:
        sys.exit("the segki extension is not available on this machine")
    bw = copy_bandwidth_gbps()
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    rows = []
    on = set(args.only)
    for model in args.models:
        for batch in args.batches:
            if "proj" in on:
                for name, (k, ns) in proj_cases(model).items():
                    rows.append(bench_projection(model, name, k, ns, batch, bw))
                    print(rows[-1], flush=True)
                    if len(ns) > 1 and beyond_native_rows(k, ns, batch):
                        rows.append(bench_packed(model, name, k, ns, batch, bw))
                        print(rows[-1], flush=True)
            if "small" in on:
                rows.append(bench_norm(model, batch, bw))
                rows.append(bench_attention_prologue(model, batch, bw))
                rows.append(bench_gdn(model, batch, bw))
                for t in (0.0, 1.0):
                    rows.append(bench_sampling(model, batch, t, bw))
            if "attention" in on:
                pairs = ([(n, args.attn_cache) for n in args.attn_valid] if args.attn_valid
                         else [(8192, 32768), (8192, 8192), (32768, 32768), (512, 32768)])
                for valid, cache in pairs:
                    rows.append(bench_attention(model, batch, valid, cache, bw))
            if "step" in on:
                pairs = ([(n, args.attn_cache) for n in args.attn_valid] if args.attn_valid
                         else [(128, 392), (392, 392), (1024, 1024), (2048, 2048), (4096, 4096)])
                for valid, cache in pairs:
                    rows.append(bench_attention_step(model, batch, valid, cache, bw))
                    print(rows[-1], flush=True)
    for r in rows:
        r["copy_gbps"] = round(bw, 1)
    cols = ["model", "kernel", "batch", "mbytes", "us", "gbps", "pct_copy", "torch_us", "speedup", "split_us"]
    header = (f"# Kernel benchmark (bf16, CUDA-graph replays, median)\n\nCopy bandwidth {bw:.0f} GB/s "
              f"({torch.cuda.get_device_name()}, torch {torch.__version__}). `torch_us` is the PyTorch "
              "composition the kernel replaces (the reference ops: cuBLAS + elementwise).\n\n"
              f"Command: `python benchmarks/kernels.py {' '.join(sys.argv[1:])}`")
    write_results(args.out, "kernels", rows, cols, header)
    print("\n".join(line for line in (args.out / "kernels.md").read_text().splitlines() if line.startswith("|")))


if __name__ == "__main__":
    main()
