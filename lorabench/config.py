"""Run configuration: dataclasses with help texts, loaded from a file plus key=value overrides.

Every default is chosen so that `lorabench demo` runs offline on a 2-core CPU. Each field's
help text lives in its `metadata["help"]`; `lorabench run --help-config` prints them all.
Invalid values raise `ConfigError` naming the field, the value and how to fix it; an unknown key
gets a "did you mean"; every float must be finite. Files are read as UTF-8 (a BOM is accepted).
Which fields a continued run may change is compat.py's business, not this module's.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .engines import ENGINES, engine_class
from .refresh import REFRESH_MODES


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which field and how to fix it."""


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    name_or_path: str = _f("tiny", "'tiny' builds a ~2.5M-param Qwen3-architecture model offline; "
                           "otherwise a hub name (Qwen/Qwen3-0.6B) or a local model dir.")
    dtype: str = _f("float32", "Trainer weights dtype: float32 | bfloat16 | float16.")
    enable_thinking: bool = _f(False, "Passed to Qwen3's chat template (ignored by the tiny tokenizer).")
    cache_dir: str = _f("", "Where the tiny model is cached; '' = ~/.cache/lorabench.")


@dataclass
class WarmStartConfig:
    steps: int = _f(400, "SFT steps for the tiny model before GRPO (0 = skip; ignored for real models). "
                     "Accuracy jumps between 300 and 350 steps (docs/research_log.md).")
    batch_size: int = _f(32, "SFT batch size.")
    lr: float = _f(6e-3, "SFT learning rate (AdamW, warm-up then cosine decay).")
    strict_format_fraction: float = _f(0.1, "Fraction of SFT answers that end with '#### N'; the rest end "
                                       "'The answer is N.', '= N' or the bare number. GRPO with the strict "
                                       "reward then has a format to discover.")


@dataclass
class LoraSettings:
    r: int = _f(16, "LoRA rank.")
    alpha: int = _f(32, "LoRA alpha; the update is scaled by alpha / r.")
    target_modules: str | list[str] = _f("all-linear", "'all-linear' or a list of module names "
                                         "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).")
    dropout: float = _f(0.0, "LoRA dropout in [0, 1) (keep 0 so trainer and engine log-probs can match).")


@dataclass
class DataConfig:
    source: str = _f("synthetic", "'synthetic' (seeded GSM8K-style generator), 'hub' (openai/gsm8k) "
                     "or a local .jsonl/.parquet file with question/answer fields.")
    eval_source: str = _f("", "Held-out set; '' = same kind as source (fresh synthetic seeds, or the "
                          "'test' split / same file).")
    eval_size: int = _f(128, "Held-out prompts used for the before/after evaluation (>= 1).")
    eval_samples: int = _f(2, "Samples per held-out prompt at the training sampling settings.")
    max_prompt_tokens: int = _f(0, "Longest prompt (chat template included) a dataset row may have; rows above "
                                "it are refused before the run starts, with a count and the first one. 0 = the "
                                "model's context minus grpo.max_new_tokens.")


LORA_COMPUTE = ("auto", "float32", "bfloat16")
COMPILE = ("off", "head", "all", "auto")


