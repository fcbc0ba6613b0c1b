"""The step-through panel on a real trainer and HFEngine (tiny random model): stepping in the
background without blocking, one run at a time, Stop between steps, errors surfaced, the views
filled from the real step record, no figure or memory build-up over 20 steps; and RunSession,
which writes the CLI's run dir."""
from __future__ import annotations

import gc
import html
import re
import threading
import time

import matplotlib.pyplot as plt
import pytest
from figure_text_size import png_text_info, recording, smallest_text_pt
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from lorabench.engines.base import AdapterNotLoaded, StaleAdapter
from lorabench.runlog import RunLog, read_jsonl
from lorabench.session import RunSession, build_trainer, start_engine
from lorabench.session.config import Config
from lorabench.viz import MIN_FONT_PT
from lorabench.widgets import (
    PROGRESS_TEXT,
    SessionCloser,
    StepPanel,
    WaitProgress,
    completions_table,
    refresh_table,
    running_line,
    status_lines,
)

PNG = b"\x89PNG\r\n\x1a\n"


def tiny_config(tmp_path, *extra) -> Config:
    return Config.load(overrides=[
        "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=6", "grpo.micro_batch_tokens=256",
        "data.eval_size=2", "lora.r=4", "lora.alpha=8", "engine.hf.device=cpu", f"refresh.file.tmp_dir={tmp_path}",
        "warmstart.steps=0", f"run.out_dir={tmp_path / 'runs'}", *extra])


@pytest.fixture
def trainer(tiny_model_dir, tokenizer, tmp_path):
    cfg = tiny_config(tmp_path)
    engine = start_engine(cfg, str(tiny_model_dir))
    trainer = build_trainer(cfg, str(tiny_model_dir), engine, tokenizer=tokenizer, log=lambda *a: None)
    yield trainer
    trainer.close()
    engine.close()


@pytest.fixture
def text_size_recorded():
    """Every PNG rendered meanwhile carries its figure's name and smallest text, as in the notebook
    tests' kernel (figure_text_size)."""
    with recording():
        yield


def figures_alive() -> int:
    gc.collect()
    return sum(isinstance(o, Figure) for o in gc.get_objects())


def test_panel_shows_a_starting_state(trainer):
    panel = StepPanel(trainer)
    assert bytes(panel.plot.value).startswith(PNG)
    assert panel.step_label.value == "steps done: 0"
    assert "click Step" in panel.status.value and "no step yet" in panel.completions.value
    buttons = (panel.step_button, panel.run_button, panel.stop_button)
    assert [b.description for b in buttons] == ["Step", "Run N", "Stop"]
    assert not panel.step_button.disabled and panel.stop_button.disabled
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert png_text_info(bytes(panel.plot.value)) == {"figure": "", "min_text_px": None}   # a plain PNG


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


def test_a_click_as_the_buttons_come_back_starts_a_run(trainer):
    """The buttons are enabled at a run's end a moment before the panel counts as idle: a click in between (a
    person quick on Run N, a loaded machine) was refused with "busy", though the button said it was free."""
    panel = StepPanel(trainer)
    enabled, set_running = threading.Event(), panel._set_running

    def slow_to_finish(running: bool) -> None:   # the front end sees the buttons enabled, the thread goes on
        set_running(running)
        if not running:
            enabled.set()
            time.sleep(0.3)
    panel._set_running = slow_to_finish
    panel.start(1)
    assert enabled.wait(60)
    panel._set_running = set_running
    assert panel.start(1), [o.get("text") for o in panel.log.outputs]   # the click, at once
    panel.wait(timeout=60)
    assert trainer.step_count == 2 and not any("busy" in o.get("text", "") for o in panel.log.outputs)


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


