"""Run directories that never lose, mix or silently change steps.

- continuing a run: refused overrides (model, adapter shape, data stream, seed, objective) leave the
  run dir byte for byte as it was; allowed ones (grpo.steps, evaluation, logging, engine) are
  appended to config_changes.jsonl and config.json is never rewritten;
- what resume cannot match is refused, never truncated or rewritten: a corrupt middle line, a
  missing or unreadable checkpoint beside the rows of committed steps, rows past the checkpoint,
  a step logged twice;
- every field of a checkpoint is checked before a byte is written or the model built (an older
  lorabench's optimizer order once the policy is); a field a newer lorabench writes is kept;
- the ways on: a finished run is extended from any step (zero included) and equals an uninterrupted
  run, a missing final export is written again, the commands the messages give run as pasted;
- one writer per run dir (real processes): a second `lorabench run`/`resume` is refused naming the
  first one's PID, and a lock left by a killed writer is reclaimed;
- SIGTERM during the tiny model's build cleans up; a SIGKILLed build's temp is removed by the next
  access to the cache.
The repairs resume does make (rows from the checkpoint, a torn last line) are in tests/test_crash.py.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from reliability_util import QUICK_RUN, cli, dir_bytes, one_line_error, refused, tree_state

from lorabench.cli import main
from lorabench.rundir import RunDirError, inspect, read_jsonl
from lorabench.runlog import RunLog
from lorabench.session import compat
from lorabench.session.config import Config, flat


# --- the two lists -----------------------------------------------------------------------------------
def test_every_config_field_is_decided_once():
    """Every field of every section (sub-sections too) states what a continued run may do with it,
    and compat reads exactly those decisions."""
    fields = list(flat(Config()))
    assert "engine.sglang.tp_size" in fields and "refresh.file.tmp_dir" in fields
    decided = [*compat.refused(), *compat.allowed(), *compat.LOCATION]
    assert sorted(decided) == sorted(fields)
    assert not set(compat.refused()) & set(compat.allowed())
    for must_refuse in ("run.seed", "lora.r", "model.name_or_path", "data.source", "grpo.lr", "warmstart.steps"):
        assert must_refuse in compat.refused()
    for may_change in ("grpo.steps", "data.eval_size", "run.save_adapter_every", "engine.backend", "refresh.mode"):
        assert may_change in compat.allowed()


def test_changes_and_refusals_in_process(tmp_path):
    old = Config.load(overrides=["grpo.steps=4"])
    assert compat.changes(old, old) == {}
    moved = Config.load(overrides=["grpo.steps=4", "run.out_dir=/elsewhere", "run.name=x"])
    assert compat.changes(old, moved) == {}                      # where a run dir is, is not its config
    more = Config.load(overrides=["grpo.steps=9", "data.eval_size=8"])
    assert compat.check_continuation(tmp_path, old, more, at_step=2) == {"grpo.steps": (4, 9),
                                                                        "data.eval_size": (128, 8)}
    with pytest.raises(RunDirError, match=r"grpo.steps=1 would end it before that.*grpo.steps >= 2"):
        compat.check_continuation(tmp_path, old, Config.load(overrides=["grpo.steps=1"]), at_step=2)
    with pytest.raises(RunDirError) as info:
        compat.check_continuation(tmp_path, old, Config.load(overrides=["grpo.steps=4", "run.seed=5"]), at_step=2)
    msg = str(info.value)
    assert "run.seed 0 -> 5" in msg and "seeds the data, the sampling, the LoRA init" in msg
    assert "run.name=NEW run.seed=5" in msg and "continue without those overrides" in msg


# --- a finished run dir, copied per test --------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 2-step `lorabench run` (in this process), the run dir every test below starts from."""
    out = tmp_path_factory.mktemp("finished")
    assert main(["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", "run.name=run",
                 f"refresh.file.tmp_dir={out}", *QUICK_RUN]) == 0
    return out / "run"