@dataclass
class GRPOConfig:
    steps: int = _f(30, "GRPO steps (one optimizer step and one adapter refresh each).")
    prompts_per_step: int = _f(8, "Distinct prompts per step (fresh every step).")
    group_size: int = _f(8, "Completions sampled per prompt; advantages are normalised within a group.")
    max_new_tokens: int = _f(48, "Completion length limit.")
    temperature: float = _f(0.7, "Sampling temperature for rollouts and the sampled held-out eval "
                            "(log-probs are of this distribution).")
    top_p: float = _f(1.0, "Nucleus sampling; keep 1.0 so log-probs cover the whole distribution.")
    lr: float = _f(1e-3, "AdamW learning rate for the LoRA parameters.")
    clip_eps: float = _f(0.2, "PPO-style ratio clip.")
    kl_beta: float = _f(0.0, "Weight of the k3 KL to the base model (adapter disabled); 0 = off.")
    micro_batch_tokens: int = _f(16384, "Padded tokens per forward/backward pass (gradient accumulation): "
                                 "sequences are grouped by length into micro-batches under this budget, so "
                                 "trainer memory does not grow with the rollout size. With checkpointing and "
                                 "compile the Qwen3-0.6B shape peaks at ~4.6 GB at 16384 (fits a 24 GB GPU next to "
                                 "the engine at mem_fraction_static=0.3; 32768 did not) and ~7.3 GB at 32768, "
                                 "which is a little faster on a larger GPU (docs/results.md, section 2).")
    lora_compute: str = _f("auto", "Precision of the LoRA matmuls in training: 'bfloat16' (autocast; the adapter "
                           "and its optimizer state stay fp32, and no fp32 copy of each LoRA layer's input is "
                           "kept for backward), 'float32' (PEFT's default) or 'auto' (bfloat16 when model.dtype "
                           "is bfloat16, else float32).")
    activation_checkpointing: bool = _f(True, "Recompute each decoder layer's activations in backward instead "
                                        "of keeping them: training memory per token drops ~30x for ~25% more "
                                        "training compute; the memory buys micro-batches large enough to be "
                                        "faster overall on a GPU (docs/results.md). false: keep them.")
    compile: str = _f("auto", "torch.compile in training, to fuse the elementwise work that took most of the "
                      "GPU's training time: 'all' (every decoder layer, activation_checkpointing inside the "
                      "compiled layer, and the output head's two passes over the vocabulary), 'head' (the head "
                      "only), 'off', or 'auto' ('all' on a CUDA GPU, 'off' elsewhere). On the H200 'all' took "
                      "the 64x8x256 training phase from 4.5 to 1.7 s; the first step pays the compile (~80 s "
                      "there), and a micro-batch of one sequence (only when unavoidable) compiles once more. "
                      "Micro-batch widths round up to a multiple of 8 (masked columns), or a width turning "
                      "from aligned to not compiles again. The same values to float32 rounding "
                      "(docs/results.md, section 2).")
    reward_mode: str = _f("strict", "'strict' (last '#### N') or 'flexible' (last number).")
    format_bonus: float = _f(0.0, "Added to the reward when '#### N' is present, right or wrong.")
    max_grad_norm: float = _f(1.0, "Gradient clipping.")
    max_delta_ratio: float = _f(1.0, "Divergence bound: an update after which some adapted layer's change "
                                "||dW|| = ||(alpha/r)·B·A|| exceeds this multiple of its base weight's ||W|| "
                                "(Frobenius norms) is treated like a non-finite loss: rolled back, never served, "
                                "saved or checkpointed, and the run stops naming the step and the norms. At 1.0 the "
                                "adapter changes a layer as much as the whole layer weighs; on the tiny model the "
                                "default grpo.lr=1e-3 reaches 0.05 in 12 steps, lr=1e-2 crosses 1.0 at step 11 "
                                "(after the reward had collapsed), lr=0.1 at step 2 (docs/reliability.md, 2b). "
                                "0 = no bound (non-finite values are always refused).")
    epochs: int = _f(1, "Optimizer steps per batch (1 = on-policy; the clip matters only above 1).")

    def __post_init__(self):
        # grpo.compile was a boolean before 'head' and 'auto' (true compiled the head and the layers)
        if str(self.compile).lower() in ("true", "false"):
            self.compile = "all" if str(self.compile).lower() == "true" else "off"


