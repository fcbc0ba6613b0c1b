"""What defines an experiment, recorded in every checkpoint, so that resume proves what it continues.

A fingerprint is plain JSON-like data: "config", every field compat.refused as trained; "data", per
data field its file's size and sha256 (synthetic: a sha256 of its first problems; 'hub': the name);
"model", the model dir's files by size and sha256 (sampled above WHOLE_LIMIT), or a hub model's repo
id and cached commit. A difference is refused naming the field or file and both values; paths are
for the message only (a moved file is the same data). docs/reliability.md §2b says what is not seen.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..rundir import CONFIG, RunDirError
from .compat import new_run_command, refused
from .config import flat

WHOLE_LIMIT = 64 << 20
SAMPLES, SAMPLE_BYTES = 16, 1 << 20
# file name prefixes (lower case) that do not define the model: docs, hidden files, the tiny model's
# recipe note (its weights and tokenizer are compared; the note names the lorabench version)
_NOT_MODEL = ("readme", "license", "notice", ".", "lorabench_recipe")


def file_fingerprint(path: Path) -> dict | None:
    """{path, bytes, sha256[, sampled]} of a file (None if missing): the sha256 of its bytes, whole up to
    WHOLE_LIMIT, else of SAMPLES blocks spread evenly (the first and the last included)."""
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
    from ..data import step_problems, synthetic_problems
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
    """A local or tiny model dir's files; a hub model's repo id and its cached snapshot's commit (its files
    arrive as they are first used: the commit names them all)."""
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


# --- comparisons ---------------------------------------------------------------------------------------
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
