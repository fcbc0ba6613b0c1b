"""grpo.max_staleness: the next step's rollouts sampled while this step trains, from the adapter the
engine has (at most one update behind), the lag recorded and checked per step, the loss weighted by
the truncated importance ratio, a rolled-back step's rollouts dropped and sampled again, a seeded
stale run repeated bit for bit, a checkpoint without the adapter one version behind resumed
on-policy for one step, and learning on the demo. Stopped and resumed stale runs: test_crash.py."""
from __future__ import annotations

import json
import signal
import threading
from concurrent.futures import Future

import pytest
import torch
from reliability_util import make_trainer, stale_run, tens_problems  # noqa: F401 (fixture)

from lorabench.engines import StaleAdapter
from lorabench.grpo import SampledAhead
from lorabench.loss import grpo_loss
from lorabench.refresh import TensorRefresh
from lorabench.rundir import BEHIND, CHECKPOINT
from lorabench.runlog import read_jsonl
from lorabench.session import Config, RunSession, resolve_model

SMALL = ["grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_new_tokens=8", "data.eval_size=2",
         "run.threads=1", "refresh.mode=tensor"]
QUIET = dict(log=lambda *a: None)


def session_for(model, tmp_path, *extra, name="s") -> RunSession:
    cfg = Config.load(None, [f"model.name_or_path={model}", f"run.out_dir={tmp_path}", f"run.name={name}",
                             *SMALL, *extra])
    return RunSession.open(cfg, tmp_path / name, evaluate_first=False, **QUIET)


def fail_next_update(trainer, message: str) -> None:
    """The trainer's next update raises RuntimeError(message), once."""
    train = trainer.policy.train

    def fails(*args, **kwargs):
        trainer.policy.train = train
        raise RuntimeError(message)
    trainer.policy.train = fails


def test_the_importance_weight_scales_each_token_and_carries_no_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 2)
    plain, _ = grpo_loss(logp, logp.detach(), adv, mask, 0.2)
    weight = torch.tensor([[2.0, 0.5]], requires_grad=True)
    weighted, _ = grpo_loss(logp, logp.detach(), adv, mask, 0.2, is_weight=weight)
    assert plain.item() == pytest.approx(-1.0) and weighted.item() == pytest.approx(-(2.0 + 0.5) / 2)
    weighted.backward()
    assert weight.grad is None and torch.allclose(logp.grad, torch.tensor([[-1.0, -0.25]]))


def test_one_step_stale_rollouts_are_recorded_checked_and_weighted(tiny_model_dir, tmp_path):
    session = session_for(tiny_model_dir, tmp_path, "grpo.max_staleness=1", "grpo.steps=5")
    try:
        session.trainer.run(progress=False)
        rows = session.metrics()
    finally:
        session.close()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["adapter/lag"] == 0                                  # the first step samples in line
    for r in rows:
        assert r["adapter/lag"] == r["step"] - 1 - r["adapter/served_version"] and 0 <= r["adapter/lag"] <= 1
        assert 0 < r["train/is_weight_mean"] <= 2.0 and 0 <= r["train/is_truncated_fraction"] <= 1
    assert read_jsonl(tmp_path / "s" / "metrics.jsonl") == rows


def test_on_policy_rows_have_no_staleness_fields(tiny_model_dir, tmp_path):
    session = session_for(tiny_model_dir, tmp_path, "grpo.steps=2")
    try:
        rows = [session.trainer.step().metrics for _ in range(2)]
    finally:
        session.close()
    assert not any(k in r for r in rows for k in ("adapter/lag", "train/is_weight_mean"))
    assert [r["adapter/served_version"] for r in rows] == [0, 1]


class SkipsWrites(TensorRefresh):
    """A refresh that stops reaching the engine after its first write."""

    def refresh(self, adapter):
        from lorabench.refresh import RefreshRecord
        return super().refresh(adapter) if self.refreshes == 0 else RefreshRecord(self.mode, adapter.version)


