"""Ctrl-C / Kernel -> Interrupt in a process that goes on (a notebook kernel), on the real trainer
and HFEngine with the tiny model: an interrupt at any moment of a step leaves the trainer at its
last committed step, its run dir saying the same, and the run that continues equals one that was
never interrupted; an interrupt during the commit is held until the commit is whole, one during close()
until the commit in flight is (a commit after its run log closed is refused, never written elsewhere); one
step at a time per trainer; `panel.wait()` interrupted stops the panel. The same contract in a real kernel
(with the interrupt arriving as Jupyter sends it) is test_kernel_session.py."""
from __future__ import annotations

import os
import random
import re
import signal
import threading
import time

import pytest
import torch
from test_widgets import tiny_config, trainer  # noqa: F401  (the panel tests' trainer fixture)

from lorabench.grpo import StepInProgress, interrupts_deferred
from lorabench.rundir import RunDirError, inspect, read_jsonl
from lorabench.runlog import RunLog
from lorabench.session import build_trainer, start_engine
from lorabench.widgets import StepPanel

pytestmark = pytest.mark.usefixtures("default_sigint")   # conftest.py: why


def interrupt_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, args=(os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def make_trainer(cfg, model_dir, tokenizer, run_dir):
    engine = start_engine(cfg, str(model_dir))
    runlog = RunLog(run_dir, log=lambda *a: None, settings=cfg.run)
    return build_trainer(cfg, str(model_dir), engine, runlog, tokenizer=tokenizer, log=lambda *a: None)


def test_interrupts_at_random_moments_change_nothing_but_time(tiny_model_dir, tokenizer, tmp_path):
    steps = 6
    cfg = tiny_config(tmp_path, f"grpo.steps={steps}")
    plain = make_trainer(cfg, tiny_model_dir, tokenizer, tmp_path / "plain")
    step_times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        plain.run(1, progress=False)
        step_times.append(time.perf_counter() - t0)
    # draws within a typical step, so that most land inside one; the window widens after a run that finished no
    # step, so the loop always ends (a trainer's first step also scores the base model for its probe and can
    # outlast every plain step: a fixed window within the fastest one could interrupt it forever)
    typical = sorted(step_times)[steps // 2]
    interrupted = make_trainer(cfg, tiny_model_dir, tokenizer, tmp_path / "interrupted")
    rng, notes, window = random.Random(0), [], typical
    for _ in range(100):
        if interrupted.step_count == steps:
            break
        before = interrupted.step_count
        timer = interrupt_after(rng.uniform(0.0, window))
        try:
            interrupted.run(steps - interrupted.step_count, progress=False)
        except KeyboardInterrupt as stop:
            notes.append(" ".join(getattr(stop, "__notes__", [])))
        finally:
            timer.cancel()
        interrupted.wait_committed()           # the last step's commit may still be on the commit thread
        rows = interrupted.runlog.metrics()
        assert [r["step"] for r in rows] == list(range(1, interrupted.step_count + 1))   # committed = in memory
        assert len(interrupted.history) == interrupted.step_count
        window = typical if interrupted.step_count > before else 1.25 * window
    assert interrupted.step_count == steps, f"{interrupted.step_count} of {steps} steps after 100 interrupts"
    assert len(notes) >= 3, notes
    assert any("was rolled back" in n for n in notes), notes    # some landed inside the update or refresh
    assert torch.equal(interrupted.policy.adapter().buffer, plain.policy.adapter().buffer)
    rows, plain_rows = interrupted.runlog.metrics(), plain.runlog.metrics()
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in plain_rows]
    assert [r["adapter/served_version"] for r in rows] == list(range(steps))
    for made in (plain, interrupted):
        made.close()
        made.engine.close()


def test_an_interrupt_during_a_commit_is_held_until_it_is_whole():
    seen = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)                 # a handler would have run by now
            seen.append("the block went on")
    assert seen == ["the block went on"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_error_in_a_block_that_held_an_interrupt_is_raised_not_hidden_by_it():
    """A commit failing on a full disk while a Ctrl-C is held: the user stops with the disk's error, noted."""
    with pytest.raises(OSError, match="No space") as raised:
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            raise OSError(28, "No space left on device")
    assert any("Ctrl-C arrived meanwhile" in note for note in raised.value.__notes__)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def step_with_held_commit(tiny_model_dir, tokenizer, tmp_path, monkeypatch, before_commit):
    """(trainer, run dir, an Event set once the commit ended) after one step whose background commit runs
    `before_commit()` first; the working directory is an empty tmp_path/cwd; the run log holds the lock."""
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    cfg, run = tiny_config(tmp_path), tmp_path / "run"
    runlog = RunLog(run, log=lambda *a: None, lock=True, settings=cfg.run)
    trainer = build_trainer(cfg, str(tiny_model_dir), start_engine(cfg, str(tiny_model_dir)), runlog,
                            tokenizer=tokenizer, log=lambda *a: None)
    commit, ended = runlog.commit, threading.Event()

    def held_commit(*args):
        try:
            before_commit()
            commit(*args)
        finally:
            ended.set()
    runlog.commit = held_commit
    trainer.step()
    return trainer, run, ended


def test_an_interrupted_close_waits_for_the_commit_in_flight(tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """Ctrl-C twice while close() waits for the step's background commit: the commit is written whole into
    the run dir, then the interrupt is raised; the run log closed after it (as session.close() does) leaves
    nothing in the working directory, and the run dir resumes at the step with nothing to repair."""
    closing = threading.Event()

    def interrupted_twice():
        assert closing.wait(timeout=120)
        for _ in range(2):   # once in the wait for this commit, once in the commit thread's join
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.3)
    trainer, run, ended = step_with_held_commit(tiny_model_dir, tokenizer, tmp_path, monkeypatch, interrupted_twice)
    wait = trainer._commits.raise_if_failed

    def waited_in_close(*args, **kwargs):   # only close() calls it after the step
        closing.set()
        wait(*args, **kwargs)
    monkeypatch.setattr(trainer._commits, "raise_if_failed", waited_in_close)
    with pytest.raises(KeyboardInterrupt):
        trainer.close()
    written_first = ended.is_set()
    trainer.runlog.close()               # as session.close() does next
    assert ended.wait(timeout=120)       # (on the old code the commit went on, into the working directory)
    trainer.engine.close()
    assert os.listdir(tmp_path / "cwd") == [] and written_first
    found = inspect(run)
    assert found.checkpoint["step"] == 1 and found.repairs == []
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1] and (run / "lock").read_text() == ""


