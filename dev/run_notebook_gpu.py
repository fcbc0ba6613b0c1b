"""Execute a notebook headless on the GPU machine (nbclient, a real ipykernel) with parameters, and
keep its figures: every image/png output is written to OUT as <notebook>_<n>.png, next to the
executed copy. Notebook 02 with the SGLang engine is the issue-4 run:

    bash .sglang/with-sglang.sh bash .gpu-extras/with-extras.sh \
        python dev/run_notebook_gpu.py notebooks/02_refresh_methods.ipynb OUT 'ENGINE="sglang"' ...
Each trailing argument is one `NAME=<python literal>` assignment, injected after the cell tagged
`parameters` (as papermill does).
"""
from __future__ import annotations

import ast
import base64
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from notebook_helpers import inject_parameters  # noqa: E402


def main() -> int:
    path, out = Path(sys.argv[1]), Path(sys.argv[2])
    values = {}
    for arg in sys.argv[3:]:
        name, _, literal = arg.partition("=")
        values[name] = ast.literal_eval(literal)
    nb = inject_parameters(nbformat.read(path, as_version=4), **values)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        NotebookClient(nb, timeout=900, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:  # keep what ran, also when a cell failed
        nbformat.write(nb, out / f"{path.stem}.executed.ipynb")
        images = 0
        for cell in nb.cells:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                if "image/png" in data:
                    images += 1
                    (out / f"{path.stem}_{images}.png").write_bytes(base64.b64decode(data["image/png"]))
        print(f"{path.name}: {time.perf_counter() - t0:.0f} s, {images} figures -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
