"""The notebooks: committed with outputs stripped and paired with jupytext percent-format .py files;
written as lessons (what and how long up front, a `parameters` cell papermill can read, no test
machinery in the story, one collapsed self-check cell at the end); and each executed headless by
papermill in a real kernel with the tests' small parameters injected: no cell error, no stderr or
library progress bar in the outputs, every figure's text at least 8 px at its natural size, the
self-check passed. Notebook 01's run dir is then resumed by the CLI."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import jupytext
import nbformat
import papermill
import pytest
from notebook_helpers import (
    MIN_TEXT_PX,
    NOTEBOOK_DIR,
    NOTEBOOKS,
    ROOT,
    SMALL,
    figures,
    noise,
    parameters_index,
    widget_outputs,
    widget_state,
    write_kernelspec,
)

pytestmark = pytest.mark.skipif(not NOTEBOOKS, reason="no notebooks found")


def test_four_notebooks_are_committed():
    assert [p.name for p in NOTEBOOKS] == ["01_step_through.ipynb", "02_refresh_methods.ipynb",
                                           "03_how_hotswap_works.ipynb", "04_which_rank.ipynb"]
    assert sorted(SMALL) == [p.stem for p in NOTEBOOKS]


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
    """The .py is jupytext percent format and holds the same cells (type, source, tags, hidden)."""
    paired = path.with_suffix(".py")
    assert paired.is_file(), f"{path.name} has no paired {paired.name}: jupytext --set-formats ipynb,py:percent"
    assert "format_name: percent" in paired.read_text()
    nb, py = nbformat.read(path, as_version=4), jupytext.read(paired)
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"

    def cells(notebook):
        return [(c.cell_type, c.source.strip(), sorted(c.metadata.get("tags", [])), c.metadata.get("jupyter"))
                for c in notebook.cells]
    assert cells(nb) == cells(py), f"{path.name} and {paired.name} differ: run jupytext --sync {path}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_written_as_a_lesson(path):
    """What and how long first (measured, for the CPU and the GPU); learner switches in the
    parameters cell; no asserts and no mention of CI in the story; the only checks in one
    collapsed cell tagged `self-check`, the last code cell."""
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source
    assert nb.cells[0].cell_type == "markdown" and "**What it shows.**" in first and "**How long.**" in first
    how_long = first.split("**How long.**")[1]
    assert "CPU" in how_long and "GPU" in how_long and "MEASURE" not in how_long
    params = nb.cells[parameters_index(nb)].source
    for switch in ('ENGINE = "hf"', 'MODEL = "tiny"'):
        assert switch in params, f"{path.name}: the parameters cell needs the switch {switch}"
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    checks = [i for i, c in code if "self-check" in c.metadata.get("tags", [])]
    assert checks == [code[-1][0]], f"{path.name}: one cell tagged self-check, the last code cell (found {checks})"
    assert nb.cells[checks[0]].metadata.get("jupyter", {}).get("source_hidden"), "the self-check cell is collapsed"
    for i, cell in enumerate(nb.cells):
        assert not re.search(r"\bCI\b", cell.source), f"{path.name} cell {i} mentions CI"
        if cell.cell_type == "code":
            assert not re.search(r"^\s*assert\b", cell.source, re.M), f"{path.name} cell {i} asserts in the lesson"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_reads_the_parameters(path, caplog):
    """Every parameter line parses (papermill skips a line with a second '=', e.g. in a comment),
    and the tests inject only parameters the notebook has."""
    params = papermill.inspect_notebook(str(path))
    assert "Unable to parse" not in caplog.text, caplog.text
    assert {"ENGINE", "MODEL"} <= set(params) and set(SMALL[path.stem]) <= set(params)


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


def execute(path, tmp_path, **extra):
    """Run the notebook with the tests' small parameters (plus `extra`) and check its outputs."""
    t0 = time.perf_counter()
    nb = papermill.execute_notebook(path, tmp_path / path.name, parameters={**SMALL[path.stem], **extra},
                                    kernel_name="python3", cwd=NOTEBOOK_DIR, progress_bar=False)
    print(f"{path.name}: {time.perf_counter() - t0:.0f} s")
    assert noise(nb) == []
    shown = figures(nb)
    assert shown, f"{path.name} shows no figure"
    for i, fig in shown:
        assert fig["figure"], f"{path.name} ({i}): a figure without a name (fig.set_label)"
        assert fig["min_text_px"] is not None and fig["min_text_px"] >= MIN_TEXT_PX, f"{path.name} ({i}): {fig}"
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    assert "self-check: all" in last and "✗" not in last, last
    return nb