@dataclass
class EngineConfig:
    backend: str = _f("hf", "The rollout engine; one of the registry's (lorabench.engines.ENGINES): 'hf' "
                      "(transformers + PEFT, CPU or GPU) or 'sglang' (in-process sglang.Engine).")
    device: str = _f("", "Device for the hf engine; '' = cuda if available else cpu.")
    adapter_name: str = _f("policy", "Name the current adapter is served under.")
    max_lora_rank: int = _f(0, "sglang: max LoRA rank; 0 = the LoRA config's r.")
    max_loras_per_batch: int = _f(4, "sglang: adapters per batch, base counts as one (>= 2).")
    mem_fraction_static: float = _f(0.3, "sglang: fraction of GPU memory for weights + KV cache. 0.3 leaves room "
                                    "for the trainer on a 24 GB GPU (docs/results.md, section 2).")
    attention_backend: str = _f("", "sglang: '' = engine default; 'triton' on the offline GPU stack.")
    sampling_backend: str = _f("", "sglang: '' = engine default; 'pytorch' on the offline GPU stack.")
    grammar_backend: str = _f("", "sglang: '' = engine default; 'none' on the offline GPU stack.")
    lora_backend: str = _f("triton", "sglang: the LoRA kernels, 'triton' or 'csgmv' (SGLang's default). On an "
                           "H200 triton decoded a 512-sequence batch at 0.86x base speed, csgmv at 0.81x, and "
                           "a 64x8x256 GRPO step took 8.6 s vs 9.5 s (docs/results.md, section 2).")
    disable_cuda_graph: bool = _f(False, "sglang: turn CUDA graphs off (slower decode, faster start).")
    release_memory_during_training: bool = _f(False, "sglang: release KV cache (and weights if merged) "
                                              "while the trainer runs; resumed symmetrically.")
    dtype: str = _f("auto", "sglang: model dtype ('auto', 'bfloat16', 'float16').")
    cuda_graph_max_bs: int = _f(0, "sglang: largest decode batch run as a CUDA graph; 0 = the largest batch the "
                                "run sends (prompts_per_step x group_size, or the held-out eval). A batch above "
                                "it decodes without graphs, 2.5-3x slower (docs/results.md).")
    tp_size: int = _f(1, "sglang: tensor-parallel size, the GPUs the engine spans from base_gpu_id (0) on; "
                      "the trainer stays on cuda:0 (docs/multi_gpu.md).")
    extra_args: str = _f("", "sglang: JSON object of further sglang.Engine arguments, e.g. "
                         '\'{"enable_memory_saver": true}\'.')
    log_file: str = _f("", "sglang: a file (appended) for the output of the engine's own processes: its "
                       "progress bars and logs; '' = this process's stdout/stderr. The notebooks send it to "
                       "lorabench-sglang.log in the temp dir, so their output is the lesson's alone.")


@dataclass
class RefreshConfig:
    mode: str = _f("tensor", "How the adapter reaches the engine after each step; one of the registry's "
                   "(lorabench.refresh.REFRESH_MODES): 'file' (PEFT dir, unload + load), 'tensor' "
                   "(load_lora_adapter_from_tensors), 'inplace' (load once, then overwrite the engine's "
                   "resident adapter: SGLang's GPU LoRA pool), 'merged' (push the adapted layers' merged "
                   "weights; decode then runs without LoRA kernels: on the H200 the fastest 64x8x256 step, 5.47 s "
                   "vs 5.66 s in place, docs/results.md section 2) or 'none' (stale-adapter control).")
    bucket_mb: float = _f(64.0, "Bucket size in MB: one push per bucket (merged; on the H200 1024 took a 1.2 GB "
                          "push from 108 to 60 ms); tensors are staged per bucket before the single adapter "
                          "load (tensor).")
    tmp_dir: str = _f("", "Where file refresh writes adapter dirs; '' = /dev/shm if writable, else the "
                      "system temp dir.")


