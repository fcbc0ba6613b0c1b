"""The step-through panel: Step / Run N / Stop over a GRPOTrainer, with live views of the run.

Steps run in one background thread (the kernel stays responsive); Stop is honoured between steps. Views are
widgets whose value is replaced in one message, notes go through the thread-safe `Output.append_stdout`, and
while the kernel is idle Kernel -> Interrupt acts as Stop.
"""
from __future__ import annotations

import html
import io
import threading
import time
import traceback
import warnings
import weakref
from pathlib import Path

import ipywidgets as widgets
import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from . import metrics as m
from .interrupts import interrupts_to_the_main_thread
from .progress import PROGRESS_TEXT, WaitProgress, duration  # noqa: F401  (WaitProgress: the lessons' import)
from .viz import GROUP_VIEWS, RUN_VIEWS, STYLE, plot_policies


def setup_notebook() -> None:
    """The figure style; no hub progress bars, no PEFT `is_gradient_checkpointing` FutureWarning."""
    from transformers.utils import logging as hf_logging
    matplotlib.rcParams.update(STYLE)
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.*", category=FutureWarning)


def sglang_in_notebook() -> list[str]:
    """Overrides for sglang in a kernel: its processes' output to a log file, no compile (a fast first Step)."""
    import tempfile
    return [f"engine.sglang.log_file={Path(tempfile.gettempdir()) / 'lorabench-sglang.log'}", "grpo.compile=off"]


_TABLE_STYLE = ("<style>.lb-table td,.lb-table th{padding:2px 8px;text-align:left;font-size:12px;"
                "font-family:monospace;vertical-align:top}.lb-table th{border-bottom:1px solid #999}</style>")


def _row(*cells, tag: str = "td") -> str:
    return "<tr>" + "".join(f"<{tag}>{cell}</{tag}>" for cell in cells) + "</tr>"


def _table(caption: str, header: list[str], rows: list[str]) -> str:
    """The panel's HTML table: `caption` (HTML) above, `header` cells, then `rows` (each from `_row`)."""
    return f"{_TABLE_STYLE}<div>{caption}</div><table class='lb-table'>{_row(*header, tag='th')}{''.join(rows)}</table>"


def completions_table(samples: list[dict], max_chars: int = 120) -> str:
    """HTML table of the last group's completions (the last prompt of the step): reward, advantage."""
    if not samples:
        return "<i>no step yet</i>"
    last = samples[-1]["prompt"]
    group = [s for s in samples if s["prompt"] == last]
    rows = [_row(i, f"{s['reward']:.2f}", f"{s['advantage']:+.2f}",
                 html.escape(s["completion"][:max_chars]).replace("\n", " ⏎ ")) for i, s in enumerate(group)]
    return _table(f"<b>Last group</b> (answer {html.escape(str(group[0]['answer']))}): "
                  f"{html.escape(group[0]['question'])}", ["#", "reward", "advantage", "completion"], rows)


def refresh_table(record) -> str:
    """HTML table of one RefreshRecord: each part and the total in ms, bytes and buckets."""
    if record is None:
        return "<i>no refresh yet</i>"
    rows = [_row(part, f"{1e3 * s:.2f}") for part, s in record.parts.items()]
    return _table(f"<b>Refresh to adapter version {record.version}</b> ({record.mode}, "
                  f"{record.nbytes / 2**20:.2f} MB in {len(record.buckets)} bucket(s))", ["part", "ms"],
                  [*rows, _row("<b>total</b>", f"<b>{1e3 * record.total_s:.2f}</b>")])