@pytest.fixture
def run_dir(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


@pytest.mark.parametrize("overrides, needles", [
    (["run.seed=5"], ["run.seed 0 -> 5", "seeds the data, the sampling, the LoRA init and (tiny) the base model"]),
    (["lora.r=8"], ["lora.r 16 -> 8", "adapter's shape"]),
    (["grpo.lr=0.1"], ["grpo.lr 0.001 -> 0.1", "optimizer state: a new value would silently not apply"]),
    (["data.source=data/gsm8k_sample.jsonl"], ["data.source 'synthetic' -> 'data/gsm8k_sample.jsonl'", "data stream"]),
    (["refresh.mode=none"], ["refresh.mode 'tensor' -> 'none'", "the stale control serves another adapter"]),
])
def test_resume_with_a_forbidden_override(run_dir, capsys, overrides, needles):
    """Refused before anything is written (config.json used to be rewritten first, leaving the run
    unresumable); a plain resume is still possible afterwards."""
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir), *overrides)
    assert all(n in line for n in needles), line
    assert f"lorabench run --config {run_dir / 'config.json'} run.name=NEW" in line
    assert "continue without those overrides" in line and "nothing was changed" in line
    assert dir_bytes(run_dir) == before
    assert compat.changes(compat.effective_config(run_dir), Config.load(run_dir / "config.json")) == {}


def test_the_new_run_a_refused_override_suggests_runs(run_dir, capsys):
    """The refusal's command, pasted into a shell as it is: a list value (lora.target_modules) was
    written unquoted, so the shell split it and the command failed."""
    import shlex
    line = refused(capsys, "resume", str(run_dir), 'lora.target_modules=["q_proj", "v_proj"]')
    command = shlex.split(line.split("Start a new run for that (")[1].split("), or continue")[0])
    assert command[:5] == ["lorabench", "run", "--config", str(run_dir / "config.json"), "run.name=NEW"], line
    assert main([a.replace("run.name=NEW", "run.name=qv") for a in command[1:]]) == 0
    new = Path(json.loads((run_dir / "config.json").read_text())["run"]["out_dir"]) / "qv"   # beside the original
    try:
        assert json.loads((new / "config.json").read_text())["lora"]["target_modules"] == ["q_proj", "v_proj"]
        assert len(read_jsonl(new / "metrics.jsonl")) == 2
    finally:
        shutil.rmtree(new)


def test_run_naming_an_existing_run_is_checked_like_resume(run_dir, tiny_model_dir, capsys):
    before = dir_bytes(run_dir)
    line = refused(capsys, "run", "--config", str(run_dir / "config.json"), f"run.out_dir={run_dir.parent}",
                    "run.name=run", "lora.r=8")
    assert f"name the existing run {run_dir}, which `lorabench run` continues" in line
    assert "lora.r 16 -> 8" in line and "run.name=NEW" in line
    assert dir_bytes(run_dir) == before


def test_run_naming_an_existing_run_continues_it(run_dir, capsys):
    """The same command again (here: the run's own config) continues the run instead of starting a
    second one in its dir: no step is redone, nothing is recorded as changed."""
    config_bytes = (run_dir / "config.json").read_bytes()
    assert main(["run", "--config", str(run_dir / "config.json"), f"run.out_dir={run_dir.parent}",
                 "run.name=run"]) == 0
    out = capsys.readouterr().out
    assert f"name the existing run {run_dir}: continuing it like `lorabench resume`" in out
    assert "continued at step 2" in out
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]
    assert (run_dir / "config.json").read_bytes() == config_bytes
    assert not (run_dir / "config_changes.jsonl").exists()


def test_run_naming_a_dir_that_is_not_a_run(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "out" / "notes").mkdir(parents=True)
    (tmp_path / "out" / "notes" / "todo.txt").write_text("mine")
    before = dir_bytes(tmp_path / "out")
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                    "run.name=notes", *QUICK_RUN)
    assert "notes exists and is not a lorabench run dir" in line and "todo.txt" in line
    assert "choose another run.name" in line
    assert dir_bytes(tmp_path / "out") == before


