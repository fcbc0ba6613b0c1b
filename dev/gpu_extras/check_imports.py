"""Checks the offline extras site on the GPU machine. From the checkout's root:

    bash .sglang/with-sglang.sh bash .gpu-extras/with-extras.sh python .gpu-extras/check_imports.py

Imports nbclient, nbformat, ipykernel, jupyter_client, ipywidgets, jupytext, matplotlib (draws and
saves a PNG), pandas and torch_memory_saver (resolves its CUDA hook binaries and loads one), then
runs a two-cell notebook through nbclient on the `python3` kernel (matplotlib figure, pandas
DataFrame) and checks the figure came back as image/png. With CUDA and without --no-gpu it also
pauses and resumes a 1 GiB tensor with torch_memory_saver in both hook modes (each in a child
process; preload mode with LD_PRELOAD, as SGLang's scheduler gets it). Prints OK/FAIL/SKIP per
check and exits 1 on any FAIL.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import textwrap
import traceback

RESULTS: list[tuple[str, str, str]] = []


def check(name):
    def wrap(fn):
        try:
            detail = fn()
            RESULTS.append((name, "OK", detail or ""))
        except SkipCheck as e:
            RESULTS.append((name, "SKIP", str(e)))
        except BaseException as e:  # noqa: BLE001  (report everything, including SystemExit)
            tb = traceback.format_exc(limit=-3).strip().splitlines()
            RESULTS.append((name, "FAIL", f"{type(e).__name__}: {e}  [{' | '.join(tb[-3:])}]"))
        status, detail = RESULTS[-1][1:]
        print(f"{status:4} {name}{': ' + detail if detail else ''}", flush=True)
        return fn
    return wrap


class SkipCheck(Exception):
    pass


def where(mod) -> str:
    return f"{getattr(mod, '__version__', '?')} from {os.path.dirname(os.path.dirname(mod.__file__))}"


print(f"python {sys.version.split()[0]} at {sys.executable}")
for k in ("PYTHONPATH", "JUPYTER_PATH", "MPLBACKEND", "IPYTHONDIR", "LD_LIBRARY_PATH"):
    print(f"  {k}={os.environ.get(k, '')}")


for module_name in ("nbformat", "jupyter_client", "nbclient"):
    check(f"import {module_name}")(lambda m=module_name: where(importlib.import_module(m)))


@check("import ipykernel")
def _():
    import ipykernel
    import ipykernel.ipkernel  # noqa: F401  (what the kernel process imports)
    import IPython
    return f"{where(ipykernel)}; IPython {where(IPython)}"


@check("import ipywidgets, jupytext")
def _():
    import ipywidgets
    import jupytext
    return f"ipywidgets {ipywidgets.__version__}, jupytext {jupytext.__version__}"


@check("kernelspec python3")
def _():
    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec("python3")
    return f"{spec.resource_dir} argv={spec.argv}"


@check("matplotlib (Agg, savefig PNG)")
def _():
    import matplotlib
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([1, 2, 3], [1, 4, 9], label="x²")
    ax.set_title("ok $\\alpha$")
    ax.legend()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "tiny.png")
        fig.savefig(path, dpi=50)
        with open(path, "rb") as f:
            head = f.read(8)
        size = os.path.getsize(path)
    plt.close(fig)
    assert head == b"\x89PNG\r\n\x1a\n", head
    return f"{where(matplotlib)}, backend {matplotlib.get_backend()}, png {size} B"


@check("pandas")
def _():
    import numpy as np
    import pandas as pd
    df = pd.DataFrame({"a": [1, 2, 3], "t": pd.date_range("2024-01-01", periods=3, tz="UTC")})
    assert df["a"].sum() == 6 and str(df["t"].dt.tz) == "UTC"
    return f"{where(pd)}; numpy {where(np)}"


@check("torch_memory_saver (import, hook binaries)")
def _():
    import ctypes

    import torch
    import torch_memory_saver
    from torch_memory_saver.utils import get_binary_path_from_package
    paths = [get_binary_path_from_package(s) for s in
             ("torch_memory_saver_hook_mode_preload", "torch_memory_saver_hook_mode_torch")]
    ctypes.CDLL(str(paths[1]))  # after torch: libcudart.so.13 is already in the process
    return (f"{os.path.dirname(os.path.dirname(torch_memory_saver.__file__))}, torch {torch.__version__} "
            f"cuda {torch.version.cuda}; {', '.join(p.name for p in paths)}")


NB_CELLS = ["import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()",
            "import pandas as pd\npd.DataFrame({'a': [1]})"]


@check("nbclient executes a notebook on kernel python3")
def _():
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NB_CELLS]
    NotebookClient(nb, kernel_name="python3", timeout=180, startup_timeout=120, allow_errors=False).execute()
    fig_out, df_out = (c.outputs for c in nb.cells)
    assert any("image/png" in o.get("data", {}) for o in fig_out), \
        f"cell 1 gave no image/png (kernel not on the inline backend?): {fig_out}"
    assert any("text/html" in o.get("data", {}) or "text/plain" in o.get("data", {}) for o in df_out), df_out
    return "cell 1 -> image/png, cell 2 -> DataFrame"


TMS_CHILD = textwrap.dedent("""
    import os, sys, torch, torch_memory_saver
    tms = torch_memory_saver.torch_memory_saver
    tms.hook_mode = sys.argv[1]
    torch.cuda.init()
    with tms.region(tag="w"):
        x = torch.full((1 << 28,), 3.0, device="cuda")  # 1 GiB
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    tms.pause("w")
    free1 = torch.cuda.mem_get_info()[0]
    tms.resume("w")
    x.fill_(5.0)
    ok = bool((x == 5.0).all())
    print(f"freed {(free1 - free0) / 2**30:.2f} GiB on pause, tensor usable after resume: {ok}", flush=True)
    # os._exit: in hook_mode="torch", torch_memory_saver 0.0.10 aborts ("only support interesting
    # region", tms_torch_free) when the MemPool frees its blocks at interpreter teardown, i.e.
    # outside any region(); that is a teardown quirk of that mode (SGLang uses "preload").
    os._exit(0 if ok and free1 - free0 > 0.9 * 2**30 else 1)
""")


def tms_child(mode: str) -> str:
    try:
        import torch
    except ImportError as e:
        raise SkipCheck(f"no torch: {e}") from e
    if "--no-gpu" in sys.argv or not torch.cuda.is_available():
        raise SkipCheck("--no-gpu or no CUDA")
    env = dict(os.environ)
    if mode == "preload":
        from torch_memory_saver.utils import get_binary_path_from_package
        env["LD_PRELOAD"] = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    p = subprocess.run([sys.executable, "-c", TMS_CHILD, mode], env=env, capture_output=True, text=True,
                       timeout=300)
    out = (p.stdout + p.stderr).strip()
    if p.returncode != 0 or "cannot be preloaded" in out:
        raise RuntimeError(f"rc={p.returncode}: {out[-1500:]}")
    return out.splitlines()[-1]


@check("torch_memory_saver pause/resume, hook_mode=preload (LD_PRELOAD)")
def _():
    return tms_child("preload")


@check("torch_memory_saver pause/resume, hook_mode=torch")
def _():
    return tms_child("torch")


fails = [r for r in RESULTS if r[1] == "FAIL"]
print(f"\n{len(RESULTS) - len(fails)}/{len(RESULTS)} checks without failure"
      + (f"; FAILED: {', '.join(r[0] for r in fails)}" if fails else ""))
sys.exit(1 if fails else 0)