def status_lines(row: dict | None, rewards: list[tuple[str, object, float]]) -> str:
    """The step, then reward, probe gap and mismatch, each explained; `rewards`: (name, fn, weight)."""
    if row is None:
        return "<i>no step yet: click Step</i>"
    step, version = row["step"], row[m.VERSION]
    head = (f"<b>step {step}</b>: completions sampled from adapter v{row[m.SERVED_VERSION]} → trained to "
            f"v{version} → v{version} refreshed into the engine in {1e3 * row[m.REFRESH_S]:.1f} ms "
            f"({row[m.REFRESH_MODE]}) · step {row[m.STEP_S]:.2f} s · ‖ΔW‖ {row[m.DELTA_NORM]:.4f}"
            + (f" · sampled {row[m.LAG]} update(s) behind the trainer (grpo.max_staleness), importance "
               f"weights mean {row[m.IS_WEIGHT]:.3f}" if m.LAG in row else ""))
    correct = row.get(m.CORRECT, row[m.REWARD])
    weights = {name: (fn, weight) for name, fn, weight in rewards}
    rule = weights["correct"][0].rule
    share = row.get(m.FORMAT, 0.0)
    bonus = (f" + {weights['format'][1]:g} × share ending '#### N' ({share:.2f}), a format bonus paid right or wrong"
             if "format" in weights else "; no format bonus in this run")
    own = "".join(f" + {weight:g} × {html.escape(name)} ({_fmt(row.get(m.reward_of(name)), '.3f')})"
                  for name, _, weight in rewards if name not in ("correct", "format"))   # a reward of your own
    reward = (f"<b>reward</b> {row[m.REWARD]:.3f} = correct {correct:.3f} (a completion scores 1 when {rule})"
              f"{bonus}{own}")
    probe = (f"<b>probe gap</b> {_fmt(row.get(m.PROBE_GAP), '.3g')} nats: mean |log p(adapter) − log p(base)| "
             "on one fixed held-out answer, scored by the engine; how far the served adapter has moved the model "
             "(0 = the base model)")
    mismatch = (f"<b>mismatch</b> mean {_fmt(row[m.MISMATCH], '.1e')}, p99 {_fmt(row.get(m.MISMATCH_P99), '.1e')} "
                f"(max {_fmt(row[m.MISMATCH_MAX], '.1e')}) nats: |trainer − engine| log-prob of the tokens just "
                "sampled; far below the probe gap means the engine served the trainer's policy (float32: ~1e-6; "
                "SGLang's bf16 kernels: mean ~3e-3; the max is one token's rounding tail, not an alarm)"
                + (f"; sampled {row[m.LAG]} update(s) behind, so here it is mostly that lag" if row.get(m.LAG) else ""))
    return "<br>".join([head, reward, probe, mismatch])


# a step's parts in the order they run (grpo.GRPOTrainer._step laps its clock after each)
STEP_PHASES = {"rollout": "sampling rollouts in the engine", "reward": "scoring the rewards",
               "train": "training the adapter", "refresh": "refreshing the engine's adapter",
               "probe": "measuring the probe gap", "log": "committing the step"}


def step_phase(trainer) -> str | None:
    """The first part of the step its clock has not lapped yet (None outside a step)."""
    clock = getattr(trainer, "clock", None)
    return None if clock is None else next((t for part, t in STEP_PHASES.items() if part not in clock.parts), None)


def running_line(step: int, done: int, total: int, elapsed_s: float, phase: str | None = None,
                 step_s: float | None = None, expected_s: float | None = None) -> str:
    """The status while a Run N goes: a bar, the step and what it does, the time so far and left (at the run's
    mean pace); inside a step the bar moves towards the last step's time, held short of it."""
    left = f" · about {duration(elapsed_s / done * (total - done))} left" if done else ""
    inside = min(step_s / expected_s, 0.95) if step_s is not None and expected_s else 0.0
    now = "".join([f" · {html.escape(phase)}" if phase else "",
                   f" · this step {duration(step_s)}" if step_s is not None else "",
                   f" (the last took {duration(expected_s)})" if step_s is not None and expected_s else ""])
    return (f"<progress value='{done + inside:.3g}' max='{total}' style='width:180px'></progress> <i>running step "
            f"{step} ({done + 1} of {total}){now} · {duration(elapsed_s)} so far{left}…</i>")


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None or value != value else format(value, spec)


