"""Notebook 01 in a real Jupyter kernel, driven the way JupyterLab drives one: cells sent as
execute_request, the panel's buttons clicked as widget comm messages (the browser's own protocol:
a `custom` click event, an `update` of the N box), Kernel -> Interrupt as an `interrupt_request` on
the control channel (ipykernel sends SIGINT to its whole process group, as JupyterLab's server
does), restart and shutdown through jupyter_client's KernelManager. Between the clicks the kernel is
left idle, as a person leaves it after clicking Run N.

`run_scenario(engine, ...)` runs the whole interactive contract and returns what it saw (the GPU run
records it); each check raises AssertionError with what was seen. Used by test_kernel_session.py
(hf engine, CPU suite; sglang engine, GPU suite)."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
from jupyter_client import KernelManager
from notebook_helpers import NOTEBOOK_DIR, SMALL, parameterized

STEP_LABEL = re.compile(r"steps done: (\d+)")
STARTED = time.monotonic()
# in the kernel: SIGUSR1 writes every thread's stack to its stderr (a wait that times out asks for them)
STACKS_DIR = Path(__file__).resolve().parents[1] / "dev" / "stacks"   # sitecustomize: stacks on SIGUSR2
STACKS_ON_SIGUSR1 = "import faulthandler as _fh, signal as _sig; _fh.register(_sig.SIGUSR1, all_threads=True)"


def say(what: str) -> None:
    """A progress line with the time since this module was loaded (the GPU log shows where a run waits)."""
    print(f"[{time.monotonic() - STARTED:7.1f} s] {what}", flush=True)


class Kernel:
    """One kernel and a client; iopub is drained from the caller's thread (`drain`), and widget
    models are tracked from their comm_open / update messages as a front end tracks them."""

    def __init__(self, cwd: Path, env: dict, kernel_name: str = "python3"):
        self.km = KernelManager(kernel_name=kernel_name)
        self.km.start_kernel(cwd=str(cwd), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=300)
        self.messages: list[dict] = []
        self.models: dict[str, dict] = {}     # comm_id -> the widget's state as the front end has it
        self.image_updates: dict[str, int] = {}
        self.replies: dict[str, dict] = {}    # msg_id -> execute_reply content, kept until `reply` takes it
        assert self.run(STACKS_ON_SIGUSR1)["status"] == "ok"   # before: SIGUSR1 would end the kernel
        self._stacks_pid = self.pid   # a restarted kernel has no such handler

    @property
    def pid(self) -> int:
        return self.km.provisioner.pid

    # -- messages -------------------------------------------------------------------------------
    def drain(self, timeout: float = 0.05) -> None:
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=timeout)
            except queue.Empty:
                return
            timeout = 0.0
            self.messages.append(msg)
            content = msg["content"]
            if msg["msg_type"] == "comm_open" and content.get("target_name") == "jupyter.widget":
                self.models[content["comm_id"]] = dict(content["data"]["state"])
            elif msg["msg_type"] == "comm_msg" and content["data"].get("method") == "update":
                model = self.models.setdefault(content["comm_id"], {})
                model.update(content["data"]["state"])
                if ["value"] in content["data"].get("buffer_paths", []):
                    self.image_updates[content["comm_id"]] = self.image_updates.get(content["comm_id"], 0) + 1

    def wait_until(self, what: str, predicate, timeout: float):
        deadline, said = time.monotonic() + timeout, time.monotonic()
        while True:
            self.drain()
            found = predicate()
            if found:
                return found
            said = self._still_waiting(what, deadline, timeout, said)

    def _still_waiting(self, what: str, deadline: float, timeout: float, said: float) -> float:
        """A line every 30 s of a wait; past `deadline`, the kernel's stacks (STACKS_ON_SIGUSR1) and an error."""
        now = time.monotonic()
        if now > deadline:
            say(f"timed out after {timeout:.0f} s waiting for {what}: the kernel's stacks follow")
            self.dump_stacks()
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        if now - said >= 30:
            say(f"still waiting for {what} ({timeout - (deadline - now):.0f} s)")
            return now
        return said

    def dump_stacks(self) -> None:
        """Every thread's stack of the kernel onto its stderr (it ran STACKS_ON_SIGUSR1 when it started), and of
        each process it started that has dev/stacks on its path (SGLang's scheduler: onto the engine's log)."""
        if self.pid != self._stacks_pid:
            return
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return
        for child in psutil.Process(self.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if str(STACKS_DIR) in child.environ().get("PYTHONPATH", ""):
                    child.send_signal(signal.SIGUSR2)
        time.sleep(2)

    def send(self, code: str) -> str:
        return self.kc.execute(code, allow_stdin=False, store_history=False)

    def reply(self, msg_id: str, timeout: float) -> dict:
        deadline, said = time.monotonic() + timeout, time.monotonic()
        while msg_id not in self.replies:
            self.drain(timeout=0.0)
            if not self._take_reply(0.05):
                said = self._still_waiting("an execute_reply", deadline, timeout, said)
        self.drain()
        return self.replies.pop(msg_id)

    def replied(self, msg_id: str) -> bool:
        """Whether `msg_id`'s execute_reply has come (without waiting): a cell that failed early ends a wait."""
        while self._take_reply(0.0):
            pass
        return msg_id in self.replies

    def _take_reply(self, timeout: float) -> bool:
        try:
            msg = self.kc.get_shell_msg(timeout=timeout)
        except queue.Empty:
            return False
        self.replies[msg["parent_header"].get("msg_id")] = msg["content"]
        return True

    def run(self, code: str, timeout: float = 600) -> dict:
        """Execute a cell and wait; its reply content with `stdout`, `stderr` and `text` (results).
        ipykernel aborts the requests that reach it right after a cell failed (an interrupt
        included); such a request is sent again, as a person runs the cell again."""
        for _ in range(5):
            msg_id = self.send(code)
            content = self.reply(msg_id, timeout)
            if content["status"] != "aborted":
                break
            time.sleep(0.5)
        return {**content, **self.outputs(msg_id)}

    def outputs(self, msg_id: str) -> dict:
        """What a cell showed: `stdout`, `stderr` and `text` (its results and displays)."""
        mine = [m for m in self.messages if m["parent_header"].get("msg_id") == msg_id]
        streams = {"stdout": "", "stderr": ""}
        for m in mine:
            if m["msg_type"] == "stream":
                streams[m["content"]["name"]] += m["content"]["text"]
        texts = [m["content"]["data"].get("text/plain", "") for m in mine
                 if m["msg_type"] in ("execute_result", "display_data")]
        return {**streams, "text": "\n".join(texts)}

    def value(self, expression: str, timeout: float = 600):
        """A JSON-able expression evaluated in the kernel."""
        out = self.run(f"import json as _json; print(_json.dumps({expression}))", timeout)
        assert out["status"] == "ok", f"{expression}: {out.get('ename')}: {out.get('evalue')}\n{out['stderr']}"
        return json.loads(out["stdout"].strip().splitlines()[-1])

    def interrupt(self) -> dict:
        msg = self.kc.session.msg("interrupt_request", {})
        self.kc.control_channel.send(msg)
        while True:
            reply = self.kc.get_control_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    # -- widgets --------------------------------------------------------------------------------
    def latest(self, model_name: str, **state) -> str:
        ids = [cid for cid, s in self.models.items() if s.get("_model_name") == model_name
               and all(s.get(k) == v for k, v in state.items())]
        assert ids, f"no {model_name} with {state} among {len(self.models)} widget models"
        return ids[-1]

    def comm(self, comm_id: str, data: dict) -> None:
        self.kc.shell_channel.send(self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))

    def click(self, comm_id: str) -> None:
        self.comm(comm_id, {"method": "custom", "content": {"event": "click"}})

    def set_value(self, comm_id: str, value) -> None:
        self.comm(comm_id, {"method": "update", "state": {"value": value}, "buffer_paths": []})

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=False)


