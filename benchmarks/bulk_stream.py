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
- ``store``: ``ring`` where each warp also stores a word to global memory per slot, as the GEMV stores its
  outputs; ``store_nofence``: the same with the refill's proxy fence left out (it compiles to a memory barrier
  that may wait for the warp's stores);
- ``dot_row``: ``ring`` whose readers do the one-row GEMV's products on 2560-wide bf16 rows (30 or 15 KB slots:
  6 or 3 rows), one warp per row as the copy-engine GEMV did; ``dot_spread``: the same products with every warp
  on every row (a row's chain split eight ways): if ``dot_row`` pays the GEMV's ~1.5 us per slot and
  ``dot_spread`` does not, the cost was the per-warp row chain;
- ``dot_mma``: ``ring`` whose readers do the one-row GEMV on the tensor cores (a 32 KB slot is a 16-row tile of
  1024 columns; ~20 instructions per warp and slot against ``dot_row``'s ~250): if it streams where ``dot_row``
  does not, a one-block-per-SM ring is bound by its per-slot work (``results/layer_tail/``), not by the copies;
- ``rows``: ``ring`` with each slot filled by 16 copies, each one row's part of a 16-row tile (the share read as
  rows of four parts), as the removed tensor-core layer tail filled its slots (``results/mma_ring/``): whether 16 copies of 1-2 KB per slot stream as one
  copy of the slot does;
- ``loads``: no copy engine, each thread keeps four 16-byte register loads in flight (the register path's rate
  on the same shares, for reference);
- any of them at two, four or eight blocks per SM (``x2``, ``x4``, ``x8``): the same bytes in flight spread over
  more blocks, as cub's DeviceTransform streams with one copy per block and several blocks per SM.

Each variant runs at every ``--mib`` size: 1024 MiB measures the steady state (~8 MB per block), 16 MiB a
GEMV-sized weight (~4 slots per block), where the first slot's latency and the tail count. Reports GB/s, % of
copy bandwidth and microseconds per slot per block. Writes ``bulk_stream.json/md``.

The buffers hold random bf16 values (``--fill zeros``: zeros, as every run before ``results/layer_tail/`` did: zero
data can run faster than real data, and the dot modes then multiplied zeros).

    python benchmarks/bulk_stream.py --out DIR [--mib 1024 16] [--fill random|zeros]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import graph_time_us, start_bench_ops, write_results

MODES = {"ring": 0, "poll": 1, "producer": 2, "split4": 3, "loads": 4, "store": 5, "store_nofence": 6, "dot_row": 7,
         "dot_spread": 8, "dot_mma": 9, "rows": 10}
# (mode, slots, slot KB, blocks per SM): the GEMV's ring first, then one change at a time
VARIANTS = [("ring", 3, 32, 1), ("rows", 3, 32, 1), ("rows", 4, 20, 1), ("ring", 4, 20, 1), ("rows", 6, 20, 1),
            ("rows", 4, 16, 1), ("ring", 4, 16, 1), ("dot_mma", 3, 32, 1), ("dot_mma", 6, 32, 1), ("dot_mma", 3, 32, 2),
            ("dot_row", 3, 30, 1), ("dot_spread", 3, 30, 1), ("dot_row", 3, 15, 1), ("dot_spread", 3, 15, 1),
            ("dot_row", 6, 30, 1), ("store", 3, 32, 1), ("store_nofence", 3, 32, 1), ("store", 3, 16, 1),
            ("store_nofence", 3, 16, 1), ("ring", 6, 32, 1), ("ring", 3, 16, 1), ("ring", 6, 16, 1), ("poll", 3, 32, 1),
            ("producer", 3, 32, 1), ("producer", 6, 32, 1), ("split4", 3, 32, 1), ("split4", 6, 32, 1),
            ("ring", 3, 32, 2), ("producer", 3, 32, 2), ("ring", 2, 16, 4), ("ring", 1, 32, 4), ("ring", 1, 16, 8),
            ("loads", 1, 16, 2), ("loads", 1, 16, 4), ("loads", 1, 16, 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--mib", type=int, nargs="+", default=[1024, 16], help="MiB streamed per call, over all blocks")
    ap.add_argument("--fill", choices=["random", "zeros"], default="random", help="what the streamed buffers hold")
    args, bw = start_bench_ops(ap, "bulk_stream")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    words = max(args.mib) * 2**18
    bufs = [torch.zeros(words, dtype=torch.int32, device="cuda") if args.fill == "zeros" else
            torch.randn(2 * words, device="cuda").to(torch.bfloat16).view(torch.int32) for _ in range(2)]
    sink = torch.zeros(max(v[3] for v in VARIANTS) * sms * 16, dtype=torch.int32, device="cuda")
    op = torch.ops.segki_bulk_stream.stream
    rows = []
    for mib in args.mib:
        for mode, slots, kb, per_sm in VARIANTS:
            blocks = per_sm * sms
            chunk = kb * 1024
            chunks_per_block = mib * 2**20 // blocks // chunk  # the op streams whole chunks only
            if mode == "rows":
                chunks_per_block -= chunks_per_block % 4       # (and whole 16-row tiles of 4 parts)
            row = dict(mib=mib, variant=f"{mode} {slots}x{kb}K" + (f" x{per_sm}" if per_sm > 1 else ""),
                       blocks=blocks, slots_per_block=chunks_per_block)
            if chunks_per_block == 0:
                rows.append(dict(row, error="less than one slot per block"))
                continue
            # distinct slices, 256 MiB or more in all, so that no call finds its bytes in L2
            n = max(2, 256 // mib)
            views = [bufs[i % 2][(i // 2) * mib * 2**18:(i // 2 + 1) * mib * 2**18] for i in range(n)]
            fns = [lambda v=v: op(v, MODES[mode], blocks, slots, chunk, sink) for v in views]
            try:
                us = graph_time_us(fns, calls=4 if mib >= 256 else 32, reps=7)
            except RuntimeError as err:
                row["error"] = str(err).splitlines()[0][:160]
            else:
                gbps = blocks * chunks_per_block * chunk / us / 1e3
                row.update(us=round(us, 2), gbps=round(gbps, 1), pct_copy=round(100 * gbps / bw, 1),
                           us_per_slot=round(us / chunks_per_block, 3))
            print(row, flush=True)
            rows.append(row)
    header = (f"# One block's stream through the copy engine ({torch.cuda.get_device_name(0)}, {sms} SMs, "
              f"copy bandwidth {bw:.0f} GB/s)\n\n"
              f"Command: `python benchmarks/bulk_stream.py --out DIR --mib {' '.join(map(str, args.mib))} "
              f"--fill {args.fill}`")
    columns = ["mib", "variant", "blocks", "slots_per_block", "us", "gbps", "pct_copy", "us_per_slot", "error"]
    write_results(args.out, "bulk_stream", rows, columns, header)


if __name__ == "__main__":
    main()
