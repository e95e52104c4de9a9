#!/usr/bin/env bash
# One GPU session: build the extension, run the GPU tests, the kernel and the decode benchmarks
# (transformers eager at batch 1 only; the torch.compile baseline needs its own call: 80-160 s warm-up).
#   bash benchmarks/run_gpu.sh --out DIR [pytest -k expression]
set -uo pipefail
[[ ${1:-} == --out ]] || { echo "usage: $0 --out DIR [-k EXPR]"; exit 2; }
out=$2; shift 2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 -m segki_lightning.ops.build > "$out/build.log" 2>&1 || { grep -m 20 error "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -x tests/gpu -p no:cacheprovider "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -25
python3 benchmarks/kernels.py --out "$out" > "$out/kernels.log" 2>&1; tail -45 "$out/kernels.log" | cut -c1-110
python3 benchmarks/decode.py --out "$out" --hf-eager-batches 1 --hf-compile-batches > "$out/decode.log" 2>&1; tail -32 "$out/decode.log" | cut -c1-160
