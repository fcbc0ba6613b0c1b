"""Writing a run directory (its layout: rundir.py). A step is committed by its checkpoint (holding the rows it
vouches for), written before its rows, so a kill can only leave rows *missing*, which a resume's `repair` appends
from the checkpoint.
"""
from __future__ import annotations

import itertools
import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import rundir
from .adapters import CONFIG_NAME, WEIGHTS_NAME, AdapterLayout, FlatAdapter
from .interrupts import interrupts_deferred
from .rundir import RunDirError, read_jsonl
from .safedir import SafeDir
from .settings import ALLOWED, REFUSED, Section, check, path_component_problem, setting

__all__ = ["NullRunLog", "RunDirError", "RunLog", "RunSettings", "read_jsonl", "redact"]

SEED_LIMIT = 2**32   # sampling seeds are seed x 1,000,003 + step: they stay below 2**63 (torch, SGLang)
_WHERE = "where the run dir is: not compared (a run dir may be moved), taken from where it is now"


@dataclass
class RunSettings(Section):
    """The `run` section: where the run dir goes, the seed, and when it is written."""
    out_dir: str = setting("runs", "Parent of run directories.", resume=ALLOWED, why=_WHERE)
    name: str = setting("", "Run directory name; '' = timestamp.", resume=ALLOWED, why=_WHERE)
    seed: int = setting(0, "Seed for data, sampling and init; on the hf engine the same seed reproduces a "
                        "run bit for bit. SGLang 0.5.17 reads a request's seed only with engine.sglang.extra_args "
                        "'{\"enable_deterministic_inference\": true}' and otherwise samples unseeded: data and init "
                        "repeat, the rollouts do not.", resume=REFUSED,
                        why="it seeds the data, the sampling, the LoRA init and (tiny) the base model")
    save_adapter_every: int = setting(10, "Write adapters/step_<n>/ every n steps (and the last step).",
                                      resume=ALLOWED, why="logging")
    checkpoint_every: int = setting(1, "Checkpoint every n steps (and the last step); rows of the steps between "
                                    "are written with the next checkpoint, so a killed run repeats at most n-1 steps "
                                    "and its run dir never holds a row its checkpoint cannot vouch for.",
                                    resume=ALLOWED, why="logging")
    sample_completions: int = setting(4, "Completions per step written to rollouts.jsonl (all are kept in the "
                                      "step record).", resume=ALLOWED, why="logging")
    threads: int = setting(0, "torch CPU threads; 0 = auto: torch's default less the CPUs other work keeps busy "
                           "(the 1-minute load average, or fewer where /proc/stat shows fewer busy now), at least 1.",
                           resume=ALLOWED, why="execution")
    commit_in_background: bool = setting(True, "Write each checkpoint and its rows on a background thread while the "
                                         "next step runs (in the same order, so a kill leaves what it would leave "
                                         "in line); false: the step waits for its commit.", resume=ALLOWED,
                                         why="execution")

    def problems(self) -> list[str]:
        problem = path_component_problem(self.name) if self.name else None
        return [
            *check(problem is None, f"run.name={self.name!r} {problem}; give one directory name such as 'gsm8k-r16' "
                   f"(the run dir is run.out_dir/run.name; point run.out_dir at the parent you want)"),
            *check(bool(self.out_dir.strip()), "run.out_dir='': give the parent directory of run dirs, e.g. runs"),
            *check("\0" not in self.out_dir, f"run.out_dir={self.out_dir!r} contains a NUL character; give a "
                   f"directory path"),
            *check(0 <= self.seed < SEED_LIMIT, f"run.seed={self.seed}: must be in [0, 2**32) (e.g. 0; sampling seeds "
                   f"are derived from it and must fit 64 bits)"),
            *check(self.save_adapter_every >= 1, f"run.save_adapter_every={self.save_adapter_every}: must be >= 1"),
            *check(self.checkpoint_every >= 1, f"run.checkpoint_every={self.checkpoint_every}: must be >= 1"),
            *check(self.threads >= 0, f"run.threads={self.threads}: must be >= 0 (0 = auto)"),
            *check(self.sample_completions >= 0, f"run.sample_completions={self.sample_completions}: must be >= 0"),
        ]

    def due(self, step: int, last_step: int) -> tuple[bool, bool]:
        """Whether step `step` of a run ending at `last_step` is checkpointed, and its adapter saved."""
        final = step == last_step
        return step % self.checkpoint_every == 0 or final, step % self.save_adapter_every == 0 or final

# whole underscore-separated words, so 'hf_token' / 'api_key' match but 'max_new_tokens' does not
_SECRET_KEY = re.compile(r"(?:^|_)(?:token|secret|password|api_key|apikey|credentials?)(?:_|$)", re.I)


def redact(config: dict) -> dict:
    """Drop anything that looks like a credential before it is written to disk."""
    return {k: (redact(v) if isinstance(v, dict) else ("<redacted>" if _SECRET_KEY.search(k) else v))
            for k, v in config.items()}


