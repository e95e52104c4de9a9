"""How fast a block streams a long share through the copy engine, and what the rate depends on.

The copy-engine GEMV (``results/bulk_gemv/``) completed one slot per ~1.5 us per block whatever the slot (15 or
30 KB) or ring (96 or 220 KB) size: ~2.4 TB/s, against 4.2 for a plain copy. This streams ``--mib`` MiB over
one or two blocks per SM with nothing but a fold of the words, in variants that each test one explanation:

- ``ring``: thread 0 issues one copy per slot; every thread waits on the slot's mbarrier (``try_wait``), reads,
  meets the others at a block barrier, then thread 0 refills the slot: the GEMV's order;
- ``poll``: the same, waiting by ``test_wait`` polls (a late wake-up from ``try_wait`` would show here);
- ``producer``: warp 0 only issues, refilling a slot once the 7 reading warps have released it on a second
  mbarrier, with no block barrier (a refill held back by the slowest warp would show here);
- ``split4``: ``ring`` with each slot filled by four copies from four lanes (copies of one block served one at
  a time would show here);
- any of them at two, four or eight blocks per SM (``x2``, ``x4``, ``x8``): the same bytes in flight spread over
  more blocks, as cub's DeviceTransform streams with one copy per block and several blocks per SM.

Reports GB/s, % of copy bandwidth and microseconds per slot per block. Writes ``bulk_stream.json/md``.

    python benchmarks/bulk_stream.py --out DIR [--mib 1024]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import build_bench_ops, copy_bandwidth_gbps, graph_time_us, write_results

MODES = {"ring": 0, "poll": 1, "producer": 2, "split4": 3}
# (mode, slots, slot KB, blocks per SM): the GEMV's ring first, then one change at a time
VARIANTS = [("ring", 3, 32, 1), ("ring", 6, 32, 1), ("ring", 3, 16, 1), ("ring", 6, 16, 1), ("poll", 3, 32, 1),
            ("producer", 3, 32, 1), ("producer", 6, 32, 1), ("split4", 3, 32, 1), ("split4", 6, 32, 1),
            ("ring", 3, 32, 2), ("producer", 3, 32, 2), ("ring", 2, 16, 4), ("ring", 1, 32, 4), ("ring", 1, 16, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mib", type=int, default=1024, help="bytes streamed per call, over all blocks")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    build_bench_ops("bulk_stream")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth_gbps()
    nbytes = args.mib * 2**20
    bufs = [torch.zeros(nbytes // 4, dtype=torch.int32, device="cuda") for _ in range(2)]
    sink = torch.zeros(max(v[3] for v in VARIANTS) * sms, dtype=torch.int32, device="cuda")
    op = torch.ops.segki_bulk_stream.stream
    rows = []
    for mode, slots, kb, per_sm in VARIANTS:
        blocks = per_sm * sms
        row = dict(variant=f"{mode} {slots}x{kb}K" + (f" x{per_sm}" if per_sm > 1 else ""), blocks=blocks)
        fns = [lambda b=b: op(b, MODES[mode], blocks, slots, kb * 1024, sink) for b in bufs]
        try:
            us = graph_time_us(fns, calls=4, reps=7)
        except RuntimeError as err:
            row["error"] = str(err).splitlines()[0][:160]
        else:
            slots_per_block = nbytes / blocks / (kb * 1024)
            gbps = nbytes / us / 1e3
            row.update(us=round(us, 1), gbps=round(gbps, 1), pct_copy=round(100 * gbps / bw, 1),
                       us_per_slot=round(us / slots_per_block, 3))
        print(row, flush=True)
        rows.append(row)
    header = (f"# One block's stream through the copy engine ({torch.cuda.get_device_name(0)}, {sms} SMs, "
              f"{args.mib} MiB a call, copy bandwidth {bw:.0f} GB/s)\n\n"
              f"Command: `python benchmarks/bulk_stream.py --out DIR --mib {args.mib}`")
    columns = ["variant", "blocks", "us", "gbps", "pct_copy", "us_per_slot", "error"]
    write_results(args.out, "bulk_stream", rows, columns, header)


if __name__ == "__main__":
    main()