def test_views_show_the_last_step(trainer, text_size_recorded):
    panel = StepPanel(trainer)
    before = panel.plot.value
    panel.start(1)
    record = panel.wait(timeout=60)
    assert bytes(panel.plot.value) != bytes(before) and bytes(panel.plot.value).startswith(PNG)
    g = trainer.settings.group_size
    last_group = [s for s in record.samples if s["prompt"] == trainer.settings.prompts_per_step - 1]
    assert len(last_group) == g
    table = panel.completions.value
    assert len(re.findall(r"<tr><td>\d+</td>", table)) == g
    for s in last_group:
        assert f"<td>{s['reward']:.2f}</td><td>{s['advantage']:+.2f}</td>" in table
        assert html.escape(s["completion"][:40]).replace("\n", " ⏎ ") in table
    for part, seconds in record.refresh.parts.items():
        assert f"<td>{part}</td><td>{1e3 * seconds:.2f}</td>" in panel.refresh.value
    assert f"{1e3 * record.refresh.total_s:.2f}" in panel.refresh.value
    assert f"adapter version {record.refresh.version}" in panel.refresh.value and record.refresh.version == 1
    m, status = record.metrics, panel.status.value
    assert "sampled from adapter v0 → trained to v1 → v1 refreshed into the engine" in status
    assert f"mean {m['mismatch/mean']:.1e}, p99 {m['mismatch/p99']:.1e} (max {m['mismatch/max']:.1e})" in status
    assert f"<b>probe gap</b> {m['probe/adapter_gap']:.3g}" in status
    assert f"<b>reward</b> {m['reward/mean']:.3f}" in status
    assert "no format bonus in this run" in status
    assert f"‖ΔW‖ {m['adapter/delta_norm']:.4f}" in status
    assert panel.step_label.value == "steps done: 1"
    info = png_text_info(bytes(panel.plot.value))
    assert info["figure"] == "step_panel" and info["min_text_px"] >= MIN_FONT_PT * panel.dpi / 72


def test_status_explains_a_format_bonus():
    from lorabench.rewards import reward_functions
    row = {"step": 3, "adapter/version": 3, "adapter/served_version": 2, "refresh/total_s": 0.01,
           "refresh/mode": "file", "time/step_s": 1.0, "adapter/delta_norm": 0.5, "reward/mean": 0.75,
           "reward/correct/mean": 0.5, "reward/format/mean": 0.5, "probe/adapter_gap": 0.1, "mismatch/mean": 1e-6,
           "mismatch/p99": 2e-6, "mismatch/max": 3e-6}
    status = status_lines(row, reward_functions("strict", 0.5))
    assert "reward</b> 0.750 = correct 0.500" in status and "+ 0.5 × share ending '#### N' (0.50)" in status
    assert "its last '#### N' is the right number" in status
    assert "no format bonus" in status_lines(row, reward_functions("flexible", 0.0))
    assert "sampled from adapter v2 → trained to v3" in status
    short = [*reward_functions("strict", 0.0), ("short", lambda *a, **k: [], 1.0)]   # a reward of one's own
    assert "+ 1 × short (0.100)" in status_lines({**row, "reward/short/mean": 0.1}, short)


def test_end_disables_the_panel(trainer):
    panel = StepPanel(trainer)
    panel.start(1)
    panel.end("closed")
    assert trainer.step_count == 1 and not panel.busy
    assert panel.step_button.disabled and panel.run_button.disabled and panel.stop_button.disabled
    assert not panel.start(1) and trainer.step_count == 1
    assert any("closed" in o.get("text", "") for o in panel.log.outputs)
    assert "steps done: 1" == panel.step_label.value           # the views stay


def test_a_failing_step_is_shown_and_reraised(trainer):
    panel = StepPanel(trainer)
    trainer.engine.unload_adapter(trainer.refresher.serving_adapter)   # the engine lost the adapter
    panel.start(2)
    with pytest.raises(RuntimeError, match="GRPO step failed") as info:
        panel.wait(timeout=60)
    assert isinstance(info.value.__cause__, AdapterNotLoaded)
    assert any("AdapterNotLoaded" in o.get("text", "") for o in panel.log.outputs)
    assert not panel.busy and not panel.step_button.disabled and trainer.step_count == 0


