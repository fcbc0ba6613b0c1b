"""Run directories: what a run writes, and how a run is read back or resumed.

    RUN_DIR/config.json          the full Config
    RUN_DIR/metrics.jsonl        one row per GRPO step, slash-namespaced keys (append-only)
    RUN_DIR/sync.jsonl           one row per refresh bucket and one per refresh total
    RUN_DIR/rollouts.jsonl       sampled completions with rewards and advantages
    RUN_DIR/evals.jsonl          held-out evaluations (before / after)
    RUN_DIR/adapters/step_<n>/   PEFT adapter dirs (load with PeftModel.from_pretrained)
    RUN_DIR/checkpoint/          trainer state for `lorabench resume` (atomic, latest step)
    RUN_DIR/plots/*.png          figures
Rows are flushed and fsynced as they are written; on resume, rows past the checkpoint's step are
dropped (atomically), so a killed run loses no step and repeats none.
"""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import torch

# whole underscore-separated words, so 'hf_token' / 'api_key' match but 'max_new_tokens' does not
_SECRET_KEY = re.compile(r"(?:^|_)(?:token|secret|password|api_key|apikey|credentials?)(?:_|$)", re.I)


def _clean(value):
    """JSON-safe: tensors to numbers, NaN/Inf to None (JSON has neither)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def redact(config: dict) -> dict:
    """Drop anything that looks like a credential before it is written to disk."""
    return {k: (redact(v) if isinstance(v, dict) else ("<redacted>" if _SECRET_KEY.search(k) else v))
            for k, v in config.items()}


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `path` via a fsynced temp file (`.<name>.<pid>.*`) renamed onto it; temps that a
    killed writer left next to it are removed first."""
    from .adapters import remove_stale_temps
    remove_stale_temps(path.parent, (f".{path.name}.",))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line from a kill mid-write: stop there
                break
    return rows


class RunDirError(ValueError):
    """A run dir lacks something resume needs; the message says what and how to recover."""


class RunLog:
    def __init__(self, run_dir: str | Path):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o750)  # never world-writable (nor world-readable)
        for sub in ("adapters", "plots", "checkpoint"):
            (self.dir / sub).mkdir(exist_ok=True)
            os.chmod(self.dir / sub, 0o750)  # explicit: whatever the process umask is

    @classmethod
    def create(cls, out_dir: str, name: str = "") -> "RunLog":
        name = name or time.strftime("%Y%m%d-%H%M%S")
        return cls(Path(out_dir) / name)

    def write_config(self, config: dict) -> None:
        atomic_write(self.dir / "config.json", json.dumps(redact(config), indent=1).encode(), 0o640)

    def _append(self, name: str, rows: list[dict]) -> None:
        fd = os.open(self.dir / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)  # not umask-dependent
        with os.fdopen(fd, "a") as fh:
            for row in rows:
                fh.write(json.dumps(_clean(row)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def log_metrics(self, row: dict) -> None:
        self._append("metrics.jsonl", [row])

    def log_sync(self, rows: list[dict]) -> None:
        self._append("sync.jsonl", rows)

    def log_rollouts(self, rows: list[dict]) -> None:
        self._append("rollouts.jsonl", rows)

    def log_eval(self, row: dict) -> None:
        self._append("evals.jsonl", [row])

    def save_adapter(self, snapshot, step: int) -> Path:
        return snapshot.save_peft_dir(self.dir / "adapters" / f"step_{step}")

    def save_checkpoint(self, state: dict, snapshot) -> None:
        """One atomic commit: trainer_state.pt holds the step, optimizer and RNG state *and* the
        adapter tensors, so a kill at any point leaves the previous or the new checkpoint whole
        (the adapter dir next to it is a copy for PEFT users; it may be a step ahead of, or briefly
        missing from, a killed run's state file, and resume never reads it when the state has the
        tensors). Temp files a killed writer left behind are removed here."""
        from .adapters import _fsync_dir, remove_stale_temps
        snapshot.save_peft_dir(self.dir / "checkpoint" / "adapter")
        buf = self.dir / "checkpoint" / "trainer_state.pt"
        remove_stale_temps(buf.parent, (".trainer_state.",))
        state = {**state, "adapter_tensors": {k: v.detach().cpu() for k, v in snapshot.tensors.items()},
                 "adapter_config": snapshot.config}
        fd, tmp = tempfile.mkstemp(prefix=f".trainer_state.{os.getpid()}.", dir=buf.parent)
        os.close(fd)
        try:
            torch.save(state, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, buf)
            _fsync_dir(buf.parent)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load_checkpoint(self):
        from .adapters import AdapterSnapshot
        state_path = self.dir / "checkpoint" / "trainer_state.pt"
        if not state_path.is_file():
            return None, None
        state = torch.load(state_path, weights_only=False)
        if "adapter_tensors" in state:
            return state, AdapterSnapshot(state["adapter_tensors"], state["adapter_config"], state["step"])
        return state, AdapterSnapshot.load_peft_dir(self.dir / "checkpoint" / "adapter")  # older run dirs

    def truncate_after(self, step: int) -> None:
        """Drop rows of steps > `step` (work a killed run did after its last checkpoint)."""
        for name in ("metrics.jsonl", "sync.jsonl", "rollouts.jsonl"):
            path = self.dir / name
            if path.is_file():
                keep = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
                atomic_write(path, "".join(json.dumps(r) + "\n" for r in keep).encode(), 0o640)

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def evals(self) -> list[dict]:
        return read_jsonl(self.dir / "evals.jsonl")

    def set_evals(self, step: int, rows: list[dict]) -> list[dict]:
        """Make `rows` the evaluations of `step`, replacing any a killed or repeated run left there
        (evaluation is seeded, so a repeat gives the same values); returns all rows."""
        kept = [r for r in self.evals() if r.get("step") != step] + rows
        atomic_write(self.dir / "evals.jsonl", "".join(json.dumps(_clean(r)) + "\n" for r in kept).encode(), 0o640)
        return kept


class NullRunLog:
    """Same methods, writes nothing: the loop never branches on whether it is logging."""
    dir = None

    def __getattr__(self, name):
        return lambda *a, **k: None

    def load_checkpoint(self):
        return None, None

    def metrics(self):
        return []