def test_a_config_temp_of_a_killed_writer_does_not_make_the_dir_foreign(tmp_path, tiny_model_dir, capsys):
    """A SIGKILL while `lorabench run` wrote config.json left its temp; the same command then refused the dir as
    "not a lorabench run dir". A dead writer's temp is not a leftover: the run starts and its write sweeps it."""
    run = tmp_path / "out" / "killed"
    run.mkdir(parents=True)
    dead = _a_dead_pid()
    (run / f".config.json.{dead}.0123abcd").write_text('{"half": ')
    (run / f".config.json.{os.getpid()}.0123abcd").write_text("a live writer's")
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                   "run.name=killed", *QUICK_RUN)
    assert "killed exists and is not a lorabench run dir" in line and f".config.json.{os.getpid()}" in line
    assert f".config.json.{dead}" not in line
    (run / f".config.json.{os.getpid()}.0123abcd").unlink()
    assert main(["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}", "run.name=killed",
                 *QUICK_RUN]) == 0
    assert (run / "config.json").is_file() and not (run / f".config.json.{dead}.0123abcd").exists()


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_resume_with_allowed_overrides_is_recorded_append_only(run_dir, capsys):
    """grpo.steps and data.eval_size may change: recorded in config_changes.jsonl, config.json
    untouched, and the changed values stay in effect for a later plain resume."""
    config_bytes = (run_dir / "config.json").read_bytes()
    assert main(["resume", str(run_dir), "grpo.steps=3", "data.eval_size=2"]) == 0
    out = capsys.readouterr().out
    assert "continued at step 2" in out and "grpo.steps: 2 -> 3 (recorded in config_changes.jsonl)" in out
    assert (run_dir / "config.json").read_bytes() == config_bytes
    rows = read_jsonl(run_dir / "config_changes.jsonl")
    assert len(rows) == 1 and rows[0]["step"] == 2
    assert rows[0]["changes"] == {"data.eval_size": [4, 2], "grpo.steps": [2, 3]}
    effective = compat.effective_config(run_dir)
    assert (effective.grpo.steps, effective.data.eval_size) == (3, 2)
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert [(e["step"], e["n"]) for e in read_jsonl(run_dir / "evals.jsonl")] == [
        (0, 8), (0, 4), (2, 8), (2, 4), (3, 4), (3, 2)]        # each row carries its own n


# --- what resume refuses to rewrite ---------------------------------------------------------------------
def test_corrupt_middle_line_is_refused_and_kept(run_dir, capsys):
    """A bad line that is not the last: resume used to rewrite the file from the rows before it."""
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(lines[0][:40] + b"\x00garbage\n" + lines[1])
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert f"{metrics} line 1 is not a whole row" in line and "The rows after it are intact" in line
    assert "repair that line (from a backup) or delete it" in line
    assert dir_bytes(run_dir) == before
    metrics.write_bytes(lines[1])                                   # the recovery the message names
    state = inspect(run_dir)
    assert state.step == 2 and state.repairs == [] and "no row for step(s) [1]" in state.notes[0]


def test_missing_checkpoint_with_rows_isrefused(run_dir, capsys):
    """Resume used to start again at step 0, delete every row and leave the old adapters beside the
    new ones."""
    (run_dir / "checkpoint" / "trainer_state.pt").unlink()
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert f"{run_dir} has no checkpoint (checkpoint/trainer_state.pt is missing)" in line
    assert "metrics.jsonl: 2 rows" in line and "evals.jsonl: evaluations at step 2" in line
    assert "Restore checkpoint/trainer_state.pt from a backup" in line and "start a new run" in line
    assert dir_bytes(run_dir) == before


def test_truncated_checkpoint_isrefused(run_dir, capsys):
    state = run_dir / "checkpoint" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert f"{state} cannot be read" in line and "Restore it from a backup" in line
    assert dir_bytes(run_dir) == before


def _tamper(state: dict, field: str) -> None:
    """One field of a checkpoint damaged the way a cut-short copy, a hand edit or another tool leaves it."""
    optimizer = state["optimizer"]
    if field == "torch_rng_cut_short":
        state["torch_rng"] = state["torch_rng"][:1000]
    elif field == "torch_rng_not_bytes":
        state["torch_rng"] = state["torch_rng"].float()
    elif field == "adapter_buffer_short":
        state["adapter_buffer"] = state["adapter_buffer"][:-5]
    elif field == "adapter_buffer_nan":
        state["adapter_buffer"][3] = float("nan")
    elif field == "adapter_buffer_float64":
        state["adapter_buffer"] = state["adapter_buffer"].double()
    elif field == "step_text":
        state["step"] = "2"
    elif field == "adapter_layout_not_json":
        state["adapter_layout"] = "[[1"
    elif field == "adapter_config_rank":
        state["adapter_config"]["r"] = 8
    elif field == "optimizer_moment_shape":
        optimizer["state"][0]["exp_avg"] = torch.zeros(3, 3)
    elif field == "optimizer_step_negative":
        optimizer["state"][0]["step"] = torch.tensor(-3.0)
    elif field == "optimizer_moments_swapped":
        optimizer["state"][0], optimizer["state"][1] = optimizer["state"][1], optimizer["state"][0]
    elif field == "optimizer_moment_nan":
        optimizer["state"][0]["exp_avg_sq"][0] = float("nan")
    elif field == "optimizer_params":
        optimizer["param_groups"][0]["params"] = [0, 1]
    elif field == "optimizer_lr":
        optimizer["param_groups"][0]["lr"] = 0.5
    elif field == "rows_not_a_dict":
        state["rows"] = []
    elif field == "fingerprint_not_dicts":
        state["fingerprint"] = {"config": 5}
    elif field == "extra_buffer_short":   # a field a newer lorabench writes, of the wrong size
        state["adapter_behind_buffer"] = state["adapter_buffer"][:7]


