"""A run directory nobody can turn against its user (docs/reliability.md, section 2b).

1. links: nothing outside a run dir is read, written, truncated or chmod'ed through it (a link, a
   FIFO, a hard-linked file or a folder of the wrong kind is refused naming it), nor through a closed
   one (never the working directory instead); a run name is one path component;
2. divergence: a diverged update (non-finite, or beyond grpo.max_delta_ratio) is never served, saved
   or checkpointed; the run stops with one line and its last good checkpoint resumes;
3. fingerprint: resume refuses a config.json, data file or model that is not what the checkpoint
   was trained on, before anything is written;
4. every input error before anything exists; a full or read-only disk mid-run is one line and the
   run resumes.
Each CLI case asserts exit code 2, one 'lorabench: ...' line naming the culprit, no traceback, the run
dir unchanged (tree_state: bytes, modes, links) and every file outside it unchanged (link targets).
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from reliability_util import (  # noqa: F401 (make_trainer: a fixture)
    QUICK_RUN,
    FullDisk,
    cli,
    make_trainer,
    mounted_disk,
    one_line_error,
    refused,
    tree_state,
)

from lorabench.cli import main
from lorabench.grpo import TrainerStopped
from lorabench.rundir import EVALS, SUMMARY, RunDirError, inspect, read_checkpoint, read_jsonl
from lorabench.runlog import RunLog
from lorabench.safedir import RunDirWriteError, SafeDir, remove_dead_dir_temps, remove_stale_temps
from lorabench.session.config import Config, ConfigError

# flexible reward: the random tiny model earns a reward now and then, so its adapter really moves
LEARNS = ["grpo.reward_mode=flexible", "grpo.group_size=4", "grpo.max_new_tokens=8", "grpo.lr=0.05"]


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 2-step `lorabench run` (in this process) with a fingerprint in its checkpoint."""
    out = tmp_path_factory.mktemp("trust")
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {i} apples and buys {i + 1}. How many?",
                                        "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}) + "\n"
                            for i in range(12)))
    assert main(["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", "run.name=run",
                 f"refresh.file.tmp_dir={out}", f"data.source={data}", *QUICK_RUN]) == 0
    return out / "run"


@pytest.fixture
def run_dir(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy, symlinks=True)
    return copy


@pytest.fixture
def victim(tmp_path):
    """A file and a folder of the user's, outside the run dir: what a link in a run dir points to."""
    outside = tmp_path / "home"
    (outside / "folder").mkdir(parents=True)
    (outside / "notes.txt").write_bytes(b"the user's notes, no newline at the end")
    (outside / "folder" / "keep.txt").write_text("keep me\n")
    return outside


def _replace_with_link(path: Path, target: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    os.symlink(target, path)


# --- 1. links: nothing outside the run dir is touched through it ---------------------------------------
LINKED = ["lock", "config.json", "config_changes.jsonl", "metrics.jsonl", "sync.jsonl", "rollouts.jsonl",
          "evals.jsonl", "summary.json", "checkpoint/trainer_state.pt", "plots/reward.png"]


@pytest.mark.parametrize("entry", LINKED)
def test_a_linked_file_in_a_run_dir_isrefused(run_dir, victim, capsys, entry):
    """`lock` -> a file elsewhere used to truncate that file to 0 bytes (exit 0); every other file a
    resume reads, appends, repairs or replaces is refused the same way when it is a link."""
    _replace_with_link(run_dir / entry, victim / "notes.txt")
    before, outside = tree_state(run_dir), tree_state(victim)
    line = refused(capsys, "resume", run_dir)
    assert f"{run_dir / entry} is a symbolic link (to {victim / 'notes.txt'})" in line, line
    assert "lorabench did not open it" in line and "replace the link with a copy of the target" in line
    assert tree_state(run_dir) == before and tree_state(victim) == outside


@pytest.mark.parametrize("entry", ["checkpoint", "adapters", "plots", "adapters/step_2"])
def test_a_linked_folder_in_a_run_dir_isrefused(run_dir, victim, capsys, entry):
    """A folder that is a link (the checkpoint would be written, old adapter dirs swapped out and
    removed, plots written into the folder it names)."""
    shutil.copytree(run_dir / entry, victim / "folder" / "copy")          # what the link points to
    _replace_with_link(run_dir / entry, victim / "folder")
    before, outside = tree_state(run_dir), tree_state(victim)
    line = refused(capsys, "resume", run_dir)
    assert f"{run_dir / entry} is a symbolic link (to {victim / 'folder'}) where lorabench expects a directory" in line
    assert tree_state(run_dir) == before and tree_state(victim) == outside


def test_the_run_dir_itself_as_a_link(run_dir, tmp_path, capsys):
    link = tmp_path / "shared"
    os.symlink(run_dir, link)
    before = tree_state(run_dir)
    line = refused(capsys, "resume", link)
    assert f"{link} is a symbolic link (to {run_dir}), not a run directory" in line and f"realpath {link}" in line
    assert tree_state(run_dir) == before and os.readlink(link) == str(run_dir)
    line = refused(capsys, "run", "--config", run_dir / "config.json", f"run.out_dir={tmp_path}", "run.name=shared")
    assert f"{link} is a symbolic link" in line and tree_state(run_dir) == before


@pytest.mark.parametrize("entry, kind", [("metrics.jsonl", "hard_link"), ("lock", "hard_link"),
                                         ("metrics.jsonl", "fifo"), ("metrics.jsonl", "folder"),
                                         ("metrics.jsonl", "dangling_link"), ("adapters/step_2", "file")])
def test_other_things_where_a_file_is_expected(run_dir, victim, capsys, entry, kind):
    """A second name of an outside file (an append or the lock's truncation would change it there
    too), a FIFO (a read would hang), a folder for a file or a file for a folder, a link to nothing."""
    path = run_dir / entry
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    if kind == "hard_link":
        os.link(victim / "notes.txt", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "file":
        path.write_text("not an adapter dir")
    else:
        os.symlink(victim / "gone.txt", path)
    before, outside = tree_state(run_dir), tree_state(victim)
    t0 = time.monotonic()
    line = refused(capsys, "resume", run_dir)
    assert time.monotonic() - t0 < 30
    want = {"hard_link": "has 2 names (hard links)", "fifo": "is a FIFO where lorabench expects a file",
            "folder": "is a directory where lorabench expects a file", "dangling_link": "is a symbolic link",
            "file": "is a file where lorabench expects a directory"}[kind]
    assert f"{path} {want}" in line, line
    assert tree_state(run_dir) == before and tree_state(victim) == outside


def test_run_out_dir_that_is_a_link_is_the_users_choice(tiny_model_dir, tmp_path):
    """The path to the run dir is the user's own (a scratch disk linked into the home dir): followed."""
    (tmp_path / "scratch").mkdir()
    os.symlink(tmp_path / "scratch", tmp_path / "runs")
    assert main(["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'runs'}", "run.name=r",
                 f"refresh.file.tmp_dir={tmp_path}", *QUICK_RUN, "grpo.steps=1"]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "scratch" / "r" / "metrics.jsonl")] == [1]
    assert main(["resume", str(tmp_path / "runs" / "r"), "grpo.steps=2"]) == 0


def test_a_leftover_dir_with_a_linked_lock_is_refused_before_the_model(tiny_model_dir, tmp_path, victim, capsys):
    """`lorabench run run.name=X` on a dir holding only `lock` (what a run stopped before its config
    leaves) where `lock` is a link: refused before the model is built; the target keeps its bytes."""
    out = tmp_path / "out"
    (out / "x").mkdir(parents=True)
    os.symlink(victim / "notes.txt", out / "x" / "lock")
    before, outside = tree_state(out), tree_state(victim)
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", "run.name=x",
                    *QUICK_RUN)
    assert f"{out / 'x' / 'lock'} is a symbolic link" in line
    assert tree_state(out) == before and tree_state(victim) == outside


