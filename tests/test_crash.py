"""Crashes mid-write and mid-run, with real processes killed by SIGKILL:

- atomic adapter writes: a writer killed at random points leaves every adapter dir complete and
  loadable (one of the versions written, config and weights of the same version) or absent;
- disk full (a real, tiny tmpfs) during a file refresh: a clear error, the engine keeps serving
  the previous adapter;
- `lorabench run` killed -9 at random steps, then `lorabench resume`: every step row exactly once,
  and every metric (timings aside) equal to an uninterrupted run's;
- the exact states a kill can leave inside a commit, built in-process: resume repairs them from
  the checkpoint (and says so) and continues as the uninterrupted run.
What resume refuses (corrupt lines, a missing checkpoint, two writers, refused overrides) is
tests/test_rundir.py.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import max_abs_diff, model_logprobs, perturb_lora_B
from reliability_util import TINY_RUN, cli, make_trainer, mounted_disk, stale_run, tens_problems  # noqa: F401
from synthetic import peft_adapter  # benchmarks/, on sys.path by conftest

from lorabench.adapters import CONFIG_NAME, PEFT_PREFIX, WEIGHTS_NAME, AdapterWriteError, FlatAdapter
from lorabench.refresh import FileRefresh
from lorabench.rundir import clean
from lorabench.runlog import read_jsonl


# --- atomic adapter writes under SIGKILL ---------------------------------------------------------
def _versions(n: int = 4) -> list[FlatAdapter]:
    """Distinct adapters of ~2 MB (long enough writes that kills land inside them); each config
    names its version, so a dir mixing one version's config with another's weights is caught."""
    versions = []
    for v in range(n):
        gen = torch.Generator().manual_seed(v)
        tensors = {}
        for layer in range(4):
            m = f"{PEFT_PREFIX}model.layers.{layer}.mlp.up_proj"
            tensors[f"{m}.lora_A.weight"] = torch.randn(8, 256, generator=gen)
            tensors[f"{m}.lora_B.weight"] = torch.randn(512, 8, generator=gen)
        for layer in range(4):
            m = f"{PEFT_PREFIX}model.layers.{layer}.mlp.down_proj"
            tensors[f"{m}.lora_A.weight"] = torch.randn(8, 512 * 24, generator=gen)
            tensors[f"{m}.lora_B.weight"] = torch.randn(256, 8, generator=gen)
        config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["down_proj", "up_proj"],
                  "revision": v}
        versions.append(FlatAdapter.from_tensors(tensors, config, v))
    return versions


def _writer_loop(parent: Path, versions, progress_fd: int) -> None:
    """The child: write versions round-robin to one path (replacing it) and to new paths."""
    i = 0
    while True:
        snap = versions[i % len(versions)]
        snap.save_peft_dir(parent / "same")
        snap.save_peft_dir(parent / f"new_{i % 25:02d}")  # 25 new dirs, then they are replaced too
        os.write(progress_fd, b".")
        i += 1


def _fork_writer(parent: Path, versions) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 1
        try:
            os.close(r)
            _writer_loop(parent, versions, w)
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _check_dir_tree(parent: Path, versions) -> dict:
    """Every visible entry is a complete adapter equal to one version; hidden ones are temps."""
    found = {"complete": 0, "hidden_temps": 0}
    for entry in sorted(parent.iterdir()):
        if entry.name.startswith("."):
            base = entry.name[1:].split(".")[0]
            rest = entry.name[len(base) + 2:]
            assert rest.startswith(("tmp-", "old-")), entry  # lorabench's temp names only
            assert rest[4:].split("-")[0].isdigit(), entry  # ...carrying the writer's pid
            found["hidden_temps"] += 1
            continue
        assert sorted(p.name for p in entry.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME], entry
        loaded = FlatAdapter.load_peft_dir(entry)              # raises on a torn file
        want = versions[loaded.config["revision"]]
        assert loaded.config == want.config
        assert loaded.tensors.keys() == want.tensors.keys()
        assert all(torch.equal(loaded.tensors[k], want.tensors[k]) for k in want.tensors), entry
        found["complete"] += 1
    return found


def test_adapter_writes_survive_sigkill(tmp_path):
    """>= 50 writers SIGKILLed at random points: each adapter dir left is complete or absent."""
    trials, versions, rng = 50, _versions(), random.Random(1234)
    totals = {"writes": 0, "with_temps": 0, "same_absent": 0, "complete": 0, "stale_removed": 0}
    for trial in range(trials):
        parent = tmp_path / f"t{trial:02d}"
        parent.mkdir()
        pid, progress = _fork_writer(parent, versions)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL  # killed, not exited
        writes = 0
        while chunk := os.read(progress, 4096):
            writes += len(chunk)
        os.close(progress)
        totals["writes"] += writes
        found = _check_dir_tree(parent, versions)
        totals["complete"] += found["complete"]
        totals["with_temps"] += found["hidden_temps"] > 0
        totals["same_absent"] += not (parent / "same").exists()
        # the next write to the same name removes what the dead writer left for that name
        hidden_before = {p.name for p in parent.iterdir() if p.name.startswith(".same.")}
        versions[0].save_peft_dir(parent / "same")
        hidden_after = {p.name for p in parent.iterdir() if p.name.startswith(".same.")}
        assert hidden_after == set()
        totals["stale_removed"] += len(hidden_before)
        _check_dir_tree(parent, versions)
    print(f"\nadapter-write kill trials: {trials}, failures: 0, {totals}")
    assert totals["writes"] > trials          # the writers really were writing...
    assert totals["with_temps"] >= trials // 5  # ...and many kills landed inside a write


# --- disk full during a file refresh -------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    with mounted_disk(tmp_path / "tmpfs", 2048) as disk:
        yield disk


def test_disk_full_file_refresh_keeps_previous_adapter(engine, make_peft_model, sample_sequences, full_disk):
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    refresher = FileRefresh(engine, "policy", tmp_dir=str(full_disk.path))
    try:
        refresher.refresh(peft_adapter(model, version=1))
        serving = engine.score(seqs, lens, "policy")
        dirs_before = sorted(refresher.root.iterdir())
        assert full_disk.fill() > 0
        perturb_lora_B(model, seed=7)
        with pytest.raises(AdapterWriteError) as info:
            refresher.refresh(peft_adapter(model, version=2))
        err = info.value
        assert err.errno == errno.ENOSPC and isinstance(err, OSError)
        msg = str(err)
        assert "no space left" in msg and str(refresher.root / "policy-000002") in msg  # what and where
        assert "refresh.file.tmp_dir" in msg and "previous adapter is untouched" in msg      # the fix
        assert engine.loaded_adapters() == ["policy"]
        after = engine.score(seqs, lens, "policy")
        assert all(torch.equal(a, b) for a, b in zip(serving, after))   # still the previous adapter
        assert sorted(refresher.root.iterdir()) == dirs_before           # no partial dir left
        assert refresher.refreshes == 1
        full_disk.free()
        refresher.refresh(peft_adapter(model, version=3))       # space again: refresh works
        assert max_abs_diff(engine.score(seqs, lens, "policy"), model_logprobs(model, seqs, lens)) < 1e-5
    finally:
        refresher.close()


# --- kill -9 mid-run, then `lorabench resume` ----------------------------------------------------
TIMING = ("time/",)


def _comparable(row: dict) -> dict:
    """A metrics row without its wall-clock parts (time/*, refresh/total_s, refresh/<part>_s),
    NaN as None (as in metrics.jsonl)."""
    return {k: v for k, v in clean(row).items()
            if not k.startswith(TIMING) and not (k.startswith("refresh/") and k.endswith("_s"))}


def _steps(run_dir: Path, name: str = "metrics.jsonl", row_kind: str | None = None) -> list[int]:
    rows = read_jsonl(run_dir / name)
    return [r["step"] for r in rows if row_kind is None or r.get("row") == row_kind]


def _wait_for(cond, proc, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the kill point"
        assert time.monotonic() - t0 < timeout, "kill point not reached in time"
        time.sleep(0.02)


def _start(args, log: Path):
    with open(log, "ab") as fh:  # the child keeps its own copy of the descriptor
        return cli(*args, stdout=fh, stderr=subprocess.STDOUT)


def _finish(proc, log: Path) -> None:
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]


def _run_args(tiny_model_dir, out: Path, name: str, shm: Path) -> list[str]:
    return ["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", f"run.name={name}",
            f"refresh.file.tmp_dir={shm}", "run.save_adapter_every=2", *TINY_RUN]


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run every resumed run must equal, step for step."""
    out = tmp_path_factory.mktemp("reference")
    _finish(_start(_run_args(tiny_model_dir, out, "ref", out), out / "log.txt"), out / "log.txt")
    return out / "ref"


def _check_against_reference(run_dir: Path, reference: Path, context) -> None:
    steps = list(range(1, 7))  # every step exactly once, in order, in every per-step file
    assert _steps(run_dir) == steps, context
    assert _steps(run_dir, "sync.jsonl", "refresh") == steps, context
    assert _steps(run_dir, "rollouts.jsonl") == _steps(reference, "rollouts.jsonl"), context
    got, want = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    for g, w in zip(got, want):  # ...and equal to the uninterrupted run's, timings aside
        assert _comparable(g) == _comparable(w), (g["step"], context)
    assert read_jsonl(run_dir / "rollouts.jsonl") == read_jsonl(reference / "rollouts.jsonl"), context
    final, ref_final = (FlatAdapter.load_peft_dir(d / "adapters" / "step_6") for d in (run_dir, reference))
    assert all(torch.equal(final.tensors[k], ref_final.tensors[k]) for k in ref_final.tensors), context


STOPPED = {signal.SIGKILL: -signal.SIGKILL, signal.SIGINT: 130, signal.SIGTERM: 128 + signal.SIGTERM}  # exit codes


def _killed_and_resumed(reference: Path, tiny_model_dir: Path, work: Path, kill_points: list[int],
                        rng: random.Random, stop: signal.Signals = signal.SIGKILL, extra=()) -> list[dict]:
    """One run (the tiny run plus `extra`) stopped by `stop` at each kill point (k: once step k's row
    is written, then a random delay of up to a step; 0: once the before-eval is written, i.e. during
    step 1, before any checkpoint), resumed after each stop, then resumed to the end; checked against
    the reference."""
    shm, run_dir, log = work / "shm", work / "run", work / "log.txt"
    shm.mkdir()
    kills = []
    for k in kill_points:
        launched = bool(kills)
        proc = _start(["resume", str(run_dir)] if launched else
                      [*_run_args(tiny_model_dir, work, "run", shm), *extra], log)
        # a resumed run may first append rows its checkpoint holds: wait for a row of a step it runs
        target = max(k, max(_steps(run_dir), default=0) + 1) if launched else k
        if target > 5:
            break
        if target == 0:
            _wait_for(lambda: len(read_jsonl(run_dir / "evals.jsonl")) >= 2, proc)
        else:
            _wait_for(lambda target=target: target in _steps(run_dir), proc)
        time.sleep(rng.uniform(0.0, 0.3))  # a step takes 0.3-0.5 s: within the next step
        if proc.poll() is not None or 6 in _steps(run_dir):
            break  # training is over: the final evaluation is tested separately
        os.killpg(proc.pid, stop)
        assert proc.wait(timeout=120) == STOPPED[stop], log.read_text()[-3000:]
        proc = None
        kills.append({"after_step": target, "rows_at_kill": len(_steps(run_dir)),
                      "checkpoint": (run_dir / "checkpoint" / "trainer_state.pt").is_file()})
    else:
        proc = _start(["resume", str(run_dir)], log)
    _finish(proc, log)

    _check_against_reference(run_dir, reference, kills)
    # before (step 0) and after (step 6) evaluations: once each, the same values
    assert read_jsonl(run_dir / "evals.jsonl") == read_jsonl(reference / "evals.jsonl"), kills
    # nothing a killed writer left behind survives the finished run
    assert not [p for p in run_dir.rglob(".*")], list(run_dir.rglob(".*"))
    assert list(shm.iterdir()) == []  # killed runs' adapter roots were removed by the next run
    return kills


def test_kill_and_resume_once(reference_run, tiny_model_dir, tmp_path):
    """One random kill (the fast suite); the slow test below makes >= 10."""
    rng = random.Random(7)
    kills = _killed_and_resumed(reference_run, tiny_model_dir, tmp_path, [rng.randint(1, 4)], rng)
    assert len(kills) == 1


@pytest.mark.slow
def test_kill_and_resume_many(reference_run, tiny_model_dir, tmp_path):
    """>= 10 kill -9 trials at random steps, in runs killed several times each."""
    rng = random.Random(2024)
    kills, chain = [], 0
    while len(kills) < 10:
        assert chain < 30, f"{len(kills)} kills in {chain} runs: the runs end before their kill points"
        points = sorted(rng.sample(range(1, 6), 3))
        points = [0] + points if chain % 2 == 0 else points  # 0: during step 1, before any checkpoint
        work = tmp_path / f"chain{chain}"
        work.mkdir()
        kills += _killed_and_resumed(reference_run, tiny_model_dir, work, points, rng)
        chain += 1
    print(f"\nkill -9 + resume trials: {len(kills)}, failures: 0, runs: {chain}; {kills}")
    assert len(kills) >= 10


# --- one step stale (grpo.max_staleness=1): stopped, resumed, extended ---------------------------
@pytest.fixture(scope="module")
def stale_extra(tmp_path_factory) -> list[str]:
    return stale_run(tens_problems(tmp_path_factory.mktemp("tens")))


@pytest.fixture(scope="module")
def stale_reference(tiny_model_dir, stale_extra, tmp_path_factory):
    """The uninterrupted stale run: it learns (the adapter moves with the rollouts), every step after
    the first sampled one version behind."""
    out = tmp_path_factory.mktemp("stale-reference")
    _finish(_start([*_run_args(tiny_model_dir, out, "ref", out), *stale_extra], out / "log.txt"), out / "log.txt")
    rows = read_jsonl(out / "ref" / "metrics.jsonl")
    assert [r["adapter/lag"] for r in rows] == [0, 1, 1, 1, 1, 1]
    assert any(r["advantage/abs_mean"] > 0 for r in rows) and rows[-1]["adapter/delta_norm"] > 0
    return out / "ref"


def test_a_stale_runs_summary_counts_the_engine_mismatch_of_on_policy_steps_only(stale_reference):
    """The summary's mismatch says whether the engine served the trainer's adapter (~1e-6 on the CPU engine); a
    step sampled one adapter behind differs by the lag (it printed ~1e-1 as the engine's mismatch)."""
    rows = read_jsonl(stale_reference / "metrics.jsonl")
    summary = json.loads((stale_reference / "summary.json").read_text())
    assert max(r["mismatch/max"] for r in rows[1:]) > 1e-3   # the lag shows in the rows
    assert summary["lagged_steps"] == 5 and summary["mismatch_max"] == rows[0]["mismatch/max"] < 1e-4, summary


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_stopped_stale_run_resumes_as_the_uninterrupted_run(stale_reference, stale_extra, tiny_model_dir, tmp_path,
                                                              stop):
    """Ctrl-C, SIGTERM and kill -9 at random moments (kill -9 twice in one run): the resumed run samples
    its first step from the checkpoint's adapter one version behind, with the same seed, so lags, rows,
    evaluations and the final adapter are the uninterrupted run's."""
    rng = random.Random(int(stop))
    points = sorted(rng.sample(range(1, 4), 2 if stop == signal.SIGKILL else 1))   # room for the delay after
    kills = _killed_and_resumed(stale_reference, tiny_model_dir, tmp_path, points, rng, stop, stale_extra)
    assert len(kills) == len(points), kills


def test_an_extended_stale_run_continues_as_the_longer_run(stale_reference, stale_extra, tiny_model_dir, tmp_path):
    """A finished 3-step stale run extended to 6 (`lorabench resume RUN grpo.steps=6`): step 4 samples
    from the adapter of step 2, as in the 6-step run."""
    log = tmp_path / "log.txt"
    _finish(_start([*_run_args(tiny_model_dir, tmp_path, "run", tmp_path), *stale_extra, "grpo.steps=3"], log), log)
    _finish(_start(["resume", str(tmp_path / "run"), "grpo.steps=6"], log), log)
    _check_against_reference(tmp_path / "run", stale_reference, "extension")
    assert "holds no adapter one version behind" not in log.read_text()


# --- the before/after evaluations the CLI writes around training -------------------------------
@pytest.mark.slow
def test_resume_after_kill_during_final_evaluation(reference_run, tmp_path):
    """The state a kill between the two 'after' evaluation rows leaves (all 6 steps and their
    checkpoint, the sampled after-row, no greedy after-row, no summary), built exactly from the
    reference run: `resume` runs no step and evaluates again, replacing the step-6 rows, so
    evals.jsonl ends equal to the reference's (evaluation is seeded). (docs/reliability.md)"""
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    shutil.copytree(reference_run, run_dir)
    (run_dir / "summary.json").unlink()
    ref = read_jsonl(reference_run / "evals.jsonl")
    (run_dir / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ref[:3]))
    _finish(_start(["resume", str(run_dir)], log), log)
    _check_against_reference(run_dir, reference_run, "final evaluation")
    evals = read_jsonl(run_dir / "evals.jsonl")
    assert evals == ref  # the final evaluation is redone once, not appended twice
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 6


@pytest.mark.slow
def test_resume_after_kill_between_before_evaluations(reference_run, tiny_model_dir, tmp_path):
    """The state a kill between the two before-evaluation rows leaves (config.json, one eval row,
    no step, no checkpoint), built exactly; `resume` should evaluate again and train."""
    from lorabench.runlog import RunLog
    from lorabench.session.config import Config
    shm, run_dir, log = tmp_path / "shm", tmp_path / "run", tmp_path / "log.txt"
    shm.mkdir()
    cfg = Config.load(overrides=_run_args(tiny_model_dir, tmp_path, "run", shm)[1:])
    runlog = RunLog(run_dir)
    runlog.write_config(cfg.to_dict())
    before = read_jsonl(reference_run / "evals.jsonl")[0]
    runlog.set_evals(before["step"], [before])
    _finish(_start(["resume", str(run_dir)], log), log)
    _check_against_reference(run_dir, reference_run, "kill between before-evaluations")


# --- the exact states a kill can leave inside a commit, built in-process ---------------------------
def _three_steps(make_trainer, tmp_path):
    """The uninterrupted 3-step run, and a run dir of the same run stopped after step 2."""
    reference = make_trainer(tmp_path / "reference")
    ref = [r.metrics for r in reference.run(progress=False)]
    run = tmp_path / "run"
    make_trainer(run).run(2, progress=False)
    return ref, run


def _cut_rows_of_step(run: Path, step: int, names=("metrics.jsonl", "sync.jsonl", "rollouts.jsonl")) -> None:
    """Remove `step`'s rows from the end of the files: what a kill between that step's checkpoint
    and its appends leaves."""
    for name in names:
        lines = (run / name).read_text().splitlines(keepends=True)
        (run / name).write_text("".join(x for x in lines if json.loads(x)["step"] != step))


@pytest.mark.parametrize("window", ["before_sync_rows", "before_metrics_row", "mid_sync_append_torn"])
def test_kill_after_checkpoint_rows_come_from_it(make_trainer, tmp_path, window):
    """Killed after step 2's checkpoint, before (some of) its rows reached the files: resume appends
    exactly the missing rows from the checkpoint, saying so; a torn last line is cut, saying so;
    the rows end equal to the uninterrupted run's and step 3 is the uninterrupted step 3."""
    ref, run = _three_steps(make_trainer, tmp_path)
    whole = {n: read_jsonl(run / n) for n in ("metrics.jsonl", "sync.jsonl", "rollouts.jsonl")}
    if window == "before_sync_rows":
        _cut_rows_of_step(run, 2)
    elif window == "before_metrics_row":
        _cut_rows_of_step(run, 2, names=("metrics.jsonl",))
    else:
        _cut_rows_of_step(run, 2)
        with open(run / "sync.jsonl", "a") as fh:
            fh.write(json.dumps(whole["sync.jsonl"][-1])[:25])       # the kill cut this row short
    said = []
    resumed = make_trainer(run, log=said.append)
    assert resumed.step_count == 2
    assert any("metrics.jsonl: appending the 1 row(s) of step(s) [2]" in line for line in said), said
    assert any("torn last line" in line for line in said) == (window == "mid_sync_append_torn"), said
    for name, rows in whole.items():
        got = read_jsonl(run / name)
        assert [r["step"] for r in got] == [r["step"] for r in rows], name
        timeless = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]
        assert [{k: v for k, v in r.items() if not k.startswith("time/")} for r in got] == timeless, name
    assert [h["step"] for h in resumed.history] == [1, 2]
    assert _comparable(resumed.step().metrics) == _comparable(ref[2])
    resumed.wait_committed()
    assert _steps(run) == [1, 2, 3]


def test_kill_between_adapter_dir_and_checkpoint(make_trainer, tmp_path):
    """adapters/step_3 written, its checkpoint not: resume restores step 2 (its checkpoint), redoes
    step 3 equal to the uninterrupted run, and rewrites adapters/step_3 with the same values."""
    ref, run = _three_steps(make_trainer, tmp_path)
    trainer = make_trainer(run)
    step2 = trainer.policy.adapter()
    ahead = FlatAdapter.from_tensors({k: v + 0.5 for k, v in step2.tensors.items()}, step2.config, 3)
    ahead.save_peft_dir(run / "adapters" / "step_3")              # the kill came right after this
    resumed = make_trainer(run, "run.save_adapter_every=1")
    restored = resumed.policy.adapter()
    assert resumed.step_count == 2 and torch.equal(restored.buffer, step2.buffer)
    assert _comparable(resumed.step().metrics) == _comparable(ref[2])
    resumed.wait_committed()
    redone = FlatAdapter.load_peft_dir(run / "adapters" / "step_3")
    assert torch.equal(redone.buffer, resumed.policy.adapter().buffer)


def test_kill_in_first_step_before_any_checkpoint(make_trainer, tmp_path):
    """Killed during step 1 (the run dir holds its config and step-0 evaluations, one of them torn):
    no step was committed, so the run starts at step 1 and writes each row once."""
    reference = make_trainer(tmp_path / "reference")
    ref = reference.step().metrics
    run = tmp_path / "run"
    from lorabench.runlog import RunLog
    RunLog(run).set_evals(0, [{"step": 0, "greedy": False, "strict": 0.0}])
    with open(run / "evals.jsonl", "a") as fh:
        fh.write('{"step": 0, "gree')                               # torn by the kill
    trainer = make_trainer(run)
    assert trainer.step_count == 0 and _steps(run) == []
    assert read_jsonl(run / "evals.jsonl") == [{"step": 0, "greedy": False, "strict": 0.0}]
    assert (run / "evals.jsonl").read_text().endswith("}\n")        # the torn line was cut, not glued onto
    rec = trainer.step()
    trainer.wait_committed()
    assert _steps(run) == [1] and _steps(run, "sync.jsonl", "refresh") == [1]
    assert _comparable(rec.metrics) == _comparable(ref)