class StepPanel:
    label = "step_panel"   # the figure's name (fig.set_label)

    def __init__(self, trainer, figsize=(11, 6.6), dpi: int = 90, tick_s: float = 1.0):
        self.trainer, self.tick_s, self.dpi = trainer, tick_s, dpi
        self._status_lock = threading.Lock()
        self._running = None                 # while a step runs: (step, done, total, run started, step started)
        self._last_step_s = None             # the last step's wall time: how far the bar moves inside a step
        self.last = None                     # the latest StepRecord
        self.error: BaseException | None = None
        # waited on instead of Thread.join, which an interrupt can leave believing a live thread ended
        self._idle = threading.Event()
        self._idle.set()
        self._stop = threading.Event()
        self._start_lock = threading.Lock()  # one run at a time
        self._ended = False
        self._draw_lock = threading.Lock()   # one redraw at a time
        self.figure = Figure(figsize=figsize, layout="constrained", dpi=dpi)
        self.figure.set_label(self.label)
        FigureCanvasAgg(self.figure)
        # a list, not numpy's object array: gc sees through it, so a closed panel's figure is freed at once
        self.axes = self.figure.subplots(2, 2).ravel().tolist()

        self.step_button = widgets.Button(description="Step", icon="step-forward", tooltip="one GRPO step")
        self.steps_input = widgets.BoundedIntText(value=5, min=1, max=100_000, description="N",
                                                  layout=widgets.Layout(width="130px"))
        self.run_button = widgets.Button(description="Run N", icon="play", tooltip="N GRPO steps")
        self.stop_button = widgets.Button(description="Stop", icon="stop", disabled=True,
                                          tooltip="stop after the current step")
        self.step_label = widgets.Label()
        self.status = widgets.HTML(layout=widgets.Layout(max_width="1100px"))
        self.plot = widgets.Image(format="png", layout=widgets.Layout(max_width="100%"))
        self.completions, self.refresh = widgets.HTML(), widgets.HTML()
        self.log = widgets.Output(layout=widgets.Layout(max_height="160px", overflow="auto"))
        self.step_button.on_click(lambda _: self.start(1))
        self.run_button.on_click(lambda _: self.start(self.steps_input.value))
        self.stop_button.on_click(lambda _: self.stop())
        controls = [self.step_button, self.steps_input, self.run_button, self.stop_button, self.step_label]
        self.widget = widgets.VBox([widgets.HBox(controls), self.status, self.plot,
                                    widgets.HBox([self.completions, self.refresh]), self.log])
        self.widget.add_class("lorabench-step-panel")
        self.render()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def render(self) -> None:
        """Redraw every view from the trainer's history and the last step record."""
        rows = list(self.trainer.history)
        self._draw([lambda ax, plot=plot: plot(rows, ax=ax) for plot in RUN_VIEWS], empty=not rows)
        self.status.value = status_lines(rows[-1] if rows else None, self.trainer.rewards)
        self.completions.value = completions_table(self.last.samples if self.last else [])
        self.refresh.value = refresh_table(self.last.refresh if self.last else None)

    def _draw(self, plots, empty: bool) -> None:
        """The live figure, one plot(ax) per axes, into the Image widget; then the steps done."""
        with self._draw_lock, matplotlib.rc_context(STYLE):
            for ax, plot in zip(self.axes, plots):
                ax.clear()
                plot(ax)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # steps are whole numbers
                if empty:   # no data: no made-up ticks, a note; title and labels keep the layout
                    ax.set(xticks=[], yticks=[])
                    ax.minorticks_off()
                    ax.text(0.5, 0.5, "no step yet", transform=ax.transAxes, ha="center", va="center", color="#666666")
            png = io.BytesIO()
            self.figure.savefig(png, format="png", dpi=self.dpi, bbox_inches="tight")
            self.plot.value = png.getvalue()
        self.step_label.value = f"steps done: {self.trainer.step_count}"

    def close(self) -> None:
        """Stop, close the widgets (ipywidgets keeps every open one alive) and free the figure."""
        self.stop()
        self._idle.wait()
        for w in (self.step_button, self.steps_input, self.run_button, self.stop_button, self.step_label,
                  self.status, self.plot, self.completions, self.refresh, self.log, *self.widget.children,
                  self.widget):
            for part in (getattr(w, "layout", None), getattr(w, "style", None), w):  # layout, style: widgets too
                if part is not None:
                    part.close()
        self.figure.clear()

    def end(self, note: str = "") -> None:
        """Wait for a running step, then disable the buttons and show `note`; the views stay."""
        self._idle.wait()
        self.step_button.disabled = self.run_button.disabled = self.stop_button.disabled = True
        self._ended = True
        if note:
            self.log.append_stdout(note + "\n")

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def start(self, n: int = 1) -> bool:
        """Run `n` steps in the background; False (and a note) if a run is already going."""
        with self._start_lock:
            if self._ended:
                self.log.append_stdout("this panel has ended: its trainer is closed\n")
                return False
            if self.busy:
                self.log.append_stdout("busy: a run is in progress (Stop it, or wait)\n")
                return False
            self._stop.clear()
            self.error = None
            _RUNNING.add(self)
            _stop_panels_on_idle_interrupt()
            self._set_running(True)
            self._idle.clear()
            done = threading.Event()   # the run's end, for the ticker; started here, so the steps start at once
            threading.Thread(target=self._tick, args=(done,), name="lorabench-panel-tick", daemon=True).start()
            threading.Thread(target=self._run, args=(int(n), done), name="lorabench-steps", daemon=True).start()
            return True

    def stop(self, note: str = "") -> None:
        """Stop after the step in progress."""
        if note and self.busy and not self._stop.is_set():
            self.log.append_stdout(note + "\n")
        self._stop.set()

    def wait(self, timeout: float | None = None):
        """Block until the run ends; re-raise its error; return the last StepRecord. Interrupted, it
        stops the run after the current step and re-raises."""
        try:
            finished = self._idle.wait(timeout)
        except KeyboardInterrupt:
            self.stop("interrupted: stopping after the current step")
            raise
        if not finished:
            raise TimeoutError(f"the run did not finish within {timeout} s")
        if self.error is not None:
            raise RuntimeError(f"a GRPO step failed: {self.error!r}") from self.error
        return self.last

    def _run(self, n: int, done: threading.Event) -> None:
        interrupts_to_the_main_thread()   # an interrupt while the panel steps is the kernel's (Stop)
        started = time.perf_counter()
        try:
            for i in range(n):
                if self._stop.is_set():
                    self.log.append_stdout(f"stopped after {i} of {n} step(s)\n")
                    break
                step_started = time.perf_counter()
                with self._status_lock:
                    self._running = (self.trainer.step_count + 1, i, n, started, step_started)
                self._show_running()
                self.last = self.trainer.step()
                self._last_step_s = time.perf_counter() - step_started
                with self._status_lock:   # from here on the ticker leaves the status line to render()
                    self._running = None
                self.render()
            self.trainer.wait_committed()   # an idle panel means the run dir holds every step it ran
        except Exception as err:  # shown in the panel and re-raised by wait()
            self.error = err
            self.log.append_stderr(traceback.format_exc())
        finally:
            done.set()
            with self._status_lock:
                self._running = None
            _RUNNING.discard(self)
            with self._start_lock:   # a click that meets the enabled buttons waits here, then starts its run
                self._set_running(False)
                self._idle.set()

    def _tick(self, done: threading.Event) -> None:
        while not done.wait(self.tick_s):
            self._show_running()

    def _show_running(self) -> None:
        with self._status_lock:
            if self._running is None:
                return
            step, i, n, started, step_started = self._running
            now = time.perf_counter()
            self.status.value = running_line(step, i, n, now - started, self._phase(), now - step_started,
                                             self._last_step_s)

    def _phase(self) -> str | None:
        return step_phase(self.trainer)

    def _set_running(self, running: bool) -> None:
        self.step_button.disabled = self.run_button.disabled = running or self._ended
        self.stop_button.disabled = not running


