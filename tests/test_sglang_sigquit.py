"""SGLang's processes report a failure to this process with SIGQUIT (engines/sglang.py). While an
engine of ours stops its processes, and for a grace period after, a SIGQUIT is theirs going: the
process must survive it (in a notebook it is the kernel). Later, with no engine of ours alive, a
SIGQUIT does what it did before lorabench handled it. The handler itself needs no GPU."""
import math
import os
import signal
import threading

import pytest

from lorabench.engines import sglang as sglang_engine


@pytest.fixture
def previous_handler(monkeypatch):
    """A recording SIGQUIT handler standing in for the one lorabench's replaced (SIG_DFL would end pytest)."""
    got = []
    before = signal.signal(signal.SIGQUIT, sglang_engine._on_sigquit)
    monkeypatch.setattr(sglang_engine, "_previous_sigquit", lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGQUIT, before)


def test_a_sigquit_while_an_engine_shuts_down_is_not_acted_on(previous_handler, monkeypatch):
    assert threading.current_thread() is threading.main_thread()
    sglang_engine._note_shutdown()
    os.kill(os.getpid(), signal.SIGQUIT)
    assert previous_handler == [] and signal.getsignal(signal.SIGQUIT) is sglang_engine._on_sigquit


def test_a_sigquit_long_after_the_last_engine_goes_to_the_previous_handler(previous_handler, monkeypatch):
    monkeypatch.setattr(sglang_engine, "_last_shutdown", -math.inf)
    os.kill(os.getpid(), signal.SIGQUIT)
    assert previous_handler == [signal.SIGQUIT]