@dataclass
class RunConfig:
    out_dir: str = _f("runs", "Parent of run directories.")
    name: str = _f("", "Run directory name; '' = timestamp.")
    seed: int = _f(0, "Seed for data, sampling and init; the same seed reproduces a run.")
    save_adapter_every: int = _f(10, "Write adapters/step_<n>/ every n steps (and the last step).")
    checkpoint_every: int = _f(1, "Checkpoint every n steps (and the last step); rows of the steps between are "
                               "written with the next checkpoint, so a killed run repeats at most n-1 steps "
                               "and its run dir never holds a row its checkpoint cannot vouch for.")
    sample_completions: int = _f(4, "Completions per step written to rollouts.jsonl (all are kept "
                                 "in the step record).")
    threads: int = _f(0, "torch CPU threads; 0 = torch default.")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> Config:
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a table/object of sections, got {data!r:.60}")
        unknown = set(data) - set(_SECTIONS)
        if unknown:
            name = min(unknown)
            raise ConfigError(f"{source}: unknown section(s) {sorted(unknown)}{_did_you_mean_section(name)}; "
                              f"valid sections: {list(_SECTIONS)}")
        sections = {}
        for name, section_cls in _SECTIONS.items():
            sub = data.get(name, {})
            if not isinstance(sub, dict):
                raise ConfigError(f"{source}: section '{name}' must be a table/object, got {sub!r}")
            sections[name] = _build_section(section_cls, sub, f"{source}: {name}")
        return cls(**sections)

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> Config:
        """A file (or the defaults) with `overrides` on top."""
        data: dict = {}
        if path is not None:
            data = read_config_file(path)
        for item in overrides:
            apply_override(data, item)
        return cls.from_dict(data, source=str(path) if path else "overrides")


_SECTIONS = {"model": ModelConfig, "warmstart": WarmStartConfig, "lora": LoraSettings, "data": DataConfig,
             "grpo": GRPOConfig, "engine": EngineConfig, "refresh": RefreshConfig, "run": RunConfig}


def read_config_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing .json or .toml file")
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path}: unsupported suffix {path.suffix!r}; use .json or .toml")
    return parse_config_bytes(path.read_bytes(), path)


def parse_config_bytes(raw: bytes, path: Path) -> dict:
    """The sections of a config file's bytes (`path` names it and its format by suffix)."""
    try:
        text = raw.decode("utf-8-sig")  # an editor's UTF-8 BOM is not an error
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                          f"{err.start}); save it as UTF-8") from err
    try:
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {err}") from err


