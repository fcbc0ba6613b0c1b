"""The run config: the components' own sections (SECTIONS, settings.py) composed, from a file plus overrides.

An invalid value raises ConfigError naming the field, the value, its origin and the fix; an unknown key gets
a "did you mean". Files are strict: UTF-8, no key given twice, each value of its field's type.
"""
from __future__ import annotations

import json
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .. import settings as st
from ..data import DataSettings
from ..engines import ENGINES, EngineNeeds, EngineSettings, UpdatesAdapterInPlace, engine_class
from ..group import PolicySpec, _owned_names, check_policy_types, member_dict, parse_policies
from ..grpo import GRPOSettings
from ..models import ModelSettings
from ..policy import LoraSettings
from ..refresh import REFRESH_MODES, RefreshSettings
from ..runlog import RunSettings
from ..settings import ConfigError, path_component_problem
from ..tiny import WarmStartSettings

__all__ = ["SECTIONS", "Config", "ConfigError", "apply_override", "describe", "engine_needs", "flat",
           "parse_config_bytes", "path_component_problem", "read_config_file"]

SECTIONS = {"model": ModelSettings, "warmstart": WarmStartSettings, "lora": LoraSettings, "data": DataSettings,
            "grpo": GRPOSettings, "engine": EngineSettings, "refresh": RefreshSettings, "run": RunSettings}

# names other tools use for a field, which spelling similarity would not find
_SYNONYMS = {"learning_rate": "grpo.lr", "lora_r": "lora.r", "rank": "lora.r", "lora_alpha": "lora.alpha",
             "max_steps": "grpo.steps", "num_steps": "grpo.steps", "model_name": "model.name_or_path",
             "num_generations": "grpo.group_size", "beta": "grpo.kl_beta", "epsilon": "grpo.clip_eps"}


@dataclass
class Config:
    model: ModelSettings = field(default_factory=ModelSettings)
    warmstart: WarmStartSettings = field(default_factory=WarmStartSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataSettings = field(default_factory=DataSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    refresh: RefreshSettings = field(default_factory=RefreshSettings)
    run: RunSettings = field(default_factory=RunSettings)
    policies: list[PolicySpec] = field(default_factory=list)   # a policy group (group.py); [] = one policy

    def __post_init__(self):
        for problem in problems(self):
            raise ConfigError(problem)

    def to_dict(self) -> dict:
        sections = {name: st.to_dict(getattr(self, name)) for name in SECTIONS}
        return {**sections, "policies": [p.to_dict() for p in self.policies]} if self.policies else sections

    def members(self) -> dict[str, Config]:
        """A policy group's policies, each as its own whole run config (group.member_dict)."""
        shared, members = self.to_dict(), {}
        for spec in self.policies:   # each field's type is checked already (parse_policies): here its range
            where = f"{spec.where or 'policies'} ({spec.name})"
            try:
                members[spec.name] = Config.from_dict(member_dict(shared, spec), source=where)
            except ConfigError as err:
                raise ConfigError(f"{where}: {err}") from err
        return members

    @classmethod
    def from_dict(cls, data: dict, source: str = "config", origins: dict[str, str] | None = None) -> Config:
        """The config of `data` (as to_dict); `origins`: {dotted key: its source} for keys not from `source`."""
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a table/object of sections, got {st.shown(data)}")
        mixed = origins is not None and any(key not in origins for key in leaf_keys(data))
        origins = origins or {}

        def origin(key: str) -> str:
            return origins.get(key, source)
        if unknown := set(data) - set(SECTIONS) - {"policies"}:
            name = min(unknown)
            near = st.closest(name, list(SECTIONS))
            given = next((origins[k] for k in origins if k.partition(".")[0] == name), source)
            raise ConfigError(f"{given}: unknown section(s) {sorted(unknown)}"
                              f"{f' (did you mean {near!r}?)' if near else ''}; valid sections: {list(SECTIONS)}")
        sections = {name: st.build(section, data.get(name, {}), f"{source}: {name}", name, did_you_mean, origin)
                    for name, section in SECTIONS.items()}
        policies = parse_policies(data.get("policies"), origin("policies"), SECTIONS)
        try:
            return cls(**sections, policies=policies)
        except ConfigError as err:
            if not mixed:   # every value from one place: the message needs no attribution
                raise
            raise ConfigError(attributed(str(err), origin, leaf_keys(data))) from err

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] = ()) -> Config:
        """A file (or the defaults) with `overrides` on top."""
        data = read_config_file(path) if path is not None else {}
        origins = {apply_override(data, item): f"override {st.shown(item)}" for item in overrides}
        return cls.from_dict(data, source=str(path) if path else "overrides", origins=origins)


