"""Rollout engines: one core protocol plus optional capabilities (base.py), one registry.

An engine is one file here plus one line in ENGINES: a class with `name`, `help`, `Settings` (its
`engine.<name>` section, or None), `needs_problems(settings, needs)`, `check_available(settings,
capabilities)`, `device_of(settings)`, `process_memory(settings, needs, vocab, base_weight_bytes)`,
`from_settings(model_path, settings, needs)` and the RolloutEngine methods. An optional dependency
(sglang) is imported only when its engine starts.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..settings import ALLOWED, Section, check, path_component_problem, setting
from .base import (
    SERVED,
    AdapterAlreadyLoaded,
    AdapterNotLoaded,
    EngineError,
    EngineNeeds,
    PushesWeights,
    ReleasesMemory,
    RolloutEngine,
    Sampling,
    StaleAdapter,
    UpdatesAdapterInPlace,
)

ENGINES = {  # config name -> "module:Class"
    "hf": "lorabench.engines.hf:HFEngine",
    "sglang": "lorabench.engines.sglang:SGLangEngine",
}


def engine_class(backend: str) -> type:
    """The engine class registered as `backend` (its module is imported now)."""
    if backend not in ENGINES:
        raise EngineError(f"engine.backend={backend!r}: use one of {sorted(ENGINES)}")
    module, _, cls = ENGINES[backend].partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class EngineSettings(Section):
    """The `engine` section: the rollout engine, its adapter name, and each engine's own sub-section."""
    backend: str = setting("hf", "The rollout engine; one of the registry's (lorabench.engines.ENGINES): 'hf' "
                           "(transformers + PEFT, CPU or GPU) or 'sglang' (in-process sglang.Engine).",
                           resume=ALLOWED, why=SERVED)
    adapter_name: str = setting("policy", "Name the current adapter is served under.", resume=ALLOWED, why=SERVED)
    release_memory_during_training: bool = setting(
        False, "Release the engine's KV cache (and its weights, with merged refresh) while the trainer runs, resumed "
        "symmetrically; an engine that can (ReleasesMemory: sglang with enable_memory_saver) frees the GPU memory "
        "for training.", resume=ALLOWED, why=SERVED)

    @classmethod
    def parts(cls) -> dict[str, type]:
        return {name: engine_class(name).Settings for name in ENGINES if engine_class(name).Settings is not None}

    def problems(self) -> list[str]:
        problem = path_component_problem(self.adapter_name)
        return [*check(self.backend in ENGINES, f"engine.backend={self.backend!r}: use one of {sorted(ENGINES)}"),
                *check(problem is None, f"engine.adapter_name={self.adapter_name!r} {problem}; give a plain name "
                       f"such as 'policy' (file refresh makes a dir named after it)")]

    @property
    def chosen(self):   # the chosen backend's own sub-section (None for an engine without settings)
        return self.subsections.get(self.backend)


def make_engine(settings, model_path: str, needs=None, **overrides):
    """The engine the `engine` section chooses, serving `model_path`, started with its sub-section and `needs`."""
    needs = needs or EngineNeeds()
    return engine_class(settings.backend).from_settings(model_path, settings.chosen, needs, **overrides)


__all__ = ["ENGINES", "AdapterAlreadyLoaded", "AdapterNotLoaded", "EngineError", "EngineNeeds", "EngineSettings",
           "PushesWeights", "ReleasesMemory", "RolloutEngine", "Sampling", "StaleAdapter", "UpdatesAdapterInPlace",
           "engine_class", "make_engine"]
