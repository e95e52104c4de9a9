"""The decode projections and the GDN step at GRPO-sized rows, launched one by one for Nsight Compute: per case,
what dispatch runs (cuBLAS past the native rows, over weights packed as the rollout engine packs them) and the
native tensor-core kernel forced at the same rows. A ``spin_kernel`` (``torch.cuda._sleep``) opens each case, so
the profile's kernels can be told apart by order; the case names are printed in that order.

    ncu --clock-control none --kernel-name regex:'spin|gemm|gemv|xmma|cutlass|silu|gdn' --section SpeedOfLight \
        --section Occupancy --section LaunchStats --section WarpStateStats --csv --page details \
        python benchmarks/ncu_shapes.py --cases 4b:16 0.8b:32 > ncu.csv
    python benchmarks/ncu_shapes.py --table ncu.csv --cases 4b:16 0.8b:32   # one line per kernel
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import MODELS, PACKED, proj_cases, rand  # noqa: E402

from segki_lightning import ops  # noqa: E402

NATIVE = {1: "linear", 2: "gated_mlp_front", 3: "qkv_proj", 4: "gdn_in_proj"}


def cases(spec: list[str]) -> list[tuple[str, int]]:
    return [(m, int(r)) for m, r in (s.split(":") for s in spec)]


def case_names(spec: list[str]) -> list[str]:
    """The cases in launch order, as ``model rows name path``."""
    out = []
    for model, rows in cases(spec):
        for name in proj_cases(model):
            out += [f"{model} {rows} {name.split(' ')[0]} dispatch", f"{model} {rows} {name.split(' ')[0]} native"]
        out.append(f"{model} {rows} gdn_decode_step native")
    return out


def launch(model: str, rows: int) -> None:
    """Each projection twice (dispatch, native), then the GDN step: every launch opened by a spin kernel."""
    for name, (k, ns) in proj_cases(model).items():
        x = rand(rows, k)
        packed = rand(sum(ns), k, scale=k**-0.5)
        ws = list(packed.split(ns))
        dispatch = ops.linear if len(ns) == 1 else PACKED[len(ns)][0]
        extra = (None, None, None) if len(ns) == 3 else ()
        torch.cuda._sleep(1000)
        dispatch(x, *ws) if len(ns) > 1 else dispatch(x, ws[0], None)
        torch.cuda._sleep(1000)
        native = getattr(torch.ops.segki, NATIVE[len(ns)])
        contiguous = [w.contiguous() for w in ws]
        native(x, *contiguous, *extra) if len(ns) > 1 else native(x, contiguous[0], None)
    h, _, (hk, hv, dk, dv), _, _ = MODELS[model]
    c = 2 * hk * dk + hv * dv
    args = [rand(rows, c), rand(rows, hv * dv), rand(rows, hv), rand(rows, hv), rand(rows, c, 4),
            rand(c, 4, scale=0.5), None, torch.randn(rows, hv, dk, dv, device="cuda") * 0.1,
            rand(hv, scale=0.5), rand(hv, scale=0.5), rand(dv)]
    torch.cuda._sleep(1000)
    torch.ops.segki.gdn_decode_step(*args, 1e-6, hk, dk, dv)


METRICS = {"Duration": "us", "DRAM Throughput": "dram_pct", "Memory Throughput": "mem_pct", "Grid Size": "grid",
           "Block Size": "block", "Registers Per Thread": "regs", "Achieved Occupancy": "occ_pct",
           "Theoretical Occupancy": "theo_occ_pct", "Waves Per SM": "waves",
           "Warp Cycles Per Issued Instruction": "cycles_per_issue"}


def table(path: Path, spec: list[str]) -> None:
    """One line per profiled kernel from ncu's ``--csv --page details`` output, under the case it belongs to."""
    rows: dict[str, dict] = {}
    order: list[str] = []
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith('"')]
    for r in csv.DictReader(lines):
        key = r["ID"]
        if key not in rows:
            rows[key] = {"kernel": r["Kernel Name"][:60]}
            order.append(key)
        if r["Metric Name"] in METRICS:
            unit = r["Metric Unit"]
            v = float(r["Metric Value"].replace(",", "")) if r["Metric Value"] not in ("", "n/a") else float("nan")
            if r["Metric Name"] == "Duration":
                v = v / 1e3 if unit in ("ns", "nsecond") else v * 1e3 if unit in ("ms", "msecond") else v
            rows[key][METRICS[r["Metric Name"]]] = v
    names = iter(case_names(spec))
    cols = list(METRICS.values())
    print("| case | kernel | " + " | ".join(cols) + " |\n|" + "---|" * (len(cols) + 2))
    current = "?"
    for key in order:
        r = rows[key]
        if "spin_kernel" in r["kernel"]:
            current = next(names, "?")
            continue
        print(f"| {current} | {r['kernel']} | " + " | ".join(f"{r.get(c, float('nan')):g}" for c in cols) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["4b:16", "0.8b:32"], help="MODEL:ROWS")
    ap.add_argument("--table", type=Path, help="ncu's CSV to summarize instead of launching anything")
    args = ap.parse_args()
    if args.table:
        table(args.table, args.cases)
        return
    with torch.no_grad():
        for model, rows in cases(args.cases):
            launch(model, rows)
    torch.cuda.synchronize()
    print("\n".join(case_names(args.cases)), file=sys.stderr)


if __name__ == "__main__":
    main()
