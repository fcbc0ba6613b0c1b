"""Which config fields a continued run may change (`lorabench resume RUN k=v`, or `lorabench run`
naming an existing run dir), decided field by field.

A continued run must still be the experiment its run dir describes: the same base model and
tokenizer, the same adapter shape, the same data stream and seed, the same objective. Changing any
of those would train the saved adapter on something else (`run.seed` alone picks another tiny base
model) or make rows before and after the change incomparable, so they are REFUSED, naming the field,
both values and what to do instead (start a new run, or continue without the override).

Fields that change how long the run goes, how it is executed, logged or evaluated are ALLOWED. Each
allowed change is appended to RUN/config_changes.jsonl (step, time, field: [old, new]); config.json
is never rewritten. The run's effective config is config.json with those rows applied in order, so a
plain `lorabench resume` after `resume RUN grpo.steps=80` keeps 80.

run.out_dir and run.name only say where the run dir is: they are not compared (a run dir may be
moved), the effective config takes them from where the run dir is now, and `resume` refuses them as
overrides (its argument names the run dir).

Every Config field is in exactly one list (tests/test_rundir.py checks it), so a new field is
refused on resume until someone decides otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path

from .config import Config, ConfigError, apply_override, parse_config_bytes, path_component_problem
from .rundir import RunDirError, scan_in
from .safedir import SafeDir

_MODEL = "it defines the base model, its numerics or its prompts"
_RECIPE = "it is part of the tiny base model's recipe: another value builds another model"
_ADAPTER = "it defines the adapter's shape or scaling, which the checkpoint holds"
_DATA = "it defines the data stream: which problems each step draws"
_SAMPLING = "it defines the sampling distribution: the rollouts and the log-probs the loss uses"
_OBJECTIVE = "it defines the objective; rows before and after would not be one experiment"

REFUSED = {
    "model.name_or_path": _MODEL, "model.dtype": _MODEL, "model.enable_thinking": _MODEL,
    "warmstart.steps": _RECIPE, "warmstart.batch_size": _RECIPE, "warmstart.lr": _RECIPE,
    "warmstart.strict_format_fraction": _RECIPE,
    "lora.r": _ADAPTER, "lora.alpha": _ADAPTER, "lora.target_modules": _ADAPTER, "lora.dropout": _ADAPTER,
    "data.source": _DATA, "data.eval_source": "it defines the held-out set the before/after evaluations compare",
    "grpo.prompts_per_step": _DATA, "grpo.group_size": _DATA,
    "grpo.max_new_tokens": _SAMPLING, "grpo.temperature": _SAMPLING, "grpo.top_p": _SAMPLING,
    "grpo.lr": "it is saved in the checkpoint's optimizer state: a new value would silently not apply",
    "grpo.clip_eps": _OBJECTIVE, "grpo.kl_beta": _OBJECTIVE, "grpo.reward_mode": _OBJECTIVE,
    "grpo.format_bonus": _OBJECTIVE, "grpo.max_grad_norm": _OBJECTIVE, "grpo.epochs": _OBJECTIVE,
    "run.seed": "it seeds the data, the sampling, the LoRA init and (tiny) the base model",
}
ALLOWED = {
    "grpo.steps": "how long the run goes (not below the steps already done)",
    "grpo.micro_batch_tokens": "memory only: the same gradients, summed in other groups",
    "grpo.activation_checkpointing": "memory and speed only: the same gradients, recomputed",
    "grpo.compile": "speed only: the same computation, compiled",
    "grpo.lora_compute": "the precision of the LoRA matmuls in training; objective, data and adapter are the same",
    "data.eval_size": "evaluation only (each evals.jsonl row carries its n)",
    "data.eval_samples": "evaluation only (each evals.jsonl row carries its n)",
    "data.max_prompt_tokens": "a guard checked before the run starts",
    "grpo.max_delta_ratio": "a guard: it decides when a diverged update stops the run, not what a step computes",
    "model.cache_dir": "where the tiny model is cached; its recipe names the model",
    **{f"engine.{k}": "how rollouts are served; the adapter is the same" for k in (
        "backend", "device", "adapter_name", "max_lora_rank", "max_loras_per_batch", "mem_fraction_static",
        "attention_backend", "sampling_backend", "grammar_backend", "lora_backend", "disable_cuda_graph",
        "release_memory_during_training", "dtype", "cuda_graph_max_bs", "tp_size", "extra_args", "log_file")},
    "refresh.mode": "how the adapter reaches the engine", "refresh.bucket_mb": "how the adapter reaches the engine",
    "refresh.tmp_dir": "where file refresh writes",
    "run.save_adapter_every": "logging", "run.checkpoint_every": "logging", "run.sample_completions": "logging",
    "run.threads": "execution",
}
LOCATION = ("run.out_dir", "run.name")


def flat_config(cfg: Config) -> dict[str, object]:
    return {f"{section}.{key}": value for section, fields in cfg.to_dict().items() for key, value in fields.items()}


def effective_config(run_dir: Path) -> Config:
    """The run's config now: config.json with the allowed changes of config_changes.jsonl applied.
    Both are read through the run dir itself (safedir.py: a link in their place is refused)."""
    run_dir = Path(run_dir)
    try:
        root = SafeDir.open(run_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise RunDirError(f"{run_dir} does not exist; pass a run dir that `lorabench run` wrote (it prints "
                          f"'run dir: ...')") from None
    with root:
        raw = root.read_bytes("config.json")
        if raw is None:
            raise RunDirError(f"{run_dir} is not a lorabench run dir: it has no config.json; pass a run dir written "
                              f"by lorabench, or start a run there with lorabench run ... run.name=NAME")
        data = parse_config_bytes(raw, run_dir / "config.json")
        changes = scan_in(root, "config_changes.jsonl").rows
    if isinstance(data.get("run"), dict):   # where the run dir is now (it may have been moved or renamed)
        name_ok = path_component_problem(run_dir.name) is None
        data["run"].update(out_dir=str(run_dir.parent), name=run_dir.name if name_ok else "")
    data = Config.from_dict(data, source=str(run_dir / "config.json")).to_dict()
    for row in changes:
        for key, (_, new) in row.get("changes", {}).items():
            section, _, name = key.partition(".")
            data[section][name] = new
    return Config.from_dict(data, source=f"{run_dir / 'config.json'} + config_changes.jsonl")


def resume_config(run_dir: Path, overrides: list[str]) -> Config:
    """The config `lorabench resume RUN overrides` asks for: the effective config plus overrides."""
    for item in overrides:
        if item.partition("=")[0].strip() in LOCATION:
            raise ConfigError(f"override {item!r}: a continued run stays in its dir ({run_dir}); to continue a copy "
                              f"elsewhere, copy the run dir and resume the copy")
    data = json.loads(json.dumps(effective_config(run_dir).to_dict()))
    for item in overrides:
        apply_override(data, item)
    return Config.from_dict(data, source="overrides")


def changes(old: Config, new: Config) -> dict[str, tuple]:
    """{field: (old, new)} for every field that differs, location fields aside."""
    before, after = flat_config(old), flat_config(new)
    return {k: (before[k], after[k]) for k in before if k not in LOCATION and before[k] != after[k]}


def check_continuation(run_dir: Path, old: Config, new: Config, at_step: int) -> dict[str, tuple]:
    """The allowed changes from `old` (the run's effective config) to `new`; refused ones raise
    RunDirError naming every refused field, both values and the way out."""
    diff = changes(old, new)
    refused = {k: v for k, v in diff.items() if k not in ALLOWED}
    if refused:
        listed = "; ".join(f"{k} {a!r} -> {b!r} ({REFUSED.get(k, 'not decided as safe to change')})"
                           for k, (a, b) in refused.items())
        overrides = " ".join(f"{k}={json.dumps(b) if not isinstance(b, str) else b}" for k, (_, b) in refused.items())
        config = Path(run_dir) / "config.json"
        raise RunDirError(f"{run_dir} cannot continue with a changed {listed}; nothing was changed. Start a new run "
                          f"for that (lorabench run --config {config} run.name=NEW {overrides}), or continue "
                          f"without those overrides")
    if "grpo.steps" in diff and diff["grpo.steps"][1] < at_step:
        raise RunDirError(f"{run_dir} is at step {at_step}; grpo.steps={diff['grpo.steps'][1]} would end it before "
                          f"that; nothing was changed. Pass grpo.steps >= {at_step}")
    return diff