class Panel:
    """The step panel as a front end sees it: its buttons, N box, step label, image and log."""

    def __init__(self, kernel: Kernel):
        self.k = kernel
        self.step = kernel.latest("ButtonModel", description="Step")
        self.run_n = kernel.latest("ButtonModel", description="Run N")
        self.stop = kernel.latest("ButtonModel", description="Stop")
        self.n = kernel.latest("BoundedIntTextModel")
        self.label = kernel.latest("LabelModel")
        self.image = kernel.latest("ImageModel")
        self.log = kernel.latest("OutputModel")

    def steps(self) -> int:
        match = STEP_LABEL.search(self.k.models[self.label].get("value", ""))
        return int(match.group(1)) if match else -1

    def idle(self) -> bool:
        return not self.k.models[self.step].get("disabled", False)

    def log_text(self) -> str:
        return "".join(o.get("text", "") for o in self.k.models[self.log].get("outputs", []))

    def wait_steps(self, at_least: int, timeout: float) -> int:
        return self.k.wait_until(f"the panel to reach {at_least} steps", lambda: self.steps() >= at_least
                                 and self.steps(), timeout)

    def wait_idle(self, timeout: float) -> None:
        self.k.wait_until("the panel to finish its run", self.idle, timeout)


def notebook_cells(values: dict) -> tuple[list[str], str]:
    """Notebook 01's code cells up to the one that displays the panel, and the cell that runs it."""
    nb = parameterized(NOTEBOOK_DIR / "01_step_through.ipynb", **values)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    shown = next(i for i, src in enumerate(cells) if "display(panel)" in src)
    run_cell = cells[shown + 1]
    assert "panel.start(STEPS)" in run_cell and "panel.wait()" in run_cell, run_cell
    return cells[:shown + 1], run_cell


