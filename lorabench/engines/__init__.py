"""Rollout engines: one core protocol plus optional capabilities (base.py), one registry.

Adding an engine is one file here (a class with `name`, `help`, `config_problems(cfg)`,
`from_config(cfg, model_path)` and the RolloutEngine methods) plus one line in ENGINES. Config
validation, the CLI's help and the benchmarks read ENGINES; modules are imported only when used,
so a missing optional dependency (sglang) fails only for the engine that needs it.
"""
from __future__ import annotations

import importlib

from .base import (
    AdapterAlreadyLoaded,
    AdapterNotLoaded,
    Completion,
    EngineError,
    PushesWeights,
    ReleasesMemory,
    RolloutEngine,
    Sampling,
    StaleAdapter,
    UpdatesAdapterInPlace,
    require,
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


def make_engine(cfg, model_path: str, **overrides):
    """The configured engine, serving `model_path`'s base weights."""
    return engine_class(cfg.engine.backend).from_config(cfg, model_path, **overrides)


__all__ = ["ENGINES", "AdapterAlreadyLoaded", "AdapterNotLoaded", "Completion", "EngineError", "PushesWeights",
           "ReleasesMemory", "RolloutEngine", "Sampling", "StaleAdapter", "UpdatesAdapterInPlace", "engine_class",
           "make_engine", "require"]