def leaf_keys(data: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a config dict's values ('grpo.lr', 'engine.sglang.tp_size', 'policies')."""
    keys = []
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys += leaf_keys(value, f"{dotted}.") if isinstance(value, dict) and key != "policies" else [dotted]
    return keys


def attributed(message: str, origin, keys: list[str]) -> str:
    """`message` prefixed with where each field it names ('grpo.lr=...') came from: 'c.toml: ...', or
    "override 'grpo.lora_compute=bfloat16' (grpo.lora_compute), c.toml (model.dtype): ..."."""
    named = ["policies"] if message.startswith("policies") else [   # a policy's own value: its entry's
        k for k in keys if re.search(rf"(?<![\w.]){re.escape(k)}=", message)]
    sources: dict[str, list[str]] = {}
    for key in named:
        sources.setdefault(origin(key), []).append(key)
    if not sources:
        return message
    if len(sources) == 1:
        return f"{next(iter(sources))}: {message}"
    return ", ".join(f"{where} ({', '.join(k)})" for where, k in sources.items()) + f": {message}"


def problems(cfg: Config) -> list[str]:
    """Each section's own problems, then what involves several sections."""
    found = [p for name in SECTIONS for p in st.value_problems(getattr(cfg, name), name)]
    found = found or [p for name in SECTIONS for p in _section_problems(getattr(cfg, name))]
    if found:
        return found
    if cfg.grpo.lora_compute == "bfloat16" and cfg.model.dtype != "bfloat16":
        found.append(f"grpo.lora_compute=bfloat16 with model.dtype={cfg.model.dtype}: autocast would run the base "
                     f"model's matmuls in bf16 too; set model.dtype=bfloat16, or grpo.lora_compute=auto")
    if cfg.grpo.max_staleness and cfg.engine.release_memory_during_training:
        found.append("grpo.max_staleness > 0 with engine.release_memory_during_training=true: the engine samples "
                     "the next step while this one trains, so it cannot be released then; set one of them off")
    members = cfg.members()   # built once here; a policy's invalid value raises, naming the policy
    if cfg.policies:   # what a group cannot do (each policy's own config is checked as members() builds it)
        mode = cfg.refresh.mode
        found += [*st.check(not REFRESH_MODES[mode].takes_base_weights, f"refresh.mode={mode} with policies: it "
                            "overwrites the engine's base weights, which every policy of the group shares; use "
                            "refresh.mode=inplace, tensor or file"),
                  *st.check(not cfg.engine.release_memory_during_training, "engine.release_memory_during_training="
                            "true with policies: each policy would release and resume the shared engine around its "
                            "own update; not supported for a group, set it to false")]
    return found + engine_class(cfg.engine.backend).needs_problems(cfg.engine.chosen, engine_needs(cfg, members))


def _section_problems(section) -> list[str]:
    return [*section.problems(), *(p for sub in section.subsections.values() for p in _section_problems(sub))]


def engine_needs(cfg: Config, members: dict[str, Config] | None = None, run: bool = True) -> EngineNeeds:
    """What this run (a group: all its policies at once) asks of its engine; `members`: cfg.members() if built.
    run=False: a scratch engine, which any refresh mode may write, in place too."""
    g, d = cfg.grpo, cfg.data
    members = cfg.members() if members is None else members
    loras = [m.lora for m in members.values()] if cfg.policies else [cfg.lora]
    targets = [lora.target_modules for lora in loras]
    if any(t == "all-linear" for t in targets):
        target = "all-linear"
    else:
        names = sorted({name for t in targets for name in ([t] if isinstance(t, str) else t)})
        target = names[0] if len(names) == 1 else tuple(names)
    return EngineNeeds(lora_rank=max(lora.r for lora in loras), target_modules=target,
                       largest_batch=max(len(loras) * g.prompts_per_step * g.group_size, d.eval_size * d.eval_samples),
                       seed=cfg.run.seed, model_dtype=cfg.model.dtype, adapters=len(loras),
                       max_new_tokens=g.max_new_tokens, samples_ahead=g.max_staleness > 0,
                       in_place=not run or UpdatesAdapterInPlace in REFRESH_MODES[cfg.refresh.mode].needs)


def flat(cfg: Config) -> dict[str, object]:
    """{'grpo.lr': 0.001, 'engine.sglang.tp_size': 1, ...}: every field of every section."""
    return {key: value for name in SECTIONS for key, _, value in st.walk(getattr(cfg, name), name)}


def did_you_mean(prefix: str, key: str) -> str:
    """A synonym (learning_rate -> grpo.lr), the same key elsewhere (grpo.seed -> run.seed), else the closest key."""
    dotted, keys = f"{prefix}.{key}", [k for name, cls in SECTIONS.items() for k, _ in st.walk_class(cls, name)]
    if key in _SYNONYMS:
        return f" (did you mean {_SYNONYMS[key]}?)"
    if elsewhere := [k for k in keys if k.rsplit(".", 1)[-1] == key and not k.startswith(f"{prefix}.")]:
        return f" (did you mean {elsewhere[0]}?)"
    own = st.closest(dotted, [k for k in keys if k.startswith(f"{prefix}.")]) or st.closest(dotted, keys)
    return f" (did you mean {own}?)" if own else ""


def apply_override(data: dict, item: str) -> str:
    """`engine.sglang.tp_size=2` -> data['engine']['sglang']['tp_size'] = '2' (typed when built); the dotted key."""
    key, sep, value = item.partition("=")
    if key.strip() == "policies" and sep:   # a list of tables, as JSON: policies=[{"name": "r1", "lora": {"r": 1}}]
        data["policies"] = value
        return "policies"
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r} must look like section.field=value, e.g. grpo.lr=3e-4")
    table = data
    for part in parts[:-1]:
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(parts[:-1])} is a value, not a section")
    table[parts[-1]] = value
    return ".".join(parts)


