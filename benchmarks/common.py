"""What the benchmarks share: the Qwen3.5 model shapes, the copy-bandwidth ceiling, CUDA-graph replay
timing and result files."""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Callable

import torch

# Qwen3.5 text-model shapes (random weights in every benchmark; nothing is downloaded)
SHAPES = {
    "0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True),
    # 9B-class: 8.95 B parameters; with fp32 masters and AdamW (~16 bytes each) its training state does not fit
    # one H200, so DDP runs out of memory where FSDP over two GPUs fits
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False),
}


def start_bench_ops(ap: argparse.ArgumentParser, source: str) -> tuple[argparse.Namespace, float]:
    """The start of a benchmark with kernels of its own: parses ``ap``'s arguments, stops unless a CUDA device is
    there, compiles ``benchmarks/csrc/<source>.cu`` (with the project's kernel headers; cached next to the
    extension's build) and loads its ops into ``torch.ops``. Returns the arguments and the copy bandwidth (GB/s)."""
    from segki_lightning.ops.build import _arch_list, build_dir, compile_library

    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    root = Path(__file__).resolve().parents[1]
    arch = _arch_list(None)
    out = build_dir(arch) / f"bench_{source}"
    out.mkdir(exist_ok=True)
    compile_library(f"segki_bench_{source}", [root / "benchmarks" / "csrc" / f"{source}.cu"], out, arch,
                    include_dirs=(root / "segki_lightning" / "csrc",))
    return args, copy_bandwidth_gbps()


def qwen35_config(name: str, **overrides):
    """A ``Qwen3_5TextConfig`` of the named shape (every 4th layer full attention, as released)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**SHAPES[name], **overrides})


def copy_bandwidth_gbps(gib: int = 2) -> float:
    """Device-to-device copy of ``gib`` GiB, counting bytes read plus written (median of 10)."""
    a = torch.empty(gib * 2**30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / statistics.median(times) / 1e9


def graph_time_us(fns: list[Callable[[], object]], calls: int = 32, reps: int = 15) -> float:
    """Median time per call (µs) of ``fns`` called round-robin inside one captured CUDA graph.

    Several functions over distinct input copies keep the weights out of L2 between calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    del g
    return statistics.median(times)


def kernel_switches() -> str:
    """The ``SEGKI_*`` settings of this run's environment (``SEGKI_PDL=0 ...``), empty when none is set."""
    return " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("SEGKI_") and k != "SEGKI_CACHE")


def write_results(out: Path, name: str, rows: list[dict], columns: list[str], header: str) -> None:
    """``out/name.json`` (all fields, one row a line: results stay small in the repository) and ``out/name.md``
    (the listed columns); the header gains a line with the run's kernel switches when any is set."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")
    switches = kernel_switches()
    if switches:
        header += f"\n\nKernel switches in the environment: `{switches}`"
    lines = [header, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in columns) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def step_args(doc: str, models: list[str], lora: bool = False) -> argparse.Namespace:
    """The arguments of the scripts that look inside one captured decode step per model: ``--out``, ``--models``
    (default ``models``), ``--batch``; with ``lora``, ``--lora R`` (the step of a LoRA policy of rank R too)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=models)
    ap.add_argument("--batch", type=int, default=1)
    if lora:
        ap.add_argument("--lora", type=int, default=0, metavar="R",
                        help="then the same model with LoRA r=R on every projection (adapters non-zero); 0: not")
    return ap.parse_args()


def captured_step(model, batch: int, new_tokens: int = 32):
    """``(engine, graph)``: a segki rollout engine on ``model`` that has decoded ``new_tokens`` tokens of one
    128-token prompt for ``batch`` rows, and its captured decode step for that batch (replay it to time one step)."""
    from segki_lightning import RolloutEngine, SamplingConfig

    engine = RolloutEngine(model, max_batch_size=batch, max_seq_len=256, use_segki=True, graph_capture=True,
                           eos_token_id=[])
    engine.generate([list(range(10, 138))], SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, n=batch))
    bucket = engine._bucket(batch)   # the one graph captured (keys: bucket, step kind)
    return engine, next(graph for (b, _), (graph, _) in engine._graphs.items() if b == bucket)
