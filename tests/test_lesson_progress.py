"""Notebook 03's own progress display (explain.Progress) against the notebook tests' noise check:
a bar tqdm itself draws is refused wherever it is printed, the lesson's bar is not; and the lesson's
bar counts and estimates the time left from the rate so far."""
from __future__ import annotations

import io
import time

import nbformat
from notebook_helpers import noise
from tqdm import tqdm

from lorabench import explain


def notebook_with(*outputs):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("", outputs=list(outputs))]
    return nb


def tqdm_text(total: int = 10, done: int = 4) -> str:
    """What tqdm writes for a bar `done` of `total` through (drawn by tqdm, not typed here)."""
    sink = io.StringIO()
    bar = tqdm(total=total, file=sink, ascii=False, mininterval=0)
    bar.update(done)
    bar.close()
    return sink.getvalue()


def test_a_tqdm_bar_is_noise_wherever_it_is_printed():
    text = tqdm_text()
    assert noise(notebook_with(nbformat.v4.new_output("stream", name="stdout", text=text)))
    assert noise(notebook_with(nbformat.v4.new_output("display_data", data={"text/plain": text})))


def test_the_lessons_progress_bar_is_not_noise(capsys):
    bar = explain.Progress("GRPO steps", 5)
    bar.update(2, "reward 0.25")
    bundle = bar._bundle()
    assert "<progress value='2' max='5'" in bundle["text/html"]
    assert noise(notebook_with(nbformat.v4.new_output("display_data", data=bundle))) == []
    assert "GRPO steps: 0/5 steps" in capsys.readouterr().out   # outside IPython it prints


def test_the_estimate_follows_the_rate_so_far():
    bar = explain.Progress("waiting", 4)
    time.sleep(1.0)
    bar.update(1)
    left = float(bar.text().split("about ")[1].split(" s left")[0])
    elapsed = time.perf_counter() - bar.t0
    assert abs(left - 3 * elapsed) <= 0.6    # 3 steps to go at the rate of the first (4 s if it took the total)
    assert bar.finish() >= 1.0 and "done in" in bar.text() and "4/4" in bar.text()
