"""Where a training micro-batch's time goes: one GRPO-style pass (completion log-probs, a loss on them, its backward)
of a Qwen3.5-shape model with random weights, segki injected as the callback injects it, timed forward-only (the
old-log-prob / reference pass) and forward + backward (the update), then one forward + backward under the torch
profiler: the kernels that take the time, grouped into families (GDN chunk kernels, matrix products, attention,
norms and element-wise work, the log-prob head), with their share and the pass's MFU on real tokens. ``host_s``
is the host's time to issue each pass (no sync of its own) and ``host_syncs`` the waits for the GPU inside one
update: where ``host_s`` nears the pass's GPU-timed ``*_s`` with no late sync, the GPU waits on the host (the
launches, not the kernels, set the pace), and fewer launches is the lever.

    python benchmarks/profile_train.py --out DIR [--shape 0.8b] [--rows 32] [--tokens 1024] [--ckpt] [--mixed]

Under ``SEGKI_TRAIN_FUSED=1`` (fla's fused norms, SwiGLU and conv in training passes) the files end in ``_fused``.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench_modules import mixed_lengths
from common import qwen35_config

PROMPT = 4
# kernel-name patterns -> family, first match wins (names as the profiler reports CUDA kernels)
FAMILIES = [
    ("gdn chunk (fla)", r"chunk|solve_tril|wy_fast|recompute_w_u|fused_recurrent|l2norm|cumsum|kkt"),
    ("attention", r"flash|fmha|attention|sdpa|varlen"),
    ("matrix products", r"gemm|gemv|cutlass|sm90_xmma|nvjet|cublas|wgmma"),
    ("conv", r"conv"),
    ("copies, casts, element-wise", r"elementwise|vectorized|copy|cast|fill|where|index|gather|scatter|cat"),
    ("reductions, norms", r"reduce|norm|softmax|logsumexp|sum"),
]


def family(name: str) -> str:
    low = name.lower()
    return next((f for f, pat in FAMILIES if re.search(pat, low)), "other")


def gpu_kernels(prof) -> dict[str, list]:
    """GPU kernel name -> [launches, ms] of a profile."""
    kernels = defaultdict(lambda: [0, 0.0])
    for e in prof.key_averages():
        us = _own_us(e)
        if e.device_type == torch.autograd.DeviceType.CUDA and us > 0 and e.key:
            kernels[e.key][0] += e.count
            kernels[e.key][1] += us / 1e3
    return kernels


SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def host_syncs(prof) -> dict[str, int]:
    """How often the host waited for the GPU in a profile (a tensor read back: ``.item()``, ``.tolist()``,
    ``int()``)."""
    return {e.key: e.count for e in prof.key_averages() if e.key in SYNCS}


def _own_us(event) -> float:
    """An averaged profiler event's own GPU microseconds (the attribute's name changed across torch versions)."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def aten_ops(prof, top: int = 40) -> list[dict]:
    """The PyTorch ops whose own kernels take the most GPU time, per input shapes: which call of the model's code a
    kernel family comes from (a copy of [33k, 16, 128] fp32 is a different fix from one of [33k, 1024])."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        us = _own_us(e)
        if e.key.startswith("aten::") and us > 0:
            rows.append(dict(op=e.key, shapes=str(e.input_shapes)[:200], calls=e.count, ms=round(us / 1e3, 2)))
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def batch(rows: int, tokens: int, mixed: bool, vocab: int, gen: torch.Generator):
    """Prompt ids/mask ``[rows, PROMPT]``, completion ids/mask ``[rows, tokens]``; ``mixed``: completion lengths
    as the GRPO benchmark's mixed case draws them."""
    lengths = mixed_lengths(tokens, rows, gen) if mixed else torch.full((rows,), tokens)
    cm = (torch.arange(tokens)[None, :] < lengths[:, None]).long()
    pm = torch.ones(rows, PROMPT, dtype=torch.long)
    ids_p = torch.randint(2, vocab, pm.shape, generator=gen)
    ids_c = torch.randint(2, vocab, cm.shape, generator=gen) * cm
    return [t.cuda() for t in (ids_p, pm, ids_c, cm)], [PROMPT + int(n) for n in lengths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shape", default="0.8b")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--ckpt", action="store_true", help="activation checkpointing of the decoder layers")
    ap.add_argument("--mixed", action="store_true", help="completion lengths 10-100 %% of --tokens")
    ap.add_argument("--padded", action="store_true", help="rows padded, not packed")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    from transformers import Qwen3_5ForCausalLM

    from segki_lightning.inject import apply_segment_ki
    from segki_lightning.ops import train_fused
    from segki_lightning.ops.gdn_chunk import training_path
    from segki_lightning.rl.flops import FlopShape, peak_flops
    from segki_lightning.rl.logprobs import completion_logprobs

    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(qwen35_config(args.shape)).to(torch.bfloat16).cuda().train()
    apply_segment_ki(model)
    if args.ckpt:
        model.activation_checkpointing_enable({"use_reentrant": False})
    tensors, lengths = batch(args.rows, args.tokens, args.mixed, model.config.vocab_size, torch.Generator().manual_seed(1))
    mask = tensors[3]

    def forward() -> torch.Tensor:
        s = completion_logprobs(model, *tensors, packed=not args.padded)
        return (s.logp * mask).sum() / mask.sum()

    def update() -> None:
        forward().backward()
        model.zero_grad(set_to_none=True)

    def timed(fn, grad: bool) -> tuple[float, float]:
        """Median seconds of ``fn`` between two CUDA events, and of the host's issuing it."""
        times, host = [], []
        for _ in range(args.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.set_grad_enabled(grad):
                a.record()
                t0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - t0)
                b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times), statistics.median(host)

    update()   # autotuning, compilation
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    (fwd_s, fwd_host_s), (upd_s, upd_host_s) = timed(forward, False), timed(update, True)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"forward {fwd_s:.3f} s (host {fwd_host_s:.3f}), forward+backward {upd_s:.3f} s (host {upd_host_s:.3f}), "
          f"peak {peak:.1f} GiB", flush=True)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        update()
        torch.cuda.synchronize()
    kernels, ops = gpu_kernels(prof), aten_ops(prof)
    total_ms = sum(ms for _, ms in kernels.values())
    fams = defaultdict(float)
    for name, (_, ms) in kernels.items():
        fams[family(name)] += ms
    flops = FlopShape.of(model).training(lengths, int(mask.sum()))
    peak_tf = peak_flops(torch.device("cuda"))
    res = dict(shape=args.shape, rows=args.rows, tokens=args.tokens, ckpt=args.ckpt, mixed=args.mixed,
               packed=not args.padded, real_tokens=sum(lengths), path=training_path(),
               device=torch.cuda.get_device_name(), forward_s=round(fwd_s, 4), update_s=round(upd_s, 4),
               host_s=dict(forward=round(fwd_host_s, 4), update=round(upd_host_s, 4)),
               kernel_launches=sum(c for c, _ in kernels.values()), host_syncs=host_syncs(prof),
               peak_gib=round(peak, 2), model_tflop=round(flops / 1e12, 1),
               mfu=round(flops / upd_s / peak_tf, 3) if peak_tf else None, kernel_ms=round(total_ms, 1),
               families={f: round(ms, 1) for f, ms in sorted(fams.items(), key=lambda kv: -kv[1])},
               top=[dict(name=n[:160], calls=c, ms=round(ms, 2)) for n, (c, ms) in
                    sorted(kernels.items(), key=lambda kv: -kv[1][1])[:40]],
               ops=ops)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.shape}_{args.rows}x{args.tokens}" + ("_ckpt" if args.ckpt else "") + ("_mixed" if args.mixed else "") \
        + ("_pad" if args.padded else "") + ("_fused" if train_fused.enabled() else "")
    (args.out / f"profile_train_{tag}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# {tag}: forward {fwd_s:.3f} s (host {fwd_host_s:.3f}), forward+backward {upd_s:.3f} s (host "
             f"{upd_host_s:.3f}), {res['kernel_launches']} kernels, MFU {res['mfu']}, peak {peak:.1f} GiB, "
             f"path {res['path']}, {res['device']}", "", "| family | ms | share |", "|---|---|---|"]
    lines += [f"| {f} | {ms:.1f} | {ms / total_ms:.1%} |" for f, ms in res["families"].items()]
    lines += ["", "| kernel | calls | ms |", "|---|---|---|"]
    lines += [f"| {k['name'][:110]} | {k['calls']} | {k['ms']} |" for k in res["top"][:30]]
    lines += ["", "| PyTorch op (input shapes) | calls | own GPU ms |", "|---|---|---|"]
    lines += [f"| {o['op']} {o['shapes'][:90]} | {o['calls']} | {o['ms']} |" for o in ops[:30]]
    (args.out / f"profile_train_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
