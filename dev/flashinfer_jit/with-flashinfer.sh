#!/usr/bin/env bash
# Runs a command with FlashInfer's JIT sources (and ninja) in the offline sglang site (build.sh beside this file):
#   bash .sglang/with-sglang.sh bash .sglang/with-flashinfer.sh COMMAND...
# The site must be unpacked already (with-sglang.sh does it). FlashInfer compiles a kernel at its first
# use with nvcc (~3 min for an engine's attention) into FLASHINFER_WORKSPACE_BASE (default /tmp/flashinfer-jit).
# Like with-sglang.sh's caches: the workspace is restored from CACHE_DIR/flashinfer.tar.xz (default .sglang/cache)
# and saved to CACHE_OUT after the command (sources, objects and ninja's logs with the kernels: ninja rebuilds
# what it cannot find up to date), unless the packed workspace exceeds FLASHINFER_CACHE_MAX_MB (default 16: the
# device call's carry holds 64 MiB in all).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE=${SGLANG_SITE_PARENT:-/tmp}/sglang-site
CACHE_DIR=${CACHE_DIR:-$HERE/cache}
CACHE_OUT=${CACHE_OUT:-$CACHE_DIR}
[ -d "$SITE/flashinfer" ] || { echo "no $SITE/flashinfer: run inside .sglang/with-sglang.sh" >&2; exit 3; }
[ -d "$SITE/flashinfer/data/include" ] || tar -xJf "$HERE/flashinfer-data.tar.xz" -C "$SITE" \
  || { echo "cannot unpack $HERE/flashinfer-data.tar.xz" >&2; exit 3; }
command -v ninja >/dev/null || export PATH="$SITE/bin:$PATH"   # the ninja build.sh packed
command -v nvcc >/dev/null || echo "with-flashinfer: no nvcc on PATH; FlashInfer cannot compile its kernels" >&2
export SGLANG_IS_FLASHINFER_AVAILABLE=true
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer-jit}
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if [ -f "$CACHE_DIR/flashinfer.tar.xz" ]; then
  tar -xJf "$CACHE_DIR/flashinfer.tar.xz" -C "$FLASHINFER_WORKSPACE_BASE" \
    && echo "with-flashinfer: kernels restored from $CACHE_DIR/flashinfer.tar.xz" >&2
fi
since=$(mktemp /tmp/flashinfer-since-XXXX)   # what the command compiled is newer than this
"$@"
rc=$?
packed=$(mktemp /tmp/flashinfer-XXXX.tar.xz)
# packed again only when the command compiled something (xz over the objects costs device time)
if [ -n "$(find "$FLASHINFER_WORKSPACE_BASE" -type f -newer "$since" -print -quit)" ] \
   && tar -cJf "$packed" -C "$FLASHINFER_WORKSPACE_BASE" . 2>/dev/null; then
  mb=$(( $(stat -c %s "$packed") / 1048576 ))
  if [ "$mb" -le "${FLASHINFER_CACHE_MAX_MB:-16}" ]; then
    mkdir -p "$CACHE_OUT" && mv "$packed" "$CACHE_OUT/flashinfer.tar.xz" && echo "with-flashinfer: kernels saved ($mb MB)" >&2
  else
    echo "with-flashinfer: the compiled workspace packs to $mb MB, above FLASHINFER_CACHE_MAX_MB; not saved" >&2
  fi
fi
rm -f "$packed" "$since"
exit $rc
