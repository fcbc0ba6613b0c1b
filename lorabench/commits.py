"""A step's commit written on one background thread while the next step runs.

The commit of step n (runlog.RunLog.commit) is written by one thread in the same order as in line,
and commit n+1 starts only after n is written whole, so a kill -9 leaves what it could leave in line
and resume repairs it the same way. What a commit writes is copied first (`host_copy`): step n+1
changes the optimizer's moments in place. A failed write is kept: `settle` returns it, `submit`
raises it, and the trainer stops (grpo.TrainerStopped) as it does when a commit in line fails.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .interrupts import interrupts_to_the_main_thread, wait_interruptibly


def host_copy(value):
    """A deep copy whose tensors are on the CPU and share no storage with `value`'s."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value   # numbers, strings, None: immutable


class BackgroundCommits:
    """At most one commit in flight, on one thread named for the run dir."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lorabench-commit-{name}",
                                        initializer=interrupts_to_the_main_thread)
        self._in_flight: Future | None = None
        self._in_flight_step = 0
        self.failed_step = 0
        self._guard = threading.Lock()     # submit (the stepping thread) and wait (any thread) share _in_flight
        self._failure: BaseException | None = None
        self.write_s = 0.0                 # how long the last finished commit took to write

    def submit(self, step: int, write, *args) -> None:
        """Start `write(*args)`, the commit of `step`, on the commit thread; a failed commit's error is
        raised instead. The caller settles first: one commit at a time, in step order."""
        with self._guard:
            if self._failure is not None:
                raise self._failure
            if self._in_flight is not None:
                raise RuntimeError(f"BackgroundCommits.submit(step {step}): the commit of step "
                                   f"{self._in_flight_step} is not settled; call settle() first")
            self._in_flight, self._in_flight_step = self._pool.submit(self._timed, write, args), step

    def _timed(self, write, args) -> None:
        t0 = time.perf_counter()
        write(*args)
        self.write_s = time.perf_counter() - t0

    def settle(self) -> BaseException | None:
        """Wait until nothing is in flight; the error of a failed commit, or None. A failure is kept:
        every later settle returns it (the run dir stops at the commit before it), and
        `failed_step` names the step whose commit failed."""
        with self._guard:
            future, step = self._in_flight, self._in_flight_step
        if future is not None:
            error = wait_interruptibly(future.exception)   # until the write ends; the error is kept, not swallowed
            with self._guard:
                if self._in_flight is future:
                    self._in_flight = None
                if error is not None and self._failure is None:
                    self._failure, self.failed_step = error, step
        return self._failure

    def failed(self) -> BaseException | None:
        """Like settle, without waiting for a commit still being written."""
        with self._guard:
            done = self._in_flight is None or self._in_flight.done()
        return self.settle() if done else self._failure

    def close(self) -> None:
        """End the thread once the commit in flight is written (see `settle` for its outcome)."""
        self._pool.shutdown(wait=True)
