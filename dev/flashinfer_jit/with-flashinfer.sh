#!/usr/bin/env bash
# Runs a command with FlashInfer's JIT sources (and ninja) in the offline sglang site (build.sh beside this file):
#   bash .sglang/with-sglang.sh bash .sglang/with-flashinfer.sh COMMAND...
# The site must be unpacked already (with-sglang.sh does it). FlashInfer compiles a kernel at its first
# use with nvcc (minutes) into FLASHINFER_WORKSPACE_BASE (default /tmp/flashinfer-jit); set it to a folder
# you bring back to keep the kernels for the next machine.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${SGLANG_SITE_PARENT:-/tmp}/sglang-site
[ -d "$SITE/flashinfer" ] || { echo "no $SITE/flashinfer: run inside .sglang/with-sglang.sh" >&2; exit 3; }
[ -d "$SITE/flashinfer/data/include" ] || tar -xJf "$HERE/flashinfer-data.tar.xz" -C "$SITE" \
  || { echo "cannot unpack $HERE/flashinfer-data.tar.xz" >&2; exit 3; }
command -v ninja >/dev/null || export PATH="$SITE/bin:$PATH"   # the ninja build.sh packed
command -v nvcc >/dev/null || echo "with-flashinfer: no nvcc on PATH; FlashInfer cannot compile its kernels" >&2
export SGLANG_IS_FLASHINFER_AVAILABLE=true
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
exec "$@"
