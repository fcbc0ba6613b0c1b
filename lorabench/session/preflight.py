"""Checks before a run dir is created or a model is built: the engine is installed, the dirs a run writes
are writable, the model is usable, the run's size fits the machine, every dataset row is readable and its
prompt fits. The size terms are lower bounds on what the run certainly allocates: a refusal is no false alarm.
"""
from __future__ import annotations

import os
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

from ..data import check_source_paths, load_gsm8k, overlong_prompts, step_problems, synthetic_problems
from ..datafiles import DataError
from ..engines import engine_class
from ..machine import machine_memory
from ..models import ModelRef, model_config, model_context, model_ref, model_tokenizer
from ..refresh import REFRESH_MODES
from ..rundir import FOLDERS
from ..settings import walk
from ..tiny import TINY_ARCH, TINY_VOCAB, cache_root, tiny_cache_path
from .config import SECTIONS, Config, ConfigError, engine_needs


def preflight(cfg: Config, run_dir: Path | None = None, continued: bool = False, log=print) -> ModelRef:
    """Every check below; returns what model.name_or_path names. `run_dir`: the run dir the run will write
    (continued=True: an existing run), None for a new one under run.out_dir."""
    engine_class(cfg.engine.backend).check_available(cfg.engine.chosen, REFRESH_MODES[cfg.refresh.mode].needs)
    cpus = len(os.sched_getaffinity(0))
    if cfg.run.threads > cpus:   # more only slows torch down; very many crash it (a segfault at 100000)
        raise ConfigError(f"run.threads={cfg.run.threads}: this process may use {cpus} CPU(s); set run.threads <= "
                          f"{cpus}, or 0 (auto: as many as other work leaves free)")
    check_dirs(cfg, run_dir, continued)
    ref = model_ref(cfg.model)
    if ref.kind == "tiny":
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
    if why := _unwritable(probe):
        raise ConfigError(f"{field}={str(path)!r}: {probe} {why}; point {field} at a writable directory")


def _appendable(value: str, field: str) -> None:
    """A file opened (not created) for appending: its directory must exist and be writable."""
    path = Path(value).expanduser().absolute()
    if path.exists() and not path.is_file():
        raise ConfigError(f"{field}={value!r} is a directory or another non-file; name a file to append to, e.g. "
                          f"{path / 'out.log'}")
    if not path.parent.is_dir():
        raise ConfigError(f"{field}={value!r}: the directory {path.parent} does not exist; create it, or name a file "
                          f"in an existing directory")
    _writable(path.parent, field)


def check_dirs(cfg: Config, run_dir: Path | None = None, continued: bool = False) -> None:
    if run_dir is not None and Path(run_dir).is_dir():   # it (a mount point, say) and its folders must be writable
        for folder in (Path(run_dir), *(Path(run_dir) / sub for sub in FOLDERS)):
            if why := (_unwritable(folder) if folder.is_dir() else None):   # check_entries refused links already
                fix = ("copy the run dir to a writable place and resume the copy" if continued else
                       "choose another run.name or run.out_dir")
                which = f"the run dir {run_dir}" + ("" if folder == Path(run_dir) else f": its folder {folder.name}/")
                raise ConfigError(f"{which} {why}, and a run writes its rows and checkpoints there; {fix}")
    else:   # a new run dir is made in run.out_dir
        _writable(cfg.run.out_dir, "run.out_dir")
    if tiny_to_build(cfg):
        _writable(cache_root(cfg.model.cache_dir), "model.cache_dir")  # the model is built there first
    for name in SECTIONS:   # every setting that declares a dir or file the run writes (refresh.file.tmp_dir, ...)
        for key, f, value in walk(getattr(cfg, name), name):
            if value and f.metadata.get("writes"):
                {"dir": _writable, "file": _appendable}[f.metadata["writes"]](value, key)


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
        if not (over := overlong_prompts(problems, tokenizer, limit, cfg.model.enable_thinking)):
            continue
        first, length = over[0]
        where = first.where or f"the synthetic problem {first.question[:40]!r}"
        fix = ("raise data.max_prompt_tokens (up to the model's context minus grpo.max_new_tokens), or lower "
               "grpo.max_new_tokens") if cfg.data.max_prompt_tokens else "lower grpo.max_new_tokens"
        raise DataError(f"{field}={source!r}: {len(over)} of {len(problems)} prompts are longer than {limit} tokens "
                        f"({why}); the first is {where} ({length}). Shorten or remove those rows, or {fix}")


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    vocab: int
    tied: bool
    linears: dict   # {projection: (in, out)} of one decoder layer

    @classmethod
    def of(cls, config) -> ModelShape:
        get = (config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d))
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        i, head_dim = int(get("intermediate_size", 4 * h)), int(get("head_dim") or h // heads)
        q, kv = heads * head_dim, int(get("num_key_value_heads") or heads) * head_dim
        linears = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                   "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return cls(h, int(get("num_hidden_layers")), int(get("vocab_size")), bool(get("tie_word_embeddings", False)),
                   linears)

    def parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.linears.values())
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


