"""Command line: `lorabench demo`, `lorabench run`, `lorabench resume` (each with --help).

Bad input (USER_ERRORS) and an error during the steps (RunStopped: where the run dir stands and how to
continue it) are one line on stderr, exit code 2. SIGTERM stops a run like Ctrl-C, cleanup included
(exit code 143; 130 for Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from .adapters import AdapterError, AdapterWriteError
from .data import DataError
from .engines.base import EngineError
from .interrupts import resend_lost_stops
from .metrics import HELD_STRICT, LAG, MISMATCH_MAX, REFRESH_S, REWARD
from .models import ModelError
from .policy import UpdateDiverged
from .rundir import CONFIG, GROUP_FILE
from .runlog import RunDirError
from .safedir import RunDirWriteError
from .session import ConfigError, describe, load_config


class RunStopped(RuntimeError):
    """A run that stopped during its steps (a diverged update, a full disk, ...): the cause's message
    plus where the run dir stands and how to continue it."""


# errors whose message already names the culprit and the fix: one line, exit code 2, no traceback
USER_ERRORS = (ConfigError, DataError, ModelError, AdapterError, AdapterWriteError, EngineError, RunDirError,
               RunDirWriteError, UpdateDiverged, RunStopped)

LESSON = ("What the model learns: the warm-start taught it to solve the problems but to end its answer\n"
          "mostly with 'The answer is N.', '= N' or the bare number; only ~10% of its training answers\n"
          "ended with '#### N'. The strict reward pays only for '#### N' with the right number, so GRPO\n"
          "discovers the GSM8K answer format, the same thing real GSM8K GRPO runs learn first.")


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that `finally` blocks and atomic writes clean up."""


def stop_handler(stop: type[BaseException]):
    """A signal handler raising `stop` where the main thread is; raised inside a finaliser, where Python
    would drop it, it is sent again (interrupts.resend_lost_stops)."""
    def handler(signum, frame):
        resend_lost_stops(stop, signum)
        raise stop()
    return handler


def log_line(*parts) -> None:
    print(*parts, flush=True)  # flushed: progress must show even when stdout is a file or a pipe


def run_experiment(cfg, run_dir: str | Path | None = None, log=log_line) -> dict:
    """Build (or resume) the run `cfg` describes, evaluate, train, evaluate, plot: the summary dict (also
    RUN_DIR/summary.json). The run dir's lock is held until the summary is written."""
    from .session import RunSession
    if cfg.policies:
        return run_group(cfg, run_dir, log)
    t0 = time.perf_counter()
    session = RunSession.open(cfg, run_dir, log=log)
    return _train(session, {"": session}, t0, log, lambda err: stopped_message(err, session.runlog))[""]


def run_group(cfg, group_dir: str | Path | None = None, log=log_line,
              resume_overrides: list[str] | None = None) -> dict:
    """A policy group (cfg.policies; or the group in `group_dir` resumed with `resume_overrides`) trained on
    one engine, each policy's run dir summarised as a single run's: {"group_dir", "policies": {name: summary}}."""
    from .session import GroupSession
    t0 = time.perf_counter()
    group = (GroupSession.resume(group_dir, resume_overrides, log=log) if resume_overrides is not None
             else GroupSession.open(cfg, group_dir, log=log))

    def stopped(err: Exception) -> str:   # one line, naming the policy whose step raised
        name = group.trainer.current
        if name is None:
            return (f"{err}; the run stopped: each policy's run dir holds its last checkpoint, and "
                    f"`lorabench resume {group.run_dir}` continues the group")
        return f"policy {name!r}: {stopped_message(err, group.members[name].runlog, group.run_dir)}"
    summaries = _train(group, group.members, t0, log, stopped)
    return {"group_dir": str(group.run_dir), "policies": summaries}


def _train(session, members: dict, t0: float, log, stopped) -> dict:
    """Evaluate, train, evaluate and summarise a session's runs ({name: RunSession}): {name: summary}. An error
    during the steps is RunStopped(stopped(err)); every run dir's lock is held until its summary is written."""
    try:
        try:
            for name, member in members.items():
                log(f"{name + ': ' if name else ''}held-out before GRPO: {_strict(member.before)}")
            t_train = time.perf_counter()
            session.trainer.run()
            seconds = time.perf_counter() - t_train
            done = {name: _evaluate_after(member.trainer, member.runlog, seconds) for name, member in members.items()}
        except USER_ERRORS as err:   # one line, with where the run stands (the cause stays chained)
            raise RunStopped(stopped(err)) from err
        except (Terminated, KeyboardInterrupt) as stop:
            stop.run_dir = session.run_dir   # the stop's line names the run dir that continues
            raise
        finally:
            session.close_engine()
        return {name: _write_summary(member, done[name], t0) for name, member in members.items()}
    finally:
        for member in members.values():
            member.runlog.close()


