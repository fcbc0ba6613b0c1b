"""Critical sections against Ctrl-C / Kernel -> Interrupt in a process that goes on after one (a
notebook kernel): a change of state that is half made when KeyboardInterrupt arrives (a commit, an
engine loading an adapter) would leave the trainer, the run dir or the engine disagreeing."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_deferred():
    """A SIGINT (Ctrl-C, Kernel -> Interrupt) arriving while the block runs is delivered when it ends, to
    the handler that was there before. On the main thread only: no other thread gets KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if arrived:
            signal.raise_signal(signal.SIGINT)


WAKE_S = 0.1   # how soon a waiting main thread acts on an interrupt that reached another thread


def wait_interruptibly(result):
    """`result()` of a Future (result or exception), waking every WAKE_S: Python acts on a SIGINT only
    when the main thread next runs Python code, which one long wait would delay to its end."""
    while True:
        try:
            return result(timeout=WAKE_S)
        except TimeoutError:   # concurrent.futures.TimeoutError is this one since Python 3.11
            continue


def interrupts_to_the_main_thread() -> None:
    """First in a thread lorabench starts: SIGINT blocked in it, so the kernel delivers it to the main thread."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
