#!/usr/bin/env bash
# Runs a command with the offline "extras" site (nbclient/nbformat/ipykernel/jupyter_client,
# ipywidgets, jupytext, matplotlib, pandas, torch_memory_saver) on the GPU node, from the
# checkout's root. Meant to sit inside the sglang wrapper:
#   bash .sglang/with-sglang.sh bash .gpu-extras/with-extras.sh python .gpu-extras/check_imports.py
# build.sh makes, next to this script, extras-site.tar.xz (full, self-contained) and
# extras-site-lean.tar.xz (relies on the GPU venv's matplotlib/pandas/Pillow/psutil/pygments/
# python-dateutil). This script unpacks $GPU_EXTRAS_TARBALL if set, else extras-site.tar.xz if it
# is here, else extras-site-lean.tar.xz: carry just the one you want.
#
# What it sets (each only adds to / defaults what the caller has):
#   PYTHONPATH   extras site APPENDED, so the sglang site and the checkout (put first by
#                with-sglang.sh) win; note that PYTHONPATH entries still come before the venv's
#                site-packages, so a package shipped here that the venv also has is taken from
#                here (full tarball: pandas 3.1.1 over the venv's 3.0.6, Pillow 13.0.0 over 12.3.0,
#                python-dateutil 4.0.0 over 2.9.0.post0, fonttools, markdown-it-py; same versions
#                for matplotlib, psutil, pygments, attrs...). The lean tarball has no such overlap.
#   JUPYTER_PATH extras' share/jupyter appended: the `python3` kernelspec (ipykernel's own,
#                argv "python -m ipykernel_launcher"; jupyter_client swaps "python" for
#                sys.executable) is findable. A kernelspec dir put earlier on JUPYTER_PATH
#                (as tests/notebook_helpers.write_kernelspec does) still wins. Kernels inherit
#                this whole environment (PYTHONPATH included) from the nbclient process.
#   JUPYTER_RUNTIME_DIR  default /tmp/gpu-extras-jupyter/runtime (connection files), so an
#                unwritable $HOME does not matter.
#   MPLBACKEND   default Agg (headless scripts).
#   IPYTHONDIR   default /tmp/gpu-extras-ipython, holding a profile whose ipython_kernel_config.py
#                sets IPKernelApp.matplotlib = "inline". Why: ipykernel only picks the inline
#                backend when MPLBACKEND is unset, so with MPLBACKEND=Agg inherited, plt.show()
#                and end-of-cell figures in an nbclient kernel would yield no image/png outputs
#                (notebook 03's test counts them). The profile makes kernels inline again.
#                Set IPYTHONDIR yourself to opt out.
#   LD_LIBRARY_PATH  torch_memory_saver (see below) only: the venv's CUDA 13 runtime dir is
#                appended when libcudart.so.13 is not in the loader cache (on the GPU machine it
#                is, from /usr/local/cuda-13.0, so nothing is added there).
#   GPU_EXTRAS_SITE, GPU_EXTRAS_TMS_PRELOAD  informational: the site dir, and the preload .so.
#
# torch_memory_saver (SGLang's --enable-memory-saver / Engine(enable_memory_saver=True)):
#   The wheel ships prebuilt hooks; on CUDA torch it loads
#   <site>/torch_memory_saver_hook_mode_{preload,torch}_cu13.abi3.so (cu13 from
#   torch.version.cuda; NEEDED: libcuda.so.1 from the driver, libcudart.so.13, libstdc++).
#   SGLang uses the default hook_mode "preload": when it spawns each scheduler process it wraps
#   proc.start() in torch_memory_saver.configure_subprocess(), which puts the preload .so on
#   LD_PRELOAD for the child (it interposes cudaMalloc/cudaFree). Nothing has to be exported by
#   hand; but ld.so resolves the .so's NEEDED libcudart.so.13 at the child's exec, before torch
#   can load its own copy from site-packages/nvidia/cu13/lib, so that dir must be findable: hence
#   the LD_LIBRARY_PATH addition below. Also PYTORCH_CUDA_ALLOC_CONF must not contain
#   expandable_segments:True (torch_memory_saver refuses to start then).
#   Your own scripts using torch_memory_saver directly: either run them with
#   LD_PRELOAD=$GPU_EXTRAS_TMS_PRELOAD (default hook mode), or set
#   torch_memory_saver.torch_memory_saver.hook_mode = "torch" before the first region() (a torch
#   CUDAPluggableAllocator, no LD_PRELOAD; cuda_graph() then is unsupported).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
TARBALL=${GPU_EXTRAS_TARBALL:-$HERE/extras-site.tar.xz}
[ -n "${GPU_EXTRAS_TARBALL:-}" ] || [ -r "$TARBALL" ] || TARBALL=$HERE/extras-site-lean.tar.xz
SITE_PARENT=${GPU_EXTRAS_PARENT:-/tmp}
SITE=$SITE_PARENT/gpu-extras-site

