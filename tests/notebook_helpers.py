"""Shared by the notebook tests: where the notebooks are, a kernelspec that runs this interpreter,
and papermill-style parameter injection (a cell after the one tagged `parameters`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))


def write_kernelspec(jupyter_dir: Path) -> Path:
    """A `python3` kernelspec under `jupyter_dir/kernels` that starts this very interpreter (the
    venv's), so the kernel sees the same packages whatever kernelspecs the machine has. Put
    `jupyter_dir` first on JUPYTER_PATH to use it."""
    spec = jupyter_dir / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python"}))
    return jupyter_dir


def parameters_index(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    return tagged[0]


def inject_parameters(nb, **values):
    """Insert a cell assigning `values` right after the `parameters` cell (as papermill does)."""
    source = "\n".join(f"{k} = {v!r}" for k, v in values.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(parameters_index(nb) + 1, cell)
    return nb
