"""Build and load the native ``segki`` extension (just in time, ninja, cached per torch version and arch).

Ahead of time: ``python -m segki_lightning.ops.build`` builds for the visible GPU and prints where;
``python -m segki_lightning.ops.build --arch 9.0`` builds for sm_90 without a GPU (CI does this).
"""
from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch

from .extension import kernel_sources

NAME = "segki_ext"
# Link the C++ runtime that torch uses, by its soname and kept: a toolchain whose default link took the static
# libstdc++ archive gave the extension its own copy of the runtime, and then a failed TORCH_CHECK (thrown in
# libc10, unwound through the extension) ended the process with a segmentation fault
# (benchmarks/error_path.py; benchmarks/results/error_path/)
LINK_LIBSTDCXX = ("-Wl,--no-as-needed", "-l:libstdc++.so.6", "-Wl,--as-needed")


def _arch_list(arch: str | None) -> str:
    if arch:
        return arch
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build_dir(arch: str) -> Path:
    root = Path(os.environ.get("SEGKI_CACHE", Path.home() / ".cache" / "segki_lightning"))
    tag = f"torch{torch.__version__.replace('+', '_')}-sm{arch.replace('.', '')}"
    path = root / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def _include_dirs() -> list[str]:
    """The pip CUDA headers (``nvidia/cu13/include``) when present: torch's headers need them."""
    site = Path(sysconfig.get_paths()["purelib"])
    return [str(p) for p in sorted(site.glob("nvidia/cu*/include")) if p.is_dir()]


def compile_library(name: str, sources: list[Path], out: Path, arch: str, extra_ldflags: tuple[str, ...] = (),
                    verbose: bool = False, include_dirs: tuple[Path, ...] = ()) -> Path:
    """Compile (if needed) ``sources`` into ``out/<name>.so`` for ``arch`` and load it into ``torch.ops``
    (``include_dirs``: more header folders, e.g. the extension's own for a benchmark's kernels)."""
    if "CUDA_HOME" not in os.environ and Path("/usr/local/cuda/bin/nvcc").exists():
        os.environ["CUDA_HOME"] = "/usr/local/cuda"  # before cpp_extension derives it from a wrapper nvcc
    from torch.utils.cpp_extension import load as cpp_load

    os.environ["TORCH_CUDA_ARCH_LIST"] = arch
    cpp_load(name=name, sources=[str(s) for s in sources], build_directory=str(out), extra_cflags=["-O3"],
             extra_cuda_cflags=["-O3", "-lineinfo"], extra_ldflags=list(extra_ldflags),
             extra_include_paths=[*map(str, include_dirs), *_include_dirs()], is_python_module=False, verbose=verbose)
    return out / f"{name}.so"


def load(arch: str | None = None, verbose: bool = False) -> Path:
    """Compile (if needed) and load the extension into ``torch.ops.segki``; return the library path."""
    arch = _arch_list(arch)
    so = compile_library(NAME, kernel_sources(), build_dir(arch), arch, LINK_LIBSTDCXX, verbose)
    from . import fake  # noqa: F401  (meta implementations for tracing / torch.compile)

    return so


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help="compute capability to build for, e.g. 9.0 (default: the visible GPU)")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    if args.arch is None and not torch.cuda.is_available():
        parser.error("no CUDA device visible: pass --arch (e.g. --arch 9.0) to build without a GPU")
    print(load(args.arch, args.verbose))


if __name__ == "__main__":
    main()
