"""The step-through panel on a real trainer and HFEngine (tiny random model): stepping in the
background without blocking, one run at a time, Stop between steps, errors surfaced, the views
filled from the real step record, no figure or memory build-up over 20 steps; and RunSession,
which writes the CLI's run dir."""
from __future__ import annotations

import gc
import html
import re
import time

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure

from lorabench.config import Config
from lorabench.engines.base import AdapterNotLoaded
from lorabench.engines.hf import HFEngine
from lorabench.grpo import GRPOTrainer
from lorabench.runlog import RunLog, read_jsonl
from lorabench.session import RunSession
from lorabench.widgets import StepPanel, completions_table, refresh_table

PNG = b"\x89PNG\r\n\x1a\n"


def tiny_config(tmp_path, *extra) -> Config:
    return Config.load(overrides=[
        "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=6", "grpo.micro_batch=4",
        "data.eval_size=2", "lora.r=4", "lora.alpha=8", "engine.device=cpu", f"refresh.tmp_dir={tmp_path}",
        "warmstart.steps=0", f"run.out_dir={tmp_path / 'runs'}", *extra])


@pytest.fixture
def trainer(tiny_model_dir, tokenizer, tmp_path):
    cfg = tiny_config(tmp_path)
    engine = HFEngine(str(tiny_model_dir), cfg)
    trainer = GRPOTrainer(cfg, str(tiny_model_dir), engine, tokenizer=tokenizer, log=lambda *a: None)
    yield trainer
    trainer.close()
    engine.close()


def figures_alive() -> int:
    gc.collect()
    return sum(isinstance(o, Figure) for o in gc.get_objects())


def test_panel_shows_a_starting_state(trainer):
    panel = StepPanel(trainer)
    assert bytes(panel.plot.value).startswith(PNG)
    assert panel.step_label.value == "steps done: 0"
    assert "click Step" in panel.status.value and "no step yet" in panel.completions.value
    assert [b.description for b in (panel.step_button, panel.run_button, panel.stop_button)] == ["Step", "Run N", "Stop"]
    assert not panel.step_button.disabled and panel.stop_button.disabled
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_run_n_returns_at_once_and_refuses_a_second_run(trainer):
    panel = StepPanel(trainer)
    t0 = time.perf_counter()
    assert panel.start(3)
    started = time.perf_counter() - t0
    assert panel.busy and started < 0.5, f"start() blocked for {started:.2f} s"
    assert panel.step_button.disabled and panel.run_button.disabled and not panel.stop_button.disabled
    assert not panel.start(1)                       # a second run while one is going: refused
    panel.step_button.click()                       # the button too
    assert any("busy" in o.get("text", "") for o in panel.log.outputs)
    record = panel.wait(timeout=120)
    assert trainer.step_count == 3 and record.step == 3 and len(trainer.history) == 3
    assert not panel.busy and not panel.step_button.disabled and panel.stop_button.disabled


def test_buttons_drive_the_trainer(trainer):
    panel = StepPanel(trainer)
    panel.step_button.click()
    panel.wait(timeout=60)
    assert trainer.step_count == 1
    panel.steps_input.value = 2
    panel.run_button.click()
    panel.wait(timeout=60)
    assert trainer.step_count == 3 and panel.step_label.value == "steps done: 3"


def test_stop_ends_the_run_between_steps(trainer):
    panel = StepPanel(trainer)
    panel.start(50)
    deadline = time.monotonic() + 60
    while trainer.step_count < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    panel.stop_button.click()
    panel.wait(timeout=60)
    assert 1 <= trainer.step_count < 50
    assert [m["step"] for m in trainer.history] == list(range(1, trainer.step_count + 1))  # no half step
    assert any("stopped after" in o.get("text", "") for o in panel.log.outputs)


