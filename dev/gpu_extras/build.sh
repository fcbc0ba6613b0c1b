#!/usr/bin/env bash
# Builds the offline "extras" sites for the GPU machine (Python 3.12.3, torch 2.11.0+cu130,
# numpy 2.5.2, no network): Jupyter (nbclient/nbformat/ipykernel/jupyter_client, ipywidgets,
# jupytext) + matplotlib + pandas + torch_memory_saver, minus what the offline sglang site
# (.sglang/sglang-site.tar.xz) already ships. Run here (PyPI access needed), from the repo root:
#   bash dev/gpu_extras/build.sh [OUT_DIR]        # OUT_DIR defaults to .gpu-extras (git-ignored)
# then carry OUT_DIR/extras-site-lean.tar.xz and OUT_DIR/with-extras.sh to the GPU machine.
# Makes two tarballs (with-extras.sh unpacks either; see GPU_EXTRAS_TARBALL there):
#   extras-site.tar.xz       full: self-contained, also ships matplotlib, pandas, Pillow and their
#                            deps (does not rely on the GPU venv having them)
#   extras-site-lean.tar.xz  lean: leaves out what the GPU venv was seen to have
#                            (gpu-venv-pip-list.txt: matplotlib 3.11.2, pandas 3.0.6, pillow 12.3.0,
#                            psutil 7.2.2, pygments 2.21.0, python-dateutil 2.9.0.post0 + six, ...)
# Never shipped (present elsewhere at run time):
#   sglang site: IPython 9.18.1, traitlets 5.16.1, pyzmq 27.3.0, nest_asyncio 1.6.0, typing_extensions 4.16.0
#   GPU venv:    numpy, torch, packaging, pyyaml, tqdm
#   JS-only:     widgetsnbextension, jupyterlab_widgets (ipywidgets' front-end halves; no Python imports them)
#   optional:    debugpy (ipykernel imports it in try/except; only the notebook debugger needs it)
set -euo pipefail
SRC=$(cd "$(dirname "$0")" && pwd)
mkdir -p "${1:-.gpu-extras}"
HERE=$(cd "${1:-.gpu-extras}" && pwd)
cp "$SRC/with-extras.sh" "$SRC/check_imports.py" "$HERE/"
WHEELS=$HERE/wheels
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_12_x86_64
      --platform manylinux2010_x86_64)
# pin what the sglang site already has, so the resolver agrees with it
CONSTRAINTS=$(mktemp)
printf '%s\n' ipython==9.18.1 traitlets==5.16.1 pyzmq==27.3.0 nest_asyncio==1.6.0 typing_extensions==4.16.0 > "$CONSTRAINTS"
mkdir -p "$WHEELS"
pip download -q -d "$WHEELS" "${PLAT[@]}" -c "$CONSTRAINTS" \
  nbclient nbformat ipykernel jupyter_client matplotlib matplotlib-inline pandas ipywidgets jupytext \
  torch_memory_saver
rm -f "$CONSTRAINTS"

SKIP_ALWAYS='numpy|ipython|traitlets|pyzmq|nest_asyncio|typing_extensions|packaging|pyyaml|debugpy|widgetsnbextension|jupyterlab_widgets'
SKIP_LEAN='matplotlib|pandas|pillow|contourpy|kiwisolver|fonttools|cycler|pyparsing|python_dateutil|tzdata|psutil|pygments|attrs|markdown_it_py|mdurl'

slim() {  # in the staged site dir
  rm -rf bin etc share/man share/jupyter/labextensions share/jupyter/nbextensions jupyterlab_jupytext
  find . -depth -type d -name __pycache__ -exec rm -rf {} +
  rm -rf pandas/tests matplotlib/tests mpl_toolkits/*/tests tornado/test jsonschema/tests \
         referencing/tests ipywidgets/tests ipywidgets/widgets/tests jsonschema_specifications/tests \
         nbformat/corpus/tests
  if [ -d matplotlib ]; then
    # sample data and the serif DejaVu faces go; DejaVu Sans (+Mono, Display), LastResortHE
    # (appended to every font lookup), STIX and Computer Modern (mathtext's fallbacks: without
    # them every $...$ label logs ~20 findfont warnings) stay
    rm -rf matplotlib/mpl-data/sample_data
    rm -f matplotlib/mpl-data/fonts/ttf/DejaVuSerif*.ttf
    rm -f matplotlib/backends/_tkagg*.so   # Tk GUI backend: cannot run headless
  fi
  # optional accelerators with pure-Python fallbacks (fontTools: only the PDF/PS/SVG font
  # subsetting uses it; wcwidth: try/except import)
  if [ -d fontTools ]; then find fontTools -name '*.so' -delete; fi
  rm -f wcwidth/_wcwidth_c*.so
  # Pillow: the Tk bridge and the AVIF plugin (optional, try/except import) with the library only it links
  rm -f PIL/_imagingtk*.so PIL/_avif*.so pillow.libs/libavif-*.so*
  # type stubs: not read at run time (jedi's typeshed is: keep its stdlib half for completions,
  # drop the 25 MB of third-party stubs)
  find . -name '*.pyi' ! -path './jedi/third_party/*' -delete
  rm -rf jedi/third_party/typeshed/stubs jedi/third_party/django-stubs
  # torch_memory_saver: on CUDA torch it only loads <stem>_cu<torch.version.cuda major>.abi3.so; the
  # GPU machine's torch is cu130, so keep the _cu13 builds (the unsuffixed ones are for ROCm)
  rm -f torch_memory_saver_hook_mode_preload.abi3.so torch_memory_saver_hook_mode_torch.abi3.so \
        torch_memory_saver_hook_mode_*_cu12.abi3.so
  # debug info: strip shared objects that auditwheel did not patch (no RPATH/RUNPATH; stripping
  # patchelf-edited files is the risky case, so Pillow's stay as shipped)
  find . -name '*.so*' -type f | while read -r f; do
    if ! readelf -d "$f" 2>/dev/null | grep -qE 'RPATH|RUNPATH'; then strip --strip-unneeded "$f"; fi
  done
  # RECORD files: keep only the lines for files still shipped (jedi's listed 20k deleted stubs)
  python3 - <<'PY'
import csv, glob, os
for rec in glob.glob("*.dist-info/RECORD"):
    with open(rec, newline="") as f:
        rows = [r for r in csv.reader(f) if r and os.path.exists(r[0])]
    with open(rec, "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
PY
  # the kernelspec stays ipykernel's (argv "python": jupyter_client swaps in sys.executable)
}

build() {  # build VARIANT STAGE_DIR TARBALL SKIP_REGEX
  local stage=$2 tarball=$3 skip="^($4)-"
  local sel
  mapfile -t sel < <(cd "$WHEELS" && ls *.whl | grep -viE "$skip")
  rm -rf "$stage"
  (cd "$WHEELS" && pip install -q --no-deps --no-compile --ignore-requires-python --target "$stage" \
     "${PLAT[@]}" "${sel[@]}")
  (cd "$stage" && slim)
  tar -C "$(dirname "$stage")" --transform "s,^$(basename "$stage"),gpu-extras-site," \
      --owner=0 --group=0 --sort=name -cf - "$(basename "$stage")" | xz -9e -T1 > "$tarball"
  echo "$1: $(du -b "$tarball" | cut -f1) bytes  $tarball"
}

build full "$HERE/site" "$HERE/extras-site.tar.xz" "$SKIP_ALWAYS"
build lean "$HERE/site-lean" "$HERE/extras-site-lean.tar.xz" "$SKIP_ALWAYS|$SKIP_LEAN"
