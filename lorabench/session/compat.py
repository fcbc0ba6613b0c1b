"""Which config fields a continued run may change (`lorabench resume RUN k=v`, or `lorabench run`
naming an existing run dir), decided where each field is defined: `setting(..., resume=ALLOWED|REFUSED,
why=...)` (settings.py), so a new field follows these rules from the line that defines it.

REFUSED: what makes the experiment (base model and tokenizer, adapter shape, data stream and seed,
objective): a change would train the saved adapter on something else or make rows before and after
incomparable; refused naming the field, both values and what to do instead. ALLOWED (how long, how
executed, logged or evaluated): appended to RUN/config_changes.jsonl; config.json is never rewritten,
and the effective config is config.json with those rows applied in order. run.out_dir and run.name
only say where the run dir is: not compared, taken from where it is now, refused as overrides.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..rundir import CONFIG, CONFIG_CHANGES, RunDirError, scan_in
from ..safedir import SafeDir
from ..settings import ALLOWED as _ALLOWED
from .config import (
    Config,
    ConfigError,
    apply_override,
    flat,
    parse_config_bytes,
    path_component_problem,
)
from .config import every_key as _every_key
from .config import field_of as _field_of

LOCATION = ("run.out_dir", "run.name")


def decisions() -> dict[str, tuple[str, str]]:
    """{key: (resume, why)} for every field of the composed config, as its section declares it
    (settings.setting); read when asked, so a part registered later is included."""
    return {key: (f.metadata["resume"], f.metadata["why"]) for key in _every_key()
            for f in [_field_of(key)] if f is not None}


def refused() -> dict[str, str]:
    """The fields a continued run may not change, and why."""
    return {k: why for k, (resume, why) in decisions().items() if resume != _ALLOWED}


def allowed() -> dict[str, str]:
    """The fields a continued run may change (where the run dir is aside), and why."""
    return {k: why for k, (resume, why) in decisions().items() if resume == _ALLOWED and k not in LOCATION}


def effective_config(run_dir: Path, changes: bool = True) -> Config:
    """The run's config now: config.json with the allowed changes of config_changes.jsonl applied
    (`changes=False`: config.json alone, as the run was started). Both are read through the run dir
    itself (safedir.py: a link in their place is refused)."""
    run_dir = Path(run_dir)
    try:
        root = SafeDir.open(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise RunDirError(f"{run_dir} does not exist; pass a run dir that `lorabench run` wrote (it prints "
                          f"'run dir: ...')") from None
    with root:
        raw = root.read_bytes(CONFIG)
        if raw is None:
            raise RunDirError(f"{run_dir} is not a lorabench run dir: it has no config.json; pass a run dir written "
                              f"by lorabench (`lorabench run` prints 'run dir: ...')")   # a run there may be refused
        data = parse_config_bytes(raw, run_dir / CONFIG)
        scan = scan_in(root, CONFIG_CHANGES)
        rows = [_change_row(run_dir, line, row) for line, row in zip(scan.lines, scan.rows)] if changes else []
    if isinstance(data.get("run"), dict):   # where the run dir is now (it may have been moved or renamed)
        name_ok = path_component_problem(run_dir.name) is None
        data["run"].update(out_dir=str(run_dir.parent), name=run_dir.name if name_ok else "")
    data = Config.from_dict(data, source=str(run_dir / CONFIG)).to_dict()
    for row in rows:
        for key, (_, new) in row.items():
            *path, name = key.split(".")
            table = data
            for part in path:
                table = table.setdefault(part, {})
            table[name] = new
    return Config.from_dict(data, source=f"{run_dir / 'config.json'} + config_changes.jsonl")


def _change_row(run_dir: Path, line: int, row: dict) -> dict:
    """A config_changes.jsonl row's changes, {field: [old, new]} as record_config_changes appends them."""
    found = row.get("changes", {})
    if not isinstance(found, dict) or not all(isinstance(v, list) and len(v) == 2 for v in found.values()):
        raise RunDirError(f"{run_dir / CONFIG_CHANGES} line {line}: 'changes' is {str(found)[:60]}, not the "
                          f"{{field: [old, new]}} lorabench appends; nothing in the run dir was changed. Repair that "
                          f"line (from a backup) or delete it, then run the command again")
    return found


def resume_config(run_dir: Path, overrides: list[str]) -> Config:
    """The config `lorabench resume RUN overrides` asks for: the effective config plus overrides."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in LOCATION:
            raise ConfigError(f"override {item!r}: a continued run stays in its dir ({run_dir}); to continue a copy "
                              f"elsewhere, copy the run dir and resume the copy")
        if key == "policies":   # a group's are in its group.json, each policy's settings in its own run dir
            raise ConfigError(f"override {item:.80}: a continued run keeps its policies; for other policies start a "
                              f"new run (lorabench run ... run.name=NEW 'policies=[...]')")
    data = json.loads(json.dumps(effective_config(run_dir).to_dict()))
    for item in overrides:
        apply_override(data, item)
    return Config.from_dict(data, source="overrides")


def new_run_command(run_dir: Path, *overrides: str) -> str:
    """The command that starts a new run from this run dir's config (a refused change's way out)."""
    return shlex.join(["lorabench", "run", "--config", str(Path(run_dir) / CONFIG), "run.name=NEW", *overrides])


def changes(old: Config, new: Config) -> dict[str, tuple]:
    """{field: (old, new)} for every field that differs, location fields aside."""
    before, after = flat(old), flat(new)
    return {k: (before[k], after[k]) for k in before if k not in LOCATION and before[k] != after[k]}


def check_continuation(run_dir: Path, old: Config, new: Config, at_step: int) -> dict[str, tuple]:
    """The allowed changes from `old` (the run's effective config) to `new`; refused ones raise
    RunDirError naming every refused field, both values and the way out."""
    diff, may_change, reasons = changes(old, new), allowed(), refused()
    refused_diff = {k: v for k, v in diff.items() if k not in may_change}
    if refused_diff:
        listed = "; ".join(f"{k} {a!r} -> {b!r} ({reasons.get(k, 'not decided as safe to change')})"
                           for k, (a, b) in refused_diff.items())
        overrides = [f"{k}={json.dumps(b) if not isinstance(b, str) else b}" for k, (_, b) in refused_diff.items()]
        raise RunDirError(f"{run_dir} cannot continue with a changed {listed}; nothing was changed. Start a new run "
                          f"for that ({new_run_command(run_dir, *overrides)}), or continue without those overrides")
    if "grpo.steps" in diff and diff["grpo.steps"][1] < at_step:
        raise RunDirError(f"{run_dir} is at step {at_step}; grpo.steps={diff['grpo.steps'][1]} would end it before "
                          f"that; nothing was changed. Pass grpo.steps >= {at_step}")
    return diff
