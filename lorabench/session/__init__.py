"""The session composes a run from its components, each given its own section of the run config:

    cfg = Config.load("my.toml", ["grpo.steps=50"])     # the sections, composed (config.py)
    session = RunSession.open(cfg, run_dir="runs/nb")    # checks, model, run dir, engine, trainer (run.py)
    session.trainer.step()
"""
from .config import Config, ConfigError, describe
from .group import GroupSession
from .run import RunPlan, RunSession, build_trainer, plan_run, resolve_model, start_engine


def load_config(path=None, overrides=()) -> Config:
    """The run config of a file (or the defaults) with `key=value` overrides on top."""
    return Config.load(path, list(overrides))


__all__ = ["Config", "ConfigError", "GroupSession", "RunPlan", "RunSession", "build_trainer", "describe",
           "load_config", "plan_run", "resolve_model", "start_engine"]