@pytest.mark.parametrize("field, needle", [
    ("torch_rng_cut_short", "field 'torch_rng' is a uint8 tensor of shape (1000,), which torch cannot restore"),
    ("torch_rng_not_bytes", "field 'torch_rng' is a float32 tensor"),
    ("adapter_buffer_short", "field 'adapter_buffer' is a float32 tensor of shape (262139,); the adapter layout needs"),
    ("adapter_buffer_nan", "field 'adapter_buffer' holds NaN/Inf"),
    ("adapter_buffer_float64", "field 'adapter_buffer' is a float64 tensor of shape (262144,), not the dtype of the "
                               "policy's adapter (float32)"),
    ("step_text", "field 'step' is '2', not a step count"),
    ("adapter_layout_not_json", "field 'adapter_layout': adapter layout is not a JSON list"),
    ("adapter_config_rank", "not a LoRA tensor of the adapter config's rank r=8"),
    ("optimizer_moment_shape", "field 'optimizer' has state 0 'exp_avg' = a float32 tensor of shape (3, 3)"),
    ("optimizer_step_negative", "field 'optimizer' has state 0 'step' = a float32 tensor of shape ()"),
    ("optimizer_moments_swapped", "field 'optimizer' has state 0 'exp_avg' = a float32 tensor of shape (256, 16), "
                                  "not a moment of base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("optimizer_moment_nan", "field 'optimizer' has state 0 'exp_avg_sq' holding NaN/Inf: every update from it"),
    ("optimizer_params", "field 'optimizer' holds parameters [0, 1], not the adapter's 56 tensors"),
    ("optimizer_lr", "field 'optimizer' applies learning rate(s) [0.5], but the run's grpo.lr is 0.001"),
    ("rows_not_a_dict", "field 'rows' is [], not the rows of its steps"),
    ("fingerprint_not_dicts", "field 'fingerprint' is {'config': 5}"),
    ("extra_buffer_short", "field 'adapter_behind_buffer' is a float32 tensor of shape (7,)"),
])
def test_a_checkpoint_field_resume_cannot_use_is_refused_before_anything_is_written(run_dir, capsys, monkeypatch,
                                                                                   field, needle):
    """Every field is checked before a byte is written or the model built (config_changes.jsonl was appended
    first, then a traceback, e.g. for a cut-short RNG state; the adapter's dtype and which moment is whose
    were checked once the policy was built): the model is never resolved."""
    def built(*args, **kwargs):
        raise AssertionError("the model was resolved before the checkpoint was refused")
    monkeypatch.setattr("lorabench.session.run.resolve_model", built)
    path = run_dir / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    _tamper(state, field)
    torch.save(state, path)
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir), "grpo.steps=3")
    assert needle in line and "checkpoint/trainer_state.pt" in line and "nothing" in line, line
    assert dir_bytes(run_dir) == before


@pytest.mark.parametrize("change, needle", [
    ("unnamed", None),
    ("unnamed_swapped", "the checkpoint's field 'optimizer' has state 0 'exp_avg' = a float32 tensor of shape "
                        "(256, 16), not a moment of base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("reordered", "the checkpoint's field 'optimizer' names its parameters in another order than this policy"),
])
def test_a_checkpoint_of_an_older_lorabench_or_another_order(run_dir, capsys, change, needle):
    """A checkpoint whose optimizer names no parameters (an older lorabench's) is in the policy's order:
    resumed, its moments checked against the policy's tensors once it is built. One naming them in another
    order (each moment fits its name) is refused there too: torch loads the moments by position."""
    path = run_dir / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    group, moments = state["optimizer"]["param_groups"][0], state["optimizer"]["state"]
    if change == "reordered":
        group["param_names"][:2] = group["param_names"][1::-1]
    else:
        del group["param_names"]
    if change != "unnamed":
        moments[0], moments[1] = moments[1], moments[0]
    torch.save(state, path)
    if needle is None:
        assert main(["resume", str(run_dir), "grpo.steps=3"]) == 0
        assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
        return
    os.chmod(run_dir, 0o755)   # its owner's mode (shared read-only): a refusal after the dir is opened keeps it
    before = tree_state(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert needle in line and "nothing was changed" in line, line
    assert tree_state(run_dir) == before


@pytest.mark.parametrize("behind", ["a_buffer", "none"])
def test_a_newer_checkpoint_field_is_kept(run_dir, capsys, behind):
    """A field this lorabench does not write (grpo.max_staleness=1's adapter one version behind) is not
    refused: checked by its kind, a buffer of the adapter's size (or None: no such adapter yet)."""
    path = run_dir / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    state["adapter_behind_buffer"] = state["adapter_buffer"].clone() if behind == "a_buffer" else None
    torch.save(state, path)
    assert main(["resume", str(run_dir), "grpo.steps=3"]) == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_evaluations_before_the_first_step_missing_is_refused(run_dir, capsys):
    (run_dir / "evals.jsonl").unlink()
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir), "grpo.steps=3")
    assert f"{run_dir / 'evals.jsonl'} lacks the step-0 (before GRPO) evaluations of a run at step 2" in line
    assert dir_bytes(run_dir) == before