def test_a_stale_engine_stops_the_run_with_the_reason(trainer):
    """An engine serving an older adapter than the trainer's (here: someone reloaded version 0 behind
    the trainer's back) fails the next step with StaleAdapter, shown in the panel, and nothing is
    trained on those rollouts."""
    panel = StepPanel(trainer)
    old = trainer.policy.adapter()
    panel.start(1)
    panel.wait(timeout=60)
    trainer.engine.unload_adapter("policy")
    trainer.engine.load_adapter_tensors("policy", old)
    panel.start(1)
    with pytest.raises(RuntimeError, match="GRPO step failed") as info:
        panel.wait(timeout=60)
    assert isinstance(info.value.__cause__, StaleAdapter)
    assert any("StaleAdapter" in o.get("text", "") for o in panel.log.outputs)
    assert trainer.step_count == 1 and len(trainer.history) == 1


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
        again.trainer.wait_committed()
        assert [m["step"] for m in RunLog(again.run_dir).metrics()] == [1, 2]
    finally:
        again.close()


# --- notebook 01: an empty panel, progress, closing by hand --------------------------------------------
def test_an_empty_panel_invents_no_axis_range(trainer):
    """Before the first step the plots show a note and no ticks (matplotlib's empty axes would show
    -0.05..0.05); after a step, real ticks."""
    panel = StepPanel(trainer)
    for ax in panel.axes:
        assert list(ax.get_xticks()) == [] and list(ax.get_yticks()) == []
        assert "no step yet" in [t.get_text() for t in ax.texts]
    panel.start(1)
    panel.wait(60)
    assert all(len(ax.get_xticks()) > 0 and not ax.texts for ax in panel.axes)
    panel.close()


def test_running_line_estimates_the_time_left():
    assert "left" not in running_line(5, 0, 4, 0.0) and "1 of 4" in running_line(5, 0, 4, 0.0)
    line = running_line(7, 2, 4, 10.0)
    assert "3 of 4" in line and "10 s so far" in line and "about 10 s left" in line and "<progress value='2'" in line
    assert "about 2.0 min left" in running_line(3, 1, 5, 30.0)


def test_wait_progress_shows_each_part_and_the_time_left():
    from notebook_helpers import noise
    progress = WaitProgress("opening the run", tick_s=0.02)
    progress("warm-start", 0, 4)
    assert "0 of 4" in progress.line.value and "left" not in progress.line.value
    time.sleep(0.05)
    progress("warm-start", 2, 4)
    assert "2 of 4" in progress.line.value and "left" in progress.line.value and progress.bar.value == 2
    progress("starting the engine")
    time.sleep(0.1)   # the line ticks by itself
    assert "starting the engine · " in progress.line.value and "so far" in progress.line.value
    total = progress.finish("ok")
    assert set(progress.parts) == {"warm-start", "starting the engine"} and total >= sum(progress.parts.values())
    assert progress.line.value.startswith("opening the run: done in") and progress.bar.value == progress.bar.max
    bundle = progress._repr_mimebundle_()
    assert bundle["text/plain"] == PROGRESS_TEXT + "opening the run"

    # the notebook tests tell it from a library's bar
    def notebook(bundle):
        import nbformat
        return nbformat.from_dict({"cells": [{"cell_type": "code", "outputs": [
            {"output_type": "display_data", "data": bundle}]}]})
    from tqdm.notebook import tqdm
    library = tqdm(total=3, display=False).container._repr_mimebundle_()
    assert noise(notebook(bundle)) == [] and len(noise(notebook(library))) == 1