def stopped_message(err: Exception, runlog, group_dir: Path | None = None) -> str:
    """The cause, then what the run dir holds and the command that continues it (a group's, for a policy)."""
    text = str(err)
    if "lorabench resume" in text:   # RunDirWriteError says it already
        return text
    step = runlog.committed_step
    held = f"{runlog.dir} is intact ({f'its last checkpoint is step {step}' if step else 'no step checkpointed'})"
    if isinstance(err, UpdateDiverged):   # resuming as it was would repeat the same seeded step
        config = str(runlog.dir / CONFIG)
        new = shlex.join(["lorabench", "run", "--config", config, "run.name=NEW", err.override])
        unbounded = shlex.join(["lorabench", "resume", str(runlog.dir), err.past_bound])
        past = f"; or continue it without the bound: {unbounded}" if err.past_bound else ""
        return f"{text}; the run stopped: {held}; a new run from its config: {new}{past}"
    if group_dir is not None:
        return f"{text}; the run stopped: {held} and `lorabench resume {group_dir}` continues the group"
    return f"{text}; the run stopped: {held} and `lorabench resume {runlog.dir}` continues it"


def _strict(before: list[dict]) -> str:
    return f"strict {before[0][HELD_STRICT]:.2f} (sampled), {before[1][HELD_STRICT]:.2f} (greedy)"


def _evaluate_after(trainer, runlog, seconds: float) -> dict:
    after = [trainer.evaluate(greedy=False), trainer.evaluate(greedy=True)]
    return {"after": after, "evals": runlog.set_evals(trainer.step_count, after), "seconds_grpo": seconds}


