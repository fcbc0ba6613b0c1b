"""The lessons' one display of a long wait (`with WaitProgress(what) as progress:`, then
`progress(part, done, total)`, or `expected_s` for one call that reports nothing): a bar and a line that ticks
every second from its own thread (widget messages arrive while the kernel is busy). The end of the block shows
the whole wait and each part's time as plain HTML, which a saved notebook keeps; its text/plain starts with
PROGRESS_TEXT, so a notebook test tells it from a library's tqdm bar.
"""
from __future__ import annotations

import html
import threading
import time

import ipywidgets as widgets

PROGRESS_TEXT = "lorabench progress: "


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


class WaitProgress:
    def __init__(self, description: str, tick_s: float = 1.0, expected_s: float | None = None):
        self.description = description
        self.bar = widgets.IntProgress(value=0, min=0, max=1, layout=widgets.Layout(width="240px"))
        self.line = widgets.HTML(f"<i>{html.escape(description)}</i>")
        self.widget = widgets.HBox([self.bar, self.line])
        self.widget.add_class("lorabench-progress")
        self.parts: dict[str, float] = {}
        self.counts: dict[str, tuple[int, int]] = {}   # part -> (done, total), parts that count
        self.seconds: float | None = None    # the whole wait, once finished
        self._started = self._part_started = time.perf_counter()
        self._part = self._done = self._total = self._expected = None
        self._note, self._handle = "", None
        self._lock = threading.Lock()
        self._finished = threading.Event()
        if expected_s:
            self(description, expected_s=expected_s)
        threading.Thread(target=self._tick, args=(tick_s,), name="lorabench-progress", daemon=True).start()

    def _repr_mimebundle_(self, **kwargs):
        return {**self.widget._repr_mimebundle_(**kwargs), "text/plain": PROGRESS_TEXT + self.description}

    def __repr__(self) -> str:   # what display() prints outside a kernel
        return PROGRESS_TEXT + self.description

    def __enter__(self):
        """`with WaitProgress(...) as progress:` shows it, and finishes it however the block ends."""
        from IPython.display import display
        self._handle = display(self, display_id=True)   # None outside a kernel (it prints)
        return self

    def __exit__(self, kind, error, trace):
        self.finish(f"stopped by {kind.__name__}" if kind else "")
        return False

    def __call__(self, what: str, done: int | None = None, total: int | None = None, note: str = "",
                 expected_s: float | None = None) -> None:
        with self._lock:
            now = time.perf_counter()
            if what != self._part:
                self._close_part(now)
                self._part, self._part_started = what, now
            self._done, self._total, self._note, self._expected = done, total, note, expected_s
            if total:
                self.counts[what] = (done or 0, total)
            self._render(now)

    def counting(self, total: int, what: str | None = None):
        """A `progress(done, total=None)` callback for code that counts pieces, as a part of this wait."""
        return lambda done, of=None: self(what or self.description, done, of or total)

    def _render(self, now: float) -> None:
        if self._part is None:
            return
        what, done, total, elapsed = html.escape(self._part), self._done, self._total, now - self._part_started
        if total:
            self.bar.max, self.bar.value = total, min(done or 0, total)
            left = f" · about {duration(elapsed / done * (total - done))} left" if done else ""
            text = f"{what}: {done or 0} of {total} · {duration(elapsed)} so far{left}"
        elif self._expected:
            self.bar.max, self.bar.value = 100, min(int(100 * elapsed / self._expected), 97)  # full when done
            text = f"{what} · {duration(elapsed)} so far · expected about {duration(self._expected)}"
        else:
            self.bar.max, self.bar.value = 1, 0
            text = f"{what} · {duration(elapsed)} so far"
        self.line.value = text + (f" · {html.escape(self._note)}" if self._note else "")

    def _tick(self, tick_s: float) -> None:
        while not self._finished.wait(tick_s):
            with self._lock:
                self._render(time.perf_counter())

    def _close_part(self, now: float) -> None:
        if self._part is not None:
            self.parts[self._part] = self.parts.get(self._part, 0.0) + now - self._part_started

    def _summary(self, total: float, note: str) -> str:
        """'what: done in 2.1 min, 30 of 30 (part 12 s, part 40 s) · note', as HTML."""
        def counted(what: str) -> str:
            return ", {} of {}".format(*self.counts[what]) if what in self.counts else ""

        parts = ", ".join(f"{what} {duration(s)}{counted(what)}" for what, s in self.parts.items()
                          if s >= 0.5 and what != self.description)
        return (f"{html.escape(self.description)}: done in {duration(total)}{counted(self.description)}"
                f"{f' ({html.escape(parts)})' if parts else ''}{f' · {html.escape(note)}' if note else ''}")

    def finish(self, note: str = "") -> float:
        """End the display with the whole wait and its parts; returns the wait in seconds. Only the first call acts."""
        if self._finished.is_set():
            return self.seconds
        self._finished.set()
        with self._lock:
            now = time.perf_counter()
            self._close_part(now)
            self._part = None
            self.seconds = total = now - self._started
            self.bar.max, self.bar.value = 1, 1
            self.line.value = self._summary(total, note)
        if self._handle is not None:   # the widget's last state, as plain HTML a saved notebook keeps
            self._handle.update({"text/plain": PROGRESS_TEXT + html.unescape(self.line.value),
                                 "text/html": f"<div class='lorabench-progress'><progress value='1' max='1' "
                                              f"style='width:240px'></progress> {self.line.value}</div>"}, raw=True)
            for widget in (self.widget, self.bar, self.line):
                widget.close()
        return total
