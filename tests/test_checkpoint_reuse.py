"""Notebook 03 looks into the adapter a run dir already holds instead of training it again
(session.reuse: find_trained_run, read_trained_run, load_trained_run; explain.use_trained_run). Here real run dirs
written by `lorabench run` are read back the way the lesson reads them: the newest run dir of the
lesson's experiment is taken; the trainer ends at its checkpoint's step with exactly its adapter,
which the engine serves; nothing in the run dirs changes (bytes and times). A run dir of another
experiment, one without a checkpoint, one with a link inside, a link to a run dir and a run dir of
another base model are passed over, each with its reason; with none left, the lesson trains."""
from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from conftest import perturb_lora_B

from lorabench import explain
from lorabench.rundir import CONFIG, METRICS, read_checkpoint, read_jsonl
from lorabench.session import Config, RunSession, build_trainer, start_engine
from lorabench.session.reuse import dir_listing, find_trained_run, run_dirs

# one experiment, small: the run dirs and the lesson's config share every field resume refuses to change
EXPERIMENT = ["grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=4", "warmstart.steps=0",
              "lora.r=4", "lora.alpha=8", "data.eval_size=2"]


def write_run(model, out, name, *extra, steps: int = 2) -> None:
    """A run dir as RunSession (`lorabench run`'s path) writes it, `steps` steps. The random model earns
    no reward, so GRPO leaves its adapter where it starts: moved off zero first, so that the adapter
    the lesson reads back is not the zero every fresh adapter is."""
    cfg = Config.load(None, [f"model.name_or_path={model}", f"run.out_dir={out}", f"run.name={name}",
                             f"refresh.file.tmp_dir={out}", "run.threads=1", f"grpo.steps={steps}", *EXPERIMENT,
                             *extra])
    session = RunSession.open(cfg, out / name, log=lambda *a: None)
    try:
        perturb_lora_B(session.trainer.model, scale=0.05)
        session.trainer.refresher.refresh(session.trainer.policy.adapter())
        session.trainer.run(steps, progress=False)
    finally:
        session.close()


def lesson(model, engine=None, tokenizer=None):
    """The lesson's config (another refresh mode and step count: both may differ), engine and trainer."""
    cfg = Config.load(None, [f"model.name_or_path={model}", "engine.backend=hf", "refresh.mode=tensor",
                             "grpo.steps=30", *EXPERIMENT])
    engine = engine or start_engine(cfg, str(model))
    return cfg, engine, build_trainer(cfg, str(model), engine, tokenizer=tokenizer, log=lambda *a: None)


def state_of(root) -> dict:
    """Every entry under `root` (links not followed) with its kind, size, times and, for files, bytes."""
    listing = dir_listing(root)
    return {name: (*entry, hashlib.sha256((root / name).read_bytes()).hexdigest() if entry[0] == "file" else None)
            for name, entry in listing.items()}


def make_newest(path, seconds: int) -> None:
    """Date `path` (and its checkpoint dir) `seconds` after now, so run_dirs lists it before the others."""
    stamp = os.stat(path).st_mtime + seconds
    for p in (path, path / "checkpoint"):
        if p.exists():
            os.utime(p, (stamp, stamp))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """runs/trained: this experiment, 2 steps; newer, each passed over: runs/other-rank (lora.r=8),
    runs/started (a config and no checkpoint), runs/linked (metrics.jsonl a link), runs/link (a link)."""
    root = tmp_path_factory.mktemp("reuse") / "runs"
    write_run(tiny_model_dir, root, "trained")
    write_run(tiny_model_dir, root, "other-rank", "lora.r=8", "lora.alpha=16", steps=1)
    (root / "started").mkdir()
    shutil.copyfile(root / "trained" / CONFIG, root / "started" / CONFIG)
    shutil.copytree(root / "trained", root / "linked", symlinks=True)
    (root / "linked" / METRICS).unlink()
    (root / "linked" / METRICS).symlink_to(root / "trained" / METRICS)
    (root / "link").symlink_to(root / "trained", target_is_directory=True)
    for i, name in enumerate(["other-rank", "started", "linked"]):
        make_newest(root / name, 100 * (i + 1))
    return root


def test_the_newest_run_of_this_experiment_is_reused_and_only_read(runs, tiny_model_dir, tokenizer):
    before = state_of(runs)
    cfg, engine, trainer = lesson(tiny_model_dir, tokenizer=tokenizer)
    try:
        assert [p.name for p in run_dirs(runs)] == ["linked", "started", "other-rank", "trained"]
        found = find_trained_run(cfg, runs, str(tiny_model_dir))
        run, text = found[0], explain.use_trained_run(trainer, found, runs, steps=30)
        assert run is not None and run.dir == runs / "trained" and run.step == 2 and not run.in_use
        assert "**Reused a checkpoint, not trained again:**" in text and "at step 2" in text
        assert f"- passed over `linked`: {runs / 'linked' / METRICS} is a symbolic link" in text   # not followed
        assert "- passed over `started`: no checkpoint yet" in text
        assert "- passed over `other-rank`: another experiment (lora.r=8 there, 4 here, lora.alpha=16" in text
        assert "`link`" not in text   # a link to a run dir is not a run dir
        # the trainer is at the checkpoint: its exact adapter, its rows, and the engine serves it
        checkpoint = read_checkpoint(runs / "trained")
        assert trainer.step_count == 2 and torch.equal(trainer.policy.adapter().buffer.cpu(),
                                                       checkpoint["adapter_buffer"])
        assert trainer.history == read_jsonl(runs / "trained" / METRICS) and len(trainer.history) == 2
        name = trainer.refresher.serving_adapter
        assert engine.served_version(name) == 2
        seqs, plens = explain.rollout_sequences(trainer, 2)
        assert explain.trainer_vs_engine(trainer, seqs, plens, name)["max"] < 1e-4
        assert explain.trainer_vs_engine(trainer, seqs, plens, None)["max"] > 1e-4   # the adapter is not zero
    finally:
        trainer.close()
        engine.close()
    assert state_of(runs) == before, "the run dirs were written to"


def test_another_base_model_is_passed_over(tiny_model_dir, tokenizer, tmp_path):
    """The same config, the same model path, other model bytes: the checkpoint's fingerprint says so."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    write_run(model, tmp_path / "runs", "trained", steps=1)
    with open(model / "tokenizer_config.json", "a") as fh:
        fh.write(" ")
    cfg = Config.load(None, [f"model.name_or_path={model}", "refresh.mode=tensor", *EXPERIMENT])
    run, passed = find_trained_run(cfg, tmp_path / "runs", str(model))
    assert run is None and [name for name, _ in passed] == ["trained"]
    assert "is not the model the checkpoint (step 1)" in passed[0][1] and "tokenizer_config.json" in passed[0][1]


def test_with_no_run_dir_the_lesson_trains_and_says_so(tiny_model_dir, tokenizer, tmp_path):
    cfg, engine, trainer = lesson(tiny_model_dir, tokenizer=tokenizer)
    try:
        found = find_trained_run(cfg, tmp_path / "no-runs", str(tiny_model_dir))
        run, text = found[0], explain.use_trained_run(trainer, found, tmp_path / "no-runs", steps=2)
        assert run is None and trainer.step_count == 2 and [r["step"] for r in trainer.history] == [1, 2]
        assert f"no run dir of this experiment with a checkpoint under `{tmp_path / 'no-runs'}`" in text
        assert text.startswith("**Trained here:**")
        assert "trained 2 GRPO steps" in text and "Passed over" not in text
    finally:
        trainer.close()
        engine.close()
    assert not (tmp_path / "no-runs").exists()
