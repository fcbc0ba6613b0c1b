"""Run directories: what a run writes, and how a run is read back or resumed.

    RUN_DIR/config.json          the full Config, written once when the run starts, never rewritten
    RUN_DIR/config_changes.jsonl allowed changes of a continued run (compat.py), appended, in order
    RUN_DIR/metrics.jsonl        one row per GRPO step, slash-namespaced keys (append-only)
    RUN_DIR/sync.jsonl           one row per refresh bucket and one per refresh total
    RUN_DIR/rollouts.jsonl       sampled completions with rewards and advantages
    RUN_DIR/evals.jsonl          held-out evaluations (before / after)
    RUN_DIR/adapters/step_<n>/   PEFT adapter dirs (load with PeftModel.from_pretrained)
    RUN_DIR/checkpoint/          trainer state for `lorabench resume` (atomic, latest step)
    RUN_DIR/plots/*.png          figures
    RUN_DIR/lock                 the writer's PID while one runs (rundir.RunLock)
A step is committed by its checkpoint: `commit` writes the adapter dir (when due), then the
checkpoint (which also holds the rows it vouches for), then appends the sync and rollout rows; the
trainer appends the metrics rows last. Rows are flushed and fsynced as they are written. So the
files never hold a row the checkpoint cannot vouch for, and a kill can only leave rows *missing*:
`load_checkpoint` appends them from the checkpoint and says so. Anything else that does not fit is
refused by rundir.inspect, which reads without writing; nothing is truncated but a torn last line.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import time
from pathlib import Path

import torch

from .adapters import AdapterLayout, FlatAdapter
from .fsutil import atomic_write
from .rundir import RunDirError, RunLock, inspect, read_jsonl, row_line, scan_jsonl
from .rundir import clean as _clean

__all__ = ["NullRunLog", "RunDirError", "RunLog", "_clean", "read_jsonl", "redact"]

# whole underscore-separated words, so 'hf_token' / 'api_key' match but 'max_new_tokens' does not
_SECRET_KEY = re.compile(r"(?:^|_)(?:token|secret|password|api_key|apikey|credentials?)(?:_|$)", re.I)


def redact(config: dict) -> dict:
    """Drop anything that looks like a credential before it is written to disk."""
    return {k: (redact(v) if isinstance(v, dict) else ("<redacted>" if _SECRET_KEY.search(k) else v))
            for k, v in config.items()}


class RunLog:
    """Writes one run dir. With lock=True (RunSession, the CLI) it first takes the run dir's
    one-writer lock, refusing if another process holds it; `close()` releases it."""

    def __init__(self, run_dir: str | Path, log=print, lock: bool = False):
        self.dir, self.log = Path(run_dir), log
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o750)  # never world-writable (nor world-readable)
        self._lock = RunLock(self.dir, log) if lock else None
        for sub in ("adapters", "plots", "checkpoint"):
            (self.dir / sub).mkdir(exist_ok=True)
            os.chmod(self.dir / sub, 0o750)  # explicit: whatever the process umask is

    @classmethod
    def create(cls, out_dir: str, name: str = "", log=print, lock: bool = False) -> RunLog:
        """RUN_DIR = out_dir/name, or out_dir/<timestamp>[-k]: a timestamped dir is made with an
        exclusive mkdir, so two runs started in the same second get two dirs."""
        if name:
            return cls(Path(out_dir) / name, log, lock)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for k in itertools.count(1):
            candidate = Path(out_dir) / (stamp if k == 1 else f"{stamp}-{k}")
            try:
                candidate.mkdir()
                return cls(candidate, log, lock)
            except FileExistsError:
                continue

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def write_config(self, config: dict) -> None:
        """config.json, once: a run's config is never rewritten (changes go to config_changes.jsonl)."""
        path = self.dir / "config.json"
        if path.exists():
            raise RunDirError(f"{path} exists: a run's config is written once and never rewritten; continue the run "
                              f"with `lorabench resume {self.dir}` or choose another run.name")
        atomic_write(path, json.dumps(redact(config), indent=1).encode(), 0o640)

    def record_config_changes(self, step: int, changes: dict[str, tuple]) -> None:
        """One row of allowed changes ({field: [old, new]}) made when continuing at `step`."""
        self._append("config_changes.jsonl", [{"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                               "changes": {k: list(v) for k, v in changes.items()}}])

    def _append(self, name: str, rows: list[dict]) -> None:
        path = self.dir / name
        self._end_with_newline(path)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)  # not umask-dependent
        with os.fdopen(fd, "a") as fh:
            for row in rows:
                fh.write(row_line(row))
            fh.flush()
            os.fsync(fh.fileno())

    def _end_with_newline(self, path: Path) -> None:
        """Never glue a row onto a torn one: a file not ending in a newline is repaired first."""
        if not path.is_file() or path.stat().st_size == 0:
            return
        with open(path, "rb") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) == b"\n":
                return
        scan = scan_jsonl(path)
        if scan.torn:
            self.log(f"{path.name}: removing a torn last line ({len(scan.tail)} bytes without a newline, cut off by "
                     f"a kill mid-write): {scan.tail[:60]!r}")
            os.truncate(path, scan.end)
        else:
            with open(path, "ab") as fh:
                fh.write(b"\n")
                fh.flush()
                os.fsync(fh.fileno())

    def log_metrics(self, rows: list[dict]) -> None:
        self._append("metrics.jsonl", rows)

    def log_eval(self, row: dict) -> None:
        self._append("evals.jsonl", [row])

    def commit(self, step: int, state: dict, adapter: FlatAdapter, rows: dict[str, list[dict]],
               save_adapter: bool) -> None:
        """The commit point of steps up to `step`: adapters/step_<n> (when due), then one atomic
        checkpoint holding the trainer state, the adapter and the pending rows, then the sync and
        rollout rows. The caller appends the metrics rows after this returns."""
        if save_adapter:
            adapter.save_peft_dir(self.dir / "adapters" / f"step_{step}")
        host = adapter.to("cpu")
        payload = {**state, "step": step, "adapter_buffer": host.buffer, "adapter_layout": host.layout.to_json(),
                   "adapter_config": host.config, "rows": rows}
        atomic_write(self.dir / "checkpoint" / "trainer_state.pt", mode=0o640,
                     writer=lambda tmp: torch.save(payload, tmp))
        for name in ("sync.jsonl", "rollouts.jsonl"):
            self._append(name, rows.get(name, []))

    def load_checkpoint(self) -> tuple[dict | None, FlatAdapter | None]:
        """The last checkpoint (None, None before the first), after making the files agree with it:
        rundir.inspect refuses what cannot be matched; its repairs are applied and logged here."""
        found = inspect(self.dir)
        for note in found.notes:
            self.log(f"note: {note}")
        for repair in found.repairs:
            self.log(f"repair: {repair.note}")
            if repair.kind == "cut_torn_tail":
                os.truncate(repair.path, repair.end)
            elif repair.kind == "add_newline":
                self._end_with_newline(repair.path)
            else:
                self._append(repair.path.name, repair.rows)
        state = found.checkpoint
        if state is None:
            return None, None
        layout = AdapterLayout.from_json(state["adapter_layout"])
        return state, FlatAdapter(state["adapter_buffer"], layout, state["adapter_config"], int(state["step"]))

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def evals(self) -> list[dict]:
        return read_jsonl(self.dir / "evals.jsonl")

    def set_evals(self, step: int, rows: list[dict]) -> list[dict]:
        """Make `rows` the evaluations of `step`, replacing any a killed or repeated run left there
        (evaluation is seeded, so a repeat gives the same values); returns all rows. The file is
        rewritten only after it was read whole (a bad line raises instead)."""
        kept = [r for r in self.evals() if r.get("step") != step] + rows
        atomic_write(self.dir / "evals.jsonl", "".join(map(row_line, kept)).encode(), 0o640)
        return kept


class NullRunLog:
    """Same methods as RunLog, writes nothing: the loop never branches on whether it is logging.
    Every method is spelled out, so a misspelled call fails instead of silently doing nothing."""
    dir = None

    def log_metrics(self, rows: list[dict]) -> None:
        pass

    def log_eval(self, row: dict) -> None:
        pass

    def commit(self, step: int, state: dict, adapter, rows: dict, save_adapter: bool) -> None:
        pass

    def load_checkpoint(self):
        return None, None

    def metrics(self) -> list[dict]:
        return []

    def evals(self) -> list[dict]:
        return []

    def close(self) -> None:
        pass
