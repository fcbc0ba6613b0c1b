"""A run opened from Python (a notebook) the way `lorabench run` opens it, so the CLI can resume it.

    session = RunSession.open(cfg, run_dir="runs/nb")   # config.json, model, engine, trainer
    session.trainer.step()                              # metrics.jsonl / sync.jsonl / checkpoint
    print(session.resume_command(extra_steps=5))        # lorabench resume runs/nb grpo.steps=8
    session.close()                                     # releases engine, temp dirs and the run dir's lock

`open` checks everything (plan_run, preflight.py, the model's fingerprint) before it creates or continues
the run dir under its lock: a failure before that leaves the run dir as it was, or absent.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data import ProblemSource
from ..engines import engine_class, make_engine
from ..grpo import GRPOTrainer
from ..interrupts import interrupts_to_the_main_thread, wait_interruptibly
from ..machine import cpu_threads
from ..models import load_tokenizer, resolve_model_path
from ..policy import Policy, UpdateDiverged, compile_mode, rngs_kept
from ..refresh import REFRESH_MODES, make_refresher
from ..rundir import CHECKPOINT, CONFIG, FOLDERS, LOCK_NAME, check_before_evals, check_entries, inspect, lock_holder
from ..runlog import NullRunLog, RunDirError, RunLog
from ..safedir import RunDirWriteError, SafeDir, killed_write_temp
from .compat import (
    check_config,
    check_continuation,
    check_data,
    check_model,
    effective_config,
    experiment_fingerprint,
    new_run_command,
)
from .config import Config, ConfigError, engine_needs
from .preflight import preflight


@dataclass
class RunPlan:
    """Where a run goes and what is there, decided before anything is written."""
    run_dir: Path | None          # None: a new timestamped dir under run.out_dir
    continued: object = None      # rundir.RunDirState of the run being continued, else None
    named_by_config: bool = False  # run.out_dir/run.name chose it (`lorabench run`), not a run_dir argument
    changes: dict = field(default_factory=dict)   # the allowed changes a continued run records, once built

    def check_model(self, cfg: Config, model_path: str, log=print) -> dict:
        """The experiment's fingerprint; a continued run's model must be its checkpoint's (none recorded: noted)."""
        fingerprint = experiment_fingerprint(cfg, model_path)
        checkpoint = self.continued.checkpoint if self.continued else None
        if checkpoint and "fingerprint" in checkpoint:
            check_model(checkpoint["fingerprint"].get("model", {}), fingerprint["model"], cfg, self.run_dir,
                        self.continued.step)
        elif checkpoint:
            log(f"note: {self.run_dir}'s checkpoint (step {self.continued.step}) records no fingerprint of its config, "
                f"data and model (written by an older lorabench), so they cannot be compared; the next checkpoint "
                f"records this run's")
        return fingerprint

    def open(self, cfg: Config, fingerprint: dict, log=print):
        """The run dir under its lock: config.json for a new run; a continued one checked again under it.
        Its checkpoints record `fingerprint` (check_model's)."""
        new = self.continued is None
        try:
            runlog = RunLog(self.run_dir, log, lock=True, settings=cfg.run) if self.run_dir else RunLog.create(
                cfg.run.out_dir, "", log, lock=True, settings=cfg.run)
            try:
                if new:   # refuses if another process made this run meanwhile
                    runlog.write_config(cfg.to_dict())
                else:   # again under the lock: another writer may have finished since plan_run looked
                    if (step := inspect(self.run_dir).step) != self.continued.step:
                        raise RunDirError(f"{self.run_dir} was continued by another process while this command "
                                          f"read it (step {self.continued.step} -> {step}); nothing was changed. "
                                          f"Run the same command again to continue from step {step}")
                    self.changes = check_continuation(self.run_dir, effective_config(self.run_dir), cfg,
                                                      self.continued.step)
            except (RunDirError, OSError):
                runlog.close(refused=True)
                raise
        except RunDirWriteError as err:
            if not new:
                raise
            raise RunDirWriteError(err.errno, f"{err.cause}; no run was started (its config.json is not "
                                   f"written): once {err.fix}, run the same command again") from None
        if not new and self.named_by_config:
            log(f"run.out_dir/run.name name the existing run {runlog.dir}: continuing it like `lorabench resume`")
        log(f"run dir: {runlog.dir}" + ("" if new else f" (continued at step {self.continued.step})"))
        runlog.fingerprint = fingerprint
        return runlog

    def record_changes(self, runlog, log=print) -> None:
        """A continued run's allowed changes into config_changes.jsonl, once its trainer accepted the checkpoint."""
        if not self.changes:
            return
        runlog.record_config_changes(self.continued.step, self.changes)
        for key, (old, new) in self.changes.items():
            note = "; earlier evaluations used the old value (each evals.jsonl row has its n)" if key.startswith(
                "data.eval_") else ""
            log(f"  {key}: {old!r} -> {new!r} (recorded in config_changes.jsonl{note})")