def test_a_link_put_in_after_the_checks_is_refused_where_it_is_opened(tmp_path, victim):
    """The early check is not the only guard: every open goes through the run dir's fd with
    O_NOFOLLOW, so a link that appears while the run is writing is refused at that write."""
    runlog = RunLog(tmp_path / "run", log=lambda *a: None, lock=True)
    try:
        runlog.log_metrics([{"step": 1}])
        runlog.save_plots({"reward": b"png"})
        for name, write in (("metrics.jsonl", lambda: runlog.log_metrics([{"step": 2}])),
                            ("evals.jsonl", lambda: runlog.set_evals(0, [{"step": 0}])),
                            ("summary.json", lambda: runlog.write_summary({"steps": 2})),
                            ("plots/reward.png", lambda: runlog.save_plots({"reward": b"png"}))):
            _replace_with_link(tmp_path / "run" / name, victim / "notes.txt")
            outside = tree_state(victim)
            with pytest.raises(RunDirError, match="is a symbolic link"):
                write()
            assert tree_state(victim) == outside, name
        with pytest.raises(RunDirError, match="is a symbolic link"):
            read_jsonl(tmp_path / "run" / "metrics.jsonl")     # a reader of the link is not
    finally:
        runlog.close()


def test_safedir_never_follows_a_link(tmp_path, victim):
    """The primitives: a link is refused for reads, appends, truncation, replacement and as a folder;
    a link named like a dead writer's temp is left as it is (lorabench's temps are never links), its target kept."""
    root = SafeDir.open(tmp_path / "d", create=True, mode=0o750)
    os.symlink(victim / "notes.txt", tmp_path / "d" / "f")
    os.symlink(victim / "folder", tmp_path / "d" / "sub")
    os.symlink(victim / "folder", tmp_path / "d" / ".x.tmp-999999999-0123abcd")  # a 'dead writer's' temp
    outside = tree_state(victim)
    for call in (lambda: root.read_bytes("f"), lambda: root.append("f", b"x"), lambda: root.truncate("f", 0),
                 lambda: root.write_atomic("f", b"x"), lambda: root.sub("sub"), lambda: root.open_own("f", os.O_RDWR)):
        with pytest.raises(RunDirError, match="symbolic link"):
            call()
    with pytest.raises(RunDirError, match="symbolic link"), root.atomic_subdir("sub"):
        pass
    remove_stale_temps(root.fd, (".x.tmp-",))
    assert os.path.islink(tmp_path / "d" / ".x.tmp-999999999-0123abcd")
    assert tree_state(victim) == outside
    root.close()


