"""The notebooks: each runs headless from the committed file on the CPU defaults (nbclient, real
engine and model, any cell error fails), is committed with outputs stripped, and matches its
paired jupytext percent-format .py. Notebook 01's run dir is then resumed by the CLI."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

from notebook_helpers import NOTEBOOK_DIR, NOTEBOOKS, ROOT, inject_parameters, parameters_index, write_kernelspec

CELL_TIMEOUT_S = 600
pytestmark = pytest.mark.skipif(not NOTEBOOKS, reason="no notebooks found")


def test_three_notebooks_are_committed():
    assert [p.name for p in NOTEBOOKS] == ["01_step_through.ipynb", "02_refresh_methods.ipynb",
                                           "03_how_hotswap_works.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_stripped(path):
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: strip them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} carries saved widget state: strip it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_paired_py_matches(path):
    """The .py is jupytext percent format and holds the same cells (type, source, tags)."""
    paired = path.with_suffix(".py")
    assert paired.is_file(), f"{path.name} has no paired {paired.name}: jupytext --set-formats ipynb,py:percent"
    assert "format_name: percent" in paired.read_text()
    nb, py = nbformat.read(path, as_version=4), jupytext.read(paired)
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"

    def cells(notebook):
        return [(c.cell_type, c.source.strip(), sorted(c.metadata.get("tags", []))) for c in notebook.cells]
    assert cells(nb) == cells(py), f"{path.name} and {paired.name} differ: run jupytext --sync {path}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_opens_with_what_and_how_long(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "**What it shows.**" in first.source and "**How long.**" in first.source
    assert "CPU" in first.source and "GPU" in first.source
    params = nb.cells[parameters_index(nb)].source
    for switch in ('ENGINE = "hf"', 'MODEL = "tiny"'):
        assert switch in params, f"{path.name}: the parameters cell needs the switch {switch}"


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    jupyter_dir = write_kernelspec(tmp_path_factory.mktemp("jupyter"))
    env = {"JUPYTER_PATH": os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")]))}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def execute(path, tmp_path, **parameters):
    nb = inject_parameters(nbformat.read(path, as_version=4), **parameters)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    t0 = time.perf_counter()
    client.execute()   # raises CellExecutionError on the first failing cell
    print(f"{path.name}: {time.perf_counter() - t0:.0f} s")
    return nb


def test_01_step_through_runs_and_the_cli_resumes_it(kernel_env, tmp_path):
    nb = execute(NOTEBOOK_DIR / "01_step_through.ipynb", tmp_path, RUN_ROOT=str(tmp_path / "runs"))
    (run_dir,) = (tmp_path / "runs").iterdir()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs), "no panel shown"
    assert any(f"lorabench resume {run_dir}" in str(o.get("data", {}).get("text/markdown", "")) for o in outputs)
    assert nb.cells[-1].cell_type == "markdown" and "lorabench resume" in nb.cells[-1].source
    from lorabench.runlog import read_jsonl
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 3
    # the notebook's run dir, continued by the CLI for one more step
    done = subprocess.run([sys.executable, "-m", "lorabench.cli", "resume", str(run_dir), "grpo.steps=4"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


def test_02_refresh_methods_runs(kernel_env, tmp_path):
    saved = tmp_path / "refresh.json"
    execute(NOTEBOOK_DIR / "02_refresh_methods.ipynb", tmp_path, SAVE_TO=str(saved))
    from lorabench.refresh_bench import load_results
    results = load_results(saved)
    assert {r["mode"] for r in results["rows"]} == {"file", "tensor", "inplace", "merged"}
    assert results["bandwidth_gbps"] > 0 and "hf engine, CPU (not SGLang)" in results["engine"]


def test_03_how_hotswap_works_runs(kernel_env, tmp_path):
    nb = execute(NOTEBOOK_DIR / "03_how_hotswap_works.ipynb", tmp_path)
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 4, f"expected the ΔW, top-k, log-prob and timeline figures, got {len(images)}"
