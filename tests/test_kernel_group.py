"""Notebook 04's group panel in a real Jupyter kernel, driven as JupyterLab drives it
(kernel_scenario.Kernel): the notebook's cells up to the panel, then Run N clicked as a widget comm
message with the kernel left idle, and Kernel -> Interrupt (interrupt_request) while the panel
steps every policy: it stops after the step in progress, each policy's run dir holds whole steps,
and the kernel goes on (the group steps again, the session closes). The CPU test runs it with the
hf engine; the GPU test with SGLang (what it saw goes to $LORABENCH_GPU_OUT)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from kernel_scenario import Kernel, Panel, kernel_env
from notebook_helpers import NOTEBOOK_DIR, SMALL, parameterized, write_kernelspec

pytest.importorskip("jupyter_client", reason="needs jupyter_client (pip install -e .[notebook])")


def notebook_cells(values: dict) -> list[str]:
    """Notebook 04's code cells up to and with the one that runs the panel (panel.start / wait)."""
    nb = parameterized(NOTEBOOK_DIR / "04_which_rank.ipynb", **values)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    run = next(i for i, src in enumerate(cells) if "panel.start(" in src)
    return cells[:run + 1]


def test_group_panel_with_the_kernel_idle_and_an_interrupt(tmp_path):
    group_panel_scenario(tmp_path, {})


@pytest.mark.gpu
def test_group_panel_with_the_kernel_idle_and_an_interrupt_sglang(tmp_path):
    import importlib.util

    import torch
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs a CUDA GPU and sglang (run dev/gpu_session.sh tests on the GPU machine)")
    # the offline GPU stack lacks FlashInfer/FA3/xgrammar (a full install needs none of these)
    stack = ["engine.sglang.attention_backend=triton", "engine.sglang.grammar_backend=none",
             "engine.sglang.dtype=bfloat16", "engine.sglang.mem_fraction_static=0.3"]
    t0, seen = time.monotonic(), {"passed": False}
    try:
        seen.update(group_panel_scenario(tmp_path, {"ENGINE": "sglang", "OVERRIDES": stack}))
        seen["passed"] = True
    finally:
        seen.update(seconds=round(time.monotonic() - t0, 1), gpu=torch.cuda.get_device_name(),
                    commit=os.environ.get("LORABENCH_COMMIT", ""), date=time.strftime("%Y-%m-%d %H:%M"))
        out = Path(os.environ.get("LORABENCH_GPU_OUT", "gpu_results"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernel_group_sglang.json").write_text(json.dumps(seen, indent=1, default=str))


def group_panel_scenario(tmp_path, engine_values: dict) -> dict:
    values = {**SMALL["04_which_rank"], "RUN_ROOT": str(tmp_path / "runs"), **engine_values}
    kernel = Kernel(NOTEBOOK_DIR, kernel_env(write_kernelspec(tmp_path / "jupyter")))
    try:
        for source in notebook_cells(values):
            out = kernel.run(source)
            assert out["status"] == "ok", f"cell failed: {out.get('ename')}: {out.get('evalue')}\n{source[:300]}"
        panel = Panel(kernel)
        steps = values["STEPS"]
        assert panel.wait_steps(steps, 30) == steps
        kernel.set_value(panel.n, 2)
        kernel.click(panel.run_n)                       # then the kernel is left idle
        assert panel.wait_steps(steps + 2, 300) == steps + 2
        panel.wait_idle(60)
        kernel.set_value(panel.n, 50)
        kernel.click(panel.run_n)
        panel.wait_steps(steps + 3, 300)
        reply = kernel.interrupt()                      # Kernel -> Interrupt while the panel steps
        assert reply["status"] == "ok", reply
        panel.wait_idle(300)
        stopped_at = panel.steps()
        assert steps + 3 <= stopped_at < steps + 2 + 50, stopped_at
        counts = kernel.value("{n: [len(t.history), t.step_count] for n, t in session.trainer.trainers.items()}")
        assert all(h == c == stopped_at for h, c in counts.values()), counts
        kernel.run("session.trainer.wait_committed()")
        rows = kernel.value("{n: [r['step'] for r in m] for n, m in session.metrics().items()}")
        assert all(r == list(range(1, stopped_at + 1)) for r in rows.values()), rows
        again = kernel.run("last = session.trainer.step()")   # the kernel and the group go on
        assert again["status"] == "ok", again
        closed = kernel.run("session.close()")
        assert closed["status"] == "ok", closed
        seen = {"stopped_at": stopped_at, "rows": {n: len(r) for n, r in rows.items()}}
        print(json.dumps(seen))
        return seen
    finally:
        kernel.close()
