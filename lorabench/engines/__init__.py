"""Rollout engines: one protocol (base.RolloutEngine), two implementations (hf, sglang)."""
from .base import (AdapterAlreadyLoaded, AdapterNotLoaded, Completion, EngineError, RolloutEngine,
                   Sampling)


def make_engine(cfg, model_path: str):
    """The configured engine, serving `model_path`'s base weights."""
    if cfg.engine.backend == "hf":
        from .hf import HFEngine
        return HFEngine(model_path, cfg)
    from .sglang import SGLangEngine
    return SGLangEngine(model_path, cfg)


__all__ = ["AdapterAlreadyLoaded", "AdapterNotLoaded", "Completion", "EngineError", "RolloutEngine",
           "Sampling", "make_engine"]
