"""A GDN layer's critical path in one replayed decode step, from ``step_timeline.py``'s blocks file.

For each GDN layer of the step (its recurrence launch, the norm, in-projection and conv kernel -- where the conv
runs apart -- before it, the six kernels after it up to the next norm without sums), each kernel's last block end after the previous kernel's last block end;
when, after that previous end, the kernel's blocks' mean PDL wait returned and their inputs landed; and its end
spread (last block's end after the median block's). Means over the step's GDN layers; us.

    python layer_path.py BLOCKS.json.gz
"""
import gzip
import json
import statistics
import sys
from collections import defaultdict

NAMES = ["in-proj", "conv", "recurrence", "out_proj", "add+norm of sums", "gate|up", "down", "segment sums",
         "add+norm"]


def layer_rows(path: str) -> dict:
    launches = defaultdict(list)
    for b in json.load(gzip.open(path)):
        launches[b["launch"]].append(b)
    order = sorted(launches)
    rows = defaultdict(list)
    for i, launch in enumerate(order):
        if "recurrence" not in launches[launch][0]["shape"] or i + 6 >= len(order):
            continue
        apart = int(launches[order[i - 1]][0]["shape"].startswith("conv"))
        if i < 2 + apart:
            continue
        seq = order[i - 2 - apart:i + 7]  # the norm before the in-projection, then the layer's kernels
        last = launches[seq[-1]][0]["shape"]
        if not last.startswith("add+norm") or "sums" in last:
            continue
        names = NAMES if apart else [n for n in NAMES if n != "conv"]
        prev_end = max(b["end"] for b in launches[seq[0]])
        for name, x in zip(names, seq[1:]):
            blocks = launches[x]
            end = max(b["end"] for b in blocks)
            rows[name].append((end - prev_end, statistics.mean(b["waited"] for b in blocks) - prev_end,
                               statistics.mean(b["loaded"] for b in blocks) - prev_end,
                               end - statistics.median(b["end"] for b in blocks)))
            prev_end = end
    return rows


def main(path: str) -> None:
    rows = layer_rows(path)
    print(f"{path}: {len(rows['recurrence'])} GDN layers")
    print("| kernel | previous end -> its last end | -> mean waited | -> mean loaded | end spread |")
    print("|---|---|---|---|---|")
    total = 0.0
    for name in (n for n in NAMES if rows[n]):
        means = [statistics.mean(r[j] for r in rows[name]) for j in range(4)]
        total += means[0]
        print(f"| {name} | {means[0]:.2f} | {means[1]:.2f} | {means[2]:.2f} | {means[3]:.2f} |")
    print(f"| the layer | {total:.2f} | | | |")


if __name__ == "__main__":
    main(sys.argv[1])
