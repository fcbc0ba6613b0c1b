"""A run opened from Python (a notebook) the way `lorabench run` opens it, so the CLI can resume it.

    session = RunSession.open(cfg, run_dir="runs/nb")   # config.json, model, engine, trainer
    session.trainer.step()                              # metrics.jsonl / sync.jsonl / checkpoint
    print(session.resume_command(extra_steps=5))        # lorabench resume runs/nb grpo.steps=8

The run directory has the CLI's layout (runlog.py). Like the CLI, a fresh run is evaluated on the
held-out set before its first step (evals.jsonl, sampled then greedy): `lorabench resume` expects
those step-0 rows.
"""
from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config


@dataclass
class RunSession:
    cfg: Config
    runlog: object        # runlog.RunLog
    engine: object        # a RolloutEngine
    trainer: object       # grpo.GRPOTrainer
    model_path: str
    model_seconds: float = 0.0                        # model resolution (tiny: build + warm-start)
    before: list[dict] = field(default_factory=list)  # step-0 held-out evals: [sampled, greedy]

    @classmethod
    def open(cls, cfg: Config, run_dir: str | Path | None = None, log=print, evaluate_first: bool = True):
        """Create (or reopen) the run dir, write config.json, build the model, engine and trainer.
        A run dir that already holds a checkpoint is resumed from it, as `lorabench resume` does."""
        import torch
        from .engines import make_engine
        from .grpo import GRPOTrainer
        from .models import resolve_model_path
        from .runlog import RunLog

        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        runlog = RunLog(run_dir) if run_dir else RunLog.create(cfg.run.out_dir, cfg.run.name)
        runlog.write_config(cfg.to_dict())
        log(f"run dir: {runlog.dir}")
        t0 = time.perf_counter()
        model_path = resolve_model_path(cfg, log=log)
        model_seconds = time.perf_counter() - t0
        engine = make_engine(cfg, model_path)
        try:
            trainer = GRPOTrainer(cfg, model_path, engine, runlog, log=log)
            session = cls(cfg, runlog, engine, trainer, model_path, model_seconds)
            if evaluate_first:
                session.evaluate_before()
        except BaseException:
            engine.close()
            raise
        return session

    def evaluate_before(self) -> list[dict]:
        """The step-0 held-out evaluations (sampled, greedy): read back from evals.jsonl, or run
        now for a new run or one killed between its two "before" evaluations."""
        from .runlog import RunDirError
        before = [e for e in self.runlog.evals() if e["step"] == 0]
        if len(before) < 2:
            if self.trainer.step_count > 0:
                raise RunDirError(f"{self.runlog.dir / 'evals.jsonl'} lacks the step-0 evaluations of a run "
                                  f"at step {self.trainer.step_count}; restore the file or start a new run")
            before = [self.trainer.evaluate(greedy=False), self.trainer.evaluate(greedy=True)]
            self.runlog.set_evals(0, before)
        self.before = before
        return before

    @property
    def run_dir(self) -> Path:
        return self.runlog.dir

    def metrics(self) -> list[dict]:
        """The rows of metrics.jsonl, as written (one per step)."""
        return self.runlog.metrics()

    def resume_command(self, extra_steps: int = 0) -> str:
        """The shell command that continues this run from its last checkpoint."""
        total = self.trainer.step_count + extra_steps
        return shlex.join(["lorabench", "resume", str(self.run_dir), f"grpo.steps={total}"])

    def close(self) -> None:
        """Release the trainer's refresher (temp dirs) and the engine."""
        try:
            self.trainer.close()
        finally:
            self.engine.close()
