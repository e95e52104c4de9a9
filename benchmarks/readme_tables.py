"""The README's performance tables, generated from the result files under ``benchmarks/results/`` (never copied by
hand): the decode table from the canonical command's output (``benchmarks/results/current/decode.json``, see
``benchmarks/run_gpu.sh canonical``), the training table's rows from the files :data:`TRAINING` names unless the
canonical output holds that case (``current/train.json``, one row a case).

    python benchmarks/readme_tables.py            # rewrite the README's generated blocks
    python benchmarks/readme_tables.py --check    # exit 1 if the README differs from the files (a CPU test runs it)
    python benchmarks/readme_tables.py --collect DIR   # DIR/train/<case>/grpo_gpu.json rows into DIR/train.json

A block in the README sits between ``<!-- table:NAME -->`` and ``<!-- end table:NAME -->``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CURRENT = "current"   # the canonical command's folder
TRAIN_ROWS = "train.json"   # in it: the canonical GRPO cases, one row each (``case``: the case's colons as _)

# decode tok/s cells: column -> (model, batch, mode); rows -> (label, system name in decode.py's output, the columns
# it fills or None for all), each cell read from the canonical run's decode.json (min-max over its rows)
COLUMNS = {"0.8B b=1": ("0.8b", 1, "greedy"), "0.8B b=16": ("0.8b", 16, "greedy"),
           "0.8B b=32 (T=1)": ("0.8b", 32, "sample T=1"), "0.8B b=64 (T=1)": ("0.8b", 64, "sample T=1"),
           "4B b=1": ("4b", 1, "greedy"), "4B b=16 (T=1)": ("4b", 16, "sample T=1"),
           "4B b=32 (T=1)": ("4b", 32, "sample T=1"), "4B b=64 (T=1)": ("4b", 64, "sample T=1")}
DECODE = [
    ("roofline (weights once / copy bandwidth)", "roofline (weights once / copy BW)", ("0.8B b=1", "4B b=1")),
    ("segki_lightning (segki + graph)", "ours: segki + graph", None),
    ("graph only (plain forward captured)", "ours: graph only", None),
    ("transformers static cache + compile (greedy)", "HF static cache + compile", None),
    ("transformers eager `generate`", "HF eager generate", None),
]
# peers measured at greedy only: their T=1 columns take the greedy row
_GREEDY_ONLY = {"HF static cache + compile", "HF eager generate"}

# GRPO at RL sizes: (label, grpo_gpu.py case, committed result file or None: ``FILE.json`` for its first row,
# ``FILE.json#N`` for row N); the canonical command's row of that case (current/train.json) wins where it exists, and
# a row with neither is left out
TRAINING = [
    ("0.8B, 128 x 1024, torch GDN rule", None, "train_scale/grpo_runs.json#2"),
    ("4B, 64 x 512, torch GDN rule", None, "train_scale/grpo_runs.json#3"),
    ("0.8B, 128 x 1024, packed, fp32 reference norms (`SEGKI_TRAIN_FUSED=0`)", None,
     "train_fused/grpo_0.8b_128x1024_runs.json#0"),
    ("0.8B, 128 x 1024, packed", "0.8b:16x1024:mb32:ckpt", "train_fused/grpo_0.8b_128x1024_runs.json#3"),
    ("4B, 64 x 512, packed", "4b:8x512:mb32:ckpt", None),
    ("0.8B, 128 x 10-100 % of 1024, packed, micro-batches of <= 34 816 tokens",
     "0.8b:16x1024:mb128:tok34816:ckpt:mixed", "train_fused/grpo_0.8b_mixed_tokens_ab.json#0"),
    ("0.8B, 128 x 10-100 % of 1024, padded", "0.8b:16x1024:mb32:ckpt:mixed:pad",
     "train_fused/grpo_0.8b_mixed_tokens_ab.json#1"),
    ("4B, 64 x 512, LoRA r=16, base frozen", None, "lora_gpu/grpo_lora.json#0"),
    ("9B shape, 32 x 512, LoRA r=16, base frozen", None, "lora_gpu/grpo_lora.json#1"),
]
CANONICAL_CASES = [case for _, case, _ in TRAINING if case]   # what run_gpu.sh's canon_train stage runs


@cache
def read_rows(path: Path) -> list[dict]:
    """The rows of a decode.py result: its JSON list, or the table of its markdown output (read once per file)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = []
    for ln in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in ln.strip("|").split("|"))))
        cells["batch"] = int(cells["batch"])
        cells["decode_tok_s"] = float(cells["decode_tok_s"]) if cells.get("decode_tok_s") else None
        rows.append(cells)
    return rows


def _files() -> list[Path]:
    """The canonical run's decode.json, where it exists."""
    current = RESULTS / CURRENT / "decode.json"
    return [current] if current.exists() else []


