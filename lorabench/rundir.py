"""Reading a run directory back without changing it (`inspect`), and the one-writer lock (`RunLock`).

`inspect` refuses, naming the file, line and a recovery, or returns the repairs that make the files agree
with the checkpoint; it writes nothing (docs/reliability.md §2a). Entries are read through safedir.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import pickle
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapters import CONFIG_NAME, LORA_DTYPE, WEIGHTS_NAME, AdapterError, AdapterLayout
from .datafiles import over_half_memory
from .metrics import SUMMARY_KEYS
from .safedir import RunDirError, SafeDir, pid_alive

# The run dir's layout; each name is written down here only, the other modules use these:
#   config.json           the full Config, written once when the run starts, never rewritten
#   config_changes.jsonl  allowed changes of a continued run (session/compat.py), appended, in order
#   metrics.jsonl         one row per GRPO step, slash-namespaced keys; sync.jsonl: one row per refresh bucket
#                         and one per refresh total; rollouts.jsonl: sampled completions with rewards and advantages
#   evals.jsonl           held-out evaluations (before / after); summary.json: the finished run's summary
#   adapters/step_<n>/    PEFT adapter dirs (PeftModel.from_pretrained); plots/*.png: figures
#   checkpoint/           trainer state for `lorabench resume` (atomic, latest step)
#   lock                  the writer's PID while one runs (RunLock)
CONFIG, CONFIG_CHANGES, SUMMARY = "config.json", "config_changes.jsonl", "summary.json"
METRICS, SYNC, ROLLOUTS, EVALS = "metrics.jsonl", "sync.jsonl", "rollouts.jsonl", "evals.jsonl"
ADAPTERS, PLOTS, CHECKPOINT_DIR = "adapters", "plots", "checkpoint"
FOLDERS = (ADAPTERS, PLOTS, CHECKPOINT_DIR)
CHECKPOINT = Path(CHECKPOINT_DIR) / "trainer_state.pt"
LOCK_NAME = "lock"
GROUP_FILE = "group.json"   # a policy group's dir: this file beside one run dir per policy (session/group.py)
ROW_FILES = (SYNC, ROLLOUTS, METRICS)   # the rows a checkpoint vouches for
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)   # what lorabench writes in adapters/step_<n> (PEFT's names)


def adapter_dir_name(step: int) -> str:
    """adapters/<this>: the PEFT dir of step `step`'s adapter (_ADAPTER_DIR reads it back)."""
    return f"step_{step}"


# the fields every checkpoint holds; others (a newer lorabench's) are kept, checked by their kind
_CHECKPOINT_KEYS = ("step", "optimizer", "torch_rng", "adapter_buffer", "adapter_layout", "adapter_config", "rows")
BEHIND = "adapter_behind_buffer"   # optional (grpo.max_staleness): the adapter one version before the checkpoint's
_RECOVER = "nothing in the run dir was changed"
_NEW_RUN = f"start a new run ({ADAPTERS}/{adapter_dir_name('<n>')} hold the trained adapters as PEFT dirs)"
_RESTORE = f"{_RECOVER}. Restore it from a backup and resume, or {_NEW_RUN}"


