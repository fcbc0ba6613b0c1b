"""The lessons' one progress display (progress.WaitProgress) against the notebook tests' noise check:
a bar tqdm itself draws is refused wherever it is printed, the lesson's bar is not; the bar counts
pieces, estimates the time left from the rate so far, and fills towards a measured expected time."""
from __future__ import annotations

import io
import re
import threading
import time

import nbformat
import pytest
from notebook_helpers import noise
from tqdm import tqdm

from lorabench.progress import PROGRESS_TEXT, WaitProgress


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


def test_the_lessons_progress_bar_is_not_noise():
    progress = WaitProgress("GRPO steps", tick_s=0.02)
    progress("GRPO steps", 2, 5, note="reward 0.25")
    bundle = progress._repr_mimebundle_()
    assert bundle["text/plain"] == PROGRESS_TEXT + "GRPO steps"
    assert "2 of 5" in progress.line.value and "reward 0.25" in progress.line.value
    assert noise(notebook_with(nbformat.v4.new_output("display_data", data=bundle))) == []
    progress.finish()


def test_counting_estimates_the_time_left_from_the_rate_so_far():
    progress = WaitProgress("refresh modes", tick_s=0.02)
    count = progress.counting(4)          # what refresh_bench.measure_many calls: count(done, total)
    time.sleep(0.05)
    count(1, 4)
    seconds_so_far, seconds_left = map(float, re.findall(r"(\d+) s", progress.line.value))
    assert progress.bar.value == 1 and "1 of 4" in progress.line.value and "left" in progress.line.value
    assert seconds_left == pytest.approx(3 * seconds_so_far, abs=1)   # 3 pieces left at the mean time so far
    count(4)
    assert progress.bar.value == progress.bar.max == 4
    assert progress.finish() >= 0.05 and progress.line.value.startswith("refresh modes: done in")


def test_an_expected_time_fills_the_bar_but_never_before_the_wait_ends(capsys):
    with WaitProgress("starting the engine", tick_s=0.02, expected_s=0.1) as progress:
        time.sleep(0.3)                    # past the expected time: the bar stays short of full
        ticker = [t for t in threading.enumerate() if t.name == "lorabench-progress"]
        assert ticker and progress.bar.value == 97 and "expected about 0 s" in progress.line.value
    assert progress.bar.value == progress.bar.max and "done in" in progress.line.value
    assert PROGRESS_TEXT + "starting the engine" in capsys.readouterr().out   # outside a kernel it prints
    with pytest.raises(RuntimeError), WaitProgress("failing", tick_s=0.02) as failed:
        raise RuntimeError("the call failed")
    assert "stopped by RuntimeError" in failed.line.value
    assert failed.finish("again") == failed.seconds         # once finished, it stays as it ended


def test_a_saved_notebook_keeps_how_long_the_wait_took(tmp_path):
    """In a real kernel: once the wait ends, its output is the final line as plain HTML (the widget
    closed), so the saved notebook still says what it waited for and how long, whatever happens to
    widget state; while it runs it is the ticking widget."""
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import time\nfrom lorabench.progress import WaitProgress\n"
        "with WaitProgress('GRPO steps', tick_s=0.05) as progress:\n"
        "    for i in range(3):\n"
        "        time.sleep(0.1)\n"
        "        progress('GRPO steps', i + 1, 3, note=f'step {i + 1}')\n"
        "    progress.finish('reward 0.5')\n")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    (output,) = nb.cells[0].outputs
    assert output["output_type"] == "display_data", output
    assert "application/vnd.jupyter.widget-view+json" not in output["data"]      # the widget is gone
    plain, shown = output["data"]["text/plain"], output["data"]["text/html"]
    assert plain.startswith(PROGRESS_TEXT + "GRPO steps: done in ") and "3 of 3" in plain and "reward 0.5" in plain
    assert "<progress value='1' max='1'" in shown and noise(nb) == []