def test_session_closer_ends_the_panel_then_closes_the_session(tiny_model_dir, tmp_path):
    """The button waits for a running step, disables the panel, closes the session (the run dir's lock
    is free: the CLI may continue it) and shows the resume command; a second click does nothing."""
    from lorabench.rundir import lock_holder
    cfg = tiny_config(tmp_path, f"model.name_or_path={tiny_model_dir}", "grpo.steps=2")
    session = RunSession.open(cfg, tmp_path / "run", log=lambda *a: None)
    panel = StepPanel(session.trainer)
    closer = SessionCloser(panel, session, extra_steps=2)
    assert lock_holder(session.run_dir) is not None and not closer.button.disabled
    panel.start(1)
    closer.button.click()
    assert not panel.busy and session.trainer.step_count == 1            # the step ran to its end first
    assert panel.step_button.disabled and panel.run_button.disabled and closer.button.disabled
    assert lock_holder(session.run_dir) is None
    shown = [o["data"]["text/markdown"] for o in closer.output.outputs]
    assert shown and f"lorabench resume {session.run_dir} grpo.steps=3" in shown[0]
    closer.click()
    assert len(closer.output.outputs) == 1
    panel.close()


def test_session_open_reports_its_parts(tmp_path):
    """RunSession.open's progress hears every warm-start step of a tiny build, then each later part."""
    heard = []
    cfg = tiny_config(tmp_path, "warmstart.steps=3", f"model.cache_dir={tmp_path / 'cache'}")
    session = RunSession.open(cfg, tmp_path / "run", log=lambda *a: None,
                              progress=lambda what, done=None, total=None: heard.append((what, done, total)))
    session.close()
    assert heard == [("warm-start", 1, 3), ("warm-start", 2, 3), ("warm-start", 3, 3),
                     ("starting the hf engine", None, None), ("building the trainer", None, None),
                     ("held-out evaluation before the first step", None, None)]


# --- the figures' readability ----------------------------------------------------------------------
def _refresh_rows():
    parts = {"file": {"snapshot": 1e-3, "stage": 2e-4, "write": 3e-3, "unload": 8e-3, "load": 4e-2},
             "tensor": {"snapshot": 1e-3, "stage": 2e-4, "unload": 8e-3, "load": 3.5e-2},
             "inplace": {"snapshot": 1e-3, "write": 1e-3}, "merged": {"snapshot": 1e-3, "merge": 6e-3, "push": 3e-3}}
    rows = []
    for m, p in parts.items():
        total, first = sum(p.values()), 0.01
        calls = [total * f for f in (0.9, 1.0, 1.1, 3.0)]   # a slow repeat: the spread shows it
        rows.append({"mode": m, "bytes": 2**20 if m != "merged" else 10 * 2**20, "parts": p, "total_s": total,
                     "first_request_s": first, "end_to_end_s": total + first, "threads": 1, "rank": 8,
                     "samples": {"total_s": calls, "first_request_s": [first] * 4,
                                 "end_to_end_s": [c + first for c in calls]}})
    return rows


def _merged_rows():
    return [{"mode": "merged", "bucket_mb": mb, "buckets": n, "bytes": 10 * 2**20,
             "parts": {"push": 1e-3 * (5 + 0.2 * n)}, "total_s": 1e-3 * (5 + 0.2 * n),
             "samples": {"total_s": [1e-3 * (5 + 0.2 * n) * f for f in (0.95, 1.0, 1.05)]}}
            for mb, n in ((0.01, 42), (0.1, 30), (1, 11), (16, 1))]


def _rank_rows():
    return [{**row, "rank": rank, "bytes": row["bytes"] * (rank if row["mode"] != "merged" else 1),
             "samples": {"end_to_end_s": [s * (1 + rank / 64) for s in row["samples"]["end_to_end_s"]]}}
            for rank in (4, 16, 64) for row in _refresh_rows()]


