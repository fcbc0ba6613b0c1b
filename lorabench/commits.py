"""A trainer's steps into its run log (runlog.RunLog.commit), in line or on one background thread.

Rows are published with the checkpoint that vouches for them. In the background commit n is written, in
the same order, while step n+1 runs on a `snapshot` of its state; a failed write is raised once, then the
trainer stops.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .interrupts import interrupts_deferred, interrupts_to_the_main_thread, wait_interruptibly
from .metrics import COMMIT_WAIT_S
from .rundir import METRICS, ROLLOUTS, SYNC


def tensors_mapped(value, fn):
    """`value` with `fn` applied to each of its tensors (in dicts, lists and tuples); the rest as it is."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: tensors_mapped(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(tensors_mapped(v, fn) for v in value)
    return value   # numbers, strings, None: immutable


def cloned(value):
    """`value` with its tensors copied (detached) as views of one new buffer per device and dtype: one copy each."""
    found: dict[tuple, list[torch.Tensor]] = {}
    tensors_mapped(value, lambda t: found.setdefault((t.device, t.dtype), []).append(t))
    copies = {}
    for tensors in found.values():
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
            copies[id(t)] = piece.view(t.shape)
    return tensors_mapped(value, lambda t: copies[id(t)])


def snapshot(value):
    """(a deep copy sharing no storage with `value`, each tensor on its device; {GPU: the event after its copies}):
    queued before the next step's in-place updates, moved to the host by the commit thread (`to_host`)."""
    devices = set()
    tensors_mapped(value, lambda t: devices.add(t.device))
    return cloned(value), {d: torch.cuda.current_stream(d).record_event() for d in devices if d.type == "cuda"}


def to_host(value, ready: dict):
    """`value`'s tensors on the host, copied on this thread's own streams once `ready`'s events have passed (not
    waiting for the stepping thread's later kernels)."""
    streams = {device: torch.cuda.Stream(device) for device in ready}
    for device, stream in streams.items():
        stream.wait_event(ready[device])

    def copy_out(t):
        if not t.is_cuda:
            return t
        with torch.cuda.stream(streams[t.device]):
            return t.to("cpu", non_blocking=True)   # into pinned memory: asynchronous
    host = tensors_mapped(value, copy_out)
    for stream in streams.values():
        stream.synchronize()
    return host


class TrainerStopped(RuntimeError):
    """A step's commit failed (the disk): this trainer takes no more steps; the run continues from
    its run dir (lorabench resume), which holds a whole commit."""