def test_stale_temp_sweep_removes_only_lorabench_temps(tmp_path):
    """A user's dated hidden backups (`.evals.jsonl.20240101`, a folder `.summary.json.20240101/`) used to be
    deleted by the next write as a dead writer's temps: only lorabench's exact temp names go, and only of the kind
    it makes there (a file for a file's write, a dir for a folder's)."""
    root, d = SafeDir.open(tmp_path / "d", create=True, mode=0o750), tmp_path / "d"
    (d / ".summary.json.20240101").mkdir()
    (d / ".summary.json.20240101" / "notes.txt").write_text("x")
    (d / ".evals.jsonl.999999999.0123abcd").mkdir()            # a file temp's name, but a folder
    (d / ".sub.tmp-999999999-0123abcd").write_text("x")         # a folder temp's name, but a file
    for name in (".evals.jsonl.20240101", ".evals.jsonl.2024.backup_1", ".evals.jsonl.999999999.0123abcd.bak"):
        (d / name).write_text("my backup\n")
    users = tree_state(d)
    (d / ".evals.jsonl.999999999.0123abce").write_text("torn")   # what killed writes leave: removed
    (d / ".summary.json.999999999.89abcdef").write_text("torn")
    (d / ".sub.old-999999999-0123abcd").mkdir()
    root.write_atomic(EVALS, b"{}\n")
    root.write_atomic(SUMMARY, b"{}")
    with root.atomic_subdir("sub"):
        pass
    assert {k: v for k, v in tree_state(d).items() if k not in (EVALS, SUMMARY, "sub")} == users
    root.close()
    cache = tmp_path / "cache"                                   # the tiny model cache's atomic_dir temps
    for name in (".m.tmp-20240101-my-notes", ".m.old-999999999-abc_1234", ".m.tmp-999999999-abc_1234.bak"):
        (cache / name).mkdir(parents=True)
    remove_dead_dir_temps(cache)
    assert sorted(p.name for p in cache.iterdir()) == [".m.tmp-20240101-my-notes", ".m.tmp-999999999-abc_1234.bak"]


def test_a_closed_safedir_refuses_instead_of_using_the_working_directory(tmp_path, monkeypatch):
    """Every primitive of a closed SafeDir raises, naming the dir and the way on; none falls back to the working
    directory (os.*(dir_fd=None)), where a commit outliving its run log once wrote its checkpoint."""
    cwd = tmp_path / "cwd"
    (cwd / "sub").mkdir(parents=True)
    (cwd / "f").write_bytes(b"kept")
    monkeypatch.chdir(cwd)
    root = SafeDir.open(tmp_path / "run", create=True, mode=0o750)
    root.close()
    before = tree_state(cwd)
    closed = f"{re.escape(str(tmp_path / 'run'))} was closed.*lorabench resume"
    for call in (lambda: root.read_bytes("f"), lambda: root.last_byte("f"), lambda: root.append("f", b"x"),
                 lambda: root.truncate("f", 0), lambda: root.write_atomic("f", b"x"), lambda: root.entry("f"),
                 lambda: root.write_atomic("new", b"x"), lambda: root.open_own("f", os.O_RDWR), lambda: root.names(),
                 lambda: root.sub("sub"), lambda: root.sub("new", create=True)):
        with pytest.raises(RunDirError, match=closed):
            call()
    with pytest.raises(RunDirError, match=closed), root.atomic_subdir("new"):
        pass
    assert tree_state(cwd) == before
    root.close()   # again: nothing to do


def test_closing_a_run_log_waits_for_the_write_in_progress(tmp_path, monkeypatch):
    """RunLog.close while the commit thread writes: the lock is held until the write is done and the write lands
    in the run dir; a write after the close is refused, not made in the working directory."""
    cwd, run = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    runlog = RunLog(run, log=lambda *a: None, lock=True)
    writing, release, append = threading.Event(), threading.Event(), runlog.root.append

    def held_append(*args, **kwargs):
        writing.set()
        assert release.wait(timeout=60)
        append(*args, **kwargs)
    runlog.root.append = held_append
    writer = threading.Thread(target=runlog.log_metrics, args=([{"step": 1}],), daemon=True)
    writer.start()
    assert writing.wait(timeout=60)
    closer = threading.Thread(target=runlog.close, daemon=True)
    closer.start()
    closer.join(timeout=0.5)
    try:
        assert closer.is_alive() and (run / "lock").read_text() == f"{os.getpid()}\n"   # held while writing
    finally:
        release.set()
        writer.join(timeout=60)
        closer.join(timeout=60)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1] and (run / "lock").read_text() == ""
    with pytest.raises(RunDirError, match="was closed"):
        runlog.log_metrics([{"step": 2}])
    assert os.listdir(cwd) == []


@pytest.mark.parametrize("name, problem", [
    ("../x", "is a path, not a name"), ("a/b", "is a path, not a name"), ("/abs", "is a path, not a name"),
    ("..", "starts with '.'"), (".", "starts with '.'"), (".hidden", "starts with '.'"),
    ("  ", "is empty"), (" x", "white space"), ("x\nname", "control character"), ("x" * 256, "256 bytes long"),
    ("a\\b", "is a path, not a name"),
])
def test_run_name_is_one_path_component(tiny_model_dir, tmp_path, capsys, name, problem):
    """`run.name=../x` used to put the run outside run.out_dir: refused at config time."""
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                    f"run.name={name}", *QUICK_RUN)
    assert line.startswith(f"lorabench: config error: run.name={name!r} ") and problem in line, line
    assert "give one directory name" in line and "point run.out_dir at the parent" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value, problem", [("../x", "is a path"), ("a/b", "is a path"), ("", "is empty")])