def _tok_s(files: list[Path], system: str, model: str, batch: int, mode: str) -> list[float]:
    want = "-" if system.startswith("roofline") else ("greedy" if system in _GREEDY_ONLY else mode)
    out = []
    for f in files:
        for r in read_rows(f):
            if (r.get("system") == system and r.get("model") == model and r.get("mode") == want
                    and (r.get("batch") == batch or want == "-") and r.get("decode_tok_s")):
                out.append(float(r["decode_tok_s"]))
    return out


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    fmt = (lambda v: f"{v:,.0f}".replace(",", " ")) if max(values) >= 1000 else (lambda v: f"{v:.1f}")
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def decode_table() -> str:
    lines = ["| Qwen3.5 decode tok/s | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    sources = set()
    for label, system, cols in DECODE:
        row = []
        for col, (model, batch, mode) in COLUMNS.items():
            files = _files() if cols is None or col in cols else []
            sources.update(str(f.relative_to(RESULTS)) for f in files)
            row.append(_span(_tok_s(files, system, model, batch, mode)))
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "Generated by `python benchmarks/readme_tables.py` from " +
              ", ".join(f"`{s}`" for s in sorted(sources)) + " (under `benchmarks/results/`; each folder's README "
              "names the command and the commit). A range spans the rows of one cell."]
    return "\n".join(lines)


def _pct(v) -> str:
    return "-" if v is None or v != v else f"{100 * v:.1f} %"


def _num(v, digits: int = 2) -> str:
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def _device(r: dict, path: Path) -> str:
    """The GPU a grpo_gpu.py result ran on: its ``device`` field, else the title of its markdown twin (``...,
    NVIDIA H100 80GB HBM3, ...``)."""
    md = path.with_suffix(".md")
    text = r.get("device") or (md.read_text() if md.exists() else "")
    m = re.search(r"NVIDIA (H\d+)", text)
    if not m:
        raise ValueError(f"{path}: no device named (a 'device' field or its .md title)")
    return m.group(1)


def _case_name(case: str) -> str:
    """A grpo_gpu.py case as its rows and folders name it (``0.8b:16x1024:mb32`` -> ``0.8b_16x1024_mb32``)."""
    return case.replace(":", "_")


def _canonical_rows(folder: Path) -> dict[str, dict]:
    """A canonical run's GRPO rows (``folder/train.json``) by case name (empty where it has not run)."""
    path = folder / TRAIN_ROWS
    return {r["case"]: r for r in json.loads(path.read_text())} if path.exists() else {}


def training_table() -> str:
    lines = ["| GRPO step (G = 8, micro-batches of 32 rows, checkpointing) | step s | rollout s | training part s | "
             "MFU of the training part | peak GiB |", "|---|---|---|---|---|---|"]
    used, canonical = [], _canonical_rows(RESULTS / CURRENT)
    for label, case, rel in TRAINING:
        name, _, index = (rel or "").partition("#")
        if case and _case_name(case) in canonical:
            path, r = RESULTS / CURRENT / TRAIN_ROWS, canonical[_case_name(case)]
        elif rel:
            path = RESULTS / name
            r = json.loads(path.read_text())[int(index or 0)]
        else:
            continue
        used.append(str(path.relative_to(RESULTS)))
        mfu = r.get("mfu", r.get("mfu_train"))
        lines.append(f"| {label} ({_device(r, path)}) | {_num(r['step_s'])} | {_num(r['rollout_s'])} | "
                     f"{_num(r['train_s'])} | {_pct(mfu)} | {_num(r['peak_gib'], 1)} |")
    lines += ["", "Generated by `python benchmarks/readme_tables.py` from " +
              ", ".join(f"`{u}`" for u in dict.fromkeys(used)) + " (under `benchmarks/results/`)."]
    return "\n".join(lines)


TABLES = {"decode": decode_table, "training": training_table}


def render(readme: str) -> str:
    """``readme`` with every generated block replaced by its table; a block name without a table is an error."""
    def block(m: re.Match) -> str:
        name = m.group(1)
        if name not in TABLES:
            raise KeyError(f"README block {name!r} has no table (known: {sorted(TABLES)})")
        return f"<!-- table:{name} -->\n{TABLES[name]()}\n<!-- end table:{name} -->"

    return re.sub(r"<!-- table:(\w+) -->\n(?:.*?\n)?<!-- end table:\1 -->", block, readme, flags=re.S)


def collect(out: Path) -> Path:
    """Merge the GRPO rows of a canonical run (``out/train/<case>/grpo_gpu.json``, grpo_gpu.py's output) into
    ``out/train.json``: a case run again replaces its row, the other rows stay (cases may run in separate calls).
    One row a line; the per-case folders (logs, markdown) need not be kept."""
    path, rows = out / TRAIN_ROWS, _canonical_rows(out)
    for f in sorted((out / "train").glob("*/grpo_gpu.json")):
        for r in json.loads(f.read_text()):
            if r.get("returncode") == 0 and "step_s" in r:   # a run that finished its steps
                rows[r["case"]] = r
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows.values()) + "\n]\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is not what the files say")
    ap.add_argument("--collect", type=Path, metavar="DIR", help="merge DIR/train/<case>/grpo_gpu.json into "
                    f"DIR/{TRAIN_ROWS} and stop")
    args = ap.parse_args()
    if args.collect:
        print(collect(args.collect))
        return
    path = ROOT / "README.md"
    now = path.read_text()
    want = render(now)
    if args.check:
        if want != now:
            sys.exit("README.md's generated tables differ from benchmarks/results/: run python benchmarks/readme_tables.py")
        return
    path.write_text(want)


if __name__ == "__main__":
    main()