def plan_run(cfg: Config, run_dir: str | Path | None = None) -> RunPlan:
    """A new run, or the continuation of the run in `run_dir` (or run.out_dir/run.name): checked for links, another
    writer, readability (rundir.inspect), `cfg`'s changes and the experiment (compat.py)."""
    path = Path(run_dir) if run_dir else (Path(cfg.run.out_dir) / cfg.run.name if cfg.run.name else None)
    if path is None or not os.path.lexists(path):
        return RunPlan(path)
    if os.path.isfile(path) and not os.path.islink(path):
        raise ConfigError(f"{path} is a file, not a run dir; choose another run.name or run.out_dir")
    check_entries(path)   # before anything else reads it: refuses links, odd kinds, shared files
    if busy := lock_holder(path):
        raise busy
    if not (path / CONFIG).is_file():   # check_entries: a file, not a link
        _refuse_leftovers(path)
        return RunPlan(path)   # empty, or left by a run stopped before it wrote its config
    try:
        return _plan_continuation(cfg, path, named_by_config=run_dir is None)
    except RunDirError as err:
        if run_dir is None:  # `lorabench run` named it: say why a run command talks about continuing
            raise RunDirError(f"run.out_dir/run.name name the existing run {path}, which `lorabench run` continues "
                              f"like `lorabench resume`: {err}") from err
        raise


def _refuse_leftovers(path: Path) -> None:
    """A dir without config.json may only hold what a run stopped before writing it leaves: empty folders, the
    lock, the temp of a writer killed mid config.json (the run's own write sweeps it)."""
    with SafeDir.open(path) as root:
        leftovers = []
        for name in root.names():
            if name in FOLDERS and root.expect(name, "dir"):
                with root.sub(name) as sub:
                    if not sub.names():
                        continue
            if killed_write_temp(name, CONFIG) and root.expect(name, "file"):
                continue
            if name != LOCK_NAME:
                leftovers.append(name)
    if leftovers:
        raise RunDirError(f"{path} exists and is not a lorabench run dir (no config.json; it holds "
                          f"{leftovers[:5]}); choose another run.name or run.out_dir")


def _plan_continuation(cfg: Config, path: Path, named_by_config: bool) -> RunPlan:
    """Config.json as the checkpoint was trained (no hand edit), the requested changes, the data's bytes."""
    state = inspect(path)
    effective = effective_config(path)
    recorded = (state.checkpoint or {}).get("fingerprint")
    if recorded:
        check_config(recorded, effective, path, state.step)
    check_continuation(path, effective, cfg, state.step)   # refused changes end here
    _check_stale_control(path, effective.refresh.mode, cfg.refresh.mode)
    _check_optimizer_lr(state, cfg)
    if recorded:
        check_data(recorded, cfg, path, state.step)
    return RunPlan(path, state, named_by_config=named_by_config)


def _check_stale_control(path: Path, old: str, new: str) -> None:
    """refresh.mode may change on resume, but not to or from the stale control (keeps_engine_fresh false)."""
    if old != new and not (REFRESH_MODES[old].keeps_engine_fresh and REFRESH_MODES[new].keeps_engine_fresh):
        raise RunDirError(f"{path} cannot continue with a changed refresh.mode {old!r} -> {new!r} (the stale control "
                          f"serves another adapter than the trainer's: it defines the experiment); nothing was "
                          f"changed. Start a new run for that ({new_run_command(path, f'refresh.mode={new}')}), or "
                          f"continue without those overrides")


def _check_optimizer_lr(state, cfg: Config) -> None:
    """The optimizer state's learning rate must be the run's grpo.lr, or the run would go on at another one."""
    if state.checkpoint is None:
        return
    rates = sorted({group.get("lr") for group in state.checkpoint["optimizer"]["param_groups"]}, key=str)
    if rates != [cfg.grpo.lr]:
        raise RunDirError(f"{state.dir / CHECKPOINT}: field 'optimizer' applies learning rate(s) {rates}, "
                          f"but the run's grpo.lr is {cfg.grpo.lr:g}; nothing in the run dir was changed. Restore the "
                          f"checkpoint from a backup, or start a new run")