class Commits:
    """The commit pipeline of one trainer. `state()`: the checkpoint's trainer state; `version()`: the
    trainer's step in memory. In the background time/commit_wait_s is the wait for the commit before."""

    def __init__(self, runlog, last_step: int, state, version):
        self.runlog, self.last_step, self._state, self._version = runlog, last_step, state, version
        self.pending: list = []   # StepRecords since the last checkpoint (run.checkpoint_every > 1)
        self.stopped = ""         # why no step may follow: a commit failed half way
        background = runlog.dir is not None and runlog.settings.commit_in_background
        self._pool = ThreadPoolExecutor(1, f"lorabench-commit-{runlog.dir.name}", interrupts_to_the_main_thread) \
            if background else None
        self._in_flight: tuple[int, Future] | None = None    # at most one commit: (step, its write)
        self._failure: tuple[int, BaseException] | None = None
        self._guard = threading.Lock()   # the stepping thread and any waiting thread share _in_flight
        self._held: list | None = None   # background writes waiting for the end of `held`

    def commit(self, record, adapter, clock, history: list) -> None:
        """Step `record.step` done: its metrics row into `history`, and into the run dir when due."""
        step = record.step
        self.pending.append(record)
        checkpoint, save_adapter = self.runlog.settings.due(step, self.last_step)
        if not checkpoint:
            self._finish(record, clock, history, waited=0.0)
        elif self._pool is None:
            try:
                self.runlog.commit(step, self._state(), adapter, self._rows(), save_adapter)
                self._finish(record, clock, history, waited=0.0)
                self.runlog.log_metrics([r.metrics for r in self.pending])
                self.pending = []
            except Exception as err:   # the run dir holds a whole commit or the one before (runlog.py); memory is ahead
                self._stop(step, err)
                raise
        else:
            t0 = time.perf_counter()
            self.raise_if_failed(wait=True)
            if self._failure is not None:
                raise self._failure[1]
            waited = time.perf_counter() - t0
            state, ready = snapshot(self._state())   # the next step changes the optimizer's moments in place
            self._finish(record, clock, history, waited)
            rows = copy.deepcopy(self._rows())   # the metrics dicts are also the history's
            self.pending = []
            write = (step, state, ready, adapter, rows, save_adapter)
            if self._held is not None:
                self._held.append(write)
            else:
                self._submit(write)

    @contextlib.contextmanager
    def held(self):
        """Background commits made inside reach the commit thread when the block ends, also when it raises (a
        group refreshes every policy first: a pickling commit thread would slow it)."""
        self._held = []
        try:
            yield
        finally:
            with interrupts_deferred():
                held, self._held = self._held, None
                for write in held:
                    self._submit(write)

    def _submit(self, write: tuple) -> None:
        with self._guard:
            self._in_flight = (write[0], self._pool.submit(self._write, *write))

    @staticmethod
    def _finish(record, clock, history: list, waited: float) -> None:
        clock.lap("log")
        record.metrics.update(clock.metrics())
        record.metrics[COMMIT_WAIT_S] = waited   # within time/log_s: the previous commit still being written
        history.append(record.metrics)

    def _rows(self) -> dict[str, list[dict]]:
        k = self.runlog.settings.sample_completions   # completions per step in rollouts.jsonl
        return {SYNC: [row for r in self.pending for row in r.refresh.rows(r.step)],
                ROLLOUTS: [s for r in self.pending for s in r.samples[:k]],
                METRICS: [r.metrics for r in self.pending]}

    def _write(self, step: int, state: dict, ready: dict, adapter, rows: dict, save_adapter: bool) -> None:
        """On the commit thread: what a commit in line writes, in the same order."""
        state = to_host(state, ready)   # the checkpoint's tensors
        self.runlog.commit(step, state, adapter, rows, save_adapter)
        self.runlog.log_metrics(rows[METRICS])

    def _settle(self, wait: bool) -> tuple[int, BaseException] | None:
        """(step, error) of a failed background commit (kept), or None; wait=False: not waiting for one in flight."""
        with self._guard:
            in_flight = self._in_flight
        if in_flight is not None and (wait or in_flight[1].done()):
            error = wait_interruptibly(in_flight[1].exception)   # until the write ends; kept, not swallowed
            with self._guard:
                if self._in_flight is in_flight:
                    self._in_flight = None
                if error is not None and self._failure is None:
                    self._failure = (in_flight[0], error)
        return self._failure

    def raise_if_failed(self, wait: bool) -> None:
        """The error of a failed background commit, raised once (later steps: TrainerStopped)."""
        failure = self._settle(wait) if self._pool is not None else None
        if failure is not None and not self.stopped:
            step, error = failure
            self._stop(step, error)
            error.add_note(f"lorabench: the commit of step {step} failed on the commit thread "
                           f"(run.commit_in_background); the trainer is at step {self._version()} in memory")
            raise error

    def check(self, wait: bool) -> None:
        """TrainerStopped once a commit failed; wait: until every commit so far is in the run dir."""
        self.raise_if_failed(wait)
        if self.stopped:
            raise TrainerStopped(self.stopped)

    def _stop(self, step: int, err: BaseException) -> None:
        self.stopped = (f"step {step} could not be written to {self.runlog.dir} ({err}); this trainer "
                        f"stops, since its memory and the run dir may disagree. Close the session and "
                        f"continue the run from the run dir (lorabench resume {self.runlog.dir})")

    def shutdown(self) -> None:
        """End the commit thread once the commit in flight is written."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