def _did_you_mean_section(name: str) -> str:
    close = difflib.get_close_matches(name, list(_SECTIONS), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# names other tools use for a field, which spelling similarity would not find
_SYNONYMS = {"learning_rate": "grpo.lr", "lora_r": "lora.r", "rank": "lora.r", "lora_alpha": "lora.alpha",
             "max_steps": "grpo.steps", "num_steps": "grpo.steps", "model_name": "model.name_or_path",
             "num_generations": "grpo.group_size", "beta": "grpo.kl_beta", "epsilon": "grpo.clip_eps"}


def _did_you_mean_key(section: str, key: str) -> str:
    """A known synonym (learning_rate -> grpo.lr), the same key in another section (grpo.seed ->
    run.seed), else the closest key of the section or of any section."""
    if key in _SYNONYMS:
        return f" (did you mean {_SYNONYMS[key]}?)"
    elsewhere = [f"{s}.{key}" for s, c in _SECTIONS.items() if s != section and key in _field_names(c)]
    if elsewhere:
        return f" (did you mean {elsewhere[0]}?)"
    own = difflib.get_close_matches(key, sorted(_field_names(_SECTIONS[section])), n=1)
    if own:
        return f" (did you mean {section}.{own[0]}?)"
    everywhere = [f"{s}.{k}" for s, c in _SECTIONS.items() for k in _field_names(c)]
    close = difflib.get_close_matches(f"{section}.{key}", everywhere, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _field_names(section_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(section_cls)}


def apply_override(data: dict, item: str) -> None:
    """`grpo.lr=3e-4` -> data['grpo']['lr'] = '3e-4' (converted to the field's type later)."""
    key, sep, value = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"override {item!r} must look like section.field=value, e.g. grpo.lr=3e-4")
    data.setdefault(section, {})[name] = value


def _convert(value, typ, where: str):
    """Convert file values and override strings to the field's type, or say how to fix them."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, __import__("types").UnionType):  # str | list[str]
        if isinstance(value, list):
            return [str(v) for v in value]
        if isinstance(value, str) and value.startswith("["):
            try:
                return [str(v) for v in json.loads(value)]
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: {value!r} is not a JSON list ({err}); write e.g. "
                                  f'["q_proj","v_proj"]') from err
        if isinstance(value, str) and "," in value:
            return [v.strip() for v in value.split(",") if v.strip()]
        return str(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: {value!r} is not a boolean; use true or false")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is a boolean, expected a {typ.__name__}")
        try:
            converted = typ(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: {value!r} is not a {typ.__name__}; write e.g. "
                              f"{'8' if typ is int else '1e-3'}") from err
        if typ is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"{where}: {value!r} is not a whole number")
        return converted
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _build_section(cls, values: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = _field_names(cls)
    unknown = set(values) - names
    if unknown:
        section = next(s for s, c in _SECTIONS.items() if c is cls)
        hint = _did_you_mean_key(section, min(unknown))
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}{hint}; valid keys: {sorted(names)}")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in values.items()}
    return cls(**kwargs)


def _require(cond: bool, msg: str):
    if not cond:
        raise ConfigError(msg)


def validate(cfg: Config) -> None:
    """Everything that can be known from the config alone; environment checks (files, model,
    engine installed, writable dirs) are preflight.py's."""
    _check_finite(cfg)
    _validate_grpo(cfg.grpo)
    _validate_lora(cfg.lora)
    _validate_engine(cfg)
    r = cfg.refresh
    _require(r.mode in REFRESH_MODES, f"refresh.mode={r.mode!r}: use one of {sorted(REFRESH_MODES)}")
    _require(r.bucket_mb > 0, f"refresh.bucket_mb={r.bucket_mb}: must be > 0 (e.g. 64)")
    _require(cfg.model.dtype in ("float32", "bfloat16", "float16"),
             f"model.dtype={cfg.model.dtype!r}: use float32, bfloat16 or float16")
    _require(cfg.grpo.lora_compute != "bfloat16" or cfg.model.dtype == "bfloat16",
             f"grpo.lora_compute=bfloat16 with model.dtype={cfg.model.dtype}: autocast would run the base model's "
             f"matmuls in bf16 too; set model.dtype=bfloat16, or grpo.lora_compute=auto")
    w = cfg.warmstart
    _require(w.steps >= 0, f"warmstart.steps={w.steps}: must be >= 0")
    _require(w.batch_size >= 1, f"warmstart.batch_size={w.batch_size}: must be >= 1")
    _require(w.lr > 0, f"warmstart.lr={w.lr}: must be > 0 (e.g. 6e-3)")
    _require(0 <= w.strict_format_fraction <= 1,
             f"warmstart.strict_format_fraction={w.strict_format_fraction}: must be in [0, 1]")
    d = cfg.data
    _require(d.eval_size >= 1, f"data.eval_size={d.eval_size}: the before/after evaluation needs at least one "
             f"held-out prompt; set data.eval_size=128 (or 4 for a quick check)")
    _require(d.eval_samples >= 1, f"data.eval_samples={d.eval_samples}: must be >= 1")
    _require(d.max_prompt_tokens >= 0, f"data.max_prompt_tokens={d.max_prompt_tokens}: must be >= 0 (0 = the "
             f"model's context minus grpo.max_new_tokens)")
    _validate_run(cfg.run)
    _require(cfg.run.save_adapter_every >= 1, f"run.save_adapter_every={cfg.run.save_adapter_every}: must be >= 1")
    _require(cfg.run.checkpoint_every >= 1, f"run.checkpoint_every={cfg.run.checkpoint_every}: must be >= 1")
    _require(cfg.run.threads >= 0, f"run.threads={cfg.run.threads}: must be >= 0 (0 = torch default)")


def path_component_problem(value: str) -> str | None:
    """Why `value` cannot be one name inside a directory (a run dir name, an adapter name), or None.
    A name is a name, not a path: no '/', not '.' or '..', not hidden, printable, UTF-8, <= 255 bytes."""
    if not value.strip():
        return "is empty"
    if "/" in value or "\\" in value:
        return "is a path, not a name (it contains a slash)"
    if value.startswith("."):
        return "starts with '.' ('.', '..' and hidden names are not run names)"
    if value != value.strip():
        return "starts or ends with white space"
    if not value.isprintable():
        return "contains a control character"
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    return f"is {size} bytes long; a name in a directory has at most 255" if size > 255 else None


SEED_LIMIT = 2**32   # sampling seeds are seed x 1,000,003 + step: they stay below 2**63 (torch, SGLang)


def _validate_run(r: RunConfig) -> None:
    problem = path_component_problem(r.name) if r.name else None
    _require(problem is None, f"run.name={r.name!r} {problem}; give one directory name such as 'gsm8k-r16' (the run "
             f"dir is run.out_dir/run.name; point run.out_dir at the parent you want)")
    _require(bool(r.out_dir.strip()), "run.out_dir='': give the parent directory of run dirs, e.g. runs")
    _require("\0" not in r.out_dir, f"run.out_dir={r.out_dir!r} contains a NUL character; give a directory path")
    _require(0 <= r.seed < SEED_LIMIT, f"run.seed={r.seed}: must be in [0, 2**32) (e.g. 0; sampling seeds are "
             f"derived from it and must fit 64 bits)")


_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+|mps)?$")