def test_a_rollout_older_than_max_staleness_is_refused(tiny_model_dir, tmp_path):
    session = session_for(tiny_model_dir, tmp_path, "grpo.max_staleness=1", "grpo.steps=6")
    trainer = session.trainer
    try:
        trainer.refresher = SkipsWrites(session.engine, trainer.refresher.adapter_name)
        with pytest.raises(StaleAdapter, match="more than grpo.max_staleness=1 behind"):
            for _ in range(6):
                trainer.step()
        assert trainer.step_count < 6   # the engine stopped at version 1: refused once it lags by 2
    finally:
        session.close()


def test_a_rolled_back_step_drops_the_rollouts_sampled_ahead(tiny_model_dir, tmp_path):
    session = session_for(tiny_model_dir, tmp_path, "grpo.max_staleness=1", "grpo.steps=4")
    trainer = session.trainer
    try:
        trainer.step()
        fail_next_update(trainer, "a failing update")
        with pytest.raises(RuntimeError, match="a failing update"):
            trainer.step()
        assert trainer.step_count == 1 and trainer._ahead is None
        trainer.run(progress=False)
        rows = session.metrics()
    finally:
        session.close()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["adapter/lag"] for r in rows] == [0, 1, 1, 1]   # step 2 sampled again from the adapter behind
    problems = [p.question for p in trainer.source.train_batch(2, 2)]
    samples = [r for r in read_jsonl(tmp_path / "s" / "rollouts.jsonl") if r["step"] == 2]
    assert {s["question"] for s in samples} <= set(problems)


def stale_run_of(model, tmp_path, name: str, *extra) -> tuple[list[dict], list[dict], torch.Tensor]:
    """A 4-step run learning on tens_problems: its rollouts.jsonl and metrics rows, its final adapter."""
    session = session_for(model, tmp_path, *stale_run(tens_problems(tmp_path)), "grpo.steps=4", *extra, name=name)
    try:
        session.trainer.run(progress=False)
        rows, adapter = session.metrics(), session.trainer.policy.adapter().buffer
    finally:
        session.close()
    return read_jsonl(tmp_path / name / "rollouts.jsonl"), rows, adapter


def without_timings(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("time/") and not k.startswith("refresh/")}


def test_two_seeded_stale_runs_are_identical(tiny_model_dir, tmp_path):
    """Rows and final adapter bit for bit; an on-policy run of the same seed (the same problems and
    sampling seeds, other adapters sampling) differs in both, so the comparison can fail."""
    first, again = (stale_run_of(tiny_model_dir, tmp_path, name) for name in ("a", "b"))
    assert [r["adapter/lag"] for r in first[1]] == [0, 1, 1, 1]
    assert first[0] == again[0] and list(map(without_timings, first[1])) == list(map(without_timings, again[1]))
    assert torch.equal(first[2], again[2])
    assert any(r["advantage/abs_mean"] > 0 for r in first[1]) and first[1][-1]["adapter/delta_norm"] > 0
    on_policy = stale_run_of(tiny_model_dir, tmp_path, "on", "grpo.max_staleness=0")
    assert on_policy[0][:8] == first[0][:8] and on_policy[0] != first[0]   # step 1 samples in line in both
    assert not torch.equal(on_policy[2], first[2])