class _SessionLifecycle:
    """What every session (one run, a policy group) does alike: the resume command, the close."""

    def resume_command(self, extra_steps: int = 0) -> str:
        """The shell command that continues the run from its last checkpoint."""
        total = self.trainer.step_count + extra_steps
        return shlex.join(["lorabench", "resume", str(self.run_dir), f"grpo.steps={total}"])

    def close_engine(self) -> None:
        """Release the trainer (its commits, refresher and temp dirs) and the engine; run dirs stay locked."""
        try:
            self.trainer.close()
        finally:
            self.engine.close()

    def close(self) -> None:
        """Release the trainer, the engine and the run dirs' locks."""
        try:
            self.close_engine()
        finally:
            self._release_run_dirs()


@dataclass
class RunSession(_SessionLifecycle):
    cfg: Config
    runlog: object        # runlog.RunLog
    engine: object        # a RolloutEngine
    trainer: object       # grpo.GRPOTrainer
    model_path: str
    model_seconds: float = 0.0                        # model resolution (tiny: build + warm-start)
    before: list[dict] = field(default_factory=list)  # step-0 held-out evals: [sampled, greedy]

    @classmethod
    def open(cls, cfg: Config, run_dir: str | Path | None = None, log=print, evaluate_first: bool = True,
             progress=None):
        """Check everything, build the model, create or continue the run dir, build engine and trainer.
        `progress(what, done=None, total=None)` hears each part as it starts (progress.WaitProgress)."""
        progress = progress or (lambda what, done=None, total=None: None)

        plan = plan_run(cfg, run_dir)
        model_path, model_seconds, fingerprints = checked_model({"default": plan}, {"default": cfg}, evaluate_first,
                                                                log, progress)
        runlog = plan.open(cfg, fingerprints["default"], log)
        try:
            engine, trainers = engine_and_trainers(cfg, {"default": cfg}, {"default": runlog}, model_path, log,
                                                   progress)
            try:
                plan.record_changes(runlog, log)
                session = cls(cfg, runlog, engine, trainers["default"], model_path, model_seconds)
                if evaluate_first:
                    progress("held-out evaluation before the first step")
                    session.evaluate_before()
            except BaseException:
                close_built(engine, trainers)
                raise
        except BaseException:
            runlog.close(refused=True)
            raise
        return session

    def evaluate_before(self) -> list[dict]:
        """The step-0 held-out evaluations (sampled, greedy): from evals.jsonl, or run now for a new run."""
        before = [e for e in self.runlog.evals() if e["step"] == 0]
        if len(before) < 2:
            before = [self.trainer.evaluate(greedy=False), self.trainer.evaluate(greedy=True)]
            self.runlog.set_evals(0, before)
        self.before = before
        return before

    @property
    def run_dir(self) -> Path:
        return self.runlog.dir

    def metrics(self) -> list[dict]:
        """The rows of metrics.jsonl, as written (one per step), once every step so far is written."""
        self.trainer.wait_committed()
        return self.runlog.metrics()

    def _release_run_dirs(self) -> None:
        self.runlog.close()


def checked_model(plans: dict[str, RunPlan], members: dict[str, Config], evaluate_first: bool, log=print,
                  progress=None) -> tuple[str, float, dict]:
    """Each plan checked (its step-0 evaluations, preflight.py), torch's CPU threads set, the model resolved and
    checked against each continued run: (path, seconds, {name: fingerprint}); nothing is written yet."""
    for name, plan in plans.items():
        if evaluate_first and plan.continued is not None:
            check_before_evals(plan.run_dir, plan.continued.step)
        preflight(members[name], plan.run_dir, continued=plan.continued is not None, log=log)
    cfg = next(iter(members.values()))
    threads, how = cpu_threads(cfg.run.threads)
    torch.set_num_threads(threads)
    log(f"torch CPU threads: {how}")
    t0 = time.perf_counter()
    model_path = resolve_model(cfg, log=log, progress=progress)
    model_seconds = time.perf_counter() - t0
    return model_path, model_seconds, {name: plan.check_model(members[name], model_path, log)
                                       for name, plan in plans.items()}


def resolve_model(cfg: Config, log=print, progress=None) -> str:
    """The base model's dir (tiny: built on first use; `progress` at each warm-start step) or hub name."""
    return resolve_model_path(cfg.model, cfg.warmstart, cfg.run.seed, log=log, progress=progress)


def start_engine(cfg: Config, model_path: str, log=None, run: bool = False, **overrides):
    """The engine cfg.engine chooses, with what the run needs of it; its notes (a small KV cache) are logged.
    run=True: a run's engine, set up for its refresh mode only; else a scratch engine any mode may write."""
    engine = make_engine(cfg.engine, model_path, engine_needs(cfg, run=run), **overrides)
    for note in getattr(engine, "notes", ()) if log is not None else ():
        log(f"note: {note}")
    return engine


