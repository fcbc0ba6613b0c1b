#!/usr/bin/env bash
# Builds the offline TRL site for the GPU machine (issue 36: TRL's GRPOTrainer as the peer).
#   bash dev/trl_peer/build.sh [OUT_DIR]      # default .trl-site (git-ignored); needs PyPI here
# Ships trl 1.16.0, accelerate 1.16.0, datasets 4.8.5 (hub>=0.25,<2: fits transformers 5.12.1's
# hub>=1.5,<2; datasets 5.x needs hub>=1.31, which the GPU venv may lack), pyarrow 23.0.1 (slimmed:
# no gandiva/tests/headers), xxhash, multiprocess 0.70.19, fsspec 2026.2.0,
# requests + urllib3/idna/certifi/charset_normalizer.
# and, as the offline sglang site has them, transformers 5.12.1, tokenizers 0.22.2 and dill 0.4.1, so a device
# call carries this site alone (the sglang site beside it passes the 64 MiB a call may carry).
# NOT shipped, found in the GPU venv: torch, numpy, triton, peft, safetensors, huggingface_hub (1.x), httpx,
#   pandas (3.0.6 seen), psutil, pyyaml, regex, tqdm, filelock, packaging, jinja2, typing_extensions
# On the GPU machine, from the checkout's root: bash .trl-site/with-trl.sh python benchmarks/trl_peer.py
set -euo pipefail
SRC=$(cd "$(dirname "$0")" && pwd)
OUT=$(mkdir -p "${1:-.trl-site}" && cd "${1:-.trl-site}" && pwd)
CACHE=${WHEEL_CACHE:-/tmp/trl-wheel-cache}
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$CACHE"
P=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
   --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
   --platform manylinux1_x86_64 --platform any)
WHEELS=(trl==1.16.0 accelerate==1.16.0 datasets==4.8.5 pyarrow==23.0.1 xxhash==4.1.0 multiprocess==0.70.19
        fsspec==2026.2.0 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1
        charset_normalizer==3.5.3 transformers==5.12.1 tokenizers==0.22.2 dill==0.4.1)
python3 -m pip download -q --no-deps "${P[@]}" -d "$CACHE" "${WHEELS[@]}"
SITE=$WORK/trl-site
for w in "${WHEELS[@]}"; do
  n=${w%%==*}; v=${w#*==}; f=$(ls "$CACHE"/${n//-/_}-"$v"-*.whl "$CACHE"/${n}-"$v"-*.whl 2>/dev/null | head -1)
  python3 -m pip install -q --no-deps --no-index --no-compile "${P[@]}" --target "$SITE" "$f"
done
cd "$SITE"
rm -rf bin
find . -depth -type d \( -name __pycache__ -o -name tests \) -exec rm -rf {} +
find . -name '*.pyi' -delete
# pyarrow: datasets imports pyarrow, .compute, .dataset, .parquet, .json (libarrow, _acero, _dataset,
# _compute, _parquet); pyarrow.lib links libarrow_substrait and libarrow_flight, so they stay; gandiva, the C++
# headers, Cython sources, cmake/pkgconfig go. Every library a kept .so needs must be in the site (checked below)
rm -rf pyarrow/include pyarrow/src pyarrow/lib/cmake pyarrow/lib/pkgconfig
rm -f pyarrow/*gandiva* pyarrow/libgandiva* pyarrow/*.pyx pyarrow/*.pxd pyarrow/*.pxi pyarrow/*.cpp pyarrow/*.h
rm -rf pyarrow/includes pyarrow/interchange/tests
for f in $(find pyarrow -name '*.so*' -type f); do
  dyn=$(readelf -d "$f" 2>/dev/null) || dyn=
  grep -qE 'RPATH|RUNPATH' <<< "$dyn" || strip --strip-unneeded "$f" 2>/dev/null || true
  for need in $(sed -n 's/.*Shared library: \[\(libarrow[^]]*\|libparquet[^]]*\)\].*/\1/p' <<< "$dyn"); do
    [ -e "pyarrow/$need" ] || { echo "$f needs pyarrow/$need, which the slimming removed" >&2; exit 1; }
  done
done
cd "$WORK"
tar --owner=0 --group=0 --sort=name -cf - trl-site | xz -9 -T1 > "$OUT/trl-site.tar.xz"
cp "$SRC/with-trl.sh" "$OUT/with-trl.sh"
echo "wrote $OUT/trl-site.tar.xz: $(stat -c %s "$OUT/trl-site.tar.xz") bytes; site $(du -sm "$SITE" | cut -f1) MiB unpacked"
