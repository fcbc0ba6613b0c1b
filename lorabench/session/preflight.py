"""Checks that need the environment, run before a run dir is created or a model is built: the engine
is installed, the dirs a run writes are writable, the model is usable, the run's size fits the
machine (sizes.py), and every dataset row is readable and its prompt fits. Nothing is written in the
run dir or the model cache (a hub tokenizer and dataset are fetched into their caches, as the run would).
"""
from __future__ import annotations

import os
from pathlib import Path

from ..data import check_source_paths, load_gsm8k, overlong_prompts, step_problems, synthetic_problems
from ..datafiles import DataError
from ..engines import engine_class
from ..models import ModelRef, model_config, model_context, model_ref, model_tokenizer
from ..refresh import REFRESH_MODES
from ..rundir import FOLDERS
from ..settings import walk
from .config import SECTIONS, Config, ConfigError
from .sizes import ModelShape, check_sizes


def preflight(cfg: Config, run_dir: Path | None = None, continued: bool = False, log=print) -> ModelRef:
    """Everything below; returns what model.name_or_path names. `run_dir`: the run dir the run will write
    (continued=True: an existing run), None for a new one under run.out_dir."""
    # each engine knows what it needs (packages, a GPU), also for the capabilities the refresh mode uses
    engine_class(cfg.engine.backend).check_available(cfg.engine.chosen, REFRESH_MODES[cfg.refresh.mode].needs)
    cpus = len(os.sched_getaffinity(0))
    if cfg.run.threads > cpus:   # more only slows torch down; very many crash it (a segfault at 100000)
        raise ConfigError(f"run.threads={cfg.run.threads}: this process may use {cpus} CPU(s); set run.threads <= "
                          f"{cpus}, or 0 (auto: as many as the load average leaves free)")
    check_dirs(cfg, run_dir, continued)
    ref = model_ref(cfg.model)
    if ref.kind == "tiny":
        from ..tiny import TINY_ARCH, TINY_VOCAB
        shape = ModelShape.of({**TINY_ARCH, "vocab_size": TINY_VOCAB})
    else:
        try:
            shape = ModelShape.of(model_config(ref))   # no weights are read
        except (TypeError, ValueError):   # a decoder field missing (None) or not a number: sizes not estimated
            shape = None
    if shape is not None:
        check_sizes(cfg, shape, engine_class(cfg.engine.backend).device_of(cfg.engine.chosen),
                    warm_start=tiny_to_build(cfg) and cfg.warmstart.steps > 0)
    check_prompts(cfg, ref, log)
    return ref


def tiny_to_build(cfg: Config) -> bool:
    from ..tiny import tiny_cache_path
    return cfg.model.name_or_path == "tiny" and not (
        tiny_cache_path(cfg.model.cache_dir, cfg.warmstart, cfg.run.seed) / "config.json").is_file()


def _unwritable(folder: Path) -> str | None:
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "is on a read-only filesystem"
    return None if os.access(folder, os.W_OK | os.X_OK) else "is not writable by this user"


def _writable(path: str | Path, field: str) -> None:
    probe = Path(path).expanduser().absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{field}={str(path)!r}: {probe} is a file, not a directory; point {field} at a directory")
    why = _unwritable(probe)
    if why:
        raise ConfigError(f"{field}={str(path)!r}: {probe} {why}; point {field} at a writable directory")


def check_dirs(cfg: Config, run_dir: Path | None = None, continued: bool = False) -> None:
    if run_dir is not None and Path(run_dir).is_dir():   # it (a mount point, say) and its folders must be writable
        for folder in (Path(run_dir), *(Path(run_dir) / sub for sub in FOLDERS)):
            why = _unwritable(folder) if folder.is_dir() else None   # rundir.check_entries refused links already
            if why:
                fix = ("copy the run dir to a writable place and resume the copy" if continued else
                       "choose another run.name or run.out_dir")
                which = f"the run dir {run_dir}" + ("" if folder == Path(run_dir) else f": its folder {folder.name}/")
                raise ConfigError(f"{which} {why}, and a run writes its rows and checkpoints there; {fix}")
    else:   # a new run dir is made in run.out_dir
        _writable(cfg.run.out_dir, "run.out_dir")
    if tiny_to_build(cfg):
        from ..tiny import cache_root
        _writable(cache_root(cfg.model.cache_dir), "model.cache_dir")  # the model is built there first
    for name in SECTIONS:   # every setting that declares a dir the run writes into (refresh.file.tmp_dir)
        for key, f, value in walk(getattr(cfg, name), name):
            if value and f.metadata.get("writes_dir"):
                _writable(value, key)
    log_file = cfg.engine.sglang.log_file
    if log_file:     # opened, not created, when the engine starts: its directory must exist
        path = Path(log_file).expanduser().absolute()
        if path.exists() and not path.is_file():
            raise ConfigError(f"engine.sglang.log_file={log_file!r} is a directory or another non-file; name a "
                              f"file to append the engine's output to, e.g. {path / 'engine.log'}")
        if not path.parent.is_dir():
            raise ConfigError(f"engine.sglang.log_file={log_file!r}: the directory {path.parent} does not exist; "
                              f"create it, or name a file in an existing directory")
        _writable(path.parent, "engine.sglang.log_file")


