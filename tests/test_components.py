"""Adding a component is one class and one registry line: a toy engine and a toy refresh mode, each
with one setting of its own, appear in `--help-config`, are validated, follow the resume rules and
run a GRPO step through RunSession, without a line changed anywhere else; a mode whose setting is a
directory it writes into gets that directory checked before the run dir exists."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lorabench.adapters import FlatAdapter
from lorabench.engines import ENGINES
from lorabench.engines.base import SERVED, EngineError
from lorabench.engines.hf import HFEngine
from lorabench.refresh import REFRESH_MODES, TensorRefresh
from lorabench.rundir import RunDirError
from lorabench.session import Config, ConfigError, RunSession, compat, describe
from lorabench.settings import ALLOWED, REFUSED, Section, check, setting


class CountingEngine(HFEngine):
    """The hf engine with a request budget: a real engine with a setting of its own."""

    @dataclass
    class Settings(Section):
        max_requests: int = setting(1000, "Requests served before the engine refuses more.", resume=ALLOWED,
                                    why=SERVED)

        def problems(self) -> list[str]:
            return check(self.max_requests >= 1, f"engine.counting.max_requests={self.max_requests}: must be >= 1")

    name = "counting"
    help = "the hf engine with a request budget"

    @staticmethod
    def check_available(settings, capabilities=()) -> None:
        pass

    @staticmethod
    def device_of(settings) -> str:
        return "cpu"

    @classmethod
    def from_settings(cls, model_path, settings, needs, **overrides):
        engine = cls(model_path, device="cpu", dtype=needs.model_dtype, **overrides)
        engine.budget, engine.requests = settings.max_requests, 0
        return engine

    def generate(self, prompt_ids, sampling, adapter):
        self.requests += 1
        if self.requests > self.budget:
            raise EngineError(f"request {self.requests} is over engine.counting.max_requests={self.budget}")
        return super().generate(prompt_ids, sampling, adapter)


class ScaledRefresh(TensorRefresh):
    """Tensor refresh of the adapter with every weight scaled: what is served then differs from the
    trainer's policy, so a continued run may not change the scale."""

    @dataclass
    class Settings(Section):
        scale: float = setting(1.0, "Factor on every adapter weight sent (1.0 = as trained).", resume=REFUSED,
                               why="it changes the policy the engine serves")

    mode = "scaled"
    help = "tensor refresh of a scaled adapter"

    def __init__(self, engine, adapter_name: str, bucket_mb: float = 64.0, scale: float = 1.0):
        super().__init__(engine, adapter_name, bucket_mb)
        self.scale = scale   # from refresh.scaled.scale: Refresher.from_settings passes its fields

    def _refresh(self, adapter, record):
        scaled = FlatAdapter(adapter.buffer * self.scale, adapter.layout, adapter.config, adapter.version)
        super()._refresh(scaled, record)


class NotedRefresh(TensorRefresh):
    """Tensor refresh that also notes each version it sent in a directory of the user's choosing."""

    @dataclass
    class Settings(Section):
        notes_dir: str = setting("", "Where each refreshed version is noted ('' = nowhere).", resume=ALLOWED,
                                 why="where the notes go", writes="dir")

    mode = "noted"
    help = "tensor refresh that notes each version in a directory"

    @classmethod
    def from_settings(cls, engine, adapter_name, settings, own=None, base_weights=None):
        refresher = cls(engine, adapter_name, settings.bucket_mb)
        refresher.notes_dir = own.notes_dir
        return refresher

    def _refresh(self, adapter, record):
        super()._refresh(adapter, record)
        if self.notes_dir:
            (Path(self.notes_dir) / f"version-{adapter.version}").touch()


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(ENGINES, "counting", f"{__name__}:CountingEngine")   # the one registry line each
    monkeypatch.setitem(REFRESH_MODES, "scaled", ScaledRefresh)


def toy_config(tmp_path, *extra) -> Config:
    return Config.load(overrides=["engine.backend=counting", "refresh.mode=scaled", "warmstart.steps=0",
                                  "grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=6",
                                  "data.eval_size=2", "lora.r=4", "lora.alpha=8", "grpo.steps=2",
                                  f"run.out_dir={tmp_path / 'runs'}", "run.name=toy", *extra])


