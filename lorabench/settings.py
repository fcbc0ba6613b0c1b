"""Settings: how a component declares what can be set, and how sections are read and explained.

Each component defines its section as a dataclass next to its code; every field is made with `setting()`:
a default, a help text, and whether a continued run may change it (`resume=ALLOWED` or `REFUSED`, `why`
in one clause). A section validates itself in `problems()` and lists registry sub-sections in `parts()`.
Values arrive as override text (converted here) or typed from TOML/JSON files (`check_types`).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import field

ALLOWED, REFUSED = "allowed", "refused"


class ConfigError(ValueError):
    """A config file or override is invalid; the message says which field and how to fix it."""


def setting(default, help: str, *, resume: str, why: str, writes: str = ""):
    """A settings field: its default, help text, and whether (and why) a continued run may change it.
    writes="dir" / "file": a directory the run writes into, or a file it appends to; checked before anything is
    made (preflight)."""
    if resume not in (ALLOWED, REFUSED):
        raise ValueError(f"resume={resume!r}: use settings.ALLOWED or settings.REFUSED")
    metadata = {"help": help, "resume": resume, "why": why, **({"writes": writes} if writes else {})}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=metadata)
    return field(default=default, metadata=metadata)


def check(condition: bool, message: str) -> list[str]:
    """[] if `condition` holds, else [message]: a section's problems() adds these up."""
    return [] if condition else [message]


class Section:
    """Base of a settings section. `parts()` names its sub-sections (read from a registry when built, so a
    part registered later is picked up), kept in `self.subsections` and reachable as attributes."""

    @classmethod
    def parts(cls) -> dict[str, type]:
        return {}

    def __post_init__(self):   # a section made in code gets its parts' defaults; build() replaces them
        self.subsections = {name: part() for name, part in self.parts().items()}

    def problems(self) -> list[str]:
        return []

    def __getattr__(self, name: str):
        if name in (subsections := self.__dict__.get("subsections", {})):
            return subsections[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")


def build(cls, values: dict, where: str, prefix: str, suggest=lambda prefix, key: "", origin=None):
    """Section `cls` (dotted name `prefix`) from `values`, each converted to its field's type. `suggest(prefix,
    key)`: a "did you mean" for an unknown key; `origin(dotted key)`: that value's source, for the messages.
    Validation is the composing config's."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table/object, got {shown(values)}")
    parts, names = cls.parts(), {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names - set(parts)
    if unknown:
        valid = sorted(names) + [f"{p}.*" for p in parts]
        at = f"{origin(f'{prefix}.{min(unknown)}')}: {prefix}" if origin else where
        raise ConfigError(f"{at}: unknown key(s) {sorted(unknown)}{suggest(prefix, min(unknown))}; valid keys: {valid}")
    hints = typing.get_type_hints(cls)
    section = cls(**{k: convert(v, hints[k], f"{origin(f'{prefix}.{k}')}: {prefix}.{k}" if origin else f"{where}.{k}")
                     for k, v in values.items() if k in names})
    section.subsections = {name: build(part, values.get(name, {}), f"{where}.{name}", f"{prefix}.{name}", suggest,
                                       origin) for name, part in parts.items()}
    return section


def check_types(cls, values, where: str) -> None:
    """Values of section `cls` from a TOML/JSON file (`where`: 'FILE: grpo'): each must already have its
    field's type, or ConfigError says how to write it (None: the defaults; unknown keys: build's)."""
    if values is None:
        return
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table/object, got {shown(values)}")
    hints, parts = typing.get_type_hints(cls), cls.parts()
    for key, value in values.items():
        if key in parts:
            check_types(parts[key], value, f"{where}.{key}")
        elif key in hints:
            problem = _type_problem(value, hints[key])
            if problem:
                raise ConfigError(f"{where}.{key}: {shown(value)} is {problem}")


def _kind(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string (in quotes)",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def _type_problem(value, typ) -> str | None:
    """Why a typed file value cannot be a field of type `typ`, with how to write it; None if it can."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):   # str | list[str]
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return None
        what = _kind(value) if not isinstance(value, list) else "a list with " + _kind(
            next(v for v in value if not isinstance(v, str)))
        return f"{what}; write a string or a list of strings, e.g. [\"q_proj\", \"v_proj\"]"
    if typ is bool:
        return None if isinstance(value, bool) else f"{_kind(value)}, not a boolean; write true or false (no quotes)"
    number = not isinstance(value, bool) and isinstance(value, int if typ is int else (int, float))
    if typ is int:
        return None if number else f"{_kind(value)}, not a whole number; write one without quotes or a decimal " \
                                   f"point, e.g. 8"
    if typ is float:
        return None if number else f"{_kind(value)}, not a number; write one without quotes, e.g. 1e-3"
    if typ is str:
        return None if isinstance(value, str) else f"{_kind(value)}, not a string; put it in quotes"
    return None


def shown(value, width: int = 60) -> str:
    """repr(value), cut to about `width` characters (a 5,000-digit number is not printed whole)."""
    text = repr(value)
    return text if len(text) <= width else f"{text[:width]}... ({len(text):,} characters)"