def test_adapter_name_is_one_path_component(value, problem):
    """File refresh makes a dir named after engine.adapter_name in its temp root."""
    with pytest.raises(ConfigError, match=f"engine.adapter_name={value!r} {problem}"):
        Config.load(overrides=[f"engine.adapter_name={value}"])


# --- 2. divergence: a diverged update is never published ------------------------------------------------
def _run_args(tiny_model_dir, out: Path, *extra) -> list[str]:
    return ["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", "run.name=run",
            f"refresh.file.tmp_dir={out}", "data.eval_size=2", "grpo.prompts_per_step=2", "grpo.steps=10",
            "run.threads=1", *LEARNS, *extra]


def _advice(line: str, run: Path) -> tuple[list[str], list[str]]:
    """The commands a divergence stop gives: (the new run's argv, the resume without the bound's or [])."""
    new = line.split("a new run from its config: lorabench ")[1].split("; or continue")[0].split()
    past = line.split("or continue it without the bound: lorabench ")[1].split() if "without the bound:" in line else []
    assert new[:3] == ["run", "--config", str(run / "config.json")] and "run.name=NEW" in new, line
    return new, past


def test_diverged_update_stops_the_run_and_its_last_checkpoint_resumes(tiny_model_dir, tmp_path, capsys):
    """The adapter's change outgrows grpo.max_delta_ratio (here the default 1.0) at some step k > 1:
    the run stops with one line naming the step, the norms and what to lower; the run dir holds
    steps 1..k-1 and their checkpoint; resuming with the same settings stops at the same step and
    changes nothing. Both ways on the line gives work: the new run at a lower grpo.lr, and the
    resume without the bound (allowed on resume) it offers for a ratio not far beyond it."""
    line = refused(capsys, *_run_args(tiny_model_dir, tmp_path))
    run = tmp_path / "run"
    step = int(line.split("GRPO step ")[1].split()[0])
    assert step > 1 and "diverged: its adapter changes model.layers." in line and "||dW||/||W|| = " in line
    assert "above grpo.max_delta_ratio=1" in line and "gradient norm" in line and "Lower grpo.lr (now 0.05" in line
    assert f"its last checkpoint is step {step - 1}" in line and "run.name=NEW grpo.lr=0.001" in line
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, step))
    assert read_checkpoint(run)["step"] == step - 1 and not (run / "summary.json").exists()
    before = tree_state(run)
    assert refused(capsys, "resume", run).split("GRPO step ")[1].split()[0] == str(step)   # seeded: the same step
    assert tree_state(run) == before
    new, past = _advice(line, run)
    assert past == ["resume", str(run), "grpo.max_delta_ratio=0"], line
    assert main(past) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 11))
    assert main([a.replace("run.name=NEW", "run.name=lower") for a in new]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "lower" / "metrics.jsonl")] == list(range(1, 11))


def test_finite_divergence_far_too_large_is_one_line(tiny_model_dir, tmp_path, capsys):
    """grpo.lr=1e30: the adapter's weights reach ~1e30, finite, so a NaN check alone let it be
    served; the next step died inside transformers. Now the first such step stops the run, the line
    offers no resume without the bound (a tenth of the rate, 1e29, diverged as surely: the rate offered
    is the default), and the new run it gives trains. Resuming with the bound off anyway (what
    reliability.md used to give) died in the engine with a traceback, at every resume after it too:
    now the step whose log-probs are not finite is rolled back, one line, the checkpoint unchanged."""
    line = refused(capsys, *_run_args(tiny_model_dir, tmp_path, "grpo.lr=1e30", "grpo.steps=6"))
    assert "diverged" in line and "||dW||/||W|| = " in line and "e+" in line and "Lower grpo.lr (now 1e+30" in line
    run = tmp_path / "run"
    new, past = _advice(line, run)
    assert past == [] and "grpo.lr=0.001" in new and "without the bound" not in line, line
    step = read_checkpoint(run)["step"]
    for overrides in (["grpo.max_delta_ratio=0"], []):
        off = refused(capsys, "resume", run, *overrides)
        assert f"GRPO step {step + 1} diverged: under its adapter the engine's log-probs are not finite" in off, off
        assert "was rolled back" in off and f"its last checkpoint is step {step}" in off and "grpo.lr=0.001" in off
        assert read_checkpoint(run)["step"] == step
    assert main([a.replace("run.name=NEW", "run.name=lower") for a in new]) == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "lower" / "metrics.jsonl")] == list(range(1, 7))


def test_diverged_step_is_rolled_back_and_never_served(make_trainer, sample_sequences):
    """In process: the step that diverges is rolled back (adapter, optimizer, version), the engine
    serves the previous adapter bit for bit, and nothing was written for it."""
    from lorabench.policy import UpdateDiverged
    seqs, lens = sample_sequences
    trainer = make_trainer(None, "grpo.max_delta_ratio=1e-9")
    from test_grpo import length_reward
    trainer.rewards = [("length", length_reward, 1.0)]        # a signal in every group: the adapter moves
    serving = trainer.engine.score(seqs, lens, "policy")
    before = trainer.policy.adapter()
    with pytest.raises(UpdateDiverged) as info:
        trainer.step()
    assert "GRPO step 1 diverged" in str(info.value) and any("rolled back" in n for n in info.value.__notes__)
    assert trainer.step_count == 0 and torch.equal(trainer.policy.adapter().buffer, before.buffer)
    assert all(torch.equal(a, b) for a, b in zip(serving, trainer.engine.score(seqs, lens, "policy")))
    assert trainer.engine.served_version("policy") == 0