def _check_finite(cfg: Config) -> None:
    """inf and nan parse as floats (from TOML, JSON or an override) but are never a setting: refuse
    them here rather than at step 1 with an error about something else."""
    for section in _SECTIONS:
        for f in dataclasses.fields(_SECTIONS[section]):
            value = getattr(getattr(cfg, section), f.name)
            if isinstance(value, float) and not math.isfinite(value):
                default = f.default if f.default is not dataclasses.MISSING else None
                raise ConfigError(f"{section}.{f.name}={value}: must be a finite number (the default is "
                                  f"{default})")


def _validate_grpo(g: GRPOConfig) -> None:
    _require(g.group_size >= 2, f"grpo.group_size={g.group_size}: group-normalised advantages need at "
             f"least 2 completions per prompt; set grpo.group_size=8 or more")
    _require(g.prompts_per_step >= 1, f"grpo.prompts_per_step={g.prompts_per_step}: must be >= 1")
    _require(g.steps >= 0, f"grpo.steps={g.steps}: must be >= 0")
    _require(g.micro_batch_tokens >= 1, f"grpo.micro_batch_tokens={g.micro_batch_tokens}: must be >= 1 "
             f"(e.g. 4096; a sequence longer than the budget forms its own micro-batch)")
    _require(g.max_new_tokens >= 1, f"grpo.max_new_tokens={g.max_new_tokens}: must be >= 1")
    _require(g.temperature > 0, f"grpo.temperature={g.temperature}: must be > 0 (greedy rollouts give "
             f"identical groups and zero advantages)")
    _require(0 < g.top_p <= 1, f"grpo.top_p={g.top_p}: must be in (0, 1]")
    _require(g.lr > 0, f"grpo.lr={g.lr}: must be > 0 (e.g. 1e-3)")
    _require(g.max_grad_norm > 0, f"grpo.max_grad_norm={g.max_grad_norm}: must be > 0 (e.g. 1.0)")
    _require(g.max_delta_ratio >= 0, f"grpo.max_delta_ratio={g.max_delta_ratio}: must be >= 0 (1.0 is the default; "
             f"0 = no bound)")
    _require(g.clip_eps > 0, f"grpo.clip_eps={g.clip_eps}: must be > 0 (e.g. 0.2)")
    _require(g.kl_beta >= 0, f"grpo.kl_beta={g.kl_beta}: must be >= 0 (0 = no KL term)")
    _require(g.epochs >= 1, f"grpo.epochs={g.epochs}: must be >= 1")
    _require(g.lora_compute in LORA_COMPUTE, f"grpo.lora_compute={g.lora_compute!r}: use one of {list(LORA_COMPUTE)}")
    _require(g.compile in COMPILE, f"grpo.compile={g.compile!r}: use one of {list(COMPILE)}")
    _require(g.reward_mode in ("strict", "flexible"),
             f"grpo.reward_mode={g.reward_mode!r}: use 'strict' or 'flexible'")


