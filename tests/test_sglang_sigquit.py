"""Stopping an engine stops its processes and no other child of this process. SGLang's processes
report a failure to this process with SIGQUIT (engines/sglang_internals.py). While an
engine of ours stops its processes, and for a grace period after, a SIGQUIT is theirs going: the
process must survive it (in a notebook it is the kernel). Later, with no engine of ours alive, a
SIGQUIT does what it did before lorabench handled it. The handler itself needs no GPU."""
import math
import os
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from lorabench.engines import sglang_internals as internals


@pytest.fixture
def previous_handler(monkeypatch):
    """A recording SIGQUIT handler standing in for the one lorabench's replaced (SIG_DFL would end pytest)."""
    got = []
    before = signal.signal(signal.SIGQUIT, internals._on_sigquit)
    monkeypatch.setattr(internals, "_previous_sigquit", lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGQUIT, before)


def test_a_sigquit_while_an_engine_shuts_down_is_not_acted_on(previous_handler, monkeypatch):
    assert threading.current_thread() is threading.main_thread()
    internals.note_shutdown()
    os.kill(os.getpid(), signal.SIGQUIT)
    assert previous_handler == [] and signal.getsignal(signal.SIGQUIT) is internals._on_sigquit


def test_a_sigquit_long_after_the_last_engine_goes_to_the_previous_handler(previous_handler, monkeypatch):
    monkeypatch.setattr(internals, "_last_shutdown", -math.inf)
    os.kill(os.getpid(), signal.SIGQUIT)
    assert previous_handler == [signal.SIGQUIT]


def test_shutting_an_engine_down_stops_its_processes_and_no_other_child():
    """sglang.Engine.shutdown SIGKILLs every child of the process; lorabench's stops the engine's own
    (here a stand-in with a child of its own, as SGLang's scheduler has) and leaves a sibling alone (in a
    notebook: the user's subprocesses, the multiprocessing resource tracker)."""
    psutil = pytest.importorskip("psutil")
    engine_proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                                    "time.sleep(600)"])
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        tree = psutil.Process(engine_proc.pid)
        for _ in range(200):                     # the engine process's own child has started
            if tree.children():
                break
            psutil.wait_procs([], timeout=0.05)
        grandchild = tree.children()[0]
        engine = SimpleNamespace(tokenizer_manager=None, get_all_child_pids=lambda: [engine_proc.pid],
                                 shutdown=lambda: None)
        internals.shut_down(engine)
        assert not psutil.pid_exists(engine_proc.pid)    # stopped and waited for (reaped) before it returned
        assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE
        assert sibling.poll() is None, "a child that is not the engine's was stopped"
    finally:
        for proc in (engine_proc, sibling):
            proc.kill()
            proc.wait()


def test_a_closed_engine_s_own_shutdown_does_not_run_at_exit(tmp_path):
    """sglang.Engine registers its shutdown (the kill of every child) to run at exit; once lorabench
    has shut the engine down, it must not run again then."""
    ran = tmp_path / "ran-at-exit"
    script = ("import atexit, pathlib, sys; from types import SimpleNamespace\n"
              "from lorabench.engines import sglang_internals as s\n"
              f"engine = SimpleNamespace(tokenizer_manager=None, get_all_child_pids=lambda: [], "
              f"shutdown=lambda: pathlib.Path({str(ran)!r}).write_text('ran'))\n"
              "atexit.register(engine.shutdown)\n"
              "if sys.argv[1] == 'close': s.shut_down(engine)\n")
    for how, expected in (("close", False), ("keep", True)):   # the check can fail: without a close it runs
        ran.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-c", script, how], check=True, timeout=120)
        assert ran.exists() == expected, how