def test_views_show_the_last_step(trainer):
    panel = StepPanel(trainer)
    before = panel.plot.value
    panel.start(1)
    record = panel.wait(timeout=60)
    assert bytes(panel.plot.value) != bytes(before) and bytes(panel.plot.value).startswith(PNG)
    g = trainer.cfg.grpo.group_size
    last_group = [s for s in record.samples if s["prompt"] == trainer.cfg.grpo.prompts_per_step - 1]
    assert len(last_group) == g
    table = panel.completions.value
    assert len(re.findall(r"<tr><td>\d+</td>", table)) == g
    for s in last_group:
        assert f"<td>{s['reward']:.2f}</td><td>{s['advantage']:+.2f}</td>" in table
        assert html.escape(s["completion"][:40]).replace("\n", " ⏎ ") in table
    for part, seconds in record.refresh.parts.items():
        assert f"<td>{part}</td><td>{1e3 * seconds:.2f}</td>" in panel.refresh.value
    assert f"{1e3 * record.refresh.total_s:.2f}" in panel.refresh.value
    m = record.metrics
    assert f"max {m['mismatch/max']:.1e}" in panel.status.value
    assert f"‖ΔW‖ {m['adapter/delta_norm']:.4f}" in panel.status.value
    assert panel.step_label.value == "steps done: 1"


def test_a_failing_step_is_shown_and_reraised(trainer):
    panel = StepPanel(trainer)
    trainer.engine.unload_adapter(trainer.refresher.serving_adapter)   # the engine lost the adapter
    panel.start(2)
    with pytest.raises(RuntimeError, match="GRPO step failed") as info:
        panel.wait(timeout=60)
    assert isinstance(info.value.__cause__, AdapterNotLoaded)
    assert any("AdapterNotLoaded" in o.get("text", "") for o in panel.log.outputs)
    assert not panel.busy and not panel.step_button.disabled and trainer.step_count == 0


def test_twenty_steps_open_no_figures_and_redraws_leak_nothing(trainer):
    from ipywidgets.widgets.widget import _instances as open_widgets
    plt.close("all")
    alive, widgets_before = figures_alive(), len(open_widgets)
    panel = StepPanel(trainer)
    for _ in range(10):
        panel.start(2)
        panel.wait(timeout=120)
    assert trainer.step_count == 20 and len(trainer.history) == 20
    assert plt.get_fignums() == [], "stepping opened pyplot figures"
    assert figures_alive() == alive + 1, "one live figure per panel, never more"
    # redrawing the same 20 steps again and again allocates nothing that survives
    panel.render()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(10):
        panel.render()
    gc.collect()
    assert len(gc.get_objects()) - before < 100, "each redraw leaves objects behind"
    panel.close()
    del panel
    assert figures_alive() == alive, "a closed panel's figure stays alive"
    assert len(open_widgets) == widgets_before, "a closed panel leaves widgets open"


def test_tables_escape_and_handle_no_step():
    assert "no step yet" in completions_table([]) and "no refresh yet" in refresh_table(None)
    samples = [{"prompt": 0, "question": "q<1>", "answer": "3", "completion": "<script>x</script>\n#### 3",
                "reward": 1.0, "advantage": 0.5}]
    table = completions_table(samples)
    assert "<script>" not in table and "&lt;script&gt;" in table and "q&lt;1&gt;" in table


# --- RunSession ------------------------------------------------------------------------------------
def test_session_writes_a_run_dir_the_cli_can_resume(tiny_model_dir, tmp_path):
    cfg = tiny_config(tmp_path, f"model.name_or_path={tiny_model_dir}", "grpo.steps=2")
    session = RunSession.open(cfg, tmp_path / "run", log=lambda *a: None)
    try:
        evals = read_jsonl(session.run_dir / "evals.jsonl")
        assert [(e["step"], e["greedy"]) for e in evals] == [(0, False), (0, True)]  # as the CLI's 'before'
        assert Config.load(session.run_dir / "config.json").to_dict() == cfg.to_dict()
        session.trainer.step()
        assert session.resume_command(extra_steps=3) == f"lorabench resume {session.run_dir} grpo.steps=4"
        assert [m["step"] for m in session.metrics()] == [1]
    finally:
        session.close()
    # reopened: resumes from the checkpoint instead of starting over, and does not evaluate again
    again = RunSession.open(cfg, tmp_path / "run", log=lambda *a: None)
    try:
        assert again.trainer.step_count == 1 and len(read_jsonl(again.run_dir / "evals.jsonl")) == 2
        again.trainer.step()
        assert [m["step"] for m in RunLog(again.run_dir).metrics()] == [1, 2]
    finally:
        again.close()