def to_dict(section) -> dict:
    """Plain data: the section's fields, then one table per sub-section."""
    data = {f.name: (list(value) if isinstance(value := getattr(section, f.name), (list, tuple)) else value)
            for f in dataclasses.fields(section)}
    data.update({name: to_dict(sub) for name, sub in section.__dict__.get("subsections", {}).items()})
    return data


def walk(section, prefix: str) -> Iterator[tuple[str, dataclasses.Field, object]]:
    """(dotted key, field, value) for every field of a section and its sub-sections."""
    for f in dataclasses.fields(section):
        yield f"{prefix}.{f.name}", f, getattr(section, f.name)
    for name, sub in section.__dict__.get("subsections", {}).items():
        yield from walk(sub, f"{prefix}.{name}")


def walk_class(cls, prefix: str) -> Iterator[tuple[str, dataclasses.Field]]:
    """(dotted key, field) for every field a section class and its current parts declare."""
    for f in dataclasses.fields(cls):
        yield f"{prefix}.{f.name}", f
    for name, part in cls.parts().items():
        yield from walk_class(part, f"{prefix}.{name}")


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def value_problems(section, prefix: str) -> list[str]:
    """Values of the right type that are never a setting: inf and nan, and text with a NUL character."""
    found = [f"{key}={value}: must be a finite number (the default is {default_of(f)})"
             for key, f, value in walk(section, prefix) if isinstance(value, float) and not math.isfinite(value)]
    return found + [f"{key}={value!r} contains a NUL character; no setting can hold one: remove it"
                    for key, _, value in walk(section, prefix)   # a str, or a list of them
                    if any(isinstance(t, str) and "\0" in t
                           for t in (value if isinstance(value, (list, tuple)) else [value]))]


def convert(value, typ, where: str):
    """A file value or an override string as the field's type, or a ConfigError saying how to write it."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):  # str | list[str]
        if isinstance(value, list):
            return [str(v) for v in value]
        if isinstance(value, str) and value.startswith("["):
            try:
                return [str(v) for v in json.loads(value)]
            except json.JSONDecodeError as err:
                raise ConfigError(f'{where}: {value!r} is not a JSON list ({err}); write e.g. ["q_proj","v_proj"]') \
                    from err
        if isinstance(value, str) and "," in value:
            return [v.strip() for v in value.split(",") if v.strip()]
        return str(value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{where}: {shown(value)} is not a boolean; use true or false")
    if typ in (int, float):
        kind = "an int" if typ is int else "a float"
        if isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is a boolean, expected {kind}")
        try:
            converted = typ(value)
        except (TypeError, ValueError, OverflowError) as err:   # OverflowError: int(inf)
            raise ConfigError(f"{where}: {shown(value)} is not {kind}; write e.g. {'8' if typ is int else '1e-3'}") \
                from err
        if typ is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"{where}: {value!r} is not a whole number")
        return converted
    if typ is str and isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: expected a string, got {shown(value)}")
    return str(value) if typ is str else value


class JSONObject(dict):
    """json.loads' object_pairs_hook (`JSONObject.of`) remembering the first key given twice: json keeps the
    last silently, TOML refuses it, and so does lorabench (`given_twice`, `unique_keys`)."""
    twice: tuple = ()

    @classmethod
    def of(cls, pairs) -> JSONObject:
        obj = cls()
        for key, value in pairs:
            if key in obj and not obj.twice:
                obj.twice = (key, obj[key], value)
            obj[key] = value
        return obj


def given_twice(value, path: str = "") -> tuple[str, object, object] | None:
    """(dotted key, first value, second value) of the first key given twice in parsed JSON, or None."""
    if isinstance(value, list):
        return next(filter(None, (given_twice(v, f"{path}[{i}]") for i, v in enumerate(value))), None)
    if not isinstance(value, dict):
        return None
    if getattr(value, "twice", ()):
        key, first, second = value.twice
        return f"{path}.{key}" if path else key, first, second
    return next(filter(None, (given_twice(v, f"{path}.{k}" if path else k) for k, v in value.items())), None)


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object_pairs_hook that refuses a key given twice in one object at once."""
    obj = JSONObject.of(pairs)
    if obj.twice:
        raise ConfigError(f"key {obj.twice[0]!r} appears twice in one table; keep one of them")
    return obj


def closest(name: str, candidates: list[str]) -> str | None:
    found = difflib.get_close_matches(name, candidates, n=1)
    return found[0] if found else None


def describe_section(cls, prefix: str) -> list[str]:
    """`--help-config` lines for a section class and its parts: key = default, help, what resume may do."""
    lines = [f"[{prefix}]"]
    for f in dataclasses.fields(cls):
        resume = "may change on resume" if f.metadata["resume"] == ALLOWED else "fixed for a run"
        lines.append(f"  {prefix}.{f.name} = {default_of(f)!r}\n      {f.metadata['help']} ({resume}: "
                     f"{f.metadata['why']})")
    for name, part in cls.parts().items():
        lines += describe_section(part, f"{prefix}.{name}")
    return lines


def path_component_problem(value: str) -> str | None:
    """Why `value` cannot be one name inside a directory (a run dir, an adapter), or None."""
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