@pytest.mark.parametrize("damage, needle", [
    ("step_twice", "line 3 repeats or goes back to step 2 (first at line 2): two processes wrote this run dir"),
    ("row_past", "line 3 holds step 3, past the checkpoint's step 2"),
    ("row_differs", "line 2 (step 2) differs from the row the checkpoint holds for it"),
])
def test_rows_the_checkpoint_cannot_vouch_for_arerefused(run_dir, capsys, damage, needle):
    metrics = run_dir / "metrics.jsonl"
    rows = read_jsonl(metrics)
    if damage == "step_twice":        # what two writers used to leave
        rows.append(rows[1])
    elif damage == "row_past":
        rows.append(dict(rows[1], step=3))
    else:
        rows[1]["reward/mean"] = 0.123456
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert needle in line and "nothing in the run dir was changed" in line
    assert dir_bytes(run_dir) == before


# --- one writer per run dir ------------------------------------------------------------------------------
def test_second_writer_in_this_process_isrefused(tmp_path):
    first = RunLog(tmp_path / "run", lock=True)
    try:
        with pytest.raises(RunDirError) as info:
            RunLog(tmp_path / "run", lock=True, log=lambda *a: None)
        msg = str(info.value)
        assert f"in use by process {os.getpid()}, this process: close the other RunSession" in msg
        assert (tmp_path / "run" / "lock").read_text() == f"{os.getpid()}\n"
    finally:
        first.close()
    assert (tmp_path / "run" / "lock").read_text() == ""             # a clean exit empties it
    RunLog(tmp_path / "run", lock=True).close()                       # free again


