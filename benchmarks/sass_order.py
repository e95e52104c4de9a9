"""Issue order of the decode GEMVs' main loops, read from the built extension's machine code (no GPU needed).

A GEMV streams weights at HBM speed only with enough loads in flight per warp: the loads it means to have in
flight must be issued before the first instruction that uses one of them, and ptxas is free to reorder them.
This prints, per kernel (tensor-core and CUDA-core, bf16), the order of its weight loads (W), x loads (x),
mma (M), fp32 FMAs (f) and branches (|) from ``cuobjdump -sass`` of ``gemv.cuda.o``, with its registers per
thread (which set how many blocks fit on an SM).

    python -m segki_lightning.ops.build --arch 9.0        # builds into the extension's cache folder
    python benchmarks/sass_order.py --out DIR --object <cache>/gemv.cuda.o [--cuobjdump PATH]
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

KERNEL = re.compile(r"gemv_(mma|small)_kernelI13__nv_bfloat16Li(\d)ELNS0_8EpilogueE(\d)E(Lb(\d))?")
CODES = (("LDG.E.NA", "W"), ("LDG.E.128.CONSTANT", "x"), ("HMMA", "M"), ("FFMA", "f"), ("SHFL", "s"), ("BRA", "|"))


def label(m: re.Match) -> str:
    rows = f"NB={m[2]}" if m[1] == "mma" else f"rows<={m[2]}"
    return f"{m[1]} {'gated' if m[3] == '1' else 'plain'} {rows}" + (f" pipe={m[5]}" if m[5] else "")


def kernels(sass: str) -> dict[str, str]:
    """{'mma plain NB=2 pipe=1': 'WWWW|xxMM...'} for every bf16 GEMV kernel in ``cuobjdump -sass``."""
    out, name, codes = {}, None, []
    for line in sass.splitlines() + ["Function : end"]:
        if "Function : " in line:
            if name:
                out[name] = "".join(codes)
            m = KERNEL.search(line)
            name = m and label(m)
            codes = []
        elif name:
            codes += [c for op, c in CODES if op in line][:1]
    return out


def registers(res_usage: str) -> dict[str, int]:
    regs, name = {}, None
    for line in res_usage.splitlines():
        m = KERNEL.search(line)
        if m:
            name = label(m)
        elif name and (r := re.search(r"REG:(\d+)", line)):
            regs[name], name = int(r[1]), None
    return regs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--object", type=Path, required=True, help="the extension build's gemv.cuda.o")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = ap.parse_args()
    run = lambda flag: subprocess.run([args.cuobjdump, flag, str(args.object)], check=True,  # noqa: E731
                                      capture_output=True, text=True).stdout
    order, regs = kernels(run("-sass")), registers(run("-res-usage"))
    lines = [f"# Decode GEMVs (bf16): issue order of the main loop, `{args.object.name}`", "",
             "W weight load, x load, M mma, f fp32 FMA, s shuffle, | branch; from the first weight load to the last mma "
             "(tensor cores) or to the first shuffle of the warp reduction (CUDA cores).", "",
             "| kernel | registers | order |", "|---|---|---|"]
    for name in sorted(order):
        seq = order[name]
        end = seq.rfind("M") if "M" in seq else seq.find("s") if "s" in seq else len(seq)
        lines.append(f"| {name} | {regs.get(name, '?')} | `{seq[seq.find('W'):end + 1][:160]}` |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sass_order.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
