"""Which config fields a continued run may change, decided where each field is defined:
`setting(..., resume=ALLOWED|REFUSED, why=...)` (settings.py).

REFUSED: what makes the experiment (model, adapter shape, data, seed, objective); refused naming the
field, both values and what to do instead. ALLOWED (how long, how executed, logged or evaluated):
appended to RUN/config_changes.jsonl; config.json is never rewritten, and the effective config is
config.json with those rows applied in order. run.out_dir and run.name only say where the run dir is:
not compared, taken from where it is now, refused as overrides.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..rundir import CONFIG, CONFIG_CHANGES, RunDirError, scan_in
from ..safedir import SafeDir
from ..settings import ALLOWED
from . import config
from .config import Config, ConfigError, apply_override, flat

LOCATION = ("run.out_dir", "run.name")


def decisions() -> dict[str, tuple[str, str]]:
    """{key: (resume, why)} for every field of the composed config (read when asked: a part registered later
    is included)."""
    return {key: (f.metadata["resume"], f.metadata["why"]) for key in config.every_key()
            for f in [config.field_of(key)] if f}


def refused() -> dict[str, str]:
    return {k: why for k, (resume, why) in decisions().items() if resume != ALLOWED}


def allowed() -> dict[str, str]:
    return {k: why for k, (resume, why) in decisions().items() if resume == ALLOWED and k not in LOCATION}


def effective_config(run_dir: Path, changes: bool = True) -> Config:
    """The run's config now: config.json with config_changes.jsonl applied (`changes=False`: config.json
    alone), both read through the run dir itself."""
    run_dir = Path(run_dir)
    try:
        root = SafeDir.open(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise RunDirError(f"{run_dir} does not exist; pass a run dir that `lorabench run` wrote (it prints "
                          f"'run dir: ...')") from None
    with root:
        raw = root.read_bytes(CONFIG)
        if raw is None:
            raise RunDirError(f"{run_dir} is not a lorabench run dir: it has no {CONFIG}; pass a run dir written "
                              f"by lorabench (`lorabench run` prints 'run dir: ...')")   # a run there may be refused
        data = config.parse_config_bytes(raw, run_dir / CONFIG)
        scan = scan_in(root, CONFIG_CHANGES)
        rows = [_change_row(run_dir, line, row) for line, row in zip(scan.lines, scan.rows)] if changes else []
    if isinstance(data.get("run"), dict):   # where the run dir is now (it may have been moved or renamed)
        name_ok = config.path_component_problem(run_dir.name) is None
        data["run"].update(out_dir=str(run_dir.parent), name=run_dir.name if name_ok else "")
    data = Config.from_dict(data, source=str(run_dir / CONFIG)).to_dict()
    for row in rows:
        for key, (_, new) in row.items():
            *path, name = key.split(".")
            table = data
            for part in path:
                table = table.setdefault(part, {})
            table[name] = new
    return Config.from_dict(data, source=f"{run_dir / CONFIG} + {CONFIG_CHANGES}")


def _change_row(run_dir: Path, line: int, row: dict) -> dict:
    found = row.get("changes", {})
    if not isinstance(found, dict) or not all(isinstance(v, list) and len(v) == 2 for v in found.values()):
        raise RunDirError(f"{run_dir / CONFIG_CHANGES} line {line}: 'changes' is {str(found)[:60]}, not the "
                          f"{{field: [old, new]}} lorabench appends; nothing in the run dir was changed. Repair that "
                          f"line (from a backup) or delete it, then run the command again")
    return found


def resume_config(run_dir: Path, overrides: list[str]) -> Config:
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
    return shlex.join(["lorabench", "run", "--config", str(Path(run_dir) / CONFIG), "run.name=NEW", *overrides])


def changes(old: Config, new: Config) -> dict[str, tuple]:
    before, after = flat(old), flat(new)
    return {k: (before[k], after[k]) for k in before if k not in LOCATION and before[k] != after[k]}


def check_continuation(run_dir: Path, old: Config, new: Config, at_step: int) -> dict[str, tuple]:
    """The allowed changes from `old` (the run's effective config) to `new`; refused ones raise RunDirError."""
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