def test_lock_of_a_killed_writer_is_reclaimed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from lorabench.rundir import RunLock
        RunLock({str(run)!r}); print("locked", flush=True); time.sleep(60)""")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirError, match=f"in use by process {holder.pid};"):
        RunLog(run, lock=True, log=lambda *a: None)
    holder.kill()
    holder.wait()
    said = []
    runlog = RunLog(run, lock=True, log=said.append)
    runlog.close()
    assert said == [f"{run}: reclaimed the lock of process {holder.pid} (no longer running; killed?)"]


def _wait(cond, proc, what: str, timeout: float = 180) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"the first writer ended (rc {proc.returncode}) before {what}"
        assert time.monotonic() - t0 < timeout, f"no {what} in {timeout} s"
        time.sleep(0.05)


def test_two_writers_on_one_run_dir(tiny_model_dir, tmp_path):
    """Two `lorabench run` on one run dir used to both exit 0 with every step twice in
    metrics.jsonl. Now the second (run or resume) is refused naming the first's PID, and the first
    finishes with every step once."""
    out, log = tmp_path / "out", tmp_path / "first.log"
    args = ["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", "run.name=run",
            f"refresh.file.tmp_dir={tmp_path}", *QUICK_RUN, "grpo.steps=30"]  # long enough to meet the others
    with open(log, "wb") as fh:
        first = cli(*args, stdout=fh, stderr=subprocess.STDOUT)
    try:
        lock = out / "run" / "lock"
        _wait(lambda: lock.is_file() and lock.read_text().strip() == str(first.pid), first, "the lock")
        seconds = [cli(*second, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for second in (args, ["resume", str(out / "run")])]   # both at once, while the first runs
        for second in seconds:
            _, err = second.communicate(timeout=120)
            assert second.returncode == 2, err[-2000:]
            line = one_line_error(err)
            assert f"{out / 'run'} is in use by process {first.pid}" in line and f"kill {first.pid}" in line
            assert "one writer per run dir" in line
        assert first.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert [r["step"] for r in read_jsonl(out / "run" / "metrics.jsonl")] == list(range(1, 31))
    assert [r["step"] for r in read_jsonl(out / "run" / "sync.jsonl") if r["row"] == "refresh"] == list(range(1, 31))
    assert (out / "run" / "lock").read_text() == ""


def test_timestamped_run_dirs_never_collide(tmp_path):
    made = [RunLog.create(str(tmp_path), "") for _ in range(3)]   # within one second
    assert len({m.dir for m in made}) == 3 and all(m.dir.parent == tmp_path for m in made)


# --- the tiny model's cache under signals ----------------------------------------------------------------
def _build_then_signal(tmp_path: Path, sig: int) -> tuple[subprocess.Popen, Path, str]:
    cache, out = tmp_path / "cache", tmp_path / "out"
    proc = cli("run", "model.name_or_path=tiny", f"run.out_dir={out}", *QUICK_RUN, "warmstart.steps=200",
               env_extra={"LORABENCH_CACHE": str(cache)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait(lambda: cache.is_dir() and any(".tmp-" in p.name for p in cache.iterdir()), proc, "the build's temp dir")
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=120)
    assert not out.exists()                # the run dir is made after the model, never for a failed build
    return proc, cache, err


def test_sigterm_during_tiny_build_leaves_no_temp(tmp_path):
    proc, cache, err = _build_then_signal(tmp_path, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    line = one_line_error(err)
    assert "stopped by SIGTERM" in line and "run the same command again" in line, line   # no run dir to resume
    assert list(cache.iterdir()) == []


def test_sigterm_mid_run_names_the_run_dir_that_continues(tiny_model_dir, tmp_path):
    """SIGTERM during the steps: the line gave `lorabench resume RUN_DIR`; now it names the run dir,
    and that command (with a shorter grpo.steps, an allowed change) finishes every step once."""
    run = tmp_path / "run"
    proc = cli("run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path}", "run.name=run",
               f"refresh.file.tmp_dir={tmp_path}", *QUICK_RUN, "grpo.steps=200", stdout=subprocess.PIPE,
               stderr=subprocess.PIPE, text=True)
    _wait(lambda: (run / "metrics.jsonl").is_file() and read_jsonl(run / "metrics.jsonl"), proc, "a step's row")
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    command = one_line_error(err).split("; `")[1].split("`")[0].split()
    assert command == ["lorabench", "resume", str(run)], err[-2000:]
    last = inspect(run).step + 2
    assert main([*command[1:], f"grpo.steps={last}"]) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, last + 1))


def test_sigkilled_tiny_build_temp_removed_by_next_access(tmp_path):
    from lorabench.tiny import WarmStartSettings, tiny_model_dir
    proc, cache, _ = _build_then_signal(tmp_path, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    temps = [p.name for p in cache.iterdir()]
    assert len(temps) == 1 and ".tmp-" in temps[0]           # what a kill -9 cannot clean up itself...
    built = tiny_model_dir(str(cache), WarmStartSettings(steps=0), seed=1, log=lambda *a: None)
    assert [p.name for p in cache.iterdir()] == [built.name]  # ...the next access (another recipe) does


def test_adapter_dirs_past_the_checkpoint(run_dir, capsys):
    """One adapters/step_<n> past the checkpoint is what a kill between it and its checkpoint leaves
    (tests/test_crash.py redoes that step); two cannot come from one kill."""
    for step in (3, 4):
        shutil.copytree(run_dir / "adapters" / "step_2", run_dir / "adapters" / f"step_{step}")
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert "holds step_3 and step_4, past the checkpoint's step 2" in line and "Restore the matching one" in line
    assert dir_bytes(run_dir) == before
    shutil.rmtree(run_dir / "adapters" / "step_4")
    assert inspect(run_dir).step == 2                               # one is accepted


# --- the ways on from a finished run -------------------------------------------------------------------
def _comparable(row: dict) -> dict:
    """A metrics row without its wall-clock parts."""
    return {k: v for k, v in row.items() if not k.startswith("time/") and not
            (k.startswith("refresh/") and k.endswith("_s"))}


def _quick_run(model, out: Path, name: str, *extra) -> Path:
    assert main(["run", f"model.name_or_path={model}", f"run.out_dir={out}", f"run.name={name}",
                 f"refresh.file.tmp_dir={out}", *QUICK_RUN, *extra]) == 0
    return out / name


@pytest.fixture(scope="module")
def three_steps(tiny_model_dir, tmp_path_factory) -> Path:
    """The finished run's experiment run for 3 steps uninterrupted: what an extension must equal."""
    return _quick_run(tiny_model_dir, tmp_path_factory.mktemp("three"), "run", "grpo.steps=3")


