"""Shared by the notebook tests: where the notebooks are, a kernelspec that runs this interpreter
with each figure's name and text size recorded in its PNG (figure_text_size), the small parameters
the tests inject (papermill's convention: a cell tagged `injected-parameters` after the one tagged
`parameters`; the notebooks themselves hold the learner's values), and the checks on executed
outputs (no stderr, no library progress bars, figure text size)."""
from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path


def load_results(path: str | Path) -> dict | None:
    """A refresh-sweep file (as refresh_bench.save_results writes it), or None if it is something else."""
    data = json.loads(Path(path).read_text())
    return data if isinstance(data, dict) and data.get("kind") == "refresh_sweep" else None


TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
MIN_TEXT_PX = 8.0

# a short warm-start (shared by 01 and 03, so the tiny model is built once), small steps, and a
# format bonus so that a barely trained model still gets a learning signal
SMALL_RUN = ["warmstart.steps=40", "warmstart.batch_size=16", "warmstart.lr=1e-2",
             "warmstart.strict_format_fraction=0.5", "grpo.prompts_per_step=2", "grpo.group_size=8",
             "grpo.max_new_tokens=40", "grpo.lr=3e-3", "grpo.format_bonus=0.5", "data.eval_size=8"]
SMALL = {
    "01_step_through": {"STEPS": 3, "BREAK_STEPS": 3, "EXERCISE_STEPS": 1, "OVERRIDES": SMALL_RUN},
    "02_refresh_methods": {"RANK": 4, "REPEATS": 2, "MERGED_POINTS": 3, "RANKS": [4, 16]},
    "03_how_hotswap_works": {"STEPS": 3, "COMPARE_STEPS": 3, "SEEDS": 2, "OVERRIDES": SMALL_RUN},
    "04_which_rank": {"RANKS": [1, 8], "STEPS": 3, "OVERRIDES": SMALL_RUN},
}


def write_kernelspec(jupyter_dir: Path) -> Path:
    """A `python3` kernelspec under `jupyter_dir/kernels` that starts this very interpreter (the
    venv's), so the kernel sees the same packages whatever kernelspecs the machine has, through
    text_size_kernel.py: every figure's PNG carries its name and smallest text. Put `jupyter_dir`
    first on JUPYTER_PATH to use it."""
    spec = jupyter_dir / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(TESTS / "text_size_kernel.py"), "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)", "language": "python"}))
    return jupyter_dir


def parameters_index(nb) -> int:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
    return tagged[0]


def parameterized(path: Path, **values):
    """The notebook at `path` with `values` injected the way papermill does it. Where papermill is
    not installed (our GPU machine's offline bundle), the same convention by hand: a cell tagged
    `injected-parameters` right after the cell tagged `parameters`."""
    try:
        from papermill.iorw import load_notebook_node
        from papermill.parameterize import parameterize_notebook
    except ImportError:
        import nbformat
        nb = nbformat.read(path, as_version=4)
        source = "# Parameters\n" + "\n".join(f"{k} = {v!r}" for k, v in values.items())
        nb.cells.insert(parameters_index(nb) + 1, nbformat.v4.new_code_cell(
            source, metadata={"tags": ["injected-parameters"]}))
        return nb
    return parameterize_notebook(load_notebook_node(str(path)), values)


def code_outputs(nb):
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.get("outputs", [])]


# a library's progress bar as its widget's text/plain shows it: tqdm's is the bar itself ('40%|####  | 4/10
# [00:02<00:03, 1.9it/s]'), or its container's repr. A lesson's own display of a long wait
# (lorabench.progress.WaitProgress) shows 'lorabench progress: <what>' there, which matches none of these.
LIBRARY_BAR = re.compile(r"it/s|s/it|\d+%\||TqdmHBox")
# a tqdm bar as text, wherever it is written: " 40%|████      | 4/10 [00:01<00:02,  2.50it/s]"
TQDM_TEXT = re.compile(r"\d+%\|[^|\n]*\|\s*\d+(\.\d+)?[kMG]?/\d+(\.\d+)?[kMG]?\s*\[")


def noise(nb) -> list[str]:
    """What a lesson must not show: stderr text (warnings, logs) and library progress bars (tqdm's
    widgets, or its text bars, on stderr or printed anywhere else). A lesson's own progress display
    (progress.WaitProgress: a widget whose text/plain is 'lorabench progress: <what>') is neither."""
    found = []
    for i, out in code_outputs(nb):
        if out.get("output_type") == "stream" and out.get("name") == "stderr":
            found.append(f"cell {i} stderr: {out['text'][:300]!r}")
        data = out.get("data", {})
        text = str(data.get("text/plain", ""))
        shown = str(out.get("text", "")) + text + str(data.get("text/html", ""))
        if "application/vnd.jupyter.widget-view+json" in data and LIBRARY_BAR.search(text):
            found.append(f"cell {i}: a progress bar widget ({text[:80]!r})")
        elif TQDM_TEXT.search(shown):   # one finding per output: a widget's text/plain is its bar too
            found.append(f"cell {i}: a tqdm text bar: {TQDM_TEXT.search(shown).group(0)!r}")
    return found


def widget_state(nb) -> dict:
    """The saved widget models of an executed notebook: model id -> {'model_name', 'state', ...}."""
    return nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})


def widget_outputs(nb) -> list[dict]:
    """What the notebook's Output widgets hold (a click's results, the panel's log)."""
    return [o for model in widget_state(nb).values() if model["model_name"] == "OutputModel"
            for o in model["state"].get("outputs", [])]


def figures(nb) -> list[tuple[int | str, dict]]:
    """Each image/png output (cell index) and each PNG image widget in the saved widget state
    ('widget'): figure_text_size.png_text_info of the PNG plus its pixel width."""
    pngs = [(i, base64.b64decode(out["data"]["image/png"])) for i, out in code_outputs(nb)
            if "image/png" in out.get("data", {})]
    pngs += [("widget", base64.b64decode(buffer["data"])) for model in widget_state(nb).values()
             if model["model_name"] == "ImageModel" for buffer in model.get("buffers", [])
             if buffer["path"] == ["value"]]
    return [(where, describe_png(png)) for where, png in pngs]


def describe_png(png: bytes) -> dict:
    import io

    from figure_text_size import png_text_info
    from PIL import Image
    return {**png_text_info(png), "width": Image.open(io.BytesIO(png)).width}