def _run_rows(n=6):
    return [{"step": s, "reward/mean": 0.1 * s, "reward/std": 0.3, "reward/strict_format": 0.15 * s,
             "completions/last_number_right": 0.7 - 0.02 * s, "kl/mean": 0.01 * (s - 1), "entropy/mean": 1.5 - 0.1 * s,
             "refresh/mode": "tensor", "refresh/stage_s": 1e-4, "refresh/unload_s": 0.01, "refresh/load_s": 0.04,
             "refresh/total_s": 0.0501, "mismatch/mean": 5e-7, "mismatch/p99": 3e-6, "probe/adapter_gap": 0.01 * s,
             "adapter/delta_norm": 0.3 * s} for s in range(1, n + 1)]


def _evals():
    return [{"step": step, "greedy": True, "n": 8, "strict": strict, "format": fmt, "flexible": flexible}
            for step, strict, fmt, flexible in ((0, 0.0, 0.0, 0.75), (6, 0.5, 1.0, 0.5))]


def _figures():
    import torch

    from lorabench import explain, viz
    f = {"module": "model.layers.0.self_attn.q_proj", "A": torch.randn(4, 32), "B": torch.randn(32, 4), "scaling": 2.0,
         "W": torch.randn(32, 32)}
    f["delta"] = 2.0 * f["B"] @ f["A"]
    topk = {"tokens": ["'####'", "'The'", "' 4'"], "base": torch.tensor([0.1, 0.3, 0.2]),
            "adapter": torch.tensor([0.8, 0.05, 0.0])}
    rows = _run_rows()
    panel = Figure(figsize=(11, 6.6), layout="constrained")
    FigureCanvasAgg(panel)
    for ax, plot in zip(panel.subplots(2, 2).ravel(), (viz.plot_rewards, viz.plot_refresh, viz.plot_mismatch,
                                                         viz.plot_delta_norm)):
        plot(rows, ax=ax)
    return {"panel": panel, "refresh_modes": viz.refresh_modes_figure(_refresh_rows(), 10.0, "hf engine, CPU"),
            "merged_buckets": viz.merged_buckets_figure(_merged_rows(), [(0.005, 42), (0.1, 30), (1, 11), (16, 1)],
                                                        10.0, "hf engine, CPU"),
            "refresh_rank": viz.refresh_rank_figure(_rank_rows(), "hf engine, CPU"),
            "timing_threads": viz.thread_probe_figure([{**_refresh_rows()[2], "threads": n} for n in (1, 2)],
                                                      "hf engine, CPU"),
            "lora_factors": explain.plot_lora_factors(f), "topk": explain.plot_topk(topk).figure,
            "effect": explain.plot_logprob_difference(["Max", " has", "####"], torch.tensor([0.1, -0.5, 2.0])).figure,
            "timeline": explain.plot_refresh_timeline(_refresh_rows()).figure,
            "run_learned": viz.run_learned_figure(rows, _evals()),
            "broken_refresh": viz.broken_refresh_figure(rows, [{**r, "mismatch/mean": 0.02 * r["step"]} for r in rows])}


def _overlaps(a, b, margin=1.0) -> bool:
    return a.x0 < b.x1 - margin and b.x0 < a.x1 - margin and a.y0 < b.y1 - margin and b.y0 < a.y1 - margin