def clean(value):
    """JSON-safe: tensors to numbers, NaN/Inf to None (JSON has neither)."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def row_line(row: dict) -> str:
    return json.dumps(clean(row)) + "\n"


def _parse_row(raw: bytes) -> tuple[dict | None, str]:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 at byte {err.start}"
    except json.JSONDecodeError as err:
        return None, f"not JSON: {err}"
    return (row, "") if isinstance(row, dict) else (None, f"a JSON {type(row).__name__}, not an object")


@dataclass
class JsonlFile:
    """The rows of one run-dir JSONL file and what a kill may have left at its end."""
    path: Path
    rows: list[dict] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)   # line number of each row
    end: int = 0              # bytes up to the end of the last whole line
    tail: bytes = b""         # after the last newline: b"" normally
    tail_is_row: bool = False  # the tail is a whole row that only lacks its newline

    @property
    def torn(self) -> bool:
        return bool(self.tail) and not self.tail_is_row


def scan_jsonl(path: Path, data: bytes | None) -> JsonlFile:
    """Every row of `data`, read from `path` (None: a missing file, which has none). A bad line that is not the
    last raises RunDirError; a bad last line without its newline is the torn line of a kill."""
    scan = JsonlFile(Path(path))
    if not data:
        return scan
    scan.end = data.rfind(b"\n") + 1
    number = 0
    for number, raw in enumerate(data[:scan.end].split(b"\n")[:-1], 1):
        if not raw.strip():
            continue
        row, why = _parse_row(raw)
        if row is None:
            raise RunDirError(f"{path} line {number} is not a whole row ({why}); {_RECOVER}. The rows after it are "
                              f"intact: repair that line (from a backup) or delete it, then run the command again")
        scan.rows.append(row)
        scan.lines.append(number)
    scan.tail = data[scan.end:]
    if scan.tail.strip():
        row, _ = _parse_row(scan.tail)
        if row is not None:
            scan.rows.append(row)
            scan.lines.append(number + 1)
            scan.tail_is_row = True
    return scan


def scan_in(root: SafeDir, name: str) -> JsonlFile:
    return scan_jsonl(root.path / name, root.read_bytes(name))


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a run-dir JSONL file (a link is refused, not a parent), for readers: a torn last line is left out."""
    path = Path(path)
    try:
        parent = SafeDir(path.parent, os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    except FileNotFoundError:
        return []
    with parent:
        return scan_in(parent, path.name).rows


def read_checkpoint(run_dir: Path | SafeDir) -> dict | None:
    """checkpoint/trainer_state.pt, or None when there is none. weights_only: a run dir from
    someone else cannot run code when it is resumed."""
    if not isinstance(run_dir, SafeDir):
        with SafeDir.open(run_dir) as root:
            return read_checkpoint(root)
    path = run_dir.path / CHECKPOINT
    if not run_dir.expect(CHECKPOINT_DIR, "dir"):
        return None
    with run_dir.sub(CHECKPOINT_DIR) as folder:
        fd = folder.open_file(CHECKPOINT.name, os.O_RDONLY)
    if fd is None:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            state = torch.load(fh, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as err:
        raise RunDirError(f"{path} cannot be read ({type(err).__name__}: {str(err)[:120]}); {_RESTORE}") from err
    if problem := checkpoint_problem(state):
        raise RunDirError(f"{path}: {problem}; {_RESTORE}")
    return state


def checkpoint_problem(state) -> str | None:
    """The first field of a checkpoint resume could not use ("field 'X' ... (why)"), or None. Unknown fields
    are kept; any *_buffer is an adapter buffer (or, but adapter_buffer, None). Policy.load checks the rest."""
    if not isinstance(state, dict):
        return f"it holds {type(state).__name__}, not the dict of fields a checkpoint is"
    if missing := [k for k in _CHECKPOINT_KEYS if k not in state]:
        return f"it lacks the field(s) {missing} (written by another lorabench version?)"
    step, config, rows = state["step"], state["adapter_config"], state["rows"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"field 'step' is {_shown(step)}, not a step count"
    try:
        layout = AdapterLayout.from_json(state["adapter_layout"])
    except AdapterError as err:
        return f"field 'adapter_layout': {err}"
    if not isinstance(config, dict) or not isinstance(config.get("r"), int) or config["r"] < 1:
        return f"field 'adapter_config' is {_shown(config)}, not a PEFT LoRA config with a rank r >= 1"
    if not layout.names:
        return "field 'adapter_layout' names no tensor"
    for name, shape in zip(layout.names, layout.shapes):   # lora_A [r, in], lora_B [out, r]
        rank_dim = 0 if name.endswith("lora_A.weight") else 1 if name.endswith("lora_B.weight") else None
        if rank_dim is None or len(shape) != 2 or min(shape) < 1 or shape[rank_dim] != config["r"]:
            return (f"field 'adapter_layout' has {name} of shape {list(shape)}, not a LoRA tensor of the adapter "
                    f"config's rank r={config['r']}")
    try:   # a random state torch can restore (tried on a generator of its own)
        torch.Generator().set_state(state["torch_rng"])
    except (RuntimeError, TypeError) as err:
        return (f"field 'torch_rng' is {_shown(state['torch_rng'])}, which torch cannot restore as its random state "
                f"({err})")
    if found := optimizer_problem(state["optimizer"], layout):
        return found
    if not isinstance(rows, dict) or not all(isinstance(v, list) and all(isinstance(r, dict) for r in v)
                                             for v in rows.values()):
        return f"field 'rows' is {_shown(rows)}, not the rows of its steps ({{file name: [row, ...]}})"
    if not isinstance(fingerprint := state.get("fingerprint", {}), dict) or not all(
            isinstance(v, dict) for v in fingerprint.values()):
        return f"field 'fingerprint' is {_shown(fingerprint)}, not a dict of what the run was trained on"
    for key in [k for k in state if k.endswith("_buffer") and (k == "adapter_buffer" or state[k] is not None)]:
        buffer = state[key]
        if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.numel() != layout.numel:
            return f"field {key!r} is {_shown(buffer)}; the adapter layout needs one dimension of {layout.numel:,}"
        if buffer.dtype != LORA_DTYPE:   # a wider dtype could hold values the policy's cannot
            return (f"field {key!r} is {_shown(buffer)}, not the dtype of the policy's adapter "
                    f"({str(LORA_DTYPE).removeprefix('torch.')})")
        if not bool(torch.isfinite(buffer).all()):
            return f"field {key!r} holds NaN/Inf: that adapter diverged"
    return None


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


def optimizer_problem(optimizer, layout: AdapterLayout) -> str | None:
    """Why `optimizer` is not AdamW's state_dict over the adapter's tensors (one param group, each tensor once,
    a step count and finite moments of its shape), or None. Unnamed moments need one of the layout's shapes."""
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    moments = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(groups[0], dict) or not isinstance(
            moments, dict):
        return f"field 'optimizer' is {_shown(optimizer)}, not the state_dict of an optimizer of one param group"
    params, names = groups[0].get("params"), groups[0].get("param_names")
    params = params if isinstance(params, list) else [params]
    if sorted(map(str, params)) != sorted(map(str, range(len(layout.names)))):
        return (f"field 'optimizer' holds parameters {params[:8]}{' ...' if len(params) > 8 else ''}, not the "
                f"adapter's {len(layout.names)} tensors")
    if names is not None and (not isinstance(names, list) or sorted(names, key=str) != sorted(layout.names)):
        return f"field 'optimizer' names its parameters {_shown(names)}, not the adapter's tensors"
    shapes = dict(zip(layout.names, layout.shapes))
    for index, entry in moments.items():
        whose = names[params.index(index)] if names and index in params else None
        tensors = entry.items() if isinstance(entry, dict) else [("state", entry)]
        for name, value in tensors:
            if index not in params or not _is_moment(name, value, {shapes[whose]} if whose else set(layout.shapes)):
                return (f"field 'optimizer' has state {index} {name!r} = {_shown(value)}, not a moment of "
                        f"{f'{whose} {list(shapes[whose])}' if whose else 'an adapter tensor'}")
            if name != "step" and not bool(torch.isfinite(value).all()):
                return (f"field 'optimizer' has state {index} {name!r} holding NaN/Inf: every update from it would "
                        f"be NaN")
    return None


def _is_moment(name: str, value, shapes: set) -> bool:
    """AdamW's per-tensor state: its step count (a scalar) or a moment of one of the adapter's shapes."""
    if name == "step":   # a count: a negative or NaN one would scale every later update wrongly
        count = value if isinstance(value, (int, float)) else value.item() if isinstance(
            value, torch.Tensor) and value.numel() == 1 else None
        return count is not None and math.isfinite(count) and count >= 0
    return isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) in shapes


def _step(row: dict) -> int:
    step = row.get("step", 0)
    return step if isinstance(step, int) else 0


def _adapter_steps(root: SafeDir) -> list[int]:
    if not root.expect(ADAPTERS, "dir"):
        return []
    with root.sub(ADAPTERS) as adapters:
        names = adapters.names()
    return sorted(int(m.group(1)) for m in map(_ADAPTER_DIR.match, names) if m)


_ADAPTER_DIR = re.compile(r"^step_(\d+)$")
FILES = (CONFIG, CONFIG_CHANGES, *ROW_FILES, EVALS, SUMMARY, LOCK_NAME)
CHANGED_IN_PLACE = (CONFIG_CHANGES, *ROW_FILES, EVALS, LOCK_NAME)   # appended or truncated
SUBDIRS = {ADAPTERS: ("dir", _ADAPTER_DIR.match), CHECKPOINT_DIR: ("file", {CHECKPOINT.name}.__contains__),
           PLOTS: ("file", re.compile(r"^[^.].*\.png$").match)}


def _refuse_too_large(root: SafeDir, name: str) -> None:
    if over := over_half_memory(size := root.entry(name).st_size):
        raise RunDirError(f"{root.path / name} is {size:,} bytes, {over}, and resume reads it whole; {_RECOVER}. Is "
                          f"it this run's file? Restore it from a backup, or start a new run")


def check_entries(run_dir: Path | SafeDir) -> None:
    """Refuse any entry lorabench would open that is a link, of an unexpected kind, or (changed in place) a
    file with a second name; the run dir itself must not be a link either."""
    if not isinstance(run_dir, SafeDir):
        with SafeDir.open(run_dir) as root:
            return check_entries(root)
    for name in FILES:
        if run_dir.expect(name, "file", single=name in CHANGED_IN_PLACE):
            _refuse_too_large(run_dir, name)
    for name, (wanted, ours) in SUBDIRS.items():
        if run_dir.expect(name, "dir"):
            with run_dir.sub(name) as sub:
                for child in filter(ours, sub.names()):
                    sub.expect(child, wanted)
                    if name == CHECKPOINT_DIR:
                        _refuse_too_large(sub, child)
                    elif name == ADAPTERS:   # resume reads the export's files, and may replace the folder
                        with sub.sub(child) as export:
                            for file in ADAPTER_FILES:
                                export.expect(file, "file")


@dataclass
class Repair:
    """One change that makes a file agree with the checkpoint; `note` is what the log says."""
    path: Path
    kind: str                  # 'cut_torn_tail' | 'add_newline' | 'append_rows'
    note: str
    rows: list[dict] = field(default_factory=list)
    end: int = 0               # cut_torn_tail: the size the file is cut to


@dataclass
class RunDirState:
    """What `inspect` found: the checkpoint (None: no step committed) and what to do before continuing."""
    dir: Path
    checkpoint: dict | None
    repairs: list[Repair] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # warnings worth a line in the log

    @property
    def step(self) -> int:
        return int(self.checkpoint["step"]) if self.checkpoint else 0


def inspect(run_dir: Path) -> RunDirState:
    run_dir = Path(run_dir)
    with SafeDir.open(run_dir) as root:
        check_entries(root)
        files = {name: scan_in(root, name) for name in (*ROW_FILES, EVALS, CONFIG_CHANGES)}
        state = RunDirState(run_dir, read_checkpoint(root))
        adapters_ahead = [s for s in _adapter_steps(root) if s > state.step]
        # summary.json may be of trained steps: any but a zero-step run's (which is extended like any run)
        has_summary = root.expect(SUMMARY, "file") and (_parse_row(root.read_bytes(SUMMARY) or b"")[0] or {}).get(
            "steps") != 0
    for scan in files.values():
        if scan.torn:
            state.repairs.append(Repair(scan.path, "cut_torn_tail", end=scan.end, note=torn_note(scan)))
        elif scan.tail_is_row:
            state.repairs.append(Repair(scan.path, "add_newline", note=f"{scan.path.name}: ending its last row with a "
                                        f"newline"))
    if state.checkpoint is None:
        _refuse_work_without_checkpoint(run_dir, files, adapters_ahead, has_summary)
        return state
    if len(adapters_ahead) > 1:
        raise RunDirError(f"{run_dir / ADAPTERS} holds step_{adapters_ahead[0]} and step_{adapters_ahead[1]}, "
                          f"past the checkpoint's step {state.step} (a kill between an adapter dir and its checkpoint "
                          f"leaves one); {_RECOVER}. Was {CHECKPOINT} restored from an older backup? Restore the "
                          f"matching one, or start a new run")
    for name in ROW_FILES:
        if missing := _rows_missing(files[name], state.checkpoint["rows"].get(name, []), state.step):
            steps = sorted({_step(r) for r in missing})
            state.repairs.append(Repair(files[name].path, "append_rows", rows=missing, note=(
                f"{name}: appending the {len(missing)} row(s) of step(s) {steps} that the checkpoint holds (the run "
                f"was stopped between its checkpoint and these rows)")))
    have = {_step(r) for r in (*files[METRICS].rows, *state.checkpoint["rows"].get(METRICS, []))}
    gaps = [s for s in range(1, max(have, default=0) + 1) if s not in have]
    if gaps:   # a corrupt line deleted by hand: noted, not refused
        state.notes.append(f"{METRICS} has no row for step(s) {gaps[:10]}{' ...' if len(gaps) > 10 else ''}; plots "
                           f"and the summary skip them")
    for line, row in zip(files[METRICS].lines, files[METRICS].rows):   # edited by hand: noted, as a gap is
        if lacking := [key for key in SUMMARY_KEYS if not isinstance(row.get(key), (int, float))]:
            state.notes.append(f"{files[METRICS].path} line {line} (step {_step(row)}) has no number for {lacking}; "
                               f"plots and the summary skip that row for them")
    return state


def check_before_evals(run_dir: Path, step: int) -> None:
    """A session continuing a run at `step` > 0 needs its two step-0 (before GRPO) evaluations."""
    with SafeDir.open(run_dir) as root:
        scan = scan_in(root, EVALS)
    if step > 0 and len([r for r in scan.rows if _step(r) == 0]) < 2:
        raise RunDirError(f"{scan.path} lacks the step-0 (before GRPO) evaluations of a run at step {step}; "
                          f"{_RECOVER}. Restore the file from a backup, or start a new run")


def torn_note(scan: JsonlFile) -> str:
    return (f"{scan.path.name}: removing a torn last line ({len(scan.tail)} bytes without a newline, cut off by a "
            f"kill mid-write): {scan.tail[:60]!r}")


def _refuse_work_without_checkpoint(run_dir: Path, files: dict, adapters: list[int], has_summary: bool) -> None:
    """No checkpoint is fine before the first commit; beside committed steps' work, step 0 would mix two runs."""
    evidence = [f"{name}: {len(files[name].rows)} rows" for name in ROW_FILES if files[name].rows]
    if later_evals := [r for r in files[EVALS].rows if _step(r) > 0]:
        evidence.append(f"{EVALS}: evaluations at step {_step(later_evals[-1])}")
    if len(adapters) > 1:
        evidence.append(f"{ADAPTERS}/step_{adapters[0]}..step_{adapters[-1]}")
    if has_summary:
        evidence.append(SUMMARY)
    if evidence:
        raise RunDirError(f"{run_dir} has no checkpoint ({CHECKPOINT} is missing) but holds the work of earlier steps "
                          f"({'; '.join(evidence)}); continuing would start again at step 0 beside them, so "
                          f"{_RECOVER}. Restore {CHECKPOINT} from a backup and resume, or {_NEW_RUN}")


def _rows_missing(scan: JsonlFile, held: list[dict], step: int) -> list[dict]:
    """The checkpoint's rows `scan` lacks at its end; refuses rows past it or unlike its copies, and steps out
    of order or logged twice."""
    steps = [_step(r) for r in scan.rows]
    for i in range(1, len(steps)):
        if steps[i] < steps[i - 1] or (scan.path.name == METRICS and steps[i] == steps[i - 1]):
            first = scan.lines[steps.index(steps[i])]
            raise RunDirError(f"{scan.path} line {scan.lines[i]} repeats or goes back to step {steps[i]} (first at "
                              f"line {first}): two processes wrote this run dir, or rows were copied in; {_RECOVER}. "
                              f"Keep one copy of each step's rows (by hand), or start a new run")
    if past := [(line, s) for line, s in zip(scan.lines, steps) if s > step]:
        raise RunDirError(f"{scan.path} line {past[0][0]} holds step {past[0][1]}, past the checkpoint's step {step}: "
                          f"the checkpoint is older than the rows (restored from a backup?); {_RECOVER}. Restore the "
                          f"matching {CHECKPOINT}, or start a new run")
    first_held = min((_step(r) for r in held), default=step + 1)
    window = [(line, row) for line, row in zip(scan.lines, scan.rows) if _step(row) >= first_held]
    for (line, row), copy in zip(window, held):   # equal on every key of the copy (as JSON): the metrics row
        if any(k not in row or row[k] != v for k, v in json.loads(row_line(copy)).items()):   # gains time/* later
            raise RunDirError(f"{scan.path} line {line} (step {_step(row)}) differs from the row the checkpoint holds "
                              f"for it; {_RECOVER}. Restore the file or the checkpoint from a backup, or start a new "
                              f"run")
    if len(window) > len(held):
        line, row = window[len(held)]
        raise RunDirError(f"{scan.path} line {line} (step {_step(row)}) is one row more than the checkpoint holds for "
                          f"its steps; {_RECOVER}. Remove the extra rows by hand, or start a new run")
    return held[len(window):]


def _lock_holder(fd: int) -> int | None:
    text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _in_use(run_dir: Path, pid: int | None) -> RunDirError:
    who = f"process {pid}" if pid else "another process (its PID is not written yet)"
    if pid == os.getpid():
        who += ", this process: close the other RunSession on this run dir first"
    stop = f"stop it (kill {pid})" if pid else "stop it"
    return RunDirError(f"{run_dir} is in use by {who}; one writer per run dir (two would interleave their rows). "
                       f"Wait for it to finish, or {stop}, then run the command again")


def lock_holder(run_dir: Path) -> RunDirError | None:
    """Whether another writer holds the run dir's lock (read-only: the lock file is not changed)."""
    with SafeDir.open(run_dir) as root:
        try:
            fd = root.open_file(LOCK_NAME, os.O_RDONLY)
        except RunDirError as err:   # not readable: another user's run dir
            return err
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _in_use(Path(run_dir), _lock_holder(fd))
    finally:
        os.close(fd)


class RunLock:
    """An fcntl.flock on RUN/lock held by the one writer, on a read-only fd (the PID is written through a
    short-lived one); `release()` or its death frees it. A killed writer's lock is reclaimed with a note."""

    def __init__(self, run_dir: Path | SafeDir, log=print):
        self.root = run_dir if isinstance(run_dir, SafeDir) else SafeDir.open(run_dir)
        self.path = self.root.path / LOCK_NAME
        deadline = time.monotonic() + 1.0   # rides out another process's read-only probe (lock_holder)
        while True:
            existed = self.root.entry(LOCK_NAME) is not None
            self.fd = self.root.open_own(LOCK_NAME, os.O_RDONLY | os.O_CREAT, 0o640)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                err = _in_use(self.root.path, _lock_holder(self.fd)) if time.monotonic() > deadline else None
                os.close(self.fd)
                if err:
                    raise err from None
                time.sleep(0.05)
                continue
            if self._named():
                break
            os.close(self.fd)   # removed (a refused writer's) or replaced since it was opened: open it again
        self.found = os.pread(self.fd, os.fstat(self.fd).st_size, 0) if existed else None   # a refusal puts it back
        previous = _lock_holder(self.fd)   # a clean exit empties the file: a PID here was killed
        if previous and previous != os.getpid():
            state = "no longer running" if not pid_alive(previous) else "no longer holding it"
            log(f"{self.root.path}: reclaimed the lock of process {previous} ({state}; killed?)")
        try:
            self._write(f"{os.getpid()}\n".encode())
        except (OSError, RunDirError):
            self.release(restore=True)
            raise

    def _named(self, fd: int | None = None) -> bool:
        """Whether RUN/lock is (still) the file the flock is on, or the same file as `fd`."""
        st, held = (os.fstat(fd) if fd is not None else self.root.entry(LOCK_NAME)), os.fstat(self.fd)
        return st is not None and (st.st_ino, st.st_dev) == (held.st_ino, held.st_dev)

    def _write(self, data: bytes) -> None:
        with self.root.editing(LOCK_NAME, os.O_WRONLY) as fd:
            if not self._named(fd):
                raise RunDirError(f"{self.path} was replaced while this process held it; one writer per run dir "
                                  f"cannot be guaranteed: stop the other writer, then run the command again")
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)

    def release(self, restore: bool = False) -> None:
        """Emptied (a clean exit), or with `restore` (a refusal) as it was found, removed if it was not there."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError, RunDirError):   # a full or read-only disk must not hide why a run stopped
            if not restore or self.found is not None:
                self._write(self.found if restore else b"")
            elif self._named():
                os.unlink(LOCK_NAME, dir_fd=self.root.fd)
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