Need = namedtuple("Need", "what nbytes fix")   # a term of a run's memory and the setting that lowers it


def needs(cfg: Config, shape: ModelShape) -> list[Need]:
    g, d = cfg.grpo, cfg.data
    train, held_out = g.prompts_per_step * g.group_size, d.eval_size * d.eval_samples
    sequences = max(train, held_out)
    fix = (f"lower grpo.prompts_per_step x grpo.group_size (now {g.prompts_per_step} x {g.group_size})"
           if train >= held_out else f"lower data.eval_size x data.eval_samples (now {d.eval_size} x {d.eval_samples})")
    terms = [Need(f"{sequences:,} sequences of {g.max_new_tokens} new tokens held at once",
                  sequences * (1024 + 64 * g.max_new_tokens), fix)]
    targets = cfg.lora.target_modules
    chosen = shape.linears if targets == "all-linear" else {k: v for k, v in shape.linears.items() if k in targets}
    lora_params = shape.layers * cfg.lora.r * sum(a + b for a, b in chosen.values())
    terms.append(Need(f"LoRA state ({lora_params:,} parameters at lora.r={cfg.lora.r}, float32 x 8)",
                      lora_params * 4 * 8, f"lower lora.r (now {cfg.lora.r})"))
    base_bytes = shape.parameters() * _DTYPE_BYTES[cfg.model.dtype]
    terms.append(Need(f"base weights ({shape.parameters():,} parameters in {cfg.model.dtype})", base_bytes,
                      "use a smaller model, or model.dtype=bfloat16"))
    engine = engine_class(cfg.engine.backend)
    terms += [Need(*term) for term in engine.process_memory(cfg.engine.chosen, engine_needs(cfg), shape.vocab,
                                                              base_bytes)]
    return sorted(terms, key=lambda n: -n.nbytes)


WARMSTART_TOKENS = 32   # fewer than any warm-start sequence has: the chat template and instruction alone are ~48


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def check_sizes(cfg: Config, shape: ModelShape, device: str, warm_start: bool = False) -> None:
    """Refuses a run whose needs() (or, `warm_start`, the tiny model's warm-start logits) exceed the machine."""
    have, where = machine_memory(device)
    n = cfg.warmstart.batch_size
    if warm_start and (warm := n * WARMSTART_TOKENS * shape.vocab * 4) > have:
        raise ConfigError(f"the tiny model's warm-start: float32 logits of {n:,} sequences of at least "
                          f"{WARMSTART_TOKENS} tokens over {shape.vocab} tokens need at least {_gb(warm)} of memory, "
                          f"more than {where} ({_gb(have)}); lower warmstart.batch_size (now {n}; 32 is the default)")
    terms = needs(cfg, shape)
    total = sum(t.nbytes for t in terms)
    if total <= have:
        return
    listed = "; ".join(f"{t.what}: {_gb(t.nbytes)}" for t in terms if t.nbytes >= total / 100)
    raise ConfigError(f"this run needs at least {_gb(total)} of memory ({listed}), more than {where} "
                      f"({_gb(have)}); {terms[0].fix}")
