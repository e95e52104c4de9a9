"""A non-editable install runs segki-train: the wheel ships the recipes and every config group inside the package,
and the entry point finds them there (CI also installs it with `pip install .` and runs the main job)."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_recipes_and_config_groups(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
    for f in ROOT.glob("recipes/*.yaml"):
        assert f"segki_lightning/recipes/{f.name}" in names, f
    for f in ROOT.glob("configs/*/*.yaml"):
        assert f"segki_lightning/configs/{f.parent.name}/{f.name}" in names, f
    assert "segki_lightning/csrc/bindings.cpp" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(next(tmp_path.glob("*.whl")))], check=True, capture_output=True, timeout=600)
    probe = ("import segki_lightning.train as t; print(t.RECIPES); "
             "assert (t.RECIPES / 'grpo.yaml').exists() and (t.CONFIGS / 'task' / 'jsonl.yaml').exists()")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert got.returncode == 0 and str(target) in got.stdout, got.stderr[-2000:]


def test_the_readme_lightning_snippet_runs_as_written(tmp_path, monkeypatch):
    """The README's Python example is complete: executed as it stands (CPU, the embedded tiny model), it trains."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Lightning"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["trainer"].global_step == 10