def engine_processes(kernel_pid: int) -> list[int]:
    """Live processes under the kernel whose title SGLang set (sglang::scheduler, ::detokenizer)."""
    try:
        tree = psutil.Process(kernel_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p.pid for p in tree if _is_sglang(p)]


def _is_sglang(proc) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and proc.cmdline()[:1] and proc.cmdline()[0].startswith("sglang::")
    except psutil.NoSuchProcess:
        return False


def any_sglang_process() -> list[int]:
    return [p.pid for p in psutil.process_iter() if _is_sglang(p)]


def gpu_apps() -> list[dict]:
    """Processes holding GPU memory now (nvidia-smi), [] without a GPU."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60).stdout
    except FileNotFoundError:
        return []
    apps = [{"pid": int(a), "mib": int(b)} for a, b in (line.split(",") for line in out.strip().splitlines() if line)]
    return [a for a in apps if a["pid"] != os.getpid()]   # the test process's own CUDA context is not the kernel's


def run_scenario(engine: str, work: Path, env: dict, overrides: list[str], seed: int = 0,
                 step_timeout: float = 300, seen: dict | None = None) -> dict:
    """The whole interactive contract on notebook 01 (see the module docstring); returns what was
    seen, filled into `seen` as it goes (so a failed run still shows how far it got)."""
    rng, seen = random.Random(seed), seen if seen is not None else {}
    seen["engine"] = engine
    values = {**SMALL["01_step_through"], "ENGINE": engine, "RUN_ROOT": str(work / "runs"),
              "OVERRIDES": [*SMALL["01_step_through"]["OVERRIDES"], *overrides]}
    cells, run_cell = notebook_cells(values)
    kernel = Kernel(NOTEBOOK_DIR, env)
    try:
        seen["kernel_pid"] = kernel.pid
        say(f"{engine}: kernel {kernel.pid} up; the notebook's cells")
        t0 = time.monotonic()
        for source in cells:
            out = kernel.run(source)
            assert out["status"] == "ok", f"cell failed: {out.get('ename')}: {out.get('evalue')}\n{source[:300]}"
        seen["open_s"] = round(time.monotonic() - t0, 1)
        engine_pids = engine_processes(kernel.pid)
        seen["engine_processes_open"] = len(engine_pids)
        out = kernel.run(run_cell)                         # Run All's blocking cell: STEPS steps
        assert out["status"] == "ok", out
        panel = Panel(kernel)
        done = panel.wait_steps(values["STEPS"], 30)
        say(f"opened in {seen['open_s']} s; the panel's clicks")
        seen.update(_clicks(kernel, panel, done, step_timeout))
        say("interrupts from a cell")
        seen.update(_interrupts(kernel, panel, rng, step_timeout, engine))
        say("close and reopen")
        seen.update(_close_and_reopen(kernel, engine_pids))
        say("restart and shutdown")
        seen.update(_restart_and_shutdown(kernel, engine))
        say("done")
    finally:
        kernel.close()
    return seen


def _clicks(kernel: Kernel, panel: Panel, done: int, step_timeout: float) -> dict:
    seen = {}
    images = kernel.image_updates.get(panel.image, 0)
    kernel.click(panel.step)                             # a double click: the second is refused
    kernel.click(panel.step)
    panel.wait_steps(done + 1, step_timeout)
    panel.wait_idle(step_timeout)
    kernel.drain(timeout=1.0)
    seen["double_click_steps"] = panel.steps() - done
    assert seen["double_click_steps"] == 1 and "busy" in panel.log_text(), (panel.steps(), panel.log_text())
    done = panel.steps()
    kernel.set_value(panel.n, 50)                        # Run N with N = 50, then Stop
    kernel.click(panel.run_n)
    panel.wait_steps(done + 1, step_timeout)
    t0 = time.monotonic()                                # another cell while the steps go on
    rows = kernel.value("len(read_jsonl(run_dir / 'metrics.jsonl'))")
    seen["cell_during_steps_s"] = round(time.monotonic() - t0, 2)
    assert not panel.idle() and rows >= done + 1, (rows, done)
    kernel.click(panel.stop)
    panel.wait_idle(step_timeout)
    seen["run_n_then_stop_steps"] = panel.steps() - done
    assert 1 <= seen["run_n_then_stop_steps"] < 50, seen
    done = panel.steps()                                 # Kernel -> Interrupt while the panel steps
    kernel.click(panel.run_n)
    panel.wait_steps(done + 1, step_timeout)
    assert kernel.interrupt()["status"] == "ok"
    panel.wait_idle(step_timeout)
    kernel.drain(timeout=1.0)
    seen["idle_interrupt_steps"] = panel.steps() - done
    assert seen["idle_interrupt_steps"] < 50 and "Kernel -> Interrupt" in panel.log_text(), panel.log_text()
    seen["image_updates"] = kernel.image_updates.get(panel.image, 0) - images
    assert seen["image_updates"] >= panel.steps() - done, seen   # one redraw per step at least
    seen["panel_steps"] = panel.steps()
    return seen


# read once the last step's commit is in the run dir (it is written while the kernel goes on)
CONSISTENT = ("session.trainer.wait_committed() or {'steps': session.trainer.step_count,"
              " 'rows': [r['step'] for r in read_jsonl(run_dir / 'metrics.jsonl')],"
              " 'served': [r['adapter/served_version'] for r in read_jsonl(run_dir / 'metrics.jsonl')],"
              " 'engine': session.engine.served_version(session.trainer.refresher.serving_adapter)}")


_REQUEST = """
import time as _time
from lorabench.engines.base import Sampling
_prompt, _adapter = session.trainer._probe[0][:session.trainer._probe[1]], session.trainer.refresher.serving_adapter
_t0 = _time.perf_counter()
{call}
_request_s = _time.perf_counter() - _t0
"""
# a request of a few seconds. SGLang: one batch of 1024 that ignores EOS (the tiny model's answers
# stop after ~30 tokens), through the engine's thread as every call goes; hf: generate calls in a row
LONG_REQUEST = {
    "sglang": _REQUEST.format(call="session.engine._thread.call(lambda e: e.generate(input_ids=[_prompt] * 1024, "
                                   "sampling_params={'max_new_tokens': 400, 'ignore_eos': True, 'temperature': 1.0}, "
                                   "lora_path=[_adapter] * 1024), session.engine.engine, "
                                   "on_interrupt=session.engine._abort)"),
    "hf": _REQUEST.format(call="for _ in range(20):\n    session.engine.generate([_prompt] * 16, "
                               "Sampling(max_new_tokens=40, temperature=1.0), _adapter)"),
}


def _interrupts(kernel: Kernel, panel: Panel, rng: random.Random, step_timeout: float, engine: str) -> dict:
    """Kernel -> Interrupt during `trainer.run(50)` from a cell, at random moments, then during a
    long engine request: each time the step in progress is rolled back, and the next step works."""
    seen = {"cell_interrupts": []}
    metrics = Path(kernel.value("str(run_dir)")) / "metrics.jsonl"
    for i in range(3):
        before = kernel.value(CONSISTENT)["steps"]
        say(f"interrupt {i + 1} of 3 during trainer.run(50), from step {before}")
        msg_id = kernel.send("records = session.trainer.run(50, progress=False)")
        kernel.wait_until("a step of trainer.run", lambda n=before, m=msg_id: _rows(metrics) > n or kernel.replied(m),
                          step_timeout)
        assert _rows(metrics) > before, ("trainer.run ended before a step", kernel.reply(msg_id, 10),
                                         kernel.outputs(msg_id))
        time.sleep(rng.uniform(0.0, 1.0))
        assert kernel.interrupt()["status"] == "ok"
        reply = kernel.reply(msg_id, step_timeout)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", (reply, kernel.outputs(msg_id))
        state = kernel.value(CONSISTENT)
        assert state["rows"] == list(range(1, state["steps"] + 1)), state     # every committed step, once
        seen["cell_interrupts"].append({"steps_before": before, "steps_after": state["steps"],
                                        "rolled_back": "was rolled back" in "".join(reply.get("traceback", []))})
    request = LONG_REQUEST[engine]
    say("a long engine request, then one interrupted")
    out = kernel.run(request)                           # the same request uninterrupted: how long it takes
    assert out["status"] == "ok", out
    seen["long_request_s"] = kernel.value("round(_request_s, 2)")
    msg_id = kernel.send(request)
    time.sleep(seen["long_request_s"] / 4)
    t0 = time.monotonic()
    assert kernel.interrupt()["status"] == "ok"
    reply = kernel.reply(msg_id, step_timeout)
    seen["mid_request_interrupt_s"] = round(time.monotonic() - t0, 2)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
    assert seen["mid_request_interrupt_s"] < seen["long_request_s"] / 2, seen   # it did not wait for the request
    out = kernel.run("record = session.trainer.step()")  # the session is usable: one more step
    assert out["status"] == "ok", out
    state = kernel.value(CONSISTENT)
    assert state["rows"] == list(range(1, state["steps"] + 1)), state
    assert state["served"] == list(range(state["steps"])), state          # step k sampled from v(k-1)
    assert state["engine"] == state["steps"], state                      # the engine holds the trainer's
    seen["after_interrupts"] = state
    assert kernel.value("1 + 1") == 2
    return seen


def _rows(metrics: Path) -> int:
    """Whole rows in a metrics.jsonl being written by the kernel (read here: the kernel is busy)."""
    return metrics.read_bytes().count(b"\n") if metrics.exists() else 0


SECOND_SESSION = """
run_dir2 = run_dir.parent / (run_dir.name + '-second')
cfg2 = Config.load(None, [f'engine.backend={ENGINE}', f'model.name_or_path={MODEL}', f'data.source={DATA}',
                          f'run.out_dir={run_dir2.parent}', f'run.name={run_dir2.name}', *OVERRIDES])