def _same_run(extended: Path, reference: Path) -> None:
    assert [_comparable(r) for r in read_jsonl(extended / "metrics.jsonl")] == [
        _comparable(r) for r in read_jsonl(reference / "metrics.jsonl")]
    last = read_jsonl(reference / "evals.jsonl")[-1]["step"]
    assert [r for r in read_jsonl(extended / "evals.jsonl") if r["step"] in (0, last)] == read_jsonl(
        reference / "evals.jsonl")


@pytest.mark.parametrize("steps", [0, 2])
def test_extending_a_finished_run(run_dir, tiny_model_dir, tmp_path, three_steps, steps):
    """`lorabench resume RUN grpo.steps=N` of a finished run, whatever it reached: the run goes on to N
    and equals an uninterrupted N-step run. A zero-step run (no checkpoint, its summary.json) was
    refused as one whose checkpoint went missing; a run resumed at the steps it has is evaluated
    again, nothing trained."""
    run = run_dir if steps else _quick_run(tiny_model_dir, tmp_path, "zero", "grpo.steps=0")
    assert main(["resume", str(run), f"grpo.steps={steps}"]) == 0
    assert len(read_jsonl(run / "metrics.jsonl")) == steps
    assert main(["resume", str(run), "grpo.steps=3"]) == 0
    _same_run(run, three_steps)
    assert read_jsonl(run / "config_changes.jsonl")[-1]["changes"] == {"grpo.steps": [steps, 3]}


