"""The 4B down's blocks at one row, grouped by where each block starts inside its first tile (k = u0 mod 9).

The down 1 x 9216 -> 2560 deals 160 tiles x 9 parts = 1440 units to 132 blocks in equal contiguous ranges
(block b's first unit b x 1440 / 132), so a block of k > 0 starts with the head of a split tile (9 - k units).
Prints, per k, the means over the step's 32 downs of the per-block numbers of ``step_timeline.py``'s
``step_timeline_blocks.json.gz``, and the mean end spread (last block's end after the median block's).

    python by_start_offset.py BLOCKS.json.gz [BLOCKS.json.gz ...]
"""
import gzip
import json
import statistics
import sys
from collections import defaultdict

SHAPE, UNITS, BLOCKS, PARTS = "1x9216->2560", 1440, 132, 9


def table(path: str) -> None:
    down = [b for b in json.load(gzip.open(path)) if b["shape"] == SHAPE]
    launches = sorted({b["launch"] for b in down})
    spreads = []
    for launch in launches:
        ends = [b["end"] for b in down if b["launch"] == launch]
        spreads.append(max(ends) - statistics.median(ends))
    by_k = defaultdict(list)
    for b in down:
        by_k[(b["block"] * UNITS // BLOCKS) % PARTS].append(b)
    print(f"{path}: {len(launches)} launches, mean end spread {statistics.mean(spreads):.2f} us")
    print("| k | blocks | tile_ends | unit_wait | landed - first | last - landed |")
    for k, blocks in sorted(by_k.items()):
        mean = lambda f: statistics.mean(f(b) for b in blocks)  # noqa: E731
        print(f"| {k} | {len(blocks) // len(launches)} | {mean(lambda b: b['tile_ends_us']):.2f} "
              f"| {mean(lambda b: b['unit_wait_us']):.2f} | {mean(lambda b: b['landed'] - b['first']):.2f} "
              f"| {mean(lambda b: b['last'] - b['landed']):.2f} |")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        table(p)
