"""Run the three notebooks with the SGLang engine in a real Jupyter kernel on our GPU machine, from a
copy of the checkout without `benchmarks/` (as where lorabench is installed without the repository's
results: a lesson must measure what it shows), and keep what they showed:

    bash .sglang/with-sglang.sh bash .gpu-extras/with-extras.sh python dev/run_notebooks_gpu.py OUT_DIR

(dev/gpu_session.sh's `notebooks` part). Each notebook gets its learner defaults plus ENGINE="sglang"
and the offline stack's engine settings, injected after its `parameters` cell (papermill's
convention); 01 and 03 use the tiny model (warm-started, cached in $LORABENCH_CACHE), 02 measures a
random-init model of Qwen3-0.6B's shape (benchmarks/synthetic.py). Into OUT_DIR go: the executed notebook
(<name>.ipynb, also when a cell failed), each figure as PNG (<name>_<figure>.png: the inline figures
and notebook 01's panel, named by the figure's label; the kernel is the notebook tests' own, which
records each figure's name and text size in its PNG), notebook 02's measured rows
(refresh_notebook02_sglang.json) and notebooks_gpu.json: per notebook the wall time, the injected
parameters, the figures with their smallest text in pixels, what the cells wrote to stderr, and the
error if any. Exit status 1 if a notebook failed or showed anything on stderr.
"""
from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))   # notebook_helpers: the notebook tests' checks of executed outputs
sys.path.append(str(ROOT / "benchmarks"))   # synthetic: the random-init model of Qwen3-0.6B's shape
CACHE = Path(os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
from figure_text_size import png_text_info  # noqa: E402
from notebook_helpers import noise, parameterized, write_kernelspec  # noqa: E402

CELL_TIMEOUT_S = 1200
# the offline GPU stack has no FlashInfer/FA3 or xgrammar (README, "Running the real configuration")
ENGINE_ARGS = ["engine.sglang.attention_backend=triton", "engine.sglang.grammar_backend=none",
               "engine.sglang.dtype=bfloat16", "engine.sglang.mem_fraction_static=0.3"]


def qwen3_06b_shape_dir(out: Path) -> str:
    """A random-init model of Qwen3-0.6B's shape in bf16 with the tiny tokenizer, cached where the
    GPU benchmarks keep theirs."""
    from synthetic import random_qwen3_dir

    from lorabench.tiny import build_tiny_tokenizer
    tokenizer = out / "tiny-tokenizer"
    build_tiny_tokenizer(tokenizer)
    return str(random_qwen3_dir("0.6B", str(tokenizer), CACHE / "qwen3-0.6b-random"))


def parameters(out: Path, work: Path) -> dict[str, callable]:
    """Per notebook: the values injected on top of its learner defaults (made when it runs); run dirs and
    the model go to `work`, what is kept to `out`."""
    return {
        "01_step_through": lambda: {"ENGINE": "sglang", "MODEL": "tiny", "RUN_ROOT": str(work / "runs"),
                                    "OVERRIDES": ENGINE_ARGS},
        "02_refresh_methods": lambda: {"ENGINE": "sglang", "MODEL": qwen3_06b_shape_dir(work), "RANK": 32,
                               "REPEATS": 10, "MERGED_POINTS": 7,
                               "SAVE_TO": str(out / "refresh_notebook02_sglang.json"),
                               "OVERRIDES": [*ENGINE_ARGS, "model.dtype=bfloat16"]},
        # 03 looks into the adapter of 01's run dir (only reads it; it trains its own when 01 did not run)
        "03_how_hotswap_works": lambda: {"ENGINE": "sglang", "MODEL": "tiny", "RUN_ROOT": str(work / "runs"),
                                         "OVERRIDES": ENGINE_ARGS},
        # four policies on one engine: its own group dir, not 01's runs (03 scans those)
        "04_which_rank": lambda: {"ENGINE": "sglang", "MODEL": "tiny", "RUN_ROOT": str(work / "group-runs"),
                                  "OVERRIDES": ENGINE_ARGS},
    }


def figure_pngs(nb) -> list[bytes]:
    """Every image/png output, then every PNG image widget in the saved widget state (the panel)."""
    pngs = [base64.b64decode(out["data"]["image/png"]) for cell in nb.cells if cell.cell_type == "code"
            for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    pngs += [base64.b64decode(b["data"]) for model in state.values() if model["model_name"] == "ImageModel"
             for b in model.get("buffers", []) if b["path"] == ["value"]]
    return pngs


def save_figures(nb, stem: str, out: Path) -> list[dict]:
    seen: dict[str, int] = {}
    saved = []
    for png in figure_pngs(nb):
        info = png_text_info(png)
        name = info["figure"] or "figure"
        seen[name] = seen.get(name, 0) + 1
        path = out / f"{stem}_{name}{'' if seen[name] == 1 else f'_{seen[name]}'}.png"
        path.write_bytes(png)
        saved.append({"file": path.name, "min_text_px": info["min_text_px"]})
    return saved


def copy_without_benchmarks(dest: Path) -> Path:
    """The package, notebooks and data of this checkout in `dest` (no benchmarks/, tests/, dev/, docs/);
    the kernels import lorabench from there (PYTHONPATH: the checkout's entry replaced by the copy)."""
    import shutil
    for part in ("lorabench", "notebooks", "data"):
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(str(dest) if Path(e or ".").resolve() == ROOT else e for e in entries)
    return dest


def run_notebook(stem: str, values: dict, out: Path, notebooks: Path) -> dict:
    nb = parameterized(notebooks / f"{stem}.ipynb", **values)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(notebooks)}})
    record = {"notebook": stem, "parameters": values, "error": None}
    t0 = time.perf_counter()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError, RuntimeError, TimeoutError) as err:
        # a failing cell (its traceback), a cell over the time limit, a dead kernel or one that did not
        # start: recorded, and the other notebooks still run
        record["error"] = f"{type(err).__name__}: {str(err)[-4000:]}"
    finally:
        record["seconds"] = round(time.perf_counter() - t0, 1)
        nbformat.write(nb, out / f"{stem}.ipynb")
        record["figures"] = save_figures(nb, stem, out)
        record["stderr"] = noise(nb)      # what a lesson must not show: stderr, library progress bars
    return record


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for name in ("sglang", "torch", "transformers", "peft", "ipykernel", "jupyter_client", "ipywidgets", "nbclient"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # what is not kept (the copy, run dirs, the kernelspec) stays out of OUT: OUT comes back whole
    work = Path(tempfile.mkdtemp(prefix="notebooks-gpu-"))
    copy = copy_without_benchmarks(work / "checkout-without-benchmarks")
    # the notebook tests' kernel: this interpreter, each figure's name and text size in its PNG
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(write_kernelspec(work / "jupyter")),
                                                               os.environ.get("JUPYTER_PATH")]))
    chosen = os.environ.get("LORABENCH_NOTEBOOKS", "").split()   # e.g. "01_step_through 02_refresh_methods"
    import torch
    summary = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
               "commit": os.environ.get("LORABENCH_COMMIT", "unknown"), "date": time.strftime("%Y-%m-%d %H:%M"),
               "ran_from": "a copy of the checkout without benchmarks/ (lorabench imported from it)",
               "versions": versions(), "notebooks": []}
    notebooks = parameters(out, work)
    for stem in chosen or list(notebooks):   # in the order asked (03 reads the run dir 01 leaves)
        values = notebooks[stem]
        record = run_notebook(stem, values(), out, copy / "notebooks")
        summary["notebooks"].append(record)
        (out / "notebooks_gpu.json").write_text(json.dumps(summary, indent=1))   # after each: a cut run keeps it
        print(f"{stem}: {record.get('seconds', '?')} s, {len(record.get('figures', []))} figures, "
              f"{len(record['stderr'])} noisy outputs" + (f": {record['stderr'][0]}" if record["stderr"] else "")
              + (f", FAILED: {record['error'][-600:]}" if record["error"] else ""), flush=True)
    return 1 if any(r["error"] or r["stderr"] for r in summary["notebooks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