class RunLog:
    """Writes one run dir, entered only through itself (safedir.py); lock=True takes its one-writer lock.
    `fingerprint`, when set, is recorded in every checkpoint; `committed_step`: the last checkpoint's step.
    made=True: the caller has just made `run_dir` itself (create), so it gets 0750 as a dir made here would."""

    def __init__(self, run_dir: str | Path, log=print, lock: bool = False, settings: RunSettings | None = None,
                 made: bool = False):
        self.dir, self.log, self.settings = Path(run_dir), log, settings or RunSettings()
        # never world-writable (nor -readable); an existing dir keeps the mode its owner gave it
        self.root = SafeDir.open(self.dir, create=not made, mode=0o750)
        self._lock, self.sub = None, {}   # the folders, made when first written (_folder)
        self._writing = threading.Lock()   # held by commit and log_metrics (on the commit thread): close waits
        self.fingerprint: dict | None = None
        self.committed_step = 0
        try:
            self._lock = rundir.RunLock(self.root, log) if lock else None
        except (RunDirError, OSError):
            self.close(refused=True)
            raise

    @classmethod
    def create(cls, out_dir: str, name: str = "", log=print, lock: bool = False,
               settings: RunSettings | None = None) -> RunLog:
        """RUN_DIR = out_dir/name, or out_dir/<timestamp>[-k] made by an exclusive mkdir (one per run)."""
        if name:
            return cls(Path(out_dir) / name, log, lock, settings)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for k in itertools.count(1):
            candidate = Path(out_dir) / (stamp if k == 1 else f"{stamp}-{k}")
            try:
                candidate.mkdir(mode=0o700)   # exclusive: one run per name; private until SafeDir sets 0750
            except FileExistsError:
                continue
            return cls(candidate, log, lock, settings, made=True)

    def close(self, refused: bool = False) -> None:
        """Once no commit is being written (also when interrupted), release the lock, then the folders: a commit
        after this is refused (SafeDir: closed), never written elsewhere. refused=True puts the lock file back
        as it was found."""
        with interrupts_deferred(), self._writing:
            if self._lock is not None:
                self._lock.release(restore=refused)
                self._lock = None
            for folder in [*self.sub.values(), self.root]:
                folder.close()

    def _folder(self, name: str) -> SafeDir:
        """adapters/, plots/ or checkpoint/, made 0750 when first written (a refused session makes none)."""
        if name not in self.sub:
            self.sub[name] = self.root.sub(name, create=True, mode=0o750)
        return self.sub[name]

    def write_config(self, config: dict) -> None:
        """config.json, once: a run's config is never rewritten (changes go to config_changes.jsonl)."""
        try:
            self.root.write_atomic(rundir.CONFIG, json.dumps(redact(config), indent=1).encode(), exclusive=True)
        except RunDirError as err:
            raise RunDirError(f"{err}: a run's config is written once and never rewritten; continue the run with "
                              f"`lorabench resume {self.dir}` or choose another run.name") from None

    def record_config_changes(self, step: int, changes: dict[str, tuple]) -> None:
        """One row of allowed changes ({field: [old, new]}) made when continuing at `step`."""
        self._append(rundir.CONFIG_CHANGES, [{"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                               "changes": {k: list(v) for k, v in changes.items()}}])

    def _append(self, name: str, rows: list[dict]) -> None:
        self._end_with_newline(name)
        self.root.append(name, "".join(map(rundir.row_line, rows)).encode(), 0o640)   # not umask-dependent

    def _end_with_newline(self, name: str) -> None:
        """Never glue a row onto a torn one: a file not ending in a newline is repaired first."""
        if self.root.last_byte(name) in (b"", b"\n"):
            return
        scan = rundir.scan_in(self.root, name)
        if scan.torn:
            self.log(rundir.torn_note(scan))
            self.root.truncate(name, scan.end)
        else:
            self.root.append(name, b"\n")

    def log_metrics(self, rows: list[dict]) -> None:
        with self._writing:
            self._append(rundir.METRICS, rows)

    def commit(self, step: int, state: dict, adapter: FlatAdapter, rows: dict[str, list[dict]],
               save_adapter: bool) -> None:
        """The commit point of steps up to `step`: adapters/step_<n> (when due), the checkpoint, then the sync
        and rollout rows."""
        with self._writing:
            if save_adapter:
                adapter.save_into(self._folder(rundir.ADAPTERS), rundir.adapter_dir_name(step))
            host = adapter.to("cpu")
            payload = {**state, "step": step, "adapter_buffer": host.buffer,
                       "adapter_layout": host.layout.to_json(), "adapter_config": host.config, "rows": rows}
            if self.fingerprint is not None:
                payload["fingerprint"] = self.fingerprint
            folder = self._folder(rundir.CHECKPOINT_DIR)
            folder.write_atomic(rundir.CHECKPOINT.name, writer=lambda fh: torch.save(payload, fh))
            self.committed_step = step
            for name in (rundir.SYNC, rundir.ROLLOUTS):
                self._append(name, rows.get(name, []))

    def check_checkpoint(self, take=None) -> tuple[dict | None, FlatAdapter | None, rundir.RunDirState]:
        """The last checkpoint (None before the first), its adapter and what rundir.inspect found (for `repair`),
        once both it and `take(state, adapter)` accepted them; writes nothing."""
        found = rundir.inspect(self.dir)
        state = found.checkpoint
        adapter = None if state is None else FlatAdapter(state["adapter_buffer"],
                                                         AdapterLayout.from_json(state["adapter_layout"]),
                                                         state["adapter_config"], int(state["step"]))
        if take is not None and state is not None:
            take(state, adapter)
        return state, adapter, found

    def repair(self, found: rundir.RunDirState) -> None:
        """The files made to agree with the checkpoint `check_checkpoint` accepted (its notes logged)."""
        for note in found.notes:
            self.log(f"note: {note}")
        for repair in found.repairs:
            self.log(f"repair: {repair.note}")
            if repair.kind == "cut_torn_tail":
                self.root.truncate(repair.path.name, repair.end)
            else:   # append_rows, or add_newline (no rows): _append ends the last row with its newline first
                self._append(repair.path.name, repair.rows)
        if found.checkpoint is not None:
            self.committed_step = int(found.checkpoint["step"])

    def export_if_missing(self, adapter: FlatAdapter, last_step: int) -> None:
        """adapters/step_<n> written again from the checkpoint when due and missing, or there but unreadable."""
        name = rundir.adapter_dir_name(adapter.version)
        if self.root.expect(rundir.ADAPTERS, "dir") and self._folder(rundir.ADAPTERS).expect(name, "dir"):
            why = _unreadable_export(self._folder(rundir.ADAPTERS), name)
        else:
            why = " was missing" if self.settings.due(adapter.version, last_step)[1] else None
        if why:
            adapter.save_into(self._folder(rundir.ADAPTERS), name)
            self.log(f"repair: {rundir.ADAPTERS}/{name}{why}: exported again from the checkpoint")

    def metrics(self) -> list[dict]:
        return rundir.scan_in(self.root, rundir.METRICS).rows

    def evals(self) -> list[dict]:
        return rundir.scan_in(self.root, rundir.EVALS).rows

    def set_evals(self, step: int, rows: list[dict]) -> list[dict]:
        """Make `rows` the evaluations of `step`, replacing any a killed or repeated run left; returns all rows."""
        kept = [r for r in self.evals() if r.get("step") != step] + rows
        self.root.write_atomic(rundir.EVALS, "".join(map(rundir.row_line, kept)).encode())
        return kept

    def write_summary(self, summary: dict) -> None:
        self.root.write_atomic(rundir.SUMMARY, json.dumps(summary, indent=1).encode())

    def save_plots(self, images: dict[str, bytes]) -> list[Path]:
        """plots/<name>.png for each rendered figure (viz.run_plot_images)."""
        for name, png in images.items():
            self._folder(rundir.PLOTS).write_atomic(f"{name}.png", png)
        return [self.dir / rundir.PLOTS / f"{name}.png" for name in images]


def _unreadable_export(adapters: SafeDir, name: str) -> str | None:
    """Why adapters/<name> cannot be loaded (' lacks FILE', '/FILE cannot be read (...)'), or None. A repair
    replaces the whole folder, so one holding anything lorabench does not write there is refused instead."""
    with adapters.sub(name) as export:
        why = _export_problem(export)
        others = [n for n in export.names() if n not in rundir.ADAPTER_FILES]
    if why and others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise RunDirError(f"{export.path}{why}; the folder also holds {shown}, which lorabench does not write: "
                          f"exporting the adapter again from the checkpoint replaces the whole folder and would delete "
                          f"them, so lorabench did not change it. Move them out of {export.path} (or restore the "
                          f"adapter's files from a backup), then run the command again")
    return why


def _export_problem(export: SafeDir) -> str | None:
    from safetensors import SafetensorError
    from safetensors.torch import load
    for file, parse in ((CONFIG_NAME, json.loads), (WEIGHTS_NAME, load)):
        data = export.read_bytes(file)   # a link, a FIFO or an unreadable file: RunDirError, not repaired
        if data is None:
            return f" lacks {file}"
        try:
            parse(data)
        except (ValueError, SafetensorError) as err:
            return f"/{file} cannot be read ({type(err).__name__}: {str(err)[:100]})"
    return None


class NullRunLog:
    """RunLog's methods, writing nothing; spelled out, so a misspelled call fails instead of doing nothing."""
    dir = None

    def __init__(self, settings: RunSettings | None = None):
        self.settings = settings or RunSettings()

    def close(self, *args, **kwargs) -> None:
        """Does nothing, as log_metrics, commit, export_if_missing and repair."""

    log_metrics = commit = export_if_missing = repair = close

    def check_checkpoint(self, take=None):
        return None, None, None

    def metrics(self) -> list[dict]:
        return []

    evals = metrics
