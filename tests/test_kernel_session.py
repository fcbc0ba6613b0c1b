"""Notebook 01 in a real Jupyter kernel, driven as JupyterLab drives it (kernel_scenario.py): the
kernel left idle while the panel steps; Step, a double click, Run N, Stop and the N box as widget
comm messages; another cell while steps go on; Kernel -> Interrupt (interrupt_request) while the
panel steps, during `trainer.run(50)` at random moments and during a long engine request; closing
the session, a second session in the same kernel, a restart and a shutdown. The CPU test runs it
with the hf engine; the GPU test with SGLang (its results go to $LORABENCH_GPU_OUT with versions)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from kernel_scenario import kernel_env, run_scenario
from notebook_helpers import write_kernelspec

pytest.importorskip("jupyter_client", reason="needs jupyter_client (pip install -e .[notebook])")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for name in ("ipykernel", "jupyter_client", "ipywidgets", "torch", "transformers", "peft", "sglang"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def test_notebook_01_with_the_kernel_idle_cpu(tmp_path):
    seen = run_scenario("hf", tmp_path, kernel_env(write_kernelspec(tmp_path / "jupyter")), [],
                        step_timeout=300)
    print(json.dumps(seen, indent=1))


@pytest.mark.gpu
def test_notebook_01_with_the_kernel_idle_sglang(tmp_path):
    import importlib.util

    import torch
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs a CUDA GPU and sglang (run dev/gpu_session.sh tests on the GPU machine)")
    # the offline GPU stack lacks FlashInfer/FA3/xgrammar (a full install needs none of these)
    stack = ["engine.sglang.attention_backend=triton", "engine.sglang.grammar_backend=none",
             "engine.sglang.dtype=bfloat16", "engine.sglang.mem_fraction_static=0.3", "refresh.mode=inplace"]
    t0, seen = time.monotonic(), {}
    out = Path(os.environ.get("LORABENCH_GPU_OUT", "gpu_results"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        run_scenario("sglang", tmp_path, kernel_env(write_kernelspec(tmp_path / "jupyter")), stack,
                     step_timeout=120, seen=seen)   # a wait raises with the kernel's stacks, inside the part's limit
        seen["passed"] = True
    finally:   # also what a failed run saw, and the engine's own log (notebooks send it to a file)
        seen.update(seconds=round(time.monotonic() - t0, 1), versions=versions(), gpu=torch.cuda.get_device_name(),
                    commit=os.environ.get("LORABENCH_COMMIT", ""), date=time.strftime("%Y-%m-%d %H:%M"))
        (out / "kernel_session_sglang.json").write_text(json.dumps(seen, indent=1, default=str))
        log = Path(tempfile.gettempdir()) / "lorabench-sglang.log"
        if log.is_file():
            shutil.copy(log, out / "kernel_session_sglang_engine.log")