session2 = RunSession.open(cfg2, run_dir2)
record2 = session2.trainer.step()
"""


def _close_and_reopen(kernel: Kernel, engine_pids: list[int]) -> dict:
    """Closing the session frees the engine's processes, their GPU memory and the run dir's lock; a
    second session opened in the same kernel then works."""
    seen = {}
    run_dir = Path(kernel.value("str(run_dir)"))
    out = kernel.run("panel.end('closed'); session.close()")
    assert out["status"] == "ok", out
    from lorabench.rundir import lock_holder
    seen["lock_after_close"] = str(lock_holder(run_dir) or "")   # '' once nobody holds it
    seen["engine_processes_after_close"] = engine_processes(kernel.pid)
    seen["gpu_apps_after_close"] = gpu_apps()
    assert not seen["lock_after_close"] and not seen["engine_processes_after_close"], seen
    assert not {a["pid"] for a in seen["gpu_apps_after_close"]} & set(engine_pids), seen
    out = kernel.run(SECOND_SESSION)
    assert out["status"] == "ok", out
    seen["second_session_steps"] = kernel.value("session2.trainer.step_count")
    assert seen["second_session_steps"] == 1
    seen["engine_processes_second"] = len(engine_processes(kernel.pid))
    return seen


def _restart_and_shutdown(kernel: Kernel, engine: str) -> dict:
    """A restart while the second session's engine runs, then a shutdown: nothing of it remains."""
    seen, old_pid = {}, kernel.pid
    kernel.km.restart_kernel(now=False)
    kernel.kc.wait_for_ready(timeout=120)
    time.sleep(2)
    seen["engine_processes_after_restart"] = engine_processes(old_pid) + (
        any_sglang_process() if engine == "sglang" else [])
    seen["gpu_apps_after_restart"] = gpu_apps()
    assert not seen["engine_processes_after_restart"], seen
    assert kernel.value("1 + 1") == 2   # the restarted kernel answers
    kernel.km.shutdown_kernel(now=False)
    time.sleep(2)
    seen["gpu_apps_after_shutdown"] = gpu_apps()
    seen["sglang_processes_after_shutdown"] = any_sglang_process()
    assert not seen["sglang_processes_after_shutdown"] and not seen["gpu_apps_after_shutdown"], seen
    return seen


def kernel_env(jupyter_dir: Path) -> dict:
    """The environment a kernel gets: this one, with `jupyter_dir` first on JUPYTER_PATH and dev/stacks first on
    PYTHONPATH (every process the kernel starts writes its stacks on SIGUSR2: `Kernel.dump_stacks`)."""
    return {**os.environ, "JUPYTER_PATH": os.pathsep.join(filter(None, [str(jupyter_dir),
                                                                          os.environ.get("JUPYTER_PATH")])),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(STACKS_DIR), os.environ.get("PYTHONPATH")]))}