def engine_and_trainers(cfg: Config, members: dict[str, Config], runlogs: dict, model_path: str, log=print,
                        progress=None) -> tuple:
    """The engine `cfg` chooses and {name: GRPOTrainer} for `members`, their policies sharing the first one's
    model. Under grpo.compile=all the policies compile on a thread while the engine starts (not with tp_size > 1:
    SGLang refuses GPUs whose free memory differs). A group's run dirs are repaired only once every policy's
    checkpoint is loaded and checked; an error there names the policy."""
    progress = progress or (lambda what, done=None, total=None: None)
    progress(f"starting the {cfg.engine.backend} engine")
    device = engine_class(cfg.engine.backend).device_of(cfg.engine.chosen)

    def build() -> dict:
        built, beside = {}, None
        for name, member in members.items():
            built[name] = beside = Policy(model_path, member.lora, member.grpo, member.model.dtype, device,
                                          adapter_name=name, init_seed=member.run.seed, beside=beside)
        return built

    ahead = (compile_mode(next(iter(members.values())).grpo.compile, device) == "all"
             and getattr(cfg.engine.chosen, "tp_size", 1) == 1)
    policies = build() if ahead else {}
    compiled, t0 = Future(), time.perf_counter()
    if ahead:
        log("grpo.compile=all: compiling the training graphs while the engine starts")
        threading.Thread(target=_compile, args=(policies, compiled), name="lorabench-compile", daemon=True).start()
    with rngs_kept(device):   # what the engine's start draws is not the run's
        engine = start_engine(cfg, model_path, log, run=True)
    trainers = {}
    try:
        if ahead:
            wait_interruptibly(compiled.result)
            log(f"training graphs compiled and engine started in {time.perf_counter() - t0:.0f} s")
        policies = policies or build()
        progress("building the trainer")
        for name, member in members.items():
            try:   # loads and checks the checkpoint
                trainers[name] = build_trainer(member, model_path, engine, runlogs[name], log=log,
                                               policy=policies[name], repair_later=bool(cfg.policies))
            except UpdateDiverged as err:   # its checkpoint's adapter: the one line printed names the policy
                if not cfg.policies:
                    raise
                raise UpdateDiverged(f"policy {name!r}: {err}", err.override, err.past_bound) from err
        for trainer in trainers.values():   # every policy's checkpoint checked: only now is a run dir repaired
            trainer.repair_run_dir()
    except BaseException:
        close_built(engine, trainers)
        raise
    return engine, trainers


def close_built(engine, trainers: dict) -> None:
    """What an open built before it failed: every trainer (commits, refresher, temp dirs), then the engine, each
    closed also when one before it fails to close."""
    with contextlib.ExitStack() as closing:
        closing.callback(engine.close)
        for trainer in trainers.values():
            closing.callback(trainer.close)


def _compile(policies: dict, done: Future) -> None:
    """On its own thread; an interrupted open leaves it to end (a compile cannot be stopped)."""
    interrupts_to_the_main_thread()
    try:
        for policy in policies.values():   # a group's policies share the layers, not the active adapter
            policy.compile_now()
    except BaseException as err:  # handed to the thread that waits for it, whatever it is
        done.set_exception(err)
    else:
        done.set_result(None)


def build_trainer(cfg: Config, model_path: str, engine, runlog=None, tokenizer=None, log=print, policy=None,
                  repair_later: bool = False):
    """The GRPO trainer for `cfg` on `engine`; `policy`: one built already (engine_and_policies), else a new one;
    repair_later: its run dir's repairs wait for trainer.repair_run_dir() (GRPOTrainer)."""
    runlog = runlog if runlog is not None else NullRunLog(cfg.run)
    if runlog.settings != cfg.run:   # the run log decides when checkpoints are due: from this config
        raise ValueError(f"the run log of {runlog.dir} was opened with other run settings than cfg.run; open it with "
                         f"RunLog(run_dir, settings=cfg.run)")
    policy = policy or Policy(model_path, cfg.lora, cfg.grpo, cfg.model.dtype, engine.device, init_seed=cfg.run.seed)
    refresher = make_refresher(cfg.refresh, engine, cfg.engine.adapter_name, base_weights=policy.base_weights())
    return GRPOTrainer(cfg.grpo, policy, engine, refresher, ProblemSource.from_settings(cfg.data, cfg.run.seed),
                       tokenizer or load_tokenizer(model_path), runlog, seed=cfg.run.seed,
                       enable_thinking=cfg.model.enable_thinking,
                       release_engine_memory=cfg.engine.release_memory_during_training, log=log,
                       repair_later=repair_later)
