"""A GPU job that reports as it goes and bounds itself: `phase(name, deadline_s)` prints a line when
the phase ends, with its time, and one every 10 s while it runs, with the requests SGLang's tokenizer
manager holds open (`watch.engine`, once there is one). A phase past its deadline, or past the job's
limit (`watch.limit(s)`), prints every thread's stack here and in the engine's processes, then ends the
process with exit code 3: a hang shows where it is, never an empty log.

The engine's processes print their stacks on SIGUSR2 when dev/stacks is first on their PYTHONPATH
(`watch.stacks_in_children()` before the engine starts; site imports dev/stacks/sitecustomize.py).
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

T0 = time.perf_counter()
engine = None                 # the lorabench engine being watched (its .engine: the sglang.Engine)
_limit_at = float("inf")


def say(line: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {line}", file=sys.__stderr__, flush=True)


def limit(seconds: float) -> None:
    global _limit_at
    _limit_at = T0 + seconds


def stacks_in_children() -> None:
    stacks = Path(__file__).resolve().parents[1] / "dev" / "stacks"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(stacks), os.environ.get("PYTHONPATH", "")])


@contextlib.contextmanager
def phase(name: str, deadline_s: float):
    t0, done = time.perf_counter(), threading.Event()

    def watch():
        while not done.wait(10):
            spent = time.perf_counter() - t0
            say(f"  {name}: {spent:.0f} s so far; {open_requests()}")
            if spent > deadline_s or time.perf_counter() > _limit_at:
                say(f"  {name}: past its deadline ({deadline_s:.0f} s) or the job's limit: every stack follows")
                dump_stacks()
                os._exit(3)
    threading.Thread(target=watch, daemon=True).start()
    failed = True
    try:
        yield
        failed = False
    finally:
        done.set()
        say(f"{name}: {'failed' if failed else 'done'} in {time.perf_counter() - t0:.1f} s")


def open_requests() -> str:
    sg = getattr(engine, "engine", None)
    if sg is None:
        return "no engine watched"
    states = dict(getattr(sg.tokenizer_manager, "rid_to_state", {}))
    finished = sum(1 for s in states.values() if getattr(s, "finished", False))
    return f"{len(states)} requests open in SGLang's tokenizer manager ({finished} finished)"


def dump_stacks() -> None:
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    sg = getattr(engine, "engine", None)
    for pid in sg.get_all_child_pids() if sg is not None else []:
        say(f"  SIGUSR2 -> engine process {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
    time.sleep(5)   # their stacks reach the shared stderr
