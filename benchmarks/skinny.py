"""The skinny product (``segki::skinny_linear``, 1-16 rows) against what decode runs there today, on Qwen3.5 shapes.

Per shape and row count, each as CUDA-graph replays over distinct weight copies (> 150 MB a round: no L2 reuse):
``skinny_us`` the skinny product (gated shapes: with the SiLU-mul in its epilogue), ``cublas_us`` one cuBLAS
product over the same packed weight (gated: plus ``segki::silu_mul`` on its halves), ``gemv_us`` the library's
GEMV on the split weights (at most 16 rows; gated: ``gated_mlp_front``). ``max_rel_err``: the skinny output's
largest error against the fp32 reference, over the output's largest value. With ``--norm``, the projections that
decode normalizes first (gate|up, the GDN input, q|k|v) take the RMSNorm as decode runs them: inside the skinny
launch (its x staging), as the ``segki::rms_norm`` kernel before the cuBLAS product and the GEMV. Writes
``skinny.json/md``.

    python benchmarks/skinny.py --out DIR [--models 4b 0.8b] [--rows 1 2 4 8 16] [--norm]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from common import SHAPES, copy_bandwidth_gbps, graph_time_us, write_results


def shapes(model: str) -> dict[str, tuple[list[int], int, bool]]:
    """name -> (the packed weight's parts' rows, K, gated) of the model's decode projections."""
    s = SHAPES[model]
    h, i, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    kd, vd, hk, hv = (s["linear_key_head_dim"], s["linear_value_head_dim"], s["linear_num_key_heads"],
                      s["linear_num_value_heads"])
    q = 2 * s["num_attention_heads"] * hd
    return {"gate_up": ([i, i], h, True), "gdn_in_proj": ([2 * hk * kd + hv * vd, hv * vd, hv, hv], h, False),
            "qkv_proj": ([q, s["num_key_value_heads"] * hd, s["num_key_value_heads"] * hd], h, False),
            "o_proj": ([h], s["num_attention_heads"] * hd, False), "down_proj": ([h], i, False),
            "lm_head": ([s["vocab_size"]], h, False)}


def gemv(x: torch.Tensor, parts: list[torch.Tensor], gated: bool):
    ops = torch.ops.segki
    if gated:
        return ops.gated_mlp_front(x, *parts)
    if len(parts) == 1:
        return ops.linear(x, parts[0], None)
    if len(parts) == 3:
        return ops.qkv_proj(x, *parts, None, None, None)
    return ops.gdn_in_proj(x, *parts)


NORMED = ("gate_up", "gdn_in_proj", "qkv_proj")   # the projections a decoder layer normalizes x for
EPS = 1e-6


def cublas(x: torch.Tensor, w: torch.Tensor, gated: bool):
    y = F.linear(x, w)
    return torch.ops.segki.silu_mul(*y.chunk(2, dim=-1)) if gated else y


def measure(model: str, name: str, parts_rows: list[int], k: int, gated: bool, rows: list[int],
            bw: float, norm: bool = False) -> list[dict]:
    from segki_lightning.ops.dispatch import skinny_fits

    nw = (torch.randn(k, device="cuda") * 0.2).to(torch.bfloat16) if norm and name in NORMED else None
    pro = () if nw is None else (nw, EPS, True)                   # the skinny launch's norm prologue

    def first(x):   # what the cuBLAS and GEMV paths launch before their product
        return x if nw is None else torch.ops.segki.rms_norm(x, nw, EPS, True)

    n = sum(parts_rows)
    wbytes = n * k * 2
    copies = max(2, min(8, int(150e6 // wbytes) + 1))
    ws = [(torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16) for _ in range(copies)]
    split = [list(w.split(parts_rows)) for w in ws]
    out = []
    for m in rows:
        row = dict(model=model, shape=name, rows=m, weight_mb=round(wbytes / 1e6, 1), norm=nw is not None)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        if skinny_fits(m, k, n, 2):
            got = torch.ops.segki.skinny_linear(x, ws[0], None, gated, *pro).float()
            y = first(x).float() @ ws[0].float().t()
            want = F.silu(y[:, : n // 2]) * y[:, n // 2:] if gated else y
            row["max_rel_err"] = float(f"{((got - want).abs().max() / want.abs().max()).item():.2e}")
            t = graph_time_us([lambda w=w: torch.ops.segki.skinny_linear(x, w, None, gated, *pro) for w in ws], 16, 9)
            row.update(skinny_us=round(t, 2), skinny_pct_copy=round(100 * wbytes / t / 1e3 / bw, 1))
        t = graph_time_us([lambda w=w: cublas(first(x), w, gated) for w in ws], 16, 9)
        row.update(cublas_us=round(t, 2), cublas_pct_copy=round(100 * wbytes / t / 1e3 / bw, 1))
        if m <= 16 and not (name == "lm_head" and m > 1):   # the GEMV on the head: one row, as decode runs it
            t = graph_time_us([lambda p=p: gemv(first(x), p, gated) for p in split], 16, 9)
            row.update(gemv_us=round(t, 2), gemv_pct_copy=round(100 * wbytes / t / 1e3 / bw, 1))
        if "skinny_us" in row:
            best = min(row["cublas_us"], row.get("gemv_us", float("inf")))
            row["speedup_vs_best"] = round(best / row["skinny_us"], 2)
        print(row, flush=True)
        out.append(row)
    del ws, split
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=["4b", "0.8b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--only", nargs="+", help="shape names to run (default: all)")
    ap.add_argument("--norm", action="store_true", help="the RMSNorm before gate|up, the GDN input and q|k|v, "
                    "as decode runs it on each path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from segki_lightning.ops.extension import native_ops

    if native_ops() is None:
        raise SystemExit("the segki extension did not load")
    bw = copy_bandwidth_gbps()
    print(f"copy bandwidth: {bw:.0f} GB/s", flush=True)
    rows = []
    for model in args.models:
        for name, (parts, k, gated) in shapes(model).items():
            if not args.only or name in args.only:
                rows += measure(model, name, parts, k, gated, args.rows, bw, args.norm)
    header = (f"# The skinny product vs cuBLAS and the GEMVs ({torch.cuda.get_device_name(0)}, copy bandwidth "
              f"{bw:.0f} GB/s, bf16, CUDA-graph replays, median)\n\n"
              f"Command: `python benchmarks/skinny.py --out DIR --models {' '.join(args.models)} --rows "
              f"{' '.join(map(str, args.rows))}" + (f" --only {' '.join(args.only)}" if args.only else "")
              + (" --norm" if args.norm else "") + "`")
    columns = ["model", "shape", "rows", "weight_mb", "norm", "skinny_us", "skinny_pct_copy", "cublas_us",
               "cublas_pct_copy", "gemv_us", "gemv_pct_copy", "speedup_vs_best", "max_rel_err"]
    write_results(args.out, "skinny", rows, columns, header)


if __name__ == "__main__":
    main()