def test_a_commit_after_its_run_log_closed_is_refused(tiny_model_dir, tokenizer, tmp_path, monkeypatch):
    """The run log closed while the step's commit waits on the commit thread: the commit is refused, and the
    trainer's close raises that error naming the run dir and the way on; nothing is written in the working
    directory, and the run dir holds no step (it starts again at step 1)."""
    release = threading.Event()
    trainer, run, ended = step_with_held_commit(tiny_model_dir, tokenizer, tmp_path, monkeypatch,
                                                lambda: release.wait(timeout=120))
    trainer.runlog.close()
    release.set()
    said = f"{re.escape(str(run))} was closed.*`lorabench resume {re.escape(str(run))}`"
    try:
        with pytest.raises(RunDirError, match=said):
            trainer.close()
    finally:
        ended.wait(timeout=120)
        trainer.engine.close()
    assert os.listdir(tmp_path / "cwd") == []
    found = inspect(run)
    assert found.checkpoint is None and found.repairs == [] and (run / "lock").read_text() == ""


def test_one_step_at_a_time_per_trainer(trainer):
    panel = StepPanel(trainer)
    panel.start(2)
    with pytest.raises(StepInProgress, match="another thread"):
        trainer.step()
    panel.wait()
    assert trainer.step_count == 2
    panel.close()


def test_an_interrupted_wait_stops_the_panel(trainer):
    panel = StepPanel(trainer)
    panel.start(50)
    timer = interrupt_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        panel.wait()
    timer.cancel()
    panel.wait()                             # the step in progress ends, then the run stops
    assert 1 <= trainer.step_count < 50 and "interrupted" in str(panel.log.outputs)
    panel.close()


FINALISER = """
import signal, sys, time, weakref
from lorabench.cli import Terminated, stop_handler
from lorabench.interrupts import resend_lost_stops
if {cli}:
    signal.signal(signal.SIG{name}, stop_handler({stop}))   # the CLI's handlers
else:
    resend_lost_stops()                                     # Python's own Ctrl-C, as in a kernel, while a step runs
class Slow:
    def __del__(self):
        print("in the finaliser", flush=True)
        time.sleep(0.3)   # the signal is handled here
def slow_callback(ref):
    Slow.__del__(None)
class Thing:
    pass
try:
    while True:
        if {weakref}:
            thing = Thing()
            ref = weakref.ref(thing, slow_callback)
            del thing
        else:
            Slow()
        time.sleep(0.1)
except {stop}:
    sys.exit(3)
"""


@pytest.mark.parametrize("name, stop, cli, in_weakref", [("TERM", "Terminated", True, False),
                                                          ("INT", "KeyboardInterrupt", True, False),
                                                          ("TERM", "Terminated", True, True),
                                                          ("INT", "KeyboardInterrupt", False, True),
                                                          ("INT", "KeyboardInterrupt", False, False)])
def test_a_signal_handled_inside_a_finaliser_still_stops_the_command(name, stop, cli, in_weakref):
    """The CLI's SIGTERM handled in a `__del__` (the regex module's, run by the garbage collector during the tiny
    model's warm-start) was printed as "Exception ignored" and lost: the build went on and the process did not stop
    within 120 s. A Ctrl-C in a weakref's callback was lost the same way in the middle of a trainer's steps (the
    interrupts test above saw no interrupt). It is sent again once the finaliser is left, with the CLI's handlers
    and with Python's own Ctrl-C once a trainer has stepped."""
    import subprocess
    import sys
    script = FINALISER.format(name=name, stop=stop, cli=cli, weakref=in_weakref)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "in the finaliser\n"
        proc.send_signal(getattr(signal, f"SIG{name}"))
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 3 and "Exception ignored" not in err, err