class GroupPanel(StepPanel):
    """The step panel of a group.PolicyGroup: each click steps every policy; the views put the policies
    side by side, with a table of each one's last step. `panel.last` is {name: StepRecord}."""
    label = "group_panel"

    def render(self) -> None:
        histories = {name: list(t.history) for name, t in self.trainer.trainers.items()}
        self._draw([lambda ax, v=view: plot_policies(histories, *v[:3], ax=ax, log=v[3], rolling=v[4])
                    for view in GROUP_VIEWS], empty=not any(histories.values()))
        self.status.value = policies_table(histories)
        self.completions.value = self.refresh.value = ""

    def _phase(self) -> str | None:
        name = getattr(self.trainer, "current", None)   # None while the policies' shared batch is sampled
        if name is None:
            return "sampling every policy's rollouts in one engine batch"
        phase = step_phase(self.trainer.trainers[name])
        return f"policy {name}: {phase}" if phase else f"policy {name}"


def policies_table(histories: dict[str, list[dict]]) -> str:
    """HTML: each policy's last step (reward, mismatch, probe gap, refresh, served version)."""
    if not any(histories.values()):
        return "<i>no step yet: click Step (every policy takes one)</i>"
    rows = []
    for name, history in histories.items():
        if not history:
            rows.append(f"<tr><td>{name}</td><td colspan=7><i>no step yet</i></td></tr>")
            continue
        last = history[-1]
        recent = [r[m.REWARD] for r in history[-5:]]
        rows.append(_row(f"<b>{name}</b>", last["step"], f"{last[m.REWARD]:.3f}", f"{sum(recent) / len(recent):.3f}",
                         _fmt(last[m.MISMATCH], ".1e"), _fmt(last.get(m.PROBE_GAP), ".3g"),
                         f"{1e3 * last[m.REFRESH_S]:.1f}", f"v{last[m.SERVED_VERSION]}"))
    return _table("One engine batch per step for all policies; each policy trained, refreshed and checked on its own "
                  "(its rollouts served by its own adapter: the trainer's version, or one behind with "
                  "grpo.max_staleness=1)", ["policy", "step", "reward", "reward, mean of 5", "mismatch mean",
                                            "probe gap", "refresh ms", "served version"], rows)


