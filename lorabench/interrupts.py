"""Critical sections against Ctrl-C / Kernel -> Interrupt in a process that goes on after one (a notebook
kernel): a half-made change of state would leave the trainer, the run dir or the engine disagreeing."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


@contextlib.contextmanager
def sigint_handled_by(handler):
    """SIGINT goes to `handler` while the block runs, then to the previous one; main thread only (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_deferred():
    """A SIGINT arriving while the block runs is delivered when it ends (main thread only, as `sigint_handled_by`).
    A block that raises stops with its own error, noted: a held Ctrl-C never hides why it failed (a full disk)."""
    arrived = []
    with sigint_handled_by(lambda signum, frame: arrived.append(signum)):
        try:
            yield
        except BaseException as err:   # noted and raised again, never swallowed
            if arrived:
                err.add_note("lorabench: a Ctrl-C arrived meanwhile and was held; this error stops the call instead")
            raise
    if arrived:
        signal.raise_signal(signal.SIGINT)


_RESENT = {KeyboardInterrupt: signal.SIGINT}   # a stop that a signal raises -> that signal


def resend_lost_stops(stop: type[BaseException] = KeyboardInterrupt, signum: int = signal.SIGINT) -> None:
    """From now on, `stop` raised by a signal's handler inside a finaliser or weakref callback (where Python prints
    "Exception ignored" and goes on) is sent again 50 ms later; other unraisables go to the previous hook."""
    _RESENT[stop] = signum
    if getattr(sys.unraisablehook, "resends_lost_stops", False):
        return
    before = sys.unraisablehook

    def hook(unraisable) -> None:
        lost = next((s for kind, s in _RESENT.items() if isinstance(unraisable.exc_value, kind)), None)
        if lost is None:
            return before(unraisable)
        timer = threading.Timer(0.05, os.kill, (os.getpid(), lost))
        timer.daemon = True
        timer.start()
    hook.resends_lost_stops = True
    sys.unraisablehook = hook


WAKE_S = 0.1   # how soon a waiting main thread acts on an interrupt that reached another thread


def wait_interruptibly(result):
    """`result()` of a Future, waking every WAKE_S: Python acts on a SIGINT only when it next runs Python code."""
    while True:
        try:
            return result(timeout=WAKE_S)
        except TimeoutError:   # concurrent.futures.TimeoutError is this one since Python 3.11
            continue


def interrupts_to_the_main_thread() -> None:
    """First in a thread lorabench starts: SIGINT blocked in it, so the kernel delivers it to the main thread."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
