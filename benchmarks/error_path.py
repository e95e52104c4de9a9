"""Why a failed ``TORCH_CHECK`` inside the native extension ends the process instead of raising.

Builds one-op extensions with the project's build call (``torch.utils.cpp_extension.load``, the same flags) whose
only op fails a ``TORCH_CHECK`` -- once from a C++ source, once from a CUDA source -- each linked two ways: with the
toolchain's defaults (how the project linked before) and with ``libstdc++.so.6`` named first and kept
(``build.LINK_LIBSTDCXX``, how it links now). Each
is called in a child process. Also records, for the built project extension, its ``NEEDED`` libraries and where its
C++ runtime symbols come from. Writes ``error_path.json`` and prints a table.

    python benchmarks/error_path.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor fail_{tag}(const at::Tensor& x) {{
  TORCH_CHECK(x.dim() == 7, "fail_{tag}: x has ", x.dim(), " dims");
  return x;
}}
TORCH_LIBRARY({lib}, m) {{ m.def("fail_{tag}(Tensor x) -> Tensor"); }}
TORCH_LIBRARY_IMPL({lib}, CompositeExplicitAutograd, m) {{ m.impl("fail_{tag}", &fail_{tag}); }}
"""
RUNTIME_SYMBOLS = ("__cxa_throw", "__cxa_allocate_exception", "__cxa_begin_catch", "__gxx_personality_v0",
                   "_Unwind_Resume", "_ZNSo3putEc", "torchCheckFail")


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True).stdout


def needed(so: Path) -> list[str]:
    return [line.split("[")[-1].rstrip("]") for line in sh("readelf", "-d", str(so)).splitlines() if "NEEDED" in line]


def symbol_kinds(so: Path) -> dict[str, str]:
    """``U`` (imported) or ``T``/``W`` (defined inside) for each C++ runtime symbol the library names (every
    overload of c10's ``torchCheckFail`` under one name)."""
    out = {}
    for line in sh("nm", "-D", str(so)).splitlines():
        parts = line.split()
        name = parts[-1].split("@")[0]
        for short in (s for s in RUNTIME_SYMBOLS if s == name or (s == "torchCheckFail" and s in name)):
            out[short] = parts[-2]
    return out


def build(name: str, suffix: str, ldflags: list[str], folder: Path, arch: str) -> Path:
    from segki_lightning.ops.build import compile_library

    src = folder / f"{name}{suffix}"
    src.write_text(SOURCE.format(tag=name, lib=name))
    (folder / name).mkdir()
    return compile_library(name, [src], folder / name, arch, tuple(ldflags))


CALL = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    getattr(getattr(torch.ops, sys.argv[2]), "fail_" + sys.argv[2])(torch.zeros(2))
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0][:100])
"""


def call(so: Path, name: str) -> dict:
    proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", CALL, str(so), name], capture_output=True,
                          text=True, timeout=300)
    fault = [line for line in proc.stderr.splitlines() if "Fatal Python error" in line or "File " in line][:8]
    return {"exit": proc.returncode, "stdout": proc.stdout.strip(), "fault": fault}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from segki_lightning.ops.build import LINK_LIBSTDCXX, NAME, _arch_list, build_dir

    arch = _arch_list(None if torch.cuda.is_available() else "9.0")
    project = build_dir(arch) / f"{NAME}.so"
    report = {"torch": torch.__version__, "cxx": sh("c++", "--version").splitlines()[:1],
              "libstdcxx_for_linker": sh("c++", "-print-file-name=libstdc++.so").strip(),
              "libstdcxx_static": sh("c++", "-print-file-name=libstdc++.a").strip(),
              "project": {"needed": needed(project), "symbols": symbol_kinds(project)} if project.exists() else None,
              "libc10": {"symbols": symbol_kinds(Path(torch.__file__).parent / "lib" / "libc10.so")}, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for suffix, kind in ((".cpp", "cpp"), (".cu", "cuda")):
            for link, flags in (("default", []), ("keep_libstdcxx", list(LINK_LIBSTDCXX))):
                name = f"check_{kind}_{link}"
                so = build(name, suffix, flags, Path(tmp), arch)
                report["cases"].append({"source": kind, "link": link, "needed": needed(so),
                                        "symbols": symbol_kinds(so), **call(so, name)})
    (args.out / "error_path.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "cases"}, indent=1))
    print("| source | link | exit | libstdc++ needed | __cxa_throw | result |")
    print("|---|---|---|---|---|---|")
    for c in report["cases"]:
        print(f"| {c['source']} | {c['link']} | {c['exit']} | {'libstdc++.so.6' in c['needed']} | "
              f"{c['symbols'].get('__cxa_throw', '-')} | {c['stdout'] or c['fault']} |")


if __name__ == "__main__":
    main()