def test_non_finite_loss_is_refused_before_the_optimizer(make_trainer):
    """Huge but finite LoRA weights (an update no bound stopped) make the loss NaN: refused before the
    optimizer steps, naming the step, the loss and the gradient norm."""
    from lorabench.policy import UpdateDiverged
    trainer = make_trainer(None, "grpo.max_delta_ratio=0")
    from test_grpo import length_reward
    trainer.rewards = [("length", length_reward, 1.0)]
    with torch.no_grad():
        for owner in trainer.policy.lora_layers.owners:
            owner.weight.fill_(1e30)
    optimizer_state = json.dumps(trainer.policy.optimizer.state_dict()["state"], default=str)
    with pytest.raises(UpdateDiverged) as info:
        trainer.step()
    msg = str(info.value)
    assert "GRPO step 1 diverged: loss nan, gradient norm nan" in msg and "was not applied" in msg
    assert json.dumps(trainer.policy.optimizer.state_dict()["state"], default=str) == optimizer_state
    assert trainer.step_count == 0


@pytest.mark.parametrize("found", ["empty", "absent", "a_killed_writer_s", "no_plots_or_adapters"])
def test_checkpoint_holding_a_diverged_adapter_is_not_served(run_dir, capsys, found):
    """A checkpoint whose adapter is far beyond the bound (written without it): resume refuses to
    serve it instead of dying inside transformers at every attempt; the run dir is unchanged. The
    refusal comes once the policy is built, under the run dir's lock, which is put back as it was: a
    lock file that was not there (deleted by hand, not copied) used to be left behind, empty, a
    killed writer's PID emptied, and plots/ and adapters/ made where a copy had left them out."""
    path = run_dir / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    state["adapter_buffer"] = state["adapter_buffer"] + 1e15
    torch.save(state, path)
    if found == "absent":
        (run_dir / "lock").unlink()
    elif found == "a_killed_writer_s":
        dead = subprocess.Popen(["true"])
        dead.wait()
        (run_dir / "lock").write_text(f"{dead.pid}\n")
    elif found == "no_plots_or_adapters":
        shutil.rmtree(run_dir / "plots")
        shutil.rmtree(run_dir / "adapters")
    before = tree_state(run_dir)
    line = refused(capsys, "resume", run_dir)
    assert "the checkpoint's adapter (step 2) changes" in line and "resuming would serve it" in line
    assert "grpo.max_delta_ratio" in line and tree_state(run_dir) == before


# --- 3. resume proves what it continues ------------------------------------------------------------------
def _edit_config(run_dir: Path, section: str, key: str, value) -> None:
    cfg = json.loads((run_dir / "config.json").read_text())
    cfg[section][key] = value
    (run_dir / "config.json").write_text(json.dumps(cfg, indent=1))


@pytest.mark.parametrize("section, key, value, shown", [
    ("grpo", "temperature", 0.9, "grpo.temperature=0.9, but its checkpoint (step 2) was trained with "
                                 "grpo.temperature=0.7"),
    ("lora", "r", 8, "lora.r=8, but its checkpoint (step 2) was trained with lora.r=16"),
    ("run", "seed", 3, "run.seed=3, but its checkpoint (step 2) was trained with run.seed=0"),
    ("grpo", "reward_mode", "flexible", "grpo.reward_mode='flexible', but"),
])
def test_hand_edited_config_json_isrefused(run_dir, capsys, section, key, value, shown):
    """A hand-edited sampling temperature used to be resumed with exit 0 and trained on."""
    _edit_config(run_dir, section, key, value)
    before = tree_state(run_dir)
    line = refused(capsys, "resume", run_dir)
    assert f"{run_dir / 'config.json'} has {shown}" in line and "was config.json edited?" in line, line
    assert "nothing was changed" in line and "lorabench run --config" in line
    assert tree_state(run_dir) == before


def test_hand_edited_allowed_field_is_taken(run_dir, capsys):
    """The fingerprint holds what defines the experiment only: an allowed field (grpo.steps) edited in
    config.json is simply the run's setting, as if passed on the command line."""
    _edit_config(run_dir, "grpo", "steps", 3)
    assert main(["resume", str(run_dir)]) == 0
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_refused_change_written_into_config_changes_isrefused(run_dir, capsys):
    with open(run_dir / "config_changes.jsonl", "w") as fh:
        fh.write(json.dumps({"step": 2, "changes": {"grpo.temperature": [0.7, 1.3]}}) + "\n")
    before = tree_state(run_dir)
    line = refused(capsys, "resume", run_dir)
    assert "grpo.temperature=1.3, but its checkpoint (step 2) was trained with grpo.temperature=0.7" in line
    assert tree_state(run_dir) == before


def test_edited_data_file_isrefused(run_dir, tmp_path, capsys):
    """The data a run trains on is identified by its bytes, not by its path as typed."""
    source = Path(json.loads((run_dir / "config.json").read_text())["data"]["source"])
    saved = source.read_bytes()
    try:
        source.write_bytes(saved.replace(b"Tom has 3 apples", b"Tom has 4 apples"))
        before = tree_state(run_dir)
        line = refused(capsys, "resume", run_dir)
        assert f"data.source='{source}' ({source}) is not the data the checkpoint (step 2)" in line, line
        assert f"{len(saved):,} bytes, sha256" in line and "now," in line and "then at" in line
        assert "Restore that file" in line and tree_state(run_dir) == before
    finally:
        source.write_bytes(saved)


