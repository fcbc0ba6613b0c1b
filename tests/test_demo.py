"""The demo path end to end on the CPU: the warm-started tiny model (built once and cached, ~3 min
on 2 cores), the CLI, the run directory, resume, and the refresh-on / refresh-off contrast.

These train for real, so they are marked `slow` (they still run in CI with `make test`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorabench.session import build_trainer, resolve_model, start_engine
from lorabench.session.config import Config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def warm_model() -> str:
    """The demo's warm-started model (same recipe as `lorabench demo`, so the cache is shared)."""
    return resolve_model(Config(), log=print)


def run_steps(model_path: str, mode: str, steps: int) -> list[dict]:
    cfg = Config.load(None, [f"refresh.mode={mode}", f"grpo.steps={steps}"])
    engine = start_engine(cfg, model_path)
    trainer = build_trainer(cfg, model_path, engine, log=lambda *a: None)
    rows = [trainer.step().metrics for _ in range(steps)]
    trainer.close()
    engine.close()
    return rows


def test_refresh_on_keeps_engine_exact_and_learns_refresh_off_stalls(warm_model):
    """With refresh on, trainer and engine agree to numerical noise on every step and the training
    reward rises; with refresh off (the stale-adapter control) the mismatch grows after the first
    step and the reward of the engine's rollouts stays where it started."""
    steps = 16
    fresh = run_steps(warm_model, "tensor", steps)
    stale = run_steps(warm_model, "none", steps)
    assert max(r["mismatch/max"] for r in fresh) < 1e-3
    assert [r["adapter/served_version"] for r in fresh] == list(range(steps))      # every step saw the last
    assert {r["adapter/served_version"] for r in stale} == {0}                       # never refreshed
    assert stale[0]["mismatch/max"] < 1e-3            # step 1: nothing trained yet, both agree
    assert stale[-1]["mismatch/mean"] > 20 * max(r["mismatch/mean"] for r in fresh)
    assert stale[-1]["mismatch/mean"] > stale[1]["mismatch/mean"]  # and it keeps growing
    first = lambda rows: sum(r["reward/mean"] for r in rows[:4]) / 4  # noqa: E731
    last = lambda rows: sum(r["reward/mean"] for r in rows[-4:]) / 4  # noqa: E731
    assert last(fresh) - first(fresh) > 0.15, [round(r["reward/mean"], 2) for r in fresh]
    assert last(stale) - first(stale) < 0.1, [round(r["reward/mean"], 2) for r in stale]
    assert last(fresh) > last(stale) + 0.15


def lorabench(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorabench.cli", *args], cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_cli_demo_writes_run_dir_and_resume_continues(warm_model, tmp_path):
    small = ["grpo.steps=2", "data.eval_size=8", "run.out_dir=" + str(tmp_path), "run.name=r", "refresh.mode=file"]
    done = lorabench("demo", *small, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "held-out strict reward" in done.stdout and "What the model learns" in done.stdout
    run = tmp_path / "r"
    for name in ("config.json", "metrics.jsonl", "sync.jsonl", "rollouts.jsonl", "evals.jsonl", "summary.json",
                 "plots/reward.png", "plots/refresh.png", "plots/mismatch.png", "adapters/step_2/adapter_config.json",
                 "checkpoint/trainer_state.pt"):
        assert (run / name).exists(), name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"reward/mean", "mismatch/max", "refresh/total_s", "refresh/write_s", "time/step_s",
            "adapter/served_version"} <= set(rows[0])
    oct_mode = (run.stat().st_mode & 0o777)
    assert not oct_mode & 0o002, f"run dir is world-writable: {oct(oct_mode)}"
    resumed = lorabench("resume", str(run), "grpo.steps=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_cli_rejects_bad_config_with_a_clear_message(tmp_path):
    bad = lorabench("demo", "grpo.group_size=1", cwd=tmp_path)
    assert bad.returncode == 2
    assert "grpo.group_size" in bad.stderr and "at least 2" in bad.stderr
    missing = lorabench("run", "--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert missing.returncode == 2 and "nope.toml" in missing.stderr
    no_model = lorabench("run", f"model.name_or_path={tmp_path / 'no-such-model'}", f"run.out_dir={tmp_path}",
                         cwd=tmp_path)
    assert no_model.returncode == 2 and "no-such-model" in no_model.stderr
    assert "Traceback" not in no_model.stderr  # a user error is one line, not a stack