def _validate_lora(lora: LoraSettings) -> None:
    _require(lora.r >= 1, f"lora.r={lora.r}: the LoRA rank must be >= 1")
    _require(lora.alpha > 0, f"lora.alpha={lora.alpha}: must be > 0")
    _require(0 <= lora.dropout < 1, f"lora.dropout={lora.dropout}: must be in [0, 1) (a probability; keep 0 so "
             f"trainer and engine log-probs can match)")
    tm = lora.target_modules
    if isinstance(tm, str):
        _require(tm == "all-linear" or tm.isidentifier(),
                 f"lora.target_modules={tm!r}: use 'all-linear' or a list of module names such as "
                 f'["q_proj","v_proj"]; regular expressions cannot be sent to SGLang')
    else:
        _require(len(tm) > 0 and all(isinstance(t, str) and t.isidentifier() for t in tm),
                 f"lora.target_modules={tm!r}: list plain module names such as q_proj, v_proj")


def _validate_engine(cfg: Config) -> None:
    e = cfg.engine
    _require(e.backend in ENGINES, f"engine.backend={e.backend!r}: use one of {sorted(ENGINES)}")
    _require(bool(_DEVICE.match(e.device)), f"engine.device={e.device!r}: use '', cpu, cuda, cuda:N or mps")
    problem = path_component_problem(e.adapter_name)
    _require(problem is None, f"engine.adapter_name={e.adapter_name!r} {problem}; give a plain name such as 'policy' "
             f"(file refresh makes a dir named after it)")
    if e.extra_args:  # parsed here first: the engine's own checks read it as JSON
        try:
            extra = json.loads(e.extra_args)
        except json.JSONDecodeError as err:
            raise ConfigError(f"engine.extra_args={e.extra_args!r} is not JSON ({err}); write a JSON object, e.g. "
                              f'\'{{"enable_memory_saver": true}}\'') from err
        _require(isinstance(extra, dict), f"engine.extra_args={e.extra_args!r}: must be a JSON object "
                 f'{{"name": value, ...}}')
    for problem in engine_class(e.backend).config_problems(cfg):
        raise ConfigError(problem)
    _require(e.cuda_graph_max_bs >= 0, f"engine.cuda_graph_max_bs={e.cuda_graph_max_bs}: must be >= 0 (0 = the "
             f"largest batch the run sends)")
    _require(e.tp_size >= 1, f"engine.tp_size={e.tp_size}: must be >= 1 (the GPUs the engine spans)")


def describe() -> str:
    """All fields with defaults and help texts, for `--help-config`."""
    lines = []
    for section, cls in _SECTIONS.items():
        lines.append(f"[{section}]")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {section}.{f.name} = {default!r}\n      {f.metadata['help']}")
    lines.append("\nengine.backend (lorabench.engines.ENGINES):")
    lines += [f"  {name:<8} {engine_class(name).help}" for name in ENGINES]
    lines.append("refresh.mode (lorabench.refresh.REFRESH_MODES):")
    lines += [f"  {name:<8} {cls.help}" for name, cls in REFRESH_MODES.items()]
    return "\n".join(lines)