@pytest.mark.parametrize("damage, said", [
    ("deleted", "adapters/step_2 was missing"),
    ("weights_cut_short", "adapters/step_2/adapter_model.safetensors cannot be read (SafetensorError"),
    ("config_cut_short", "adapters/step_2/adapter_config.json cannot be read (JSONDecodeError"),
    ("config_deleted", "adapters/step_2 lacks adapter_config.json"),
])
def test_a_lost_final_adapter_export_is_written_again(run_dir, capsys, damage, said):
    """adapters/step_2, the finished run's final export, deleted or cut short (a copy interrupted): a
    resume (which trains nothing) wrote a summary without it, or beside the torn file, no word; now it
    is exported again from the checkpoint, which holds the same adapter: the same bytes."""
    export = run_dir / "adapters" / "step_2"
    original = {p.name: p.read_bytes() for p in export.iterdir()}
    if damage == "deleted":
        shutil.rmtree(export)
    elif damage == "config_deleted":
        (export / "adapter_config.json").unlink()
    else:
        name = "adapter_model.safetensors" if damage == "weights_cut_short" else "adapter_config.json"
        (export / name).write_bytes(original[name][:len(original[name]) // 2])
    assert main(["resume", str(run_dir)]) == 0
    repairs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("repair: adapters/")]
    assert len(repairs) == 1 and said in repairs[0] and repairs[0].endswith(": exported again from the checkpoint")
    assert {p.name: p.read_bytes() for p in export.iterdir()} == original


@pytest.mark.parametrize("damage, said", [
    ("config_a_link", "adapters/step_2/adapter_config.json is a symbolic link (to "),
    ("weights_a_link", "adapters/step_2/adapter_model.safetensors is a symbolic link (to "),
    ("weights_cut_short", "adapters/step_2/adapter_model.safetensors cannot be read (SafetensorError"),
])
def test_an_adapter_export_holding_a_link_or_the_users_files_is_refused(run_dir, capsys, damage, said):
    """adapters/step_2 with adapter_config.json a link (git-annex, DVC) and the user's README.md beside it: a
    resume said 'exported again' and replaced the folder, README.md gone. A link there is refused like elsewhere
    in the run dir, and a damaged export is replaced only when it holds nothing but lorabench's files."""
    export = run_dir / "adapters" / "step_2"
    (export / "README.md").write_text("# my model card\n")
    name = "adapter_config.json" if damage == "config_a_link" else "adapter_model.safetensors"
    outside = run_dir.parent / "annex" / name
    if damage.endswith("a_link"):
        outside.parent.mkdir()
        shutil.move(export / name, outside)
        (export / name).symlink_to(outside)
    else:
        (export / name).write_bytes((export / name).read_bytes()[:100])
    before, target = tree_state(run_dir), outside.exists() and outside.read_bytes()
    line = refused(capsys, "resume", str(run_dir))
    assert said in line, line
    if damage.endswith("a_link"):
        assert "replace the link with a copy of the target" in line, line
    else:
        assert "also holds README.md, which lorabench does not write" in line and "Move them out of" in line, line
    assert tree_state(run_dir) == before and (outside.exists() and outside.read_bytes()) == target


@pytest.mark.parametrize("every, exports", [(10, ["step_3"]), (2, ["step_2", "step_3"])])
def test_extending_a_run_whose_final_export_was_deleted(run_dir, three_steps, every, exports):
    """The finished run's final export (adapters/step_2) deleted, then the run extended: the extended
    run's final export is written, the same bytes as the uninterrupted 3-step run's; step_2 is written
    again where a 3-step run exports it (run.save_adapter_every=2), not where it does not (10)."""
    shutil.rmtree(run_dir / "adapters" / "step_2")
    assert main(["resume", str(run_dir), "grpo.steps=3", f"run.save_adapter_every={every}"]) == 0
    assert sorted(os.listdir(run_dir / "adapters")) == exports
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (run_dir / "adapters" / "step_3" / name).read_bytes() == (
            three_steps / "adapters" / "step_3" / name).read_bytes()


@pytest.mark.parametrize("row, needle", [
    ({"step": 2, "changes": [1]}, "'changes' is [1], not the {field: [old, new]} lorabench appends"),
    ({"step": 2, "changes": {"grpo.steps": 5}}, "'changes' is {'grpo.steps': 5}, not the {field: [old, new]}"),
])
def test_a_config_change_row_not_as_lorabench_appends_it_is_refused(run_dir, capsys, row, needle):
    """A hand-written config_changes.jsonl row of another shape: a traceback (AttributeError, TypeError)."""
    with open(run_dir / "config_changes.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")
    before = dir_bytes(run_dir)
    line = refused(capsys, "resume", str(run_dir))
    assert f"{run_dir / 'config_changes.jsonl'} line 1: {needle}" in line and "nothing in the run dir" in line, line
    assert dir_bytes(run_dir) == before


def test_a_row_without_what_the_summary_reads_is_noted_and_skipped(run_dir, capsys):
    """A metrics row edited by hand without its reward or refresh time: the run continued, then the summary raised
    a KeyError after the new step was written. Now inspect notes the row (as it notes a missing one) and the
    summary's statistics come from the rows that hold them."""
    metrics = run_dir / "metrics.jsonl"
    first, *rest = metrics.read_text().splitlines()
    row = json.loads(first)
    del row["refresh/total_s"], row["reward/mean"]
    metrics.write_text("\n".join([json.dumps(row), *rest]) + "\n")
    state = inspect(run_dir)
    assert f"{metrics} line 1 (step 1) has no number for ['reward/mean', 'refresh/total_s']" in state.notes[0]
    assert main(["resume", str(run_dir), "grpo.steps=3"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert summary["steps"] == 3 and summary["train_reward_first5"] == sum(r["reward/mean"] for r in rows[1:]) / 2
    assert summary["refresh_ms_max"] == 1e3 * max(r["refresh/total_s"] for r in rows[1:])


def test_a_resume_continued_by_another_process_meanwhile_is_refused(run_dir, capsys, monkeypatch):
    """Two resumes started together: both read step 2 before the lock; the second, once the first had continued the
    run to step 3, recorded its changes at step 2. Now the step is read again under the lock."""
    from lorabench.session import run as session_run
    real_plan_run, after_the_other = session_run.plan_run, {}

    def plan_then_another_resume(cfg, path=None):
        plan = real_plan_run(cfg, path)                                # this command reads step 2
        monkeypatch.setattr(session_run, "plan_run", real_plan_run)
        assert main(["resume", str(run_dir), "grpo.steps=3"]) == 0    # another one continues to step 3 meanwhile
        capsys.readouterr()
        after_the_other.update(dir_bytes(run_dir))
        return plan

    monkeypatch.setattr(session_run, "plan_run", plan_then_another_resume)
    line = refused(capsys, "resume", str(run_dir), "grpo.steps=4")
    assert f"{run_dir} was continued by another process while this command read it (step 2 -> 3)" in line
    assert "Run the same command again to continue from step 3" in line
    assert dir_bytes(run_dir) == after_the_other
    assert main(["resume", str(run_dir), "grpo.steps=4"]) == 0        # the recovery the message names
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
