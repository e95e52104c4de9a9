"""Where each block of the skinny products, the GDN recurrences and the one-launch attention steps -- and of the
kernels between them: the norms, the deferred segments' sums and the GDN conv -- waits inside one replayed decode
step: the graph is captured while those kernels stamp each block's phases (``segki::timeline_stamps``,
``csrc/timeline.cuh``), then replayed once. Per launch (in launch order) and per product shape, the mean time of
each phase of a block:

    start -> waited (the PDL wait) -> loaded (x's loads landed) -> reduced (the norm's sums; = loaded without
          a norm) -> staged (x in shared memory) -> first (its first unit landed) -> last (its last unit
          multiplied) -> end (the last tile's sums and stores)

and, inside first -> last, ``unit_wait`` (waiting for units to land: the copies are behind) and ``tile_ends`` (the
tile sums of all but the last tile); the rest is multiplying. ``landed`` is when its last unit had landed (seen by
its producer warp), after the PDL wait (negative: before it), and ``landed_last`` how long after that the last unit
was multiplied: near one unit's multiply, the copies pace the product; far more, the consumers. Per SM, ``gap``
(this block's start after the previous product block on the same SM ended: the launch hand-over, or the kernels
between two products) and
``dry`` (the previous block's end to this block's first unit: how long the SM's weight stream stood still);
``end_spread`` is the last block's end after the median block's.

The recurrence's rows (``recurrence``: its cluster kernel, which runs where the (row, head) items are fewer than
the SMs; ``conv+recurrence`` where the step's conv runs inside it) use the same columns: waited -> loaded its
inputs landed (and the conv's outputs computed), -> reduced the delta rule done (its state had landed) and the new
state's stores issued, -> staged the head's norm sums exchanged through the cluster, staged = first, -> last its
output (and the conv windows) stored, -> end; it has no gap or dry time. So do the one-launch attention step's
(``attention step``): waited -> loaded its prologue done, -> reduced its positions attended, -> staged its split
merged over its warps, -> first the cluster's barrier passed, -> last its outputs combined and stored, -> end the
last barrier passed; ``units`` is its positions. Where the (row, head) items are as many as the SMs, the streamed
recurrence (``streamed recurrence``; ``conv+streamed recurrence`` with the step's conv inside): waited -> loaded
its first item's state landed (= reduced = staged = first), -> last its last item's output stored, -> end its
states' stores done; ``units`` is its items. The kernels between
(``norm``, ``add+norm`` with the residual add, ``of N sums`` where x comes as the product's segments' fp32 sums;
``segment sums``; ``conv``), as thread 0 of a block sees them: waited -> loaded its inputs in (the norm: squared),
-> reduced the norm's block sum, -> last its outputs stored; the phases a kernel lacks last no time.

A block places itself in the step by ``%globaltimer`` at its start and end, which ticks every 250 ns on the H200;
its phases are on the SM clock, converted with the cycles per ns of all the step's blocks together (their clock
spans over their timer spans). Besides the tables, ``step_timeline_blocks.json.gz`` has every block.

    python benchmarks/step_timeline.py --out DIR [--models 0.8b 4b] [--batch 1]
"""
from __future__ import annotations

import gzip
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import captured_step, step_args, write_results  # noqa: E402

PHASES = ("start", "waited", "loaded", "reduced", "staged", "first", "last", "end")
# a record: [launch << 32 | block, SM << 32 | grid, timer at start and end (ns), the SM clock at each phase, cycles
# waiting for units, cycles in tile ends, units, the SM clock when its last unit had landed (products; else 0)]
WORDS = 16
TABLE = ("launch", "kind", "rows", "k", "n", "gated", "grid", "parts", "tiles")
# kinds (csrc/timeline.cuh): 0 product (gated holds flags: 1 gated, 2 x in registers), 1 recurrence (k, n, gated,
# parts and tiles its Dk, Hv x Dv, conv inside, blocks per value head, value heads), 2 attention step (D, query heads, gated, splits, KV heads), 3 norm (k its
# width, gated 1 with the residual add, parts the fp32 sums x comes in), 4 segment sums (parts its segments),
# 5 conv (k its width, n its channels), 6 streamed recurrence (Dk, Hv x Dv, conv inside, items, value heads)
ROOM = 1 << 17       # records; a 4B step at 16 rows writes ~35k (its conv: 512 blocks a GDN layer)
STEPS = [f"{a}_{z}" for a, z in zip(PHASES, PHASES[1:])]                 # each phase's mean duration
SUMS = ["unit_wait_us", "tile_ends_us", "units"]                         # per block, inside first -> last
LANDED = ["landed_us", "landed_last_us"]  # products: the last unit landed after the wait; last multiplied after that
METRICS = ["span_us", *STEPS, *SUMS, *LANDED, "gap_us", "dry_us", "end_spread_us"]  # per launch, mean per shape