def test_a_checkpoint_without_the_adapter_behind_resumes_one_step_on_policy(make_trainer, tmp_path):
    """A stale run's checkpoint written before it held the adapter one version behind: the resumed
    run says so in one line, samples its first step from the current adapter (lag 0), then one behind."""
    run_dir, problems = tmp_path / "run", tens_problems(tmp_path)
    make_trainer(run_dir, *stale_run(problems), "grpo.steps=2").run(progress=False)
    state = torch.load(run_dir / CHECKPOINT, weights_only=True)
    assert state[BEHIND].shape == state["adapter_buffer"].shape
    del state[BEHIND]
    torch.save(state, run_dir / CHECKPOINT)
    said = []
    trainer = make_trainer(run_dir, *stale_run(problems), "grpo.steps=4", log=said.append)
    notes = [line for line in said if "holds no adapter one version behind" in line]
    assert len(notes) == 1 and "step 3 is sampled on-policy (adapter/lag 0)" in notes[0], said
    trainer.run(progress=False)
    assert [r["adapter/lag"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 0, 1]


def test_staleness_is_refused_with_memory_release():
    with pytest.raises(Exception, match="release_memory_during_training"):
        Config.load(None, ["grpo.max_staleness=1", "engine.release_memory_during_training=true"])


# --- a policy group, one step stale: its batch sampled while its updates run ---------------------------
def stale_group(model, tmp_path, name: str, steps: int, *extra):
    from lorabench.session import GroupSession
    entries = json.dumps([{"name": "fast", "grpo": {"lr": 0.003}}, {"name": "slow", "grpo": {"lr": 0.001}}])
    cfg = Config.load(None, [f"model.name_or_path={model}", f"run.out_dir={tmp_path}", f"run.name={name}", *SMALL,
                             *stale_run(tens_problems(tmp_path)), f"grpo.steps={steps}", f"policies={entries}",
                             *extra])
    return GroupSession.open(cfg, tmp_path / name, evaluate_first=False, **QUIET)


def group_outcome(group, tmp_path, name: str) -> dict:
    """Per policy: its rollouts.jsonl, its metrics rows without timings, its final adapter."""
    group.trainer.wait_committed()
    return {p: (read_jsonl(tmp_path / name / p / "rollouts.jsonl"),
                list(map(without_timings, read_jsonl(tmp_path / name / p / "metrics.jsonl"))),
                t.policy.adapter().buffer) for p, t in group.trainer.trainers.items()}


def test_a_stale_group_samples_ahead_and_each_policy_is_its_stale_run_alone(tiny_model_dir, tmp_path, monkeypatch):
    """Every step after the first is sampled while the previous step's updates ran, from the adapters one
    update behind (lag 1, served version step - 2), and each policy's rows and final adapter are bit for bit
    those of the same policy run alone, stale (the CPU engine serves each request as if it came alone)."""
    group = stale_group(tiny_model_dir, tmp_path, "g", 4)
    try:
        taken, take = [], SampledAhead.take

        def counted(ahead, steps):
            got = take(ahead, steps)
            taken.append(got is not None)
            return got
        monkeypatch.setattr(SampledAhead, "take", counted)
        group.trainer.run(progress=False)
        together = group_outcome(group, tmp_path, "g")
        members = group.cfg.members()
    finally:
        group.close()
    assert taken == [True, True, True]   # step 1 in line (nothing sampled ahead), each later batch sampled ahead
    for name, (rollouts, rows, adapter) in together.items():
        assert [r["adapter/lag"] for r in rows] == [0, 1, 1, 1]
        assert [r["adapter/served_version"] for r in rows] == [0, 0, 1, 2]
        alone = RunSession.open(members[name], tmp_path / f"alone-{name}", evaluate_first=False, **QUIET)
        try:
            alone.trainer.run(progress=False)
            assert alone.trainer._ahead is None
            expected = (read_jsonl(tmp_path / f"alone-{name}" / "rollouts.jsonl"),
                        list(map(without_timings, alone.metrics())), alone.trainer.policy.adapter().buffer)
        finally:
            alone.close()
        assert rollouts == expected[0] and rows == expected[1] and torch.equal(adapter, expected[2]), name
    assert not torch.equal(together["fast"][2], together["slow"][2])   # two learning rates: two adapters


def test_a_stale_group_stopped_and_resumed_is_the_uninterrupted_group(tiny_model_dir, tmp_path):
    """Closed after 2 of 4 steps (its batch sampled ahead dropped) and resumed: the resumed step samples in line
    from the adapters behind, as the pipeline would have, and every row and final adapter equals the
    uninterrupted run's; so does a failed update's step, rolled back for every policy and taken again."""
    from lorabench.session import GroupSession
    whole = stale_group(tiny_model_dir, tmp_path, "whole", 4)
    try:
        whole.trainer.run(progress=False)
        expected = group_outcome(whole, tmp_path, "whole")
    finally:
        whole.close()
    part = stale_group(tiny_model_dir, tmp_path, "part", 4)
    try:
        part.trainer.run(2, progress=False)
        assert part.trainer._ahead is not None    # step 3's batch, sampled ahead, dropped at close
    finally:
        part.close()
    resumed = GroupSession.resume(tmp_path / "part", evaluate_first=False, **QUIET)
    try:
        fail_next_update(resumed.trainer.trainers["slow"], "an update that fails once")
        with pytest.raises(RuntimeError, match="fails once"):
            resumed.trainer.step()
        assert resumed.trainer.current == "slow"
        # fast had updated, not yet published: rolled back with slow
        assert {n: t.step_count for n, t in resumed.trainer.trainers.items()} == {"fast": 2, "slow": 2}
        resumed.trainer.run(progress=False)
        got = group_outcome(resumed, tmp_path, "part")
    finally:
        resumed.close()
    for name in expected:
        assert got[name][0] == expected[name][0] and got[name][1] == expected[name][1], name
        assert torch.equal(got[name][2], expected[name][2]), name


@pytest.mark.slow
def test_one_step_stale_grpo_learns_on_the_demo(tmp_path):
    """The demo model with grpo.max_staleness=1: the training reward rises as the on-policy demo's does.

    32 steps, the mean of the last 8: the demo's reward takes off between steps 10 and 20, a one-step lag can
    put that later, and a stale run may dip for a few steps after it (the warm-started model, and so the
    curve, differs between CPU kinds); on-policy and stale both end near 0.5 (docs/results.md)."""
    model = resolve_model(Config(), log=print)
    cfg = Config.load(None, [f"model.name_or_path={model}", "grpo.max_staleness=1", "grpo.steps=32",
                             "data.eval_size=16", f"run.out_dir={tmp_path}", "run.name=stale"])
    session = RunSession.open(cfg, tmp_path / "stale", evaluate_first=False, **QUIET)
    try:
        session.trainer.run(progress=False)
        rows = session.metrics()
    finally:
        session.close()
    first = sum(r["reward/mean"] for r in rows[:4]) / 4
    last = sum(r["reward/mean"] for r in rows[-8:]) / 8
    assert last - first > 0.3, [round(r["reward/mean"], 2) for r in rows]
    assert sum(r["adapter/lag"] for r in rows) >= len(rows) // 2, [r["adapter/lag"] for r in rows]


def _failed(error: Exception) -> Future:
    future = Future()
    future.set_exception(error)
    return future


def _done(value) -> Future:
    future = Future()
    future.set_result(value)
    return future


@pytest.mark.usefixtures("default_sigint")
def test_a_batch_sampled_ahead_for_another_step_is_dropped_interruptibly():
    """One behaviour for a trainer's and a group's batch sampled ahead: taken for its step (its error raised),
    else waited for and dropped with its error; the wait for one still running stops at a Ctrl-C."""
    assert SampledAhead(3, _done("rollouts"), _done("scored")).take(3) == "scored"
    with pytest.raises(ValueError, match="reward"):
        SampledAhead(3, _done("rollouts"), _failed(ValueError("reward function failed"))).take(3)
    assert SampledAhead({"a": 3}, _done("rollouts"), _failed(ValueError("reward"))).take({"a": 4}) is None
    running = Future()   # an engine call that ends 5 s after the Ctrl-C (a wait that ignores it fails, not hangs)
    timers = [threading.Timer(0.3, signal.raise_signal, (signal.SIGINT,)),
              threading.Timer(5.3, running.set_result, ("rollouts",))]
    try:
        for timer in timers:
            timer.start()
        with pytest.raises(KeyboardInterrupt):
            SampledAhead(3, running, _done("scored")).take(4)
        assert not running.done()   # the wait stopped at the Ctrl-C, not when the engine call ended
    finally:
        for timer in timers:
            timer.cancel()