def test_relative_data_path_from_another_directory_isrefused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A relative data.source resolves against the working directory: resumed from another one it
    names another file (or none); refused naming the file the checkpoint was trained on."""
    first, second = tmp_path / "a", tmp_path / "b"
    for folder, answer in ((first, 2), (second, 3)):
        folder.mkdir()
        (folder / "d.jsonl").write_text("".join(json.dumps({"question": f"{i}+{answer}?", "answer": f"#### {i}"}) + "\n"
                                                for i in range(6)))
    monkeypatch.chdir(first)
    assert main(["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}", "run.name=r",
                 f"refresh.file.tmp_dir={tmp_path}", "data.source=d.jsonl", *QUICK_RUN]) == 0
    capsys.readouterr()
    monkeypatch.chdir(second)
    run = tmp_path / "out" / "r"
    before = tree_state(run)
    line = refused(capsys, "resume", run)
    assert f"data.source='d.jsonl' ({second / 'd.jsonl'}) is not the data" in line
    assert f"then at {first / 'd.jsonl'}" in line
    (second / "d.jsonl").unlink()
    line = refused(capsys, "resume", run)
    assert f"(relative to {second}) is not the data" in line and "missing now" in line
    assert tree_state(run) == before
    monkeypatch.chdir(first)
    assert main(["resume", str(run), "grpo.steps=3"]) == 0                  # from where it was started: fine


def test_changed_model_isrefused(run_dir, tiny_model_dir, tmp_path, capsys):
    """model.name_or_path names a dir whose files changed (another checkpoint saved over it)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    _edit_config(run_dir, "model", "name_or_path", str(model))
    line = refused(capsys, "resume", run_dir)        # a different path is a config edit first
    assert "model.name_or_path=" in line and "was config.json edited?" in line
    _edit_config(run_dir, "model", "name_or_path", str(tiny_model_dir))
    weights = tiny_model_dir / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-8] + bytes(8))                      # the last weights changed
        before = tree_state(run_dir)
        line = refused(capsys, "resume", run_dir)
        assert f"model.name_or_path='{tiny_model_dir}' is not the model the checkpoint (step 2)" in line, line
        assert "model.safetensors is" in line and "now," in line and tree_state(run_dir) == before
    finally:
        weights.write_bytes(original)


def test_checkpoint_without_fingerprint_still_resumes(run_dir, capsys):
    """Run dirs written before checkpoints carried a fingerprint stay resumable, with a note; the next
    checkpoint records one."""
    path = run_dir / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)
    del state["fingerprint"]
    torch.save(state, path)
    assert main(["resume", str(run_dir), "grpo.steps=3"]) == 0
    assert "records no fingerprint of its config, data and model" in capsys.readouterr().out
    assert set(read_checkpoint(run_dir)["fingerprint"]) == {"config", "data", "model"}


def test_hub_model_is_identified_by_its_cached_commit(tmp_path, monkeypatch):
    """A hub model's files arrive one by one as they are first used, so the commit of its cached
    snapshot identifies it; another commit is refused naming both."""
    from huggingface_hub import constants

    from lorabench.session.compat import check_model, model_fingerprint
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    cfg = Config.load(overrides=["model.name_or_path=org/model"])
    snapshot = tmp_path / "models--org--model" / "snapshots" / "a1b2c3"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "models--org--model" / "refs").mkdir()
    (tmp_path / "models--org--model" / "refs" / "main").write_text("a1b2c3")
    recorded = model_fingerprint(cfg, "org/model")
    assert recorded == {"name": "org/model", "revision": "a1b2c3"}
    check_model(recorded, recorded, cfg, tmp_path, 2)
    with pytest.raises(RunDirError, match="the hub commit is d4e5f6 now, a1b2c3 then"):
        check_model(recorded, {"name": "org/model", "revision": "d4e5f6"}, cfg, tmp_path, 2)


def test_fingerprint_names_what_defines_the_experiment(finished_run, tiny_model_dir):
    fp = read_checkpoint(finished_run)["fingerprint"]
    assert fp["config"]["grpo.temperature"] == 0.7 and "grpo.steps" not in fp["config"]
    source = fp["data"]["data.source"]
    assert Path(source["path"]).is_absolute() and len(source["sha256"]) == 64 and source["bytes"] > 0
    files = fp["model"]["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files) and "README.md" not in files


# --- 4. errors before anything exists, and during a run ---------------------------------------------------
@pytest.fixture
def read_only_mount(tmp_path):
    """A real read-only filesystem mounted at out/ro: a run name inside a writable run.out_dir."""
    path = tmp_path / "out" / "ro"
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root and CAP_SYS_ADMIN)")
    yield path
    subprocess.run(["umount", str(path)], capture_output=True)