def prompt_limit(cfg: Config, context: int) -> tuple[int, str]:
    g, d = cfg.grpo, cfg.data
    room = context - g.max_new_tokens
    if room < 1:
        raise ConfigError(f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for a prompt in the model's "
                          f"context of {context} tokens; lower grpo.max_new_tokens")
    if d.max_prompt_tokens > room:
        raise ConfigError(f"data.max_prompt_tokens={d.max_prompt_tokens} plus grpo.max_new_tokens={g.max_new_tokens} "
                          f"exceeds the model's context of {context} tokens; set data.max_prompt_tokens <= {room}")
    if d.max_prompt_tokens:
        return d.max_prompt_tokens, f"data.max_prompt_tokens={d.max_prompt_tokens}"
    return room, f"the model's context of {context} minus grpo.max_new_tokens={g.max_new_tokens}"


def _problem_sets(cfg: Config, log) -> list[tuple[str, str, list]]:
    """(field, source, problems) the run will prompt with (synthetic: step 1 and the held-out set, all alike)."""
    d, seed = cfg.data, cfg.run.seed
    check_source_paths(d.source, d.eval_source)
    train = (step_problems(seed, 1, cfg.grpo.prompts_per_step) if d.source == "synthetic"
             else load_gsm8k("train", d.source))
    if len(train) < cfg.grpo.prompts_per_step:   # train_batch would draw some row twice in one step
        raise DataError(f"data.source={d.source!r} has {len(train)} row(s), fewer than grpo.prompts_per_step="
                        f"{cfg.grpo.prompts_per_step}: every step would train on some problem twice (its group "
                        f"counted twice in the loss); set grpo.prompts_per_step <= {len(train)}, or give more rows")
    source = d.eval_source or d.source
    if source == "synthetic":
        held_out = synthetic_problems(d.eval_size, f"eval-{seed}")
    else:
        held_out = train if source == d.source and source != "hub" else load_gsm8k(
            "test" if source == "hub" else "train", source)
        held_out = held_out[:d.eval_size]
        if len(held_out) < d.eval_size:
            log(f"note: {source} has {len(held_out)} rows, fewer than data.eval_size={d.eval_size}; all are used")
        if not d.eval_source and d.source not in ("synthetic", "hub"):
            log(f"note: data.eval_source is '': the held-out rows are the first {len(held_out)} rows of the training "
                f"file {d.source}, which training draws from too; set data.eval_source to a separate file")
    return [("data.source", d.source, train), ("data.eval_source" if d.eval_source else "data.source", source,
                                                held_out)]


def check_prompts(cfg: Config, ref: ModelRef, log=print) -> None:
    context = model_context(ref)
    limit, why = prompt_limit(cfg, context)
    sets = _problem_sets(cfg, log)   # reads and checks the files first: a bad row is found without a tokenizer
    tokenizer = model_tokenizer(ref, cfg.model, cfg.warmstart, cfg.run.seed)
    for field, source, problems in sets:
        over = overlong_prompts(problems, tokenizer, limit, cfg.model.enable_thinking)
        if not over:
            continue
        first, length = over[0]
        where = first.where or f"the synthetic problem {first.question[:40]!r}"
        fix = ("raise data.max_prompt_tokens (up to the model's context minus grpo.max_new_tokens), or lower "
               "grpo.max_new_tokens") if cfg.data.max_prompt_tokens else "lower grpo.max_new_tokens"
        raise DataError(f"{field}={source!r}: {len(over)} of {len(problems)} prompts are longer than {limit} tokens "
                        f"({why}); the first is {where} ({length}). Shorten or remove those rows, or {fix}")
