"""The README's performance tables are what the committed result files say (benchmarks/readme_tables.py), and
every result path the README names is in the tree."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "benchmarks" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_readme_tables_are_generated_from_the_results(tables):
    readme = (ROOT / "README.md").read_text()
    assert "<!-- table:decode -->" in readme and "<!-- table:training -->" in readme
    assert tables.render(readme) == readme, "run python benchmarks/readme_tables.py"


def test_the_canonical_folder_wins(tables, tmp_path, monkeypatch):
    """The decode table reads results/current/decode.json; a canonical GRPO case there replaces its row."""
    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    (tmp_path / "current").mkdir()
    rows = [dict(model="0.8b", system="ours: segki + graph", batch=1, mode="greedy", decode_tok_s=1234.5),
            dict(model="0.8b", system="roofline (weights once / copy BW)", batch=1, mode="-", decode_tok_s=2800.0)]
    (tmp_path / "current" / "decode.json").write_text(json.dumps(rows))
    table = tables.decode_table()
    assert "| segki_lightning (segki + graph) | 1 234 |" in table or "| segki_lightning (segki + graph) | 1 235 |" in table
    assert "`current/decode.json`" in table
    case = tables.CANONICAL_CASES[0]
    out = tmp_path / "current" / "train" / case.replace(":", "_")   # grpo_gpu.py's output, collected by case
    out.mkdir(parents=True)
    (out / "grpo_gpu.json").write_text(json.dumps([dict(case=case.replace(":", "_"), returncode=0, step_s=5.0,
                                                         rollout_s=2.0, train_s=3.0, mfu=0.31, peak_gib=20.0,
                                                         device="NVIDIA H200")]))
    tables.collect(tmp_path / "current")
    for _, _, rel in tables.TRAINING:   # the committed files the other rows read (``FILE.json#row``)
        name = (rel or "").partition("#")[0]
        for f in (Path(name), Path(name).with_suffix(".md")) if name else ():
            if (ROOT / "benchmarks" / "results" / f).exists():
                (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / f).write_text((ROOT / "benchmarks" / "results" / f).read_text())
    assert "| 5.00 | 2.00 | 3.00 | 31.0 % | 20.0 |" in tables.training_table()
    assert "`current/train.json`" in tables.training_table()


def test_collect_replaces_a_case_run_again_and_keeps_the_others(tables, tmp_path):
    """Cases may run in separate calls: each collect merges its rows by case; a failed run leaves the row it had."""
    def run(case, step_s, rc=0):
        out = tmp_path / "train" / case
        out.mkdir(parents=True, exist_ok=True)
        row = dict(case=case, returncode=rc) | (dict(step_s=step_s) if rc == 0 else {})
        (out / "grpo_gpu.json").write_text(json.dumps([row]))

    run("a", 1.0)
    run("b", 2.0)
    tables.collect(tmp_path)
    run("a", 3.0)
    run("b", None, rc=1)
    path = tables.collect(tmp_path)
    for case in ("a", "b"):   # only what is merged is kept: the per-case folders may go
        (tmp_path / "train" / case / "grpo_gpu.json").unlink()
    tables.collect(tmp_path)
    rows = json.loads(path.read_text())
    assert [(r["case"], r["step_s"]) for r in rows] == [("a", 3.0), ("b", 2.0)]
    assert len(path.read_text().splitlines()) == 4   # one row a line


def test_every_result_path_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"benchmarks/results/([\w./-]+)", readme))
    named |= {m for m in re.findall(r"`([\w.-]+/[\w./-]*)`", readme)
              if (ROOT / "benchmarks" / "results" / m.split("/")[0]).is_dir()}
    named.discard("current")   # the canonical command's folder, made by running it
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / "results" / n.rstrip("/.")).exists())
    assert not missing, missing
