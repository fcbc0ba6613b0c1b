#!/usr/bin/env bash
# FlashInfer's JIT sources for the offline sglang stack, which leaves them out (../../shared/sglang-offline):
# with them, and nvcc on the GPU machine (CUDA 13.0 there), SGLang can run its default attention
# (attention_backend=flashinfer) instead of triton. Run here, after the stack's build.sh (its wheel cache):
#   bash dev/flashinfer_jit/build.sh [OUT_DIR]     # OUT_DIR defaults to .sglang (carried with it)
# writes OUT_DIR/flashinfer-data.tar.xz (~10 MB; CUTLASS's and CCCL's Python, examples and tests left out)
# and OUT_DIR/with-flashinfer.sh; on the GPU machine, inside the stack's wrapper:
#   bash .sglang/with-sglang.sh bash .sglang/with-flashinfer.sh python benchmarks/lora_decode_gpu.py ...
set -euo pipefail
OUT=${1:-.sglang}
WHEEL=$(ls "${WHEEL_CACHE:-${TMPDIR:-/tmp}/sglang-wheel-cache}"/flashinfer_python-0.6.15.post1-*.whl 2>/dev/null | head -1)
if [ -z "$WHEEL" ]; then
  WHEEL_DIR=$(mktemp -d)
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: -d "$WHEEL_DIR" \
    flashinfer-python==0.6.15.post1
  WHEEL=$(ls "$WHEEL_DIR"/flashinfer_python-*.whl)
fi
WORK=$(mktemp -d)
python3 - "$WHEEL" "$WORK" <<'P'
import sys, zipfile
wheel, out = sys.argv[1:]
skip = ("flashinfer/data/cutlass/python/", "flashinfer/data/cutlass/examples/", "flashinfer/data/cutlass/test/",
        "flashinfer/data/cutlass/tools/", "flashinfer/data/cccl/python/")
keep = ("flashinfer/data/cutlass/tools/util/include/",)   # cutlass/util/*.h: the sm90 prefill kernels include them
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("flashinfer/data/") and (n.startswith(keep) or not n.startswith(skip))]
    z.extractall(out, names)
print(f"{len(names)} files from {wheel}")
P
# ninja, which FlashInfer's JIT runs (the GPU machine's venv may lack it): its binary into bin/
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 --python-version 3.12 \
  -d "$WORK/ninja-wheel" ninja==1.13.2
python3 - "$WORK" <<'P'
import glob, os, sys, zipfile
work = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{work}/ninja-wheel/ninja-*.whl")[0]) as z:
    os.makedirs(f"{work}/bin", exist_ok=True)
    with open(f"{work}/bin/ninja", "wb") as out:
        out.write(z.read("ninja-1.13.2.data/scripts/ninja"))
os.chmod(f"{work}/bin/ninja", 0o755)
P
mkdir -p "$OUT"
tar -cJf "$OUT/flashinfer-data.tar.xz" -C "$WORK" flashinfer bin
cp "$(dirname "$0")/with-flashinfer.sh" "$OUT/"
rm -rf "$WORK"
ls -la "$OUT/flashinfer-data.tar.xz"