def test_figures_are_readable_and_legends_sit_outside_the_data():
    """Every notebook figure, drawn from small made-up rows in the notebooks' style: text >= 8 pt (11 px
    at 100 dpi), each legend outside its axes and clear of the title, the parts of a refresh on a linear
    axis, and a name for the browser test's screenshots."""
    import matplotlib

    from lorabench.viz import STYLE
    with matplotlib.rc_context(STYLE):
        figs = _figures()
        try:
            for name, fig in figs.items():
                fig.canvas.draw()
                assert smallest_text_pt(fig) >= MIN_FONT_PT, (name, smallest_text_pt(fig))
                renderer = fig.canvas.get_renderer()
                for ax in fig.axes:
                    legend = ax.get_legend()
                    if legend is None:
                        continue
                    box = legend.get_window_extent(renderer)
                    assert not _overlaps(box, ax.get_window_extent(renderer)), f"{name}: a legend over the data"
                    for title in (ax.title, ax._left_title):
                        if title.get_text():
                            assert not _overlaps(box, title.get_window_extent(renderer)), f"{name}: legend on title"
            # the parts compare on a linear axis; the end-to-end spread on a log one, where the floor shows
            assert [ax.get_xscale() for ax in figs["refresh_modes"].axes] == ["log", "linear"]
            for name in ("refresh_modes", "merged_buckets", "refresh_rank", "timing_threads"):
                assert figs[name].get_label() == name
            assert figs["timeline"].get_label() == "refresh_timeline"
            assert figs["run_learned"].get_label() == "run_learned"
            assert figs["broken_refresh"].get_label() == "broken_refresh"
        finally:
            for fig in figs.values():
                plt.close(fig)


def test_the_mismatch_plot_keeps_steps_sampled_one_behind_apart():
    """A stale run's lagged steps differ by the lag: they were drawn on the engine's mismatch line."""
    from lorabench import viz
    rows = [{**r, "adapter/lag": 0 if r["step"] == 1 else 1, "mismatch/mean": 5e-7 if r["step"] == 1 else 0.01}
            for r in _run_rows()]
    lines = {line.get_label(): line for line in viz.plot_mismatch(rows).get_lines()}
    assert list(lines["mismatch, mean"].get_xdata()) == [1]
    assert list(lines["mean, one behind (lag)"].get_xdata()) == [2, 3, 4, 5, 6]
    plt.close("all")


def test_push_cost_fit_recovers_the_cost_per_push():
    from lorabench.viz import push_cost_fit
    fixed, per_push = push_cost_fit(_merged_rows())
    assert fixed == pytest.approx(5.0) and per_push == pytest.approx(0.2)




def test_the_status_line_says_what_the_step_is_doing_while_it_runs(trainer):
    """Inside a step the status line is not frozen: it names the part under way (from the trainer's
    step clock) and its time, and from the second step on the bar moves inside the step."""
    panel = StepPanel(trainer, tick_s=0.05)
    train = trainer.policy.train

    def slow_train(*args, **kwargs):   # a step long enough to be watched
        time.sleep(0.5)
        return train(*args, **kwargs)

    trainer.policy.train = slow_train
    assert panel.start(2)
    seen, deadline = [], time.monotonic() + 120
    while panel.busy and time.monotonic() < deadline:
        seen.append(panel.status.value)
        time.sleep(0.02)
    panel.wait(60)
    training = [s for s in seen if "training the adapter" in s]
    assert training and all("this step " in s and "so far" in s for s in training), set(seen)
    second = [s for s in training if "(2 of 2)" in s]
    assert second and all("the last took" in s for s in second)
    values = [float(re.search(r"<progress value='([\d.]+)'", s).group(1)) for s in second]
    assert all(1 <= v < 2 for v in values) and max(values) > 1   # inside step 2: past 1 of 2, short of 2
    assert "running step" not in panel.status.value and "<b>step 2</b>" in panel.status.value
    panel.close()


def test_step_phase_follows_the_step_clock():
    from lorabench.clock import Clock
    from lorabench.widgets import STEP_PHASES, step_phase

    class Trainer:
        clock = None

    t = Trainer()
    assert step_phase(t) is None
    t.clock = Clock()
    assert step_phase(t) == STEP_PHASES["rollout"]
    for part in ("rollout", "reward"):
        t.clock.lap(part)
    assert step_phase(t) == STEP_PHASES["train"]
    for part in ("train", "refresh", "probe", "log"):
        t.clock.lap(part)
    assert step_phase(t) is None
    assert "training the adapter" in running_line(3, 0, 2, 4.0, STEP_PHASES["train"], 4.0, 10.0)
    assert "<progress value='0.4'" in running_line(3, 0, 2, 4.0, "x", 4.0, 10.0)
