"""One thread that an engine is created on and that runs every call to it: SGLang's `Engine` runs the
event loop of the thread that created it, which in a Jupyter kernel's main thread is the kernel's own.

Invariants:
- calls run one at a time, in arrival order, so an engine's record of itself matches what it did;
- an interrupted caller gets KeyboardInterrupt at once; its call still finishes here (`on_interrupt`
  may end it early) before the next one runs;
- a call made from this thread runs at once (an engine method calling another);
- after `fail(reason)` or `close()`, every call raises EngineError(reason).
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from ..interrupts import wait_interruptibly
from .base import EngineError


class EngineThread:
    """Runs calls on one daemon thread with an asyncio event loop of its own (`loop`)."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self.running_call = 0            # id of the call running now (0: none); read by on_interrupt
        self.failure = ""                # why calls are refused (set by fail / close)
        self.loop: asyncio.AbstractEventLoop | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)   # the loop an engine created here captures
        ready.set()
        while (item := self._calls.get()) is not None:
            call_id, fn, args, kwargs, future = item
            if not future.set_running_or_notify_cancel():
                continue
            if self.failure:   # handed over before the engine failed or closed
                future.set_exception(EngineError(self.failure))
                continue
            self.running_call = call_id
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:  # handed to the caller, whatever it is (a failure's cancel: the reason)
                failed = self.failure and isinstance(err, asyncio.CancelledError)
                future.set_exception(EngineError(self.failure) if failed else err)
            else:
                future.set_result(result)
            finally:
                self.running_call = 0
        tasks = _cancel_all(self.loop)   # what the engine left on the loop (its receive loop)
        if tasks:
            self.loop.run_until_complete(asyncio.wait(tasks, timeout=5))
        self.loop.close()

    def use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """On this thread: calls run on `loop` (sglang.Engine's own) from now on: interrupts and failures reach it."""
        assert self.on_this_thread, "use_loop runs on the engine thread"
        if loop is not self.loop:
            self.loop.close()
            self.loop = loop

    @property
    def on_this_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable, *args, on_interrupt: Callable[[int], None] | None = None, **kwargs):
        """fn(*args, **kwargs) on the engine thread: its result, or its exception re-raised here. If this
        caller is interrupted while it waits, `on_interrupt(call_id)` runs here first; the call goes on."""
        if self.on_this_thread:
            return fn(*args, **kwargs)
        if self.failure:
            raise EngineError(self.failure)
        call_id, future = next(self._ids), Future()
        self._calls.put((call_id, fn, args, kwargs, future))
        try:
            return wait_interruptibly(future.result)
        except KeyboardInterrupt:
            if not future.cancel() and on_interrupt is not None:  # cancel(): it had not started yet
                on_interrupt(call_id)
            raise

    def fail(self, reason: str) -> None:
        """The engine is gone: the running call (its tasks cancelled) and every later one raise EngineError."""
        self.failure = reason
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(_cancel_all, self.loop)

    def close(self, reason: str = "the engine is closed") -> None:
        """Stop the thread after the calls already handed over; later calls raise EngineError(reason)."""
        self.failure = self.failure or reason
        self._calls.put(None)
        if not self.on_this_thread:
            self._thread.join(timeout=30)


def _cancel_all(loop: asyncio.AbstractEventLoop) -> set:
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    return tasks