_RUNNING: weakref.WeakSet[StepPanel] = weakref.WeakSet()   # panels whose steps are running now


def _on_idle_interrupt(signum, frame) -> None:
    """SIGINT while the kernel is idle: stepping panels stop after their current step."""
    for panel in list(_RUNNING):
        panel.stop("Kernel -> Interrupt: stopping after the current step")


def _stop_panels_on_idle_interrupt() -> None:
    """Make `_on_idle_interrupt` the SIGINT handler ipykernel restores after each message (from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    from IPython import get_ipython
    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is not None and hasattr(kernel, "saved_sigint_handler"):
        kernel.saved_sigint_handler = _on_idle_interrupt


class SessionCloser:
    """A button that ends the panel, closes the session (engine and run-dir lock) and shows the shell
    command that continues the run; until clicked the panel stays live, after Run All too."""

    def __init__(self, panel: StepPanel, session, extra_steps: int = 0):
        self.panel, self.session, self.extra_steps = panel, session, extra_steps
        self.closed = False
        self.button = widgets.Button(description="Close the session", icon="power-off", button_style="warning",
                                     layout=widgets.Layout(width="200px"),
                                     tooltip="end the panel, release the engine and the run dir's lock")
        self.output = widgets.Output()
        self.button.on_click(lambda _: self.click())
        self.widget = widgets.VBox([self.button, self.output])
        self.widget.add_class("lorabench-session-closer")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def click(self) -> None:
        if self.closed:
            return
        from IPython.display import Markdown
        self.button.disabled = True
        try:
            self.panel.end("session closed: continue the run from a shell with the command under the button")
            self.session.close()
        except Exception:   # shown under the button; a click has no cell to fail
            self.output.append_stderr(traceback.format_exc())
            raise
        self.closed = True
        command = self.session.resume_command(extra_steps=self.extra_steps)
        self.output.append_display_data(Markdown(f"Session closed. Continue the run from the repository root:\n"
                                                 f"```bash\n{command}\n```"))


