"""The engine thread (engines/engine_thread.py) that SGLangEngine is created and driven on: calls
from any thread run one at a time on it, on an asyncio loop of its own, also when the caller's
thread runs a loop of its own (a Jupyter kernel's); an interrupted caller stops waiting at once while
its call finishes; a failed or closed engine refuses calls with the reason. SGLang itself is tested
on the GPU (test_sglang_gpu.py, test_kernel_session.py); here the thread runs plain functions."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from lorabench.engines.base import EngineError
from lorabench.engines.engine_thread import EngineThread

pytestmark = pytest.mark.usefixtures("default_sigint")   # conftest.py: why


@pytest.fixture
def runner():
    thread = EngineThread("test-engine")
    yield thread
    thread.close()


def test_calls_from_many_threads_run_on_the_one_thread_in_order(runner):
    seen, results = [], {}

    def record(i):
        seen.append((i, threading.current_thread().name))
        return i * i

    def caller(i):
        results[i] = runner.call(record, i)
    callers = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == {i: i * i for i in range(8)}
    assert {name for _, name in seen} == {"test-engine"} and len(seen) == 8


def test_an_error_is_raised_in_the_caller(runner):
    def fail():
        raise ValueError("from the engine thread")
    with pytest.raises(ValueError, match="from the engine thread"):
        runner.call(fail)
    assert runner.call(lambda: 3) == 3   # the thread goes on


def test_the_loop_is_its_own_while_the_caller_runs_a_loop(runner):
    """What a kernel's cell does: call the engine from inside a running event loop. The engine's
    sync methods run their loop until complete, which needs a loop that is not running."""
    async def engine_request():
        await asyncio.sleep(0.01)
        return asyncio.get_running_loop()

    def sync_engine_method():   # as sglang.Engine's sync methods do
        return asyncio.get_event_loop().run_until_complete(engine_request())

    async def cell():
        return asyncio.get_running_loop(), runner.call(sync_engine_method)

    kernel_loop, engine_loop = asyncio.run(cell())
    assert engine_loop is runner.loop and engine_loop is not kernel_loop


def test_a_call_from_the_engine_thread_runs_at_once(runner):
    assert runner.call(lambda: runner.call(lambda: "inner")) == "inner"


def test_an_interrupted_caller_returns_at_once_and_the_call_finishes(runner):
    started, release, done, aborted = threading.Event(), threading.Event(), threading.Event(), []

    def slow():   # runs until the test lets it end: the caller must return while it still runs
        started.set()
        release.wait(10)
        done.set()

    def interrupt_once_running():   # Ctrl-C, Kernel -> Interrupt, while the call runs (however loaded the machine)
        started.wait(10)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt_once_running, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.call(slow, on_interrupt=lambda call_id: aborted.append((call_id, runner.running_call)))
        assert started.is_set() and not done.is_set()   # the caller returned; the call goes on
        assert len(aborted) == 1 and aborted[0][0] == aborted[0][1] != 0   # told which call, while it ran
    finally:
        release.set()
    assert runner.call(lambda: done.is_set())   # the next call runs after the interrupted one


def test_a_failed_engine_ends_the_running_call_and_refuses_the_next(runner):
    def waits_for_a_reply_that_never_comes():
        return asyncio.get_event_loop().run_until_complete(asyncio.sleep(60))
    threading.Timer(0.2, runner.fail, args=("the scheduler died",)).start()
    with pytest.raises(EngineError, match="the scheduler died"):
        runner.call(waits_for_a_reply_that_never_comes)
    with pytest.raises(EngineError, match="the scheduler died"):
        runner.call(lambda: 1)


def test_a_closed_engine_refuses_calls():
    runner = EngineThread("closing")
    assert runner.call(lambda: 1) == 1
    runner.close()
    with pytest.raises(EngineError, match="closed"):
        runner.call(lambda: 1)
    assert runner.loop.is_closed()