def test_01_step_through_runs_and_the_cli_resumes_it(kernel_env, tmp_path):
    """Run with CLOSE_AT_END (no person to click): the close button's own path closes the session,
    disables the panel and shows the resume command, which the CLI then runs. (Run All as a learner
    runs it, the panel live afterwards and closed by a click, is the browser test's.)"""
    nb = execute(NOTEBOOK_DIR / "01_step_through.ipynb", tmp_path, RUN_ROOT=str(tmp_path / "runs"), CLOSE_AT_END=True)
    (run_dir,) = (tmp_path / "runs").iterdir()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs), "no panel shown"
    assert [f["figure"] for _, f in figures(nb)] == ["run_learned", "broken_refresh", "step_panel"]
    shown = [str(o.get("data", {}).get("text/markdown", "")) for o in widget_outputs(nb)]
    assert any(f"lorabench resume {run_dir}" in text for text in shown), shown
    buttons = {m["state"]["description"]: m["state"]["disabled"] for m in widget_state(nb).values()
               if m["model_name"] == "ButtonModel"}
    assert buttons == {"Step": True, "Run N": True, "Stop": True, "Close the session": True}, buttons
    from lorabench.runlog import read_jsonl
    small = SMALL["01_step_through"]
    ran = small["STEPS"] + small["EXERCISE_STEPS"]   # the panel's run, then the steps with the learner's reward
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == ran
    # the notebook closed its session: the CLI continues the run for one more step
    done = subprocess.run([sys.executable, "-m", "lorabench.cli", "resume", str(run_dir), f"grpo.steps={ran + 1}"],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stdout + done.stderr
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, ran + 2))


def test_02_refresh_methods_runs(kernel_env, tmp_path):
    saved = tmp_path / "refresh.json"
    nb = execute(NOTEBOOK_DIR / "02_refresh_methods.ipynb", tmp_path, SAVE_TO=str(saved))
    from notebook_helpers import load_results
    results = load_results(saved)
    assert {r["mode"] for r in results["rows"]} == {"file", "tensor", "inplace", "merged"}
    assert results["bandwidth_gbps"] > 0 and "hf engine, CPU (not SGLang)" in results["engine"]
    small = SMALL["02_refresh_methods"]
    # section 3's bucket sizes (sections 2 and 4 use the default 64 MB): one push count each
    sweep = [r for r in results["rows"] if r["mode"] == "merged" and r["bucket_mb"] != 64]
    by_rank = {(r["mode"], r["rank"]) for r in results["rows"]}
    assert len({r["buckets"] for r in sweep}) == len(sweep) == small["MERGED_POINTS"]
    assert {(m, k) for m in ("file", "tensor", "inplace", "merged") for k in small["RANKS"]} <= by_rank
    assert [f["figure"] for _, f in figures(nb)] == ["timing_threads", "refresh_modes", "merged_buckets",
                                                     "refresh_rank"]


def test_03_how_hotswap_works_runs(kernel_env, tmp_path):
    """With no run dir to reuse (an empty RUN_ROOT), the lesson trains its adapter itself and says so;
    tests/test_checkpoint_reuse.py reads a real run dir the way the lesson does."""
    nb = execute(NOTEBOOK_DIR / "03_how_hotswap_works.ipynb", tmp_path, RUN_ROOT=str(tmp_path / "runs"))
    assert [f["figure"] for _, f in figures(nb)] == ["lora_factors", "delta_w", "delta_w_singular_values",
                                                     "next_token_topk", "per_token_effect", "refresh_timeline",
                                                     "refreshed_vs_stale"]
    shown = "".join(str(o.get("data", {}).get("text/markdown", "")) for c in nb.cells for o in c.get("outputs", []))
    assert "**Trained here:**" in shown and f"trained {SMALL['03_how_hotswap_works']['STEPS']} GRPO steps" in shown


def test_04_which_rank_runs(kernel_env, tmp_path):
    """The ranks train side by side in one group dir: one run dir per policy, every step of each."""
    from lorabench.runlog import read_jsonl
    small = SMALL["04_which_rank"]
    nb = execute(NOTEBOOK_DIR / "04_which_rank.ipynb", tmp_path, RUN_ROOT=str(tmp_path / "runs"))
    assert [f["figure"] for _, f in figures(nb)] == ["rank_sweep", "group_panel"]
    (group,) = (tmp_path / "runs").iterdir()
    assert sorted(os.listdir(group)) == ["group.json", *sorted(f"r{r}" for r in small["RANKS"])]
    for r in small["RANKS"]:
        assert [row["step"] for row in read_jsonl(group / f"r{r}" / "metrics.jsonl")] == list(range(1, 4))
    shown = "".join(str(o.get("data", {}).get("text/markdown", "")) for c in nb.cells for o in c.get("outputs", []))
    assert "Held-out, greedy" in shown and "before → after" in shown