def test_run_name_on_a_read_only_filesystem(read_only_mount, tmp_path, capsys):
    """The run name is a read-only mount inside a writable run.out_dir: refused before the tiny model
    is built (an EROFS traceback after the model build, and a half-made run dir, before)."""
    cache = tmp_path / "cache"
    before = tree_state(tmp_path / "out")
    line = refused(capsys, "run", "model.name_or_path=tiny", f"model.cache_dir={cache}",
                    f"run.out_dir={tmp_path / 'out'}", "run.name=ro", *QUICK_RUN)
    assert f"the run dir {read_only_mount} is on a read-only filesystem" in line
    assert "choose another run.name or run.out_dir" in line
    assert not cache.exists() and tree_state(tmp_path / "out") == before


@pytest.mark.parametrize("override, needles", [
    ("lora.r=1000000", ["LoRA state (16,384,000,000 parameters at lora.r=1000000", "lower lora.r (now 1000000)"]),
    ("grpo.group_size=100000000", ["200,000,000 sequences", "lower grpo.prompts_per_step x grpo.group_size"]),
    ("data.eval_size=1000000000", ["2,000,000,000 sequences", "lower data.eval_size x data.eval_samples"]),
])
def test_sizes_far_beyond_the_machine_arerefused(tiny_model_dir, tmp_path, capsys, override, needles):
    """Instead of a silent wait (swapping, or the OOM killer), an estimate and a refusal."""
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                    *QUICK_RUN, override)
    assert "this run needs at least" in line and "GB of memory" in line and "more than the memory" in line
    assert all(n in line for n in needles), line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, needle", [
    ("engine.hf.device=gpu", "engine.hf.device='gpu': use '', cpu, cuda, cuda:N or mps"),
    ("run.seed=-1", "run.seed=-1: must be in [0, 2**32)"),
    ("run.seed=99999999999999999999", "run.seed=99999999999999999999: must be in [0, 2**32)"),
    ("run.out_dir=", "run.out_dir='': give the parent directory"),
    ("data.source=/dev/zero", "is not a regular file"),
    ("grpo.max_delta_ratio=-1", "grpo.max_delta_ratio=-1.0: must be >= 0"),
    ("run.threads=100000", "run.threads=100000: this process may use"),    # torch segfaulted at the first matmul
])
def test_more_values_refused_before_anything_exists(tiny_model_dir, tmp_path, capsys, override, needle):
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                    "run.name=r", *QUICK_RUN, override)
    assert needle in line, line
    assert not (tmp_path / "out").exists()


def test_engine_log_file_that_is_a_directory(tiny_model_dir, tmp_path, capsys):
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                    *QUICK_RUN, f"engine.sglang.log_file={tmp_path}")
    assert f"engine.sglang.log_file='{tmp_path}' is a directory" in line and "name a file" in line
    assert not (tmp_path / "out").exists()


def test_data_source_that_is_a_directory(tiny_model_dir, tmp_path, capsys):
    line = refused(capsys, "run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}",
                    *QUICK_RUN, f"data.source={tmp_path}")
    assert f"data.source='{tmp_path}': dataset file {tmp_path} is a directory" in line
    assert not (tmp_path / "out").exists()


def test_huge_file_in_a_run_dir_isrefused(run_dir, capsys):
    """A sparse metrics.jsonl of 1 TB costs the sender of a run dir nothing; resume reads it whole."""
    os.truncate(run_dir / "metrics.jsonl", 10**12)
    before = tree_state(run_dir)
    line = refused(capsys, "resume", run_dir)
    assert f"{run_dir / 'metrics.jsonl'} is 1,000,000,000,000 bytes, more than half the memory" in line
    assert tree_state(run_dir) == before


def test_tiny_model_build_on_a_full_disk(tmp_path, capsys):
    """The tiny model's cache on a filesystem too small for it: one line, no run dir, no temp left."""
    disk = FullDisk(tmp_path / "cache", size_kb=1024)
    if not disk.mount():
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    try:
        line = refused(capsys, "run", "model.name_or_path=tiny", f"model.cache_dir={disk.path}",
                        f"run.out_dir={tmp_path / 'out'}", *QUICK_RUN)
        assert f"model.cache_dir: the tiny model could not be written to {disk.path}" in line, line
        assert "Free space on that filesystem" in line
        assert list(disk.path.iterdir()) == [] and not (tmp_path / "out").exists()
    finally:
        disk.unmount()


