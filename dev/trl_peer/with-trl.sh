#!/usr/bin/env bash
# Runs a command with the offline TRL site on the GPU machine, from the checkout's root:
#   bash .trl-site/with-trl.sh python benchmarks/trl_peer.py --out $OUT/trl_peer.json
# Unpacks trl-site.tar.xz (next to this script) into /tmp once and sets PYTHONPATH = trl-site : checkout.
# The site ships transformers and tokenizers at the sglang site's versions (build.sh), so the call
# carries it alone; the GPU venv gives torch, peft and the rest.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SITE_PARENT=${TRL_SITE_PARENT:-/tmp}
[ -d "$SITE_PARENT/trl-site/transformers" ] || { rm -rf "$SITE_PARENT/trl-site"; tar -xJf "$HERE/trl-site.tar.xz" -C "$SITE_PARENT"; } \
  || { echo "cannot unpack $HERE/trl-site.tar.xz" >&2; exit 3; }
export PYTHONPATH="$SITE_PARENT/trl-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec "$@"
