"""What a continued run may change and what it must match.

Each field's `setting(..., resume=ALLOWED|REFUSED, why=...)` decides whether it may change (settings.py);
allowed changes are appended to config_changes.jsonl, config.json is never rewritten. Every checkpoint
records a fingerprint (the refused fields, the data files' and model files' size and sha256) that a
continued run must match; docs/reliability.md §2b says what is not seen.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import shlex
import stat
from pathlib import Path

from ..data import step_problems, synthetic_problems
from ..rundir import CONFIG, CONFIG_CHANGES, GROUP_FILE, RunDirError, scan_in
from ..safedir import SafeDir
from ..settings import ALLOWED, walk_class
from . import config
from .config import Config, ConfigError, apply_override, flat

LOCATION = ("run.out_dir", "run.name")


def decisions() -> dict[str, tuple[str, str]]:
    """{key: (resume, why)} for every field of the composed config (read when asked)."""
    return {key: (f.metadata["resume"], f.metadata["why"]) for name, cls in config.SECTIONS.items()
            for key, f in walk_class(cls, name)}


def refused() -> dict[str, str]:
    return {k: why for k, (resume, why) in decisions().items() if resume != ALLOWED}


def allowed() -> dict[str, str]:
    return {k: why for k, (resume, why) in decisions().items() if resume == ALLOWED and k not in LOCATION}


def effective_config(run_dir: Path, changes: bool = True) -> Config:
    """The run's config now: config.json with config_changes.jsonl applied (`changes=False`: without)."""
    run_dir = Path(run_dir)
    try:
        root = SafeDir.open(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise RunDirError(f"{run_dir} does not exist; pass a run dir that `lorabench run` wrote (it prints "
                          f"'run dir: ...')") from None
    with root:
        raw = root.read_bytes(CONFIG)
        if raw is None and (runs := _run_dirs_in(root)):
            raise RunDirError(f"{run_dir} is not a run dir: it has no {CONFIG} but holds the run dirs {runs[:5]} "
                              f"(the runs' parent dir, or a policy group whose {GROUP_FILE} is gone); nothing was "
                              f"changed. Resume one of them (lorabench resume {run_dir / runs[0]}), or restore the "
                              f"group's {GROUP_FILE} from a backup to continue the group")
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


def _run_dirs_in(root: SafeDir) -> list[str]:
    """The entries of `root` that are directories (not links) holding a config.json."""
    found = []
    for name in root.names():
        entry = root.entry(name)
        if entry is not None and stat.S_ISDIR(entry.st_mode):
            with contextlib.suppress(RunDirError), root.sub(name) as sub:   # an unreadable one is not listed
                if sub.entry(CONFIG) is not None:
                    found.append(name)
    return found


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
    if refused_diff := {k: v for k, v in diff.items() if k not in may_change}:
        listed = "; ".join(f"{k} {a!r} -> {b!r} ({reasons.get(k, 'not decided as safe to change')})"
                           for k, (a, b) in refused_diff.items())
        overrides = [f"{k}={json.dumps(b) if not isinstance(b, str) else b}" for k, (_, b) in refused_diff.items()]
        raise RunDirError(f"{run_dir} cannot continue with a changed {listed}; nothing was changed. Start a new run "
                          f"for that ({new_run_command(run_dir, *overrides)}), or continue without those overrides")
    if "grpo.steps" in diff and diff["grpo.steps"][1] < at_step:
        raise RunDirError(f"{run_dir} is at step {at_step}; grpo.steps={diff['grpo.steps'][1]} would end it before "
                          f"that; nothing was changed. Pass grpo.steps >= {at_step}")
    return diff


WHOLE_LIMIT = 64 << 20
SAMPLES, SAMPLE_BYTES = 16, 1 << 20
# file name prefixes (lower case) that do not define the model: docs, hidden files, the tiny model's recipe note
_NOT_MODEL = ("readme", "license", "notice", ".", "lorabench_recipe")


def file_fingerprint(path: Path) -> dict | None:
    """{path, bytes, sha256[, sampled]} of a file (None if missing): whole up to WHOLE_LIMIT, else SAMPLES
    blocks spread evenly (the first and the last included)."""
    path = Path(path).expanduser().absolute()
    if not path.is_file():
        return None
    size, digest = path.stat().st_size, hashlib.sha256()
    with open(path, "rb") as fh:
        if size <= WHOLE_LIMIT:
            for block in iter(lambda: fh.read(SAMPLE_BYTES), b""):
                digest.update(block)
        else:
            step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
            for k in range(SAMPLES):
                fh.seek(k * step)
                digest.update(fh.read(SAMPLE_BYTES))
    return {"path": str(path), "bytes": size, "sha256": digest.hexdigest(),
            **({"sampled": True} if size > WHOLE_LIMIT else {})}


def data_fingerprint(cfg) -> dict:
    out = {}
    for field, source in (("data.source", cfg.data.source), ("data.eval_source", cfg.data.eval_source)):
        if source == "synthetic":
            problems = step_problems(cfg.run.seed, 1, 4) + synthetic_problems(4, f"eval-{cfg.run.seed}")
            text = json.dumps([[p.question, p.answer] for p in problems], ensure_ascii=False)
            out[field] = {"synthetic": hashlib.sha256(text.encode()).hexdigest()}
        elif source == "hub":
            out[field] = {"hub": "openai/gsm8k"}
        elif source:
            out[field] = file_fingerprint(Path(source))
    return out


def model_fingerprint(cfg, model_path: str) -> dict:
    """A local or tiny model dir's files; a hub model's repo id and its cached snapshot's commit."""
    name = cfg.model.name_or_path
    folder = Path(model_path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import try_to_load_from_cache
        cached = try_to_load_from_cache(name, "config.json")
        return {"name": name, "revision": Path(cached).parent.name if isinstance(cached, str) else None}
    return {"name": name, "files": {p.name: _without_path(file_fingerprint(p))
                                    for p in sorted(folder.iterdir())
                                    if p.is_file() and not p.name.lower().startswith(_NOT_MODEL)}}


def experiment_fingerprint(cfg, model_path: str) -> dict:
    fields = flat(cfg)
    return {"config": {k: fields[k] for k in refused()}, "data": data_fingerprint(cfg),
            "model": model_fingerprint(cfg, model_path)}


def _new_run_hint(run_dir: Path) -> str:
    return f"start a new run for it ({new_run_command(run_dir)})"


def check_config(recorded: dict, effective, run_dir: Path, step: int) -> None:
    """The run dir's effective config must be what the checkpoint was trained with, field by field."""
    now = flat(effective)
    for key, then in recorded.get("config", {}).items():
        if key in now and json.dumps(now[key]) != json.dumps(then):
            raise RunDirError(f"{Path(run_dir) / CONFIG} has {key}={now[key]!r}, but its checkpoint (step {step}) "
                              f"was trained with {key}={then!r} (was {CONFIG} edited?); nothing was changed. Put "
                              f"{key} back to {json.dumps(then)} in {CONFIG}, or {_new_run_hint(run_dir)}")


def _describe(fp: dict | None) -> str:
    if fp is None:
        return "missing"
    if "sha256" in fp:
        return f"{fp['bytes']:,} bytes, sha256 {fp['sha256'][:12]}{' (sampled)' if fp.get('sampled') else ''}"
    return json.dumps(fp)


def _without_path(fp: dict | None) -> dict | None:
    return {k: v for k, v in fp.items() if k != "path"} if isinstance(fp, dict) else fp


def check_data(recorded: dict, cfg, run_dir: Path, step: int) -> None:
    now = data_fingerprint(cfg)
    for field, then in recorded.get("data", {}).items():
        current = now.get(field)
        if _without_path(current) == _without_path(then):
            continue
        value = getattr(cfg.data, field.split(".")[1])
        where = f" ({current['path']})" if current else f" (relative to {Path.cwd()})"
        then_where = f" at {then['path']}" if isinstance(then, dict) and "path" in then else ""
        raise RunDirError(f"{field}={value!r}{where} is not the data the checkpoint (step {step}) of {run_dir} was "
                          f"trained on: {_describe(current)} now, {_describe(then)} then{then_where}; nothing was "
                          f"changed. Restore that file (or run from the directory the run was started in), or "
                          f"{_new_run_hint(run_dir)}")


def check_model(recorded: dict, current: dict, cfg, run_dir: Path, step: int) -> None:
    then_files, now_files = recorded.get("files"), current.get("files")
    differences = []
    if recorded.get("revision") and current.get("revision") and recorded["revision"] != current["revision"]:
        differences.append(f"the hub commit is {current['revision']} now, {recorded['revision']} then")
    if then_files is not None and now_files is not None:
        for name in sorted(set(then_files) | set(now_files)):
            if then_files.get(name) != now_files.get(name):
                differences.append(f"{name} is {_describe(now_files.get(name))} now, "
                                   f"{_describe(then_files.get(name))} then")
    if differences:
        more = f" (and {len(differences) - 1} more file(s))" if len(differences) > 1 else ""
        raise RunDirError(f"model.name_or_path={cfg.model.name_or_path!r} is not the model the checkpoint (step "
                          f"{step}) of {run_dir} was trained on: {differences[0]}{more}; nothing was changed. "
                          f"Restore that model, or {_new_run_hint(run_dir)}")