def _run_until_step(args, run: Path, step: int, log: Path):
    with open(log, "wb") as fh:
        proc = cli(*args, stdout=fh, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (run / "metrics.jsonl").is_file() or len(read_jsonl(run / "metrics.jsonl")) < step:
        assert proc.poll() is None, (proc.returncode, log.read_text()[-2000:], proc.stderr.read()[-2000:])
        assert time.monotonic() - t0 < 180, "no step row in time"
        time.sleep(0.02)
    return proc


@pytest.fixture
def small_disk(tmp_path):
    with mounted_disk(tmp_path / "disk", 16384) as disk:
        yield disk


@pytest.mark.parametrize("failure", ["disk_full", "read_only", "refresh_disk_full"])
def test_disk_failure_during_a_run_is_one_line_and_resumes(tiny_model_dir, small_disk, tmp_path, failure):
    """The run dir's filesystem fills up (a real ENOSPC) or turns read-only (a real EROFS) mid-run, or
    the file refresh's does: one line naming the cause and the file, no traceback (it used to be two
    chained ones, never saying "no space left"), and how to continue; once fixed, `lorabench resume`
    finishes every step exactly once."""
    on_disk = failure != "refresh_disk_full"
    run = (small_disk.path if on_disk else tmp_path) / "run"
    args = ["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={run.parent}", "run.name=run",
            f"refresh.file.tmp_dir={tmp_path if on_disk else small_disk.path}", *QUICK_RUN, "grpo.steps=200",
            "run.save_adapter_every=1000", *([] if on_disk else ["refresh.mode=file"])]
    proc = _run_until_step(args, run, 2, tmp_path / "log.txt")
    if failure == "read_only":
        _remount(small_disk.path, "ro")
    else:
        small_disk.fill()
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err[-3000:]
    line = one_line_error(err)
    if on_disk:
        cause = "no space left on its filesystem" if failure == "disk_full" else "its filesystem is read-only"
        code = "ENOSPC" if failure == "disk_full" else "EROFS"
        assert f"cannot write {run}/" in line and cause in line and f"({code})" in line, line
        assert f"`lorabench resume {run}` continues from its last checkpoint" in line, line
    else:
        assert f"no space left to write adapter dir {small_disk.path}/" in line and "refresh.file.tmp_dir" in line, line
        assert f"the run stopped: {run} is intact (its last checkpoint is step " in line
        assert f"`lorabench resume {run}` continues it" in line
    assert not line.startswith("lorabench: error: [Errno")   # the message, not the errno in front of it
    if failure == "read_only":
        _remount(small_disk.path, "rw")
    else:
        small_disk.free()
    last = inspect(run).step + 3
    resumed = cli("resume", str(run), f"grpo.steps={last}", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, last + 1))
    assert [r["step"] for r in read_jsonl(run / "sync.jsonl") if r["row"] == "refresh"] == list(range(1, last + 1))
    assert inspect(run).step == last


def test_disk_full_at_the_start_says_to_run_the_command_again(tiny_model_dir, small_disk, tmp_path, capsys):
    """The run dir's disk is full before the run writes its config: the line said `lorabench resume
    RUN`, which refuses a dir without config.json. Now it says to run the same command again, and that
    command, once there is space, makes the run."""
    args = ["run", f"model.name_or_path={tiny_model_dir}", f"run.out_dir={small_disk.path}", "run.name=run",
            f"refresh.file.tmp_dir={tmp_path}", *QUICK_RUN]
    small_disk.fill()
    line = refused(capsys, *args)
    run = small_disk.path / "run"
    assert f"cannot write {run}/lock: no space left" in line and "(ENOSPC)" in line, line
    assert "no run was started" in line and "run the same command again" in line and "resume" not in line, line
    small_disk.free()
    assert main(args) == 0
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2] and (run / "summary.json").is_file()


@pytest.mark.parametrize("background", [True, False])
def test_a_commit_failing_otherwise_than_by_the_disk_stops_the_trainer_too(make_trainer, tmp_path, monkeypatch,
                                                                           background):
    """The checkpoint's pickling raises (not an OSError): in line, the step raised it and the trainer went on
    stepping with its memory ahead of the run dir; in the background it stopped. Both stop now."""
    import pickle

    from lorabench import runlog as runlog_module
    run = tmp_path / "run"
    trainer = make_trainer(run, f"run.commit_in_background={str(background).lower()}")
    trainer.step()
    trainer.wait_committed()

    def unpicklable(*args, **kwargs):
        raise pickle.PicklingError("cannot pickle a test's object")

    monkeypatch.setattr(runlog_module.torch, "save", unpicklable)
    with pytest.raises(pickle.PicklingError):
        trainer.step()
        trainer.wait_committed()
    monkeypatch.undo()
    with pytest.raises(TrainerStopped, match="lorabench resume"):
        trainer.step()
    assert inspect(run).step == 1
    assert make_trainer(run).step_count == 1


def _remount(path: Path, mode: str) -> None:
    """Remount read-only (or back): refused as busy while a write is in flight, so tried again."""
    t0 = time.monotonic()
    while subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], capture_output=True).returncode != 0:
        assert time.monotonic() - t0 < 20, f"cannot remount {path} {mode}"
        time.sleep(0.01)


@pytest.mark.parametrize("background", [True, False])
def test_disk_full_in_a_commit_keeps_the_run_dir_consistent(make_trainer, small_disk, background):
    """In process: the checkpoint write of step 2 meets ENOSPC: RunDirWriteError (an OSError with
    errno ENOSPC) naming the file, raised by that step (in line) or by the first call that waits for
    its commit (in the background: here wait_committed); that trainer takes no more steps
    (TrainerStopped names the way on); the run dir still holds step 1 whole, and resumes."""
    run = small_disk.path / "run"
    trainer = make_trainer(run, f"run.commit_in_background={str(background).lower()}")
    trainer.step()
    trainer.wait_committed()                   # step 1 is on the disk before it fills
    small_disk.fill()
    with pytest.raises(RunDirWriteError) as info:
        trainer.step()
        trainer.wait_committed()
    assert trainer.step_count == 2
    assert info.value.errno == errno.ENOSPC and f"{run}/" in str(info.value) and "no space left" in str(info.value)
    small_disk.free()
    with pytest.raises(TrainerStopped, match="lorabench resume"):   # memory and run dir may disagree now
        trainer.step()
    with pytest.raises(TrainerStopped, match="lorabench resume"):
        trainer.wait_committed()
    assert inspect(run).step == 1
    resumed = make_trainer(run)
    assert resumed.step_count == 1 and resumed.step().step == 2
