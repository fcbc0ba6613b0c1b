#!/usr/bin/env bash
# Runs a command with the offline TRL site on the GPU machine, from the checkout's root:
#   bash .trl-site/with-trl.sh python benchmarks/trl_peer.py --out $OUT/trl_peer.json
# Unpacks trl-site.tar.xz (next to this script) and ../.sglang/sglang-site.tar.xz into /tmp once, and
# sets PYTHONPATH = trl-site : sglang-site : checkout. trl-site comes first (it only adds packages the
# other two lack); the sglang site is needed for transformers 5.12.1 / tokenizers 0.22.2. The sglang
# site's sitecustomize.py is then on the path too (it only keeps sglang off FlashInfer: harmless here).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE_PARENT=${TRL_SITE_PARENT:-/tmp}
SG_TAR=${SGLANG_TARBALL:-$PWD/.sglang/sglang-site.tar.xz}
[ -d "$SITE_PARENT/trl-site" ] || tar -xJf "$HERE/trl-site.tar.xz" -C "$SITE_PARENT" || { echo "cannot unpack $HERE/trl-site.tar.xz" >&2; exit 3; }
[ -d "$SITE_PARENT/sglang-site" ] || tar -xJf "$SG_TAR" -C "$SITE_PARENT" || { echo "cannot unpack $SG_TAR" >&2; exit 3; }
export PYTHONPATH="$SITE_PARENT/trl-site:$SITE_PARENT/sglang-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "$@"