def read_config_file(path: str | Path) -> dict:
    """A config file's sections, each value of its field's type (settings.check_types)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing .json or .toml file")
    if path.suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path}: unsupported suffix {path.suffix!r}; use .json or .toml")
    data = parse_config_bytes(path.read_bytes(), path)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be an object of sections, got {st.shown(data)}")
    for name, section in SECTIONS.items():
        st.check_types(section, data.get(name), f"{path}: {name}")
    check_policy_types(data.get("policies"), str(path), SECTIONS)
    return data


def parse_config_bytes(raw: bytes, path: Path) -> dict:
    """The sections of a config file's bytes (`path`: its name and, by suffix, format)."""
    try:
        text = raw.decode("utf-8-sig")  # an editor's UTF-8 BOM is not an error
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {raw[err.start]:#04x} at offset "
                          f"{err.start}); save it as UTF-8") from err
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text, object_pairs_hook=st.JSONObject.of)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:]}: {err}") from err
    except ValueError as err:   # int() of a longer number than Python reads, in TOML and JSON alike
        if "integer string conversion" not in str(err):
            raise
        raise ConfigError(f"config file {path} holds a number of more than {sys.get_int_max_str_digits():,} digits, "
                          f"which Python does not read and no setting takes; shorten it") from err
    if twice := st.given_twice(data):
        key, first, second = twice
        name = json.dumps(key.rsplit(".", 1)[-1])
        pattern = re.compile(rf"{re.escape(name)}\s*:")
        lines = [i + 1 for i, line in enumerate(text.splitlines()) for _ in pattern.finditer(line)]
        at = "" if len(lines) != 2 else f" (line {lines[0]})" if lines[0] == lines[1] else \
            f" (lines {lines[0]} and {lines[1]})"   # where the key's name is found twice only: no guessing
        raise ConfigError(f"config file {path}: {key} is given twice{at}, {st.shown(first, 30)} then "
                          f"{st.shown(second, 30)}; JSON readers keep the last one without a word, and lorabench "
                          f"refuses it as TOML does: keep the one you mean")
    return data


def describe() -> str:
    """All fields with defaults, help texts and what a continued run may do with them (`--help-config`)."""
    lines = [line for name, cls in SECTIONS.items() for line in st.describe_section(cls, name)]
    lines.append("\nengine.backend (lorabench.engines.ENGINES):")
    lines += [f"  {name:<8} {engine_class(name).help}" for name in ENGINES]
    lines.append("refresh.mode (lorabench.refresh.REFRESH_MODES):")
    lines += [f"  {name:<8} {cls.help}" for name, cls in REFRESH_MODES.items()]
    lines += ["\npolicies (lorabench.group): several LoRA policies trained side by side on one engine and one base",
              "  model, each with its own run dir GROUP/<name>. A list of tables, each a name and the fields that",
              "  policy sets for itself; everything else is shared. TOML: policies = [{name = \"r1\", lora.r = 1},",
              "  {name = \"r16\", lora.r = 16}]; on the command line as JSON: policies='[{\"name\": \"r1\", \"lora\":",
              "  {\"r\": 1}}, ...]'. A policy may set: " + _owned_names() + "."]
    return "\n".join(lines)
