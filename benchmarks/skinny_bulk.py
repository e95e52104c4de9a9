"""A 16- and 32-row GEMM streamed through the copy engine onto tensor cores, against cuBLAS, on 0.8B shapes.

Past 16 rows every decode projection is cuBLAS, which runs the 0.8B shapes at 16-31 % of copy bandwidth
(``results/bulk_gemv/profile_no_pdl/``): the GRPO rollout's 32-row step spends over half its time there. The
library's own tensor-core GEMV lost to cuBLAS at 32 rows. ``csrc/skinny_bulk.cu`` is the copy-engine design
(one block per SM, 16-row weight tiles through a ring of shared-memory slots, x in shared memory,
``mma.m16n8k16``) with K = 1024, as a measurement before any of it enters the library. Each row checks the
result against the same product in fp32 (``max_rel_err``), and times both as CUDA-graph replays over distinct
weight copies (no L2 reuse). Writes ``skinny_bulk.json/md``.

    python benchmarks/skinny_bulk.py --out DIR
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import graph_time_us, start_bench_ops, write_results

# output rows of 0.8B projections with K = 1024 (the hidden size): qkv (8 x 256 x 2 + 2 x 2 x 256), gate|up,
# the GDN input projection (q|k|v 6144 + z 2048, b and a left out), the output head
SHAPES = {"qkv_proj": 5120, "gate_up": 7168, "gdn_in_proj": 8192, "lm_head": 248320}
K = 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32], choices=[16, 32])
    args, bw = start_bench_ops(ap, "skinny_bulk")
    op = torch.ops.segki_skinny.gemm
    rows = []
    for name, n in SHAPES.items():
        wbytes = n * K * 2
        copies = max(2, min(8, int(150e6 // wbytes) + 1))  # > 100 MB of weights per replay round
        ws = [(torch.randn(n, K, device="cuda") * K**-0.5).to(torch.bfloat16) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, K, device="cuda").to(torch.bfloat16)
            out = torch.full((m, n), float("nan"), device="cuda")
            op(ws[0], x, out)
            want = x.float() @ ws[0].float().t()
            err = ((out - want).abs().max() / want.abs().max()).item()
            outs = [torch.empty(m, n, device="cuda") for _ in ws]
            ours = graph_time_us([lambda w=w, o=o: op(w, x, o) for w, o in zip(ws, outs)], calls=16, reps=9)
            cublas = graph_time_us([lambda w=w: torch.matmul(x, w.t()) for w in ws], calls=16, reps=9)
            row = dict(shape=name, n=n, rows=m, weight_mb=round(wbytes / 1e6, 1), ours_us=round(ours, 2),
                       ours_pct_copy=round(100 * wbytes / ours / 1e3 / bw, 1), cublas_us=round(cublas, 2),
                       cublas_pct_copy=round(100 * wbytes / cublas / 1e3 / bw, 1),
                       speedup=round(cublas / ours, 2), max_rel_err=float(f"{err:.2e}"))
            print(row, flush=True)
            rows.append(row)
        del ws
    header = (f"# 16/32-row GEMM through the copy engine vs cuBLAS ({torch.cuda.get_device_name(0)}, copy bandwidth "
              f"{bw:.0f} GB/s, K = {K}, bf16 in, fp32 out for ours, bf16 for cuBLAS)\n\n"
              f"Command: `python benchmarks/skinny_bulk.py --out DIR --rows {' '.join(map(str, args.rows))}`")
    columns = ["shape", "rows", "weight_mb", "ours_us", "ours_pct_copy", "cublas_us", "cublas_pct_copy", "speedup",
               "max_rel_err"]
    write_results(args.out, "skinny_bulk", rows, columns, header)


if __name__ == "__main__":
    main()
