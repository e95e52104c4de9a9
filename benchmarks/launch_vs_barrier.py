"""What a phase boundary costs: a kernel launch against a grid-wide barrier inside one persistent kernel.

The first step of the plan for one persistent kernel per decoder layer (``benchmarks/NOTES.md``): a decode layer
at one row is ~7 launches of kernels that each stream one weight. Here ``--phases`` phases each stream their own
slice of a buffer (``--sizes`` bytes per phase: 0, and the 0.8B layer's weight sizes) over the whole grid,
separated by

- ``launch + PDL``: one kernel per phase, launched with programmatic dependent launch as every native decode
  kernel is (each waits for the previous one before it reads);
- ``launch``: the same without PDL;
- ``bulk + launch + PDL``: one kernel per phase again, each block's share streamed into shared memory by the
  copy engine (``cp.async.bulk``) through a ring of 3 x 32 KB slots whose first chunks are issued before the PDL
  wait; 96 KB per block, so a block of the next kernel fits beside one of this kernel and has its copies in
  flight while this one finishes: what a decode GEMV could do alone, without a persistent kernel;
- ``barrier``: one kernel, a hand-rolled grid barrier (an arrival counter) between phases;
- ``grid.sync``: one cooperative kernel, cooperative groups' grid barrier between phases;
- ``bulk + barrier``: the ``barrier`` kernel with each block's share streamed into shared memory by the copy
  engine (``cp.async.bulk``) through a ring of 4 x 32 KB slots, issued as slots free up whatever the phase: the
  next phase's first chunks are in flight while the block waits at the barrier, as a persistent decode kernel
  could stream its next weights while it waits for the activations they multiply;
- ``bulk + grid.sync``: the same with cooperative groups' grid barrier.

All inside a captured CUDA graph, one block per SM, 256 threads. Reports microseconds per phase, the part above
the bytes' time at copy bandwidth, and the GB/s reached. Writes ``launch_vs_barrier.json/md``.

    python benchmarks/launch_vs_barrier.py --out DIR [--phases 16] [--sizes 0 1048576 4194304 16777216]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import graph_time_us, start_bench_ops, write_results

VARIANTS = ("launch + PDL", "launch", "bulk + launch + PDL", "barrier", "bulk + barrier", "grid.sync", "bulk + grid.sync")


def measure(variant: str, phases: int, size: int, blocks: int) -> float:
    """Microseconds per phase: the median over graph replays; distinct buffers keep each replay out of L2."""
    ops = torch.ops.segki_bench
    words = max(size // 16, 1) * phases
    bufs = [torch.zeros(words * 4, dtype=torch.int32, device="cuda") for _ in range(2)]
    sink = torch.zeros(blocks, dtype=torch.int32, device="cuda")
    bar = torch.zeros(2, dtype=torch.int32, device="cuda")
    if "launch" in variant:
        fns = [lambda b=b: ops.launches(b, phases, blocks, variant == "launch + PDL", variant.startswith("bulk"), sink)
               for b in bufs]
    elif variant.startswith("bulk"):
        fns = [lambda b=b: ops.persistent_bulk(b, phases, blocks, variant.endswith("grid.sync"), bar, sink)
               for b in bufs]
    else:
        fns = [lambda b=b: ops.persistent(b, phases, blocks, variant == "grid.sync", bar, sink) for b in bufs]
    return graph_time_us(fns, calls=8) / phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--phases", type=int, default=16)
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 2**20, 4 * 2**20, 16 * 2**20],
                    help="bytes streamed per phase (0.8B layer weights: out_proj 4 MiB, down 7 MiB, in_proj 17 MiB)")
    args, bw = start_bench_ops(ap, "launch_vs_barrier")
    blocks = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for variant in VARIANTS:   # the cooperative launches last: a capture they fail must not cost the others
        for size in args.sizes:
            row = dict(variant=variant, bytes_per_phase=size, phases=args.phases, blocks=blocks)
            try:
                us = measure(variant, args.phases, size, blocks)
            except RuntimeError as err:   # e.g. a cooperative launch the graph cannot capture
                row["error"] = str(err).splitlines()[0][:160]
            else:
                floor = size / bw / 1e3   # us at copy bandwidth
                row.update(us_per_phase=round(us, 2), us_above_bytes=round(us - floor, 2),
                           gbps=round(size / us / 1e3, 1) if size else None)
            print(row, flush=True)
            rows.append(row)
    header = (f"# Phase boundaries: launches against grid barriers ({torch.cuda.get_device_name(0)}, {blocks} blocks "
              f"x 256 threads, {args.phases} phases, copy bandwidth {bw:.0f} GB/s)\n\n"
              f"Command: `python benchmarks/launch_vs_barrier.py --out DIR --phases {args.phases} --sizes "
              f"{' '.join(map(str, args.sizes))}`")
    write_results(args.out, "launch_vs_barrier", rows,
                  ["variant", "bytes_per_phase", "us_per_phase", "us_above_bytes", "gbps", "error"], header)


if __name__ == "__main__":
    main()
