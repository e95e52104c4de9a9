"""Decode of a LoRA policy against the same model's full-weight decode and transformers' eager LoRA generate
(random bf16 weights, adapters non-zero, one GPU, all in one run).

    python benchmarks/lora_decode.py --out DIR [--model 4b] [--batches 1 16 64] [--r 16] [--hf-eager-batches 1]
        [--hf-eager-tokens 64]

Issue line: a LoRA policy (r=16 on every projection) decodes at >= 85 % of the full-weight rollout at b=1, 16 and
64, and >= 3x transformers' eager LoRA generate. Rows: ours with full weights, ours with peft's LoRA on every
projection (``all-linear``; the low-rank paths beside the fused ops, inject/adapters.py) as peft's composition
(``SEGKI_LORA_OP=0``) and as the native lora_add op (the default), transformers' eager ``generate`` of the LoRA
model; sampled at T=1, decode tok/s as in decode.py (prefill excluded).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode  # noqa: E402
from common import write_results  # noqa: E402

from segki_lightning import apply_segment_ki, remove_segment_ki  # noqa: E402
from segki_lightning.rl.lora import apply_lora  # noqa: E402


def lora_policy(model, r: int):
    """``model`` wrapped by peft with LoRA r on every projection (alpha 2r, fp32 adapters on the bf16 base), its B
    made non-zero (peft starts B at zero: a trained adapter's path is not); the model's own layers are peft's from
    here on. Returns the ``PeftModel``."""
    peft_model = apply_lora(model, r=r, lora_alpha=2 * r)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * 0.01)
    return peft_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="4b")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--hf-eager-batches", nargs="*", type=int, default=[1])
    ap.add_argument("--hf-eager-tokens", type=int, default=64)
    args = ap.parse_args()
    sampling = decode.MODES["sample T=1"]
    model = decode.build(args.model)
    rows: list[dict] = []
    full = {}
    for batch in args.batches:
        full[batch] = decode.ours(model, batch, sampling, True)
        rows.append(dict(system="ours: full weights", batch=batch, **full[batch]))
        print(rows[-1], flush=True)
    remove_segment_ki(model)
    lora_policy(model, args.r)
    user_switch = os.environ.get("SEGKI_LORA_OP")
    for op, label in (("0", "peft's composition"), ("1", "lora_add op")):   # SEGKI_LORA_OP, read at capture
        os.environ["SEGKI_LORA_OP"] = op
        for batch in args.batches:
            r = decode.ours(model, batch, sampling, True)
            ratio = round(r["decode_tok_s"] / full[batch]["decode_tok_s"], 3) if "decode_tok_s" in r else None
            unfused = sum(map(len, apply_segment_ki(model).skipped.values()))   # the injection's report (0: all fused)
            rows.append(dict(system=f"ours: LoRA r={args.r}, {label}", batch=batch, vs_full=ratio,
                             unfused_segments=unfused, **r))
            print(rows[-1], flush=True)
    remove_segment_ki(model)   # peft's own layers from here
    os.environ.pop("SEGKI_LORA_OP")   # the results' header names the switches the run was started with
    if user_switch is not None:
        os.environ["SEGKI_LORA_OP"] = user_switch
    for batch in args.hf_eager_batches:
        r = decode.hf(model, batch, False, args.hf_eager_tokens)
        ours = max((x.get("decode_tok_s", 0) for x in rows if x["system"].startswith("ours: LoRA")
                    and x["batch"] == batch), default=None)
        rows.append(dict(system=f"HF eager generate, LoRA r={args.r}", batch=batch,
                         ours_vs_this=round(ours / r["decode_tok_s"], 2) if ours else None, **r))
        print(rows[-1], flush=True)
    cols = ["system", "batch", "decode_tok_s", "step_ms", "vs_full", "ours_vs_this", "unfused_segments", "path"]
    header = (f"# LoRA decode (Qwen3.5-{args.model} shape, bf16, LoRA r={args.r} on every projection, sampled T=1, "
              f"{torch.cuda.get_device_name()})\n\n"
              f"Command: `python benchmarks/lora_decode.py {' '.join(sys.argv[1:])}`")
    write_results(args.out, "lora_decode", rows, cols, header)
    print((args.out / "lora_decode.md").read_text())


if __name__ == "__main__":
    main()