def test_they_appear_in_the_help_and_are_validated(registered, tmp_path):
    text = describe()
    assert "engine.counting.max_requests = 1000" in text and "refresh.scaled.scale = 1.0" in text
    assert "counting" in text.split("engine.backend (")[1] and "scaled" in text.split("refresh.mode (")[1]
    cfg = toy_config(tmp_path, "engine.counting.max_requests=5", "refresh.scaled.scale=0.5")
    assert cfg.engine.counting.max_requests == 5 and cfg.refresh.scaled.scale == 0.5
    with pytest.raises(ConfigError, match=r"engine.counting.max_requests=0: must be >= 1"):
        toy_config(tmp_path, "engine.counting.max_requests=0")
    with pytest.raises(ConfigError, match=r"did you mean engine.counting.max_requests\?"):
        toy_config(tmp_path, "engine.counting.max_request=5")
    with pytest.raises(ConfigError, match=r"refresh.scaled.scale: 'big' is not a float"):
        toy_config(tmp_path, "refresh.scaled.scale=big")


def test_they_follow_the_resume_rules(registered, tmp_path):
    assert "engine.counting.max_requests" in compat.allowed()
    assert compat.refused()["refresh.scaled.scale"] == "it changes the policy the engine serves"
    old = toy_config(tmp_path)
    diff = compat.check_continuation(tmp_path, old, toy_config(tmp_path, "engine.counting.max_requests=7"), 1)
    assert diff == {"engine.counting.max_requests": (1000, 7)}
    with pytest.raises(RunDirError, match=r"refresh.scaled.scale 1.0 -> 0.5 \(it changes the policy"):
        compat.check_continuation(tmp_path, old, toy_config(tmp_path, "refresh.scaled.scale=0.5"), 1)


def test_they_run_a_step_and_a_continued_run_keeps_the_rules(registered, tmp_path):
    cfg = toy_config(tmp_path, "engine.counting.max_requests=50", "refresh.scaled.scale=0.5")
    session = RunSession.open(cfg, log=lambda *a: None)
    try:
        record = session.trainer.step()
        engine, trainer = session.engine, session.trainer
        assert isinstance(engine, CountingEngine) and engine.requests >= 3    # evaluations, then the rollout
        assert record.refresh.mode == "scaled" and engine.served_version("policy") == 1
        trained = trainer.policy.adapter().tensors                            # PEFT state-dict names
        held = dict(engine._peft.named_parameters())                           # name.lora_A.<adapter>.weight
        name = next(n for n in trained if ".lora_A." in n)
        served = held[name.replace(".lora_A.", ".lora_A.policy.")]
        assert torch.allclose(served, 0.5 * trained[name]) and trained[name].abs().sum() > 0   # scaled, as set
    finally:
        session.close()
    with pytest.raises(RunDirError, match="refresh.scaled.scale"):
        RunSession.open(toy_config(tmp_path, "engine.counting.max_requests=50"), log=lambda *a: None)
    again = RunSession.open(toy_config(tmp_path, "engine.counting.max_requests=60", "refresh.scaled.scale=0.5"),
                            log=lambda *a: None)
    try:
        assert again.trainer.step_count == 1 and again.engine.budget == 60
    finally:
        again.close()


def test_a_mode_with_a_dir_setting_gets_it_checked_and_used(monkeypatch, tmp_path):
    monkeypatch.setitem(REFRESH_MODES, "noted", NotedRefresh)   # its one registry line
    notes, not_a_dir = tmp_path / "notes", tmp_path / "a-file"
    notes.mkdir()
    not_a_dir.write_text("")
    config = toy_config(tmp_path, "engine.backend=hf", "refresh.mode=noted", f"refresh.noted.notes_dir={not_a_dir}")
    with pytest.raises(ConfigError, match=rf"refresh.noted.notes_dir='{not_a_dir}': .* is a file, not a directory"):
        RunSession.open(config, log=lambda *a: None)
    assert not (tmp_path / "runs").exists()                     # refused before anything was made
    session = RunSession.open(toy_config(tmp_path, "engine.backend=hf", "refresh.mode=noted",
                                         f"refresh.noted.notes_dir={notes}"), log=lambda *a: None)
    try:
        session.trainer.step()
    finally:
        session.close()
    assert sorted(p.name for p in notes.iterdir()) == ["version-0", "version-1"]