def _write_summary(session, done: dict, t0: float) -> dict:
    from .viz import run_plot_images
    cfg, runlog, before, after = session.cfg, session.runlog, session.before, done["after"]
    rows = runlog.metrics()
    plots = runlog.save_plots(run_plot_images(rows, done["evals"]))
    refresh_ms = sorted(1e3 * v for v in _values(rows, REFRESH_S)) or [float("nan")]
    rewards = _values(rows, REWARD)
    summary = {
        "run_dir": str(runlog.dir), "steps": len(rows), "refresh_mode": cfg.refresh.mode, "engine": cfg.engine.backend,
        "heldout_strict_before": before[0][HELD_STRICT], "heldout_strict_after": after[0][HELD_STRICT],
        "heldout_greedy_before": before[1][HELD_STRICT], "heldout_greedy_after": after[1][HELD_STRICT],
        "train_reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
        "train_reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
        "refresh_ms_p50": refresh_ms[len(refresh_ms) // 2], "refresh_ms_max": refresh_ms[-1],
        # a step sampled one adapter behind (grpo.max_staleness) differs by that lag, not by the engine
        "mismatch_max": max(_values([r for r in rows if not r.get(LAG)], MISMATCH_MAX), default=float("nan")),
        "lagged_steps": sum(1 for r in rows if r.get(LAG)),
        "seconds_model": session.model_seconds, "seconds_grpo": done["seconds_grpo"],
        "seconds_total": time.perf_counter() - t0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "plots": [str(p) for p in plots],
    }
    runlog.write_summary(summary)
    return summary


def _values(rows: list[dict], key: str) -> list[float]:
    """`key` of each row that holds a number there (a row edited by hand may not: rundir.inspect notes it)."""
    return [r[key] for r in rows if isinstance(r.get(key), (int, float))]


def print_summary(s: dict) -> None:
    if "policies" in s:
        print(f"\n=== lorabench summary: {len(s['policies'])} policies on one engine ===")
        for name, p in s["policies"].items():
            print(f"{name:>12}: held-out strict (sampled) {p['heldout_strict_before']:.2f} -> "
                  f"{p['heldout_strict_after']:.2f}, train reward first 5 -> last 5 {p['train_reward_first5']:.2f} -> "
                  f"{p['train_reward_last5']:.2f}, refresh p50 {p['refresh_ms_p50']:.1f} ms, run dir {p['run_dir']}")
        print(f"group dir: {s['group_dir']}")
        return
    print("\n=== lorabench summary ===")
    print(f"engine {s['engine']}, refresh '{s['refresh_mode']}', {s['steps']} GRPO steps")
    print(f"held-out strict reward (sampled): {s['heldout_strict_before']:.2f} -> {s['heldout_strict_after']:.2f}"
          f"   (greedy: {s['heldout_greedy_before']:.2f} -> {s['heldout_greedy_after']:.2f})")
    print(f"train reward, first 5 steps -> last 5: {s['train_reward_first5']:.2f} -> {s['train_reward_last5']:.2f}")
    print(f"adapter refresh per step: p50 {s['refresh_ms_p50']:.1f} ms, max {s['refresh_ms_max']:.1f} ms; "
          f"trainer-vs-engine log-prob mismatch max {s['mismatch_max']:.2e}"
          + (f" (on-policy steps; the {s['lagged_steps']} sampled one adapter behind differ by that lag)"
             if s.get("lagged_steps") else ""))
    print(f"time: model {s['seconds_model']:.0f}s, GRPO {s['seconds_grpo']:.0f}s, total {s['seconds_total']:.0f}s; "
          f"peak RSS {s['peak_rss_mb']:.0f} MB")
    print(f"run dir: {s['run_dir']}\nplots:   " + "\n         ".join(s["plots"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="lorabench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="offline demo: tiny Qwen3 model, synthetic GSM8K, GRPO with live "
                          "adapter refresh on the CPU reference engine")
    demo.add_argument("overrides", nargs="*", help="section.field=value, e.g. refresh.mode=file")
    run = sub.add_parser("run", help="a run from a config file plus overrides")
    run.add_argument("--config", help=".json or .toml config file (sections as in --help-config)")
    run.add_argument("--help-config", action="store_true", help="list every config field with its help")
    run.add_argument("overrides", nargs="*", help="section.field=value, e.g. grpo.steps=100")
    resume = sub.add_parser("resume", help="continue a run from its last checkpoint")
    resume.add_argument("run_dir")
    resume.add_argument("overrides", nargs="*", help="e.g. grpo.steps=80 to extend the run")
    args, rest = parser.parse_known_args(argv)   # overrides after --config are the rest (argparse stops there)
    if any(arg.startswith("-") for arg in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = [*args.overrides, *rest]
    on_main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, stop_handler(Terminated)) if on_main_thread else None
    resend_lost_stops()   # Python's own Ctrl-C (where it is not ignored) dropped in a finaliser
    try:
        summary = _command(args)
    except USER_ERRORS as err:
        kind = "config error" if isinstance(err, ConfigError) else "error"
        print(f"lorabench: {kind}: {err}", file=sys.stderr)
        return 2
    except (Terminated, KeyboardInterrupt) as stop:
        name, code = ("SIGTERM", 128 + signal.SIGTERM) if isinstance(stop, Terminated) else ("Ctrl-C", 130)
        print(f"lorabench: stopped by {name}; {_way_on(stop, args)}", file=sys.stderr)
        return code
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    if summary is not None:
        print_summary(summary)
    return 0


def _way_on(stop: BaseException, args) -> str:
    """What continues a run stopped by a signal: its run dir's resume, or (before it had one) the same command."""
    where = getattr(stop, "run_dir", None) or (args.run_dir if args.command == "resume" else None)
    if where:
        return f"`lorabench resume {where}` continues from its last checkpoint"
    return ("it stopped before training: run the same command again (or, if it printed a run dir, "
            "`lorabench resume` that dir)")


def _command(args) -> dict | None:
    if args.command == "run" and args.help_config:
        print(describe())
        return None
    if args.command == "resume":
        from .session.compat import resume_config
        if os.path.lexists(Path(args.run_dir) / GROUP_FILE):   # a policy group: every policy continues
            return run_group(None, args.run_dir, resume_overrides=list(args.overrides))
        return run_experiment(resume_config(args.run_dir, args.overrides), run_dir=args.run_dir)
    cfg = load_config(getattr(args, "config", None), args.overrides)
    if args.command == "demo":
        print(LESSON + "\n")
    return run_experiment(cfg)


if __name__ == "__main__":
    sys.exit(main())
