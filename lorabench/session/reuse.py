"""A trained run's adapter, read from its run dir (only read, its lock only probed) without continuing it:
`find_trained_run` finds the newest run dir of cfg's experiment, `load_trained_run` puts it into a trainer.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..adapters import AdapterLayout, FlatAdapter
from ..rundir import CHECKPOINT_DIR, CONFIG, METRICS, check_entries, lock_holder, read_checkpoint, read_jsonl
from ..safedir import RunDirError
from .compat import changes, check_model, effective_config, model_fingerprint, refused
from .config import ConfigError


@dataclass
class TrainedRun:
    dir: Path
    step: int                 # the checkpoint's step: the adapter's version
    checkpoint: dict          # rundir.read_checkpoint's state (weights only)
    rows: list[dict]          # metrics.jsonl up to that step
    in_use: bool              # another process holds its lock: it may still be training
    listing: dict             # dir_listing when it was read, to show it was only read


def dir_listing(path: Path) -> dict[str, tuple]:
    """Every entry under `path` (links not followed): {relative path: (kind, size, mtime_ns)}."""
    found, todo = {}, [Path(path)]
    while todo:
        folder = todo.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
                found[str(Path(entry.path).relative_to(path))] = (kind, st.st_size, st.st_mtime_ns)
                if kind == "dir":
                    todo.append(Path(entry.path))
    return found


def run_dirs(run_root: str | Path) -> list[Path]:
    """The run dirs directly under `run_root` (holding config.json, no links), newest first by the time their
    checkpoint (or the dir itself) last changed."""
    root = Path(run_root)
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if not p.is_symlink() and p.is_dir() and (p / CONFIG).is_file()]

    def changed(p: Path) -> int:
        checkpoint = p / CHECKPOINT_DIR
        return max(os.lstat(p).st_mtime_ns, os.lstat(checkpoint).st_mtime_ns if checkpoint.is_dir() else 0)
    return sorted(dirs, key=changed, reverse=True)


def read_trained_run(cfg, run_dir: str | Path, model_path: str) -> TrainedRun:
    """The last checkpoint of `run_dir` if it is the experiment `cfg` describes; raises RunDirError (or
    ConfigError) saying why not."""
    run_dir = Path(run_dir)
    check_entries(run_dir)   # no link in it is followed, nothing of an odd kind is opened
    listing = dir_listing(run_dir)
    if differ := {k: v for k, v in changes(effective_config(run_dir), cfg).items() if k in refused()}:
        shown = ", ".join(f"{k}={a!r} there, {b!r} here" for k, (a, b) in list(differ.items())[:3])
        raise RunDirError(f"{run_dir.name}: another experiment ({shown})")
    state = read_checkpoint(run_dir)
    if state is None:
        raise RunDirError(f"{run_dir.name}: no checkpoint yet (no step finished)")
    step = int(state["step"])
    if "fingerprint" in state:
        check_model(state["fingerprint"].get("model", {}), model_fingerprint(cfg, model_path), cfg, run_dir, step)
    rows = [r for r in read_jsonl(run_dir / METRICS) if r.get("step", 0) <= step]
    return TrainedRun(run_dir, step, state, rows, lock_holder(run_dir) is not None, listing)


def find_trained_run(cfg, run_root: str | Path, model_path: str) -> tuple[TrainedRun | None, list[tuple[str, str]]]:
    """The newest run dir under `run_root` that `read_trained_run` accepts (None if none), and (name, why) of
    each newer one passed over."""
    passed = []
    for run_dir in run_dirs(run_root):
        try:
            return read_trained_run(cfg, run_dir, model_path), passed
        except (RunDirError, ConfigError, OSError, ValueError) as err:
            why = str(err).split("; ")[0].removeprefix(f"{run_dir.name}: ")
            passed.append((run_dir.name, why))
    return None, passed


def load_trained_run(trainer, run: TrainedRun) -> None:
    """Put the checkpoint into `trainer` (whose run log writes nothing) as `lorabench resume` does, refreshing
    the engine with it."""
    state = run.checkpoint
    layout = AdapterLayout.from_json(state["adapter_layout"])
    trainer.load_state(state, FlatAdapter(state["adapter_buffer"], layout, state["adapter_config"], run.step),
                       list(run.rows))