# unpack once per node; the stamp (the tarball's checksum) makes a rebuilt tarball replace it.
# Unpacks into a temp dir and renames, under a lock, so concurrent first runs cannot see half a site.
unpack() {
  local stamp tmp
  stamp=$(cksum < "$TARBALL" | cut -d' ' -f1-2) || return 1
  [ "$(cat "$SITE/.stamp" 2>/dev/null)" = "$stamp" ] && return 0
  tmp=$(mktemp -d "$SITE_PARENT/gpu-extras-unpack.XXXXXX") || return 1
  if tar -xJf "$TARBALL" -C "$tmp" && echo "$stamp" > "$tmp/gpu-extras-site/.stamp"; then
    rm -rf "$SITE" && mv -T "$tmp/gpu-extras-site" "$SITE"
  fi
  local rc=$?
  rm -rf "$tmp"
  return $rc
}
[ -r "$TARBALL" ] || { echo "with-extras.sh: no $TARBALL (build it with .gpu-extras/build.sh, and carry it)" >&2; exit 3; }
mkdir -p "$SITE_PARENT"
if command -v flock >/dev/null; then
  ( flock 9 && unpack ) 9>"$SITE_PARENT/gpu-extras-site.lock"
else
  unpack
fi || { echo "with-extras.sh: cannot unpack $TARBALL into $SITE" >&2; exit 3; }

export GPU_EXTRAS_SITE=$SITE
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE"
export JUPYTER_PATH="${JUPYTER_PATH:+$JUPYTER_PATH:}$SITE/share/jupyter"
export JUPYTER_RUNTIME_DIR=${JUPYTER_RUNTIME_DIR:-/tmp/gpu-extras-jupyter/runtime}
export MPLBACKEND=${MPLBACKEND:-Agg}
if [ -z "${IPYTHONDIR:-}" ]; then
  export IPYTHONDIR=$SITE_PARENT/gpu-extras-ipython
  mkdir -p "$IPYTHONDIR/profile_default"
  cfg=$IPYTHONDIR/profile_default/ipython_kernel_config.py
  [ -f "$cfg" ] || printf '%s\n' \
    '# written by .gpu-extras/with-extras.sh: inline figures in kernels despite MPLBACKEND=Agg' \
    'c.IPKernelApp.matplotlib = "inline"' > "$cfg"
fi
mkdir -p "$JUPYTER_RUNTIME_DIR"

# torch_memory_saver: the preload hook and the CUDA runtime it links (see the header)
export GPU_EXTRAS_TMS_PRELOAD=$SITE/torch_memory_saver_hook_mode_preload_cu13.abi3.so
if ! { /sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null; } | grep -q 'libcudart\.so\.13 '; then
  py=${GPU_EXTRAS_PYTHON:-$(command -v python3 || command -v python)}
  purelib=$("$py" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
  for d in "$purelib"/nvidia/cu13/lib "$purelib"/nvidia/cuda_runtime/lib; do
    if [ -e "$d/libcudart.so.13" ]; then
      case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d" ;; esac
      break
    fi
  done
fi

exec "$@"