def blocks_of(words: list[list[int]]) -> list[dict]:
    """The records as blocks: launch id, block, SM, grid, the phases' times in us on the timer's scale (not yet
    shifted), and the block's sums. Cycles become ns at the step's cycles per ns: all its blocks' clock spans over
    their timer spans (each timer span is off by up to a tick, the total by far less)."""
    n = len(PHASES)
    cycles = sum(w[4 + n - 1] - w[4] for w in words)
    ns = sum(w[3] - w[2] for w in words)
    if cycles <= 0 or ns <= 0:
        raise ValueError("the records span no time: were they written?")
    per_ns = cycles / ns
    out = []
    for w in words:
        clock = w[4:4 + n]

        def at(c: int) -> float:  # the clock on the timer's scale, us (used within this record's iteration)
            return (w[2] + (c - clock[0]) / per_ns) / 1e3

        out.append(dict(launch=w[0] >> 32, block=w[0] & 0xFFFFFFFF, sm=w[1] >> 32, grid=w[1] & 0xFFFFFFFF,
                        **{p: at(c) for p, c in zip(PHASES, clock)}, landed=at(w[7 + n]) if w[7 + n] else None,
                        unit_wait_us=w[4 + n] / per_ns / 1e3, tile_ends_us=w[5 + n] / per_ns / 1e3, units=w[6 + n]))
    return out


def label(shape: dict) -> str:
    kind, rows = shape["kind"], shape["rows"]
    if kind == 6:
        return f"{'conv+' if shape['gated'] else ''}streamed recurrence {rows}x{shape['tiles']} heads"
    if kind == 5:
        return f"conv {rows}x{shape['n']} channels"
    if kind == 4:
        return f"segment sums {rows}x{shape['n']}{' gated' if shape['gated'] else ''} of {shape['parts']}"
    if kind == 3:
        of = f" of {shape['parts']} sums" if shape["parts"] else ""
        return f"{'add+' if shape['gated'] else ''}norm {rows}x{shape['k']}{of}"
    if kind == 2:
        return f"attention step {rows}x{shape['tiles']} KV heads x {shape['parts']} splits"
    if kind == 1:
        return f"{'conv+' if shape['gated'] else ''}recurrence {rows}x{shape['tiles']} heads"
    flags = shape["gated"]
    return f"{rows}x{shape['k']}->{shape['n']}{' gated' if flags & 1 else ''}{' x in registers' if flags & 2 else ''}"


def known(blocks: list[dict], table: list[dict]) -> tuple[list[dict], float]:
    """The blocks of the launches the table names, and the first one's start (the step's t0, us)."""
    launches = {t["launch"] for t in table}
    blocks = [b for b in blocks if b["launch"] in launches]
    return blocks, min(b["start"] for b in blocks)


def mark_sm_gaps(blocks: list[dict], shapes: dict[int, dict]) -> None:
    """Each product block's gap (its start after the previous product block on its SM ended) and dry time (that end
    to its first unit); None for the first on an SM and for the other kernels' blocks."""
    prev_on_sm: dict[int, dict] = {}
    for b in sorted(blocks, key=lambda b: b["start"]):
        if shapes[b["launch"]]["kind"] != 0:
            b["gap"] = b["dry"] = None
            continue
        prev = prev_on_sm.get(b["sm"])
        b["gap"] = b["start"] - prev["end"] if prev else None
        b["dry"] = b["first"] - prev["end"] if prev else None
        prev_on_sm[b["sm"]] = b


def launch_row(lid: int, shape: dict, bs: list[dict], t0: float) -> dict:
    """One launch: its start in the step, span and end spread, and its blocks' mean phase durations and sums."""
    ends, first = sorted(b["end"] for b in bs), min(b["start"] for b in bs)
    row = dict(launch=lid, shape=label(shape), blocks=len(bs), at_us=round(first - t0, 2),
               span_us=round(ends[-1] - first, 2), end_spread_us=round(ends[-1] - statistics.median(ends), 2))
    for step, a, z in zip(STEPS, PHASES, PHASES[1:]):
        row[step] = round(statistics.fmean(b[z] - b[a] for b in bs), 2)
    for key in SUMS:
        row[key] = round(statistics.fmean(b[key] for b in bs), 2)
    landed = [b for b in bs if b["landed"] is not None]
    for key, a, z in (("landed_us", "waited", "landed"), ("landed_last_us", "landed", "last")):
        row[key] = round(statistics.fmean(b[z] - b[a] for b in landed), 2) if landed else None
    for key in ("gap", "dry"):
        vals = [b[key] for b in bs if b[key] is not None]
        row[f"{key}_us"] = round(statistics.fmean(vals), 2) if vals else None
    return row


def shape_rows(launches: list[dict]) -> list[dict]:
    """The launches' metrics averaged per shape (those a shape has: None values left out)."""
    kinds = defaultdict(list)
    for r in launches:
        kinds[r["shape"]].append(r)
    per_shape = []
    for s, rs in kinds.items():
        row = dict(shape=s, launches=len(rs), blocks=rs[0]["blocks"])
        for k in METRICS:
            vals = [r[k] for r in rs if r[k] is not None]
            if vals:
                row[k] = round(statistics.fmean(vals), 2)
        per_shape.append(row)
    return per_shape


def summarize(blocks: list[dict], table: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per launch (in start order) and per shape: the phases' mean durations (us), the launch's span and end
    spread, and the SM gap and dry time against the previous skinny block on each SM."""
    shapes = {t["launch"]: t for t in table}
    blocks, t0 = known(blocks, table)
    mark_sm_gaps(blocks, shapes)
    by_launch = defaultdict(list)
    for b in blocks:
        by_launch[b["launch"]].append(b)
    order = sorted(by_launch.items(), key=lambda kv: min(b["start"] for b in kv[1]))
    launches = [launch_row(lid, shapes[lid], bs, t0) for lid, bs in order]
    return launches, shape_rows(launches)


def block_rows(blocks: list[dict], table: list[dict]) -> list[dict]:
    """Each block as a row for the per-block file: its launch's shape, its phases and its last unit's landing in us
    from the step's first block's start (3 decimals), its sums, gap and dry time."""
    shapes = {t["launch"]: label(t) for t in table}
    blocks, t0 = known(blocks, table)
    rows = []
    for b in blocks:
        row = dict(launch=b["launch"], shape=shapes[b["launch"]], block=b["block"], sm=b["sm"])
        row.update({p: round(b[p] - t0, 3) for p in PHASES})
        row["landed"] = round(b["landed"] - t0, 3) if b["landed"] is not None else None
        row.update({k: (round(b[k], 3) if b.get(k) is not None else None)
                    for k in ("unit_wait_us", "tile_ends_us", "gap", "dry")}, units=b["units"])
        rows.append(row)
    return rows


def stamp_step(name: str, batch: int) -> tuple[list[dict], list[dict], list[dict]]:
    """Captures the model's decode step with its kernels stamping, replays it once, and reads the stamps."""
    from decode import build

    from segki_lightning.ops.extension import native_ops

    ops = native_ops()
    if ops is None:
        raise SystemExit("the segki extension did not load")
    stamps = ops.timeline_stamps
    buf = torch.zeros(WORDS * (ROOM + 1), dtype=torch.int64, device="cuda")
    buf[1] = ROOM
    model = build(name)
    stamps(buf, True)
    engine, graph = captured_step(model, batch, new_tokens=8)
    table = [dict(zip(TABLE, row)) for row in stamps(buf, True).tolist()]
    for _ in range(3):
        graph.replay()
    buf[0] = 0
    graph.replay()
    torch.cuda.synchronize()
    stamps(buf, False)
    n = int(buf[0])
    if n > ROOM:
        raise RuntimeError(f"{n} records for room for {ROOM}: raise ROOM")
    words = buf[WORDS:WORDS * (n + 1)].view(n, WORDS).tolist()
    engine.free()
    blocks = blocks_of(words)
    launches, per_shape = summarize(blocks, table)
    per_block = block_rows(blocks, table)
    for r in launches + per_shape + per_block:
        r.update(model=name, batch=batch)
    return launches, per_shape, per_block


def main() -> None:
    args = step_args(__doc__, ["0.8b", "4b"])
    per_model = [stamp_step(name, args.batch) for name in args.models]
    launches, per_shape, per_block = ([r for rows in parts for r in rows] for parts in zip(*per_model))
    header = (f"# The decode step's stamped kernels' blocks (skinny products, GDN conv and recurrences, attention "
              f"steps, norms, segment sums) in one replayed step (batch {args.batch}; us)\n\nCommand: "
              f"`python benchmarks/step_timeline.py --out DIR --models {' '.join(args.models)} --batch {args.batch}`")
    write_results(args.out, "step_timeline", per_shape, ["model", "shape", "launches", "blocks", *METRICS], header)
    write_results(args.out, "step_timeline_launches", launches,
                  ["model", "launch", "shape", "blocks", "at_us", *METRICS], header)
    with gzip.open(args.out / "step_timeline_blocks.json.gz", "wt") as f:   # every block, for distributions
        json.dump(per_block, f)
    print((args.out / "step_timeline.md").read_text())


if __name__ == "__main__":
    main()
