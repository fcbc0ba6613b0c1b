"""GRPO: what the loss tests in test_loss.py leave out; rollouts collated into a batch; the policy's
micro-batched update; the trainer end to end on the tiny random model with a real HFEngine
(refresh exactness through mismatch/max, the served-version check, rollback of a failed step); the
run dir the trainer writes and resume."""
import copy
import json
import math
import os
import stat
import threading

import pytest
import torch
from conftest import CoreOnlyEngine, load_checkpoint, merged_state_dict, perturb_lora_B

from lorabench import metrics
from lorabench.adapters import FlatAdapter
from lorabench.commits import cloned
from lorabench.data import Problem
from lorabench.engines import EngineError, StaleAdapter
from lorabench.engines.base import Completion, Sampling
from lorabench.explain import trainer_vs_engine
from lorabench.loss import group_advantages, grpo_loss, token_logprobs
from lorabench.policy import Policy
from lorabench.refresh import REFRESH_MODES, TensorRefresh
from lorabench.rewards import gsm8k_reward
from lorabench.rollout import RolloutBatch, Rollouts, collate, sample
from lorabench.runlog import RunLog, read_jsonl
from lorabench.session import build_trainer, start_engine
from lorabench.session.config import Config


# --- advantages and loss (what test_loss.py does not cover) -------------------------------------------
def test_advantages_normalised_per_group():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 8, generator=gen)
    rewards[:8] = 0.5                                           # one constant group
    adv = group_advantages(rewards, 8).view(6, 8)
    assert torch.equal(adv[0], torch.zeros(8))
    assert torch.allclose(adv.mean(1), torch.zeros(6), atol=1e-5)
    std = adv[1:].std(1, unbiased=False)
    assert torch.all((std > 0.99) & (std <= 1.0))               # unit std up to the eps
    # order within a group is preserved: a higher reward gets a higher advantage
    r = rewards.view(6, 8)[1]
    assert torch.equal(torch.argsort(adv[1]), torch.argsort(r))


def _loss(ratio, adv, clip=0.2):
    logp = torch.log(torch.tensor(ratio)).requires_grad_(True)
    loss, metrics = grpo_loss(logp, torch.zeros_like(logp), torch.tensor(adv), torch.ones_like(logp), clip)
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_loss_clip_is_pessimistic():
    """The clip removes the incentive to move further, never a penalty: below 1-eps with A > 0 and above
    1+eps with A < 0 the unclipped term is the smaller one and keeps its gradient."""
    loss, grad, metrics = _loss([[0.5]], [1.0])
    assert loss == pytest.approx(-0.5) and grad.abs().sum() > 0 and metrics["clip_fraction"] == 1.0
    loss, grad, _ = _loss([[1.5]], [-1.0])
    assert loss == pytest.approx(1.5) and grad.abs().sum() > 0
    loss, grad, _ = _loss([[0.5]], [-1.0])                       # below 1 - eps with A < 0: clipped
    assert loss == pytest.approx(0.8) and grad.abs().sum() == 0


def test_loss_kl_zero_at_reference_and_off_without_beta():
    logp = torch.tensor([[-1.0, -2.0]])
    mask, adv = torch.ones_like(logp), torch.tensor([0.0])
    loss, metrics = grpo_loss(logp, logp, adv, mask, 0.2, ref_logp=logp.clone(), kl_beta=0.5)
    assert loss.item() == pytest.approx(0.0) and metrics["kl"] == pytest.approx(0.0)
    _, metrics = grpo_loss(logp, logp, adv, mask, 0.2, ref_logp=torch.tensor([[-1.5, -1.0]]), kl_beta=0.0)
    assert "kl" not in metrics


# --- collate ------------------------------------------------------------------------------------------
def _hand_rollouts():
    problems = [Problem("q0", "#### 1", "1"), Problem("q1", "#### 2", "2")]
    completions = [Completion([5, 6, 7], [8, 9], [-0.1, -0.2], "length"),
                   Completion([5, 6, 7], [10], [-0.3], "stop"),
                   Completion([5, 6], [11, 12, 13], [-0.4, -0.5, -0.6], "length"),
                   Completion([5, 6], [14], [-0.7], "stop")]
    return Rollouts(problems, completions, ["a", "b", "c", "d"], "policy", 3)


def test_collate_aligns_tokens_masks_and_engine_logprobs():
    rollouts = _hand_rollouts()
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    batch = collate(rollouts, rewards, pad_id=0)
    assert isinstance(batch, RolloutBatch) and batch.size == 4 and not hasattr(batch, "group")
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 10, 0], [5, 6, 11, 12, 13], [5, 6, 14, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1] * 5, [1, 1, 1, 0, 0]]
    assert batch.lengths == [5, 4, 5, 3]
    # log-prob row t predicts token t+1: the completion's tokens are rows prompt_len-1 ...
    assert batch.completion_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]]
    assert torch.allclose(batch.engine_logprobs, torch.tensor([[0, 0, -0.1, -0.2], [0, 0, -0.3, 0],
                                                               [0, -0.4, -0.5, -0.6], [0, -0.7, 0, 0]]))
    assert torch.equal(batch.rewards, rewards)
    assert torch.equal(batch.advantages, group_advantages(rewards, 2))      # groups of 2 (2 problems)
    assert batch.advantages[2:].abs().sum() == 0                            # an all-equal group
    # one log-prob short in one row and one over in the next: the totals agree, the rows would not
    rollouts.completions[0].logprobs.pop()
    rollouts.completions[1].logprobs.append(-0.9)
    with pytest.raises(ValueError, match="log-probs do not match its tokens"):
        collate(rollouts, rewards, pad_id=0)


def test_batch_rows_trim_to_their_own_longest_sequence():
    batch = collate(_hand_rollouts(), torch.tensor([1.0, 0.0, 0.0, 1.0]), pad_id=0)
    part = batch.rows([1, 3])
    assert part.input_ids.tolist() == [[5, 6, 7, 10], [5, 6, 14, 0]]
    assert part.completion_mask.shape == (2, 3) and part.engine_logprobs.shape == (2, 3)
    assert torch.equal(part.advantages, batch.advantages[[1, 3]])
    assert torch.equal(batch.to("cpu").input_ids, batch.input_ids)


def test_batch_rows_round_their_width_up_to_a_multiple_within_the_batch():
    """Compiled layers get micro-batch widths in multiples of 8: the batch gets masked columns on the
    right first, and a micro-batch's width rounds up, never past the batch's own."""
    batch = collate(_hand_rollouts(), torch.tensor([1.0, 0.0, 0.0, 1.0]), pad_id=0)   # L = 5
    padded = batch.padded_to_multiple(4)
    assert padded.input_ids.tolist()[3] == [5, 6, 14, 0, 0, 0, 0, 0]
    assert padded.attention_mask[:, 5:].sum() == 0 and padded.lengths == batch.lengths
    assert torch.equal(padded.completion_mask[:, :4], batch.completion_mask) and padded.completion_mask.shape == (4, 7)
    assert padded.engine_logprobs[:, 4:].abs().sum() == 0
    assert padded.padded_to_multiple(4) is padded
    assert padded.rows([3], width_multiple=4).input_ids.shape == (1, 4)    # 3 tokens -> 4
    assert padded.rows([0, 3], width_multiple=4).input_ids.shape == (2, 8)  # 5 -> 8
    assert batch.rows([0, 3], width_multiple=4).input_ids.shape == (2, 5)   # not past the batch's 5


# --- the trainer ----------------------------------------------------------------------------------------
METRIC_KEYS = {
    "step", "reward/mean", "reward/std", "reward/correct/mean", "reward/strict_format", "advantage/abs_mean",
    "advantage/active_groups", "loss/policy", "loss/clip_fraction", "kl/mean", "entropy/mean", "grad_norm",
    "train/tokens", "completions/mean_length", "completions/stop_fraction", "completions/last_number_right",
    "mismatch/mean", "mismatch/p99", "mismatch/max",
    "mismatch/active_mean", "adapter/version", "adapter/served_version", "adapter/delta_norm", "probe/adapter_gap",
    "refresh/mode", "refresh/bytes", "refresh/total_s",
    "time/rollout_s", "time/reward_s", "time/train_s", "time/refresh_s", "time/probe_s", "time/log_s", "time/step_s",
    "time/commit_wait_s",
}
REFRESH_PARTS = {"file": {"stage", "write", "unload", "load"}, "tensor": {"stage", "unload", "load"},
                 "inplace": {"write"}, "merged": {"merge", "push"}, "none": set()}


def small_config(tmp_path, mode="tensor", *extra) -> Config:
    # ~50 tokens per sequence: a 160-token budget splits a step's 8 sequences into several micro-batches;
    # adapters perturbed far beyond a real update (so every change shows): the divergence bound is off
    # here and tested on its own (test_run_dir_trust.py)
    return Config.load(overrides=[
        "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_new_tokens=8", "grpo.micro_batch_tokens=160",
        "data.eval_size=4", "grpo.steps=3", "grpo.lr=5e-2", "grpo.max_delta_ratio=0", "lora.r=4", "lora.alpha=8",
        "engine.hf.device=cpu", f"refresh.mode={mode}", f"refresh.file.tmp_dir={tmp_path}", "run.save_adapter_every=1",
        *extra])


def length_reward(prompts, completions, **kwargs):
    """A reward the random model earns unevenly (it never answers correctly): the completion's length."""
    return [len(c) / 40.0 for c in completions]


@pytest.fixture
def make_trainer(tiny_model_dir, tokenizer, tmp_path):
    made = []

    def make(mode="tensor", *extra, run_dir=None, engine=None):
        cfg = small_config(tmp_path, mode, *extra)
        engine = engine or start_engine(cfg, str(tiny_model_dir))
        made.append(engine)
        runlog = RunLog(run_dir, lambda *a: None, settings=cfg.run) if run_dir else None
        trainer = build_trainer(cfg, str(tiny_model_dir), engine, runlog, tokenizer=tokenizer, log=lambda *a: None)
        trainer.config = cfg     # what it was built from, for the checks below
        made.append(trainer)
        return trainer
    yield make
    for obj in reversed(made):
        obj.close()


def _perturb_and_refresh(trainer, seed=0):
    """A non-trivial adapter in the trainer, pushed to the engine as the trainer would."""
    perturb_lora_B(trainer.model, seed, scale=0.3)
    trainer.refresher.refresh(trainer.policy.adapter())


def test_trainer_starts_with_its_adapter_in_engine(make_trainer):
    trainer = make_trainer("tensor")
    assert trainer.engine.loaded_adapters() == [trainer.refresher.adapter_name]
    assert trainer.refresher.refreshes == 1
    assert trainer.step_count == trainer.policy.version == 0
    assert trainer.engine.served_version("policy") == 0
    base_scores, score = [], trainer.engine.score

    def noted_score(seqs, prompt_lens, adapter):
        if adapter is None:
            base_scores.append(seqs)
        return score(seqs, prompt_lens, adapter)
    trainer.engine.score = noted_score
    assert trainer.probe_gap() < 1e-6                           # fresh LoRA (B = 0) == base
    _perturb_and_refresh(trainer)
    assert trainer.probe_gap() > 1e-3
    trainer.step()
    assert len(base_scores) == 1          # the base is scored once: a step's probe asks the engine for the adapter only


def test_step_record_and_exact_tensor_refresh(make_trainer):
    trainer = make_trainer("tensor")
    _perturb_and_refresh(trainer)
    for expected_step in (1, 2, 3):
        rec = trainer.step()
        m = rec.metrics
        assert rec.step == m["step"] == expected_step == trainer.step_count
        assert set(m) == METRIC_KEYS | {f"refresh/{p}_s" for p in REFRESH_PARTS["tensor"]}
        assert m["mismatch/max"] < 1e-4, m["mismatch/max"]     # the engine served the trainer's policy
        assert m["mismatch/mean"] <= m["mismatch/p99"] + 1e-9 and m["mismatch/p99"] <= m["mismatch/max"]
        assert m["probe/adapter_gap"] > 1e-3                    # and it is not the base model
        # rollouts came from the previous version, the refresh sent this step's
        assert (m["adapter/served_version"], m["adapter/version"]) == (expected_step - 1, expected_step)
        assert trainer.engine.served_version("policy") == expected_step
        assert m["refresh/mode"] == "tensor" and m["refresh/bytes"] == trainer.policy.adapter().nbytes
        assert rec.refresh.version == expected_step and set(rec.refresh.parts) == REFRESH_PARTS["tensor"]
        assert m["kl/mean"] is None                             # grpo.kl_metric is off by default
        assert 0 < m["entropy/mean"] <= math.log(trainer.model.config.vocab_size)
        assert m["completions/last_number_right"] == pytest.approx(sum(
            gsm8k_reward(s["completion"], s["answer"], "flexible") for s in rec.samples) / len(rec.samples))
        assert m["adapter/delta_norm"] == pytest.approx(trainer.policy.adapter().delta_norm())
        assert m["adapter/delta_norm"] > 0
        assert 0 <= m["reward/mean"] <= 1 and 0 <= m["completions/stop_fraction"] <= 1
        assert 1 <= m["completions/mean_length"] <= 8
        assert m["train/tokens"] > 8 * m["completions/mean_length"]     # prompts + completions, real tokens only
        assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float) and k != "mismatch/active_mean")
        # the parts of the step are laps of one clock: they add up to the step, logging included
        parts = [v for k, v in m.items() if k.startswith("time/") and k not in ("time/step_s", "time/commit_wait_s")]
        assert m["time/step_s"] == pytest.approx(sum(parts)) and m["time/log_s"] >= 0
        # every completion is in the record, with the reward it really earned and its group advantage
        assert len(rec.samples) == 2 * 4
        rewards = torch.tensor([s["reward"] for s in rec.samples])
        for s in rec.samples:
            assert s["step"] == expected_step and s["prompt"] in (0, 1)
            assert s["served_version"] == expected_step - 1
            assert s["reward"] == gsm8k_reward(s["completion"], s["answer"], "strict")
        assert torch.allclose(torch.tensor([s["advantage"] for s in rec.samples]), group_advantages(rewards, 4))
        assert m["reward/mean"] == pytest.approx(rewards.mean().item()) == pytest.approx(m["reward/correct/mean"])
    assert len(trainer.history) == 3
    # the names readers import (lorabench.metrics) are the rows': none names a key no step or evaluation writes
    held = {v for k, v in vars(metrics).items() if k.startswith("HELD_")}   # evals.jsonl's
    declared = {v for k, v in vars(metrics).items() if k.isupper() and isinstance(v, str)} - held
    stale_or_bonus = {metrics.LAG, metrics.IS_WEIGHT, metrics.IS_TRUNCATED, metrics.FORMAT}
    assert declared - stale_or_bonus <= set(m) and declared <= METRIC_KEYS | stale_or_bonus
    assert set(trainer.evaluate(greedy=True)) == held | {"step"}


@pytest.mark.parametrize("mode", ["tensor", "file", "inplace", "merged", "none"])
def test_mismatch_shows_whether_refresh_happened(make_trainer, mode):
    """Perturb the trainer's LoRA between steps (standing in for an optimizer update that a random
    model with all-zero rewards would not make): the step right after sees a stale engine in every
    mode; after that step's own refresh, only mode=none is still stale."""
    trainer = make_trainer(mode)
    first = trainer.step().metrics
    assert first["mismatch/max"] < 1e-4                          # B = 0 on both sides
    perturb_lora_B(trainer.model, seed=1, scale=0.3)
    second = trainer.step().metrics
    assert second["mismatch/max"] > 1e-3                         # the engine had not seen the change yet
    third = trainer.step().metrics
    if mode == "none":
        assert third["mismatch/max"] > 1e-3                      # the stale-adapter control stays stale
        assert third["refresh/bytes"] == 0
        assert third["probe/adapter_gap"] < 1e-6                 # the engine still has the initial B = 0
        assert third["adapter/served_version"] == 0 and third["adapter/version"] == 3
    else:
        assert third["mismatch/max"] < 1e-4                      # step 2's refresh made the engine exact
        assert third["refresh/bytes"] > 0
        assert third["adapter/served_version"] == 2
    assert set(k[len("refresh/"):-2] for k in third if k.startswith("refresh/") and k.endswith("_s")
               and k != "refresh/total_s") == REFRESH_PARTS[mode]
    if mode == "merged":
        assert math.isnan(third["probe/adapter_gap"]) and trainer.engine.loaded_adapters() == []


class SkipsWrites(TensorRefresh):
    """A refresher that loads the first adapter and then silently writes nothing (a lost update)."""
    mode = "skip"
    help = "loads once, then drops every update without saying so (tests)"

    def _refresh(self, adapter, record):
        if self.refreshes == 0:
            super()._refresh(adapter, record)


def test_stale_adapter_raised_when_a_refresh_skips_its_write(make_trainer, monkeypatch):
    """The engine must report the trainer's version: a refresh that did not reach the engine stops the
    next step before anything is trained, even where the numeric mismatch is far too small to see."""
    monkeypatch.setitem(REFRESH_MODES, "skip", SkipsWrites)
    trainer = make_trainer("skip", "grpo.lr=1e-7")
    trainer.rewards = [("length", length_reward, 1.0)]
    first = trainer.step()
    assert first.metrics["advantage/abs_mean"] > 0 and trainer.policy.adapter().delta_norm() > 0   # it did learn
    assert trainer.engine.served_version("policy") == 0 and trainer.step_count == 1
    # the numeric check: trainer (version 1) vs engine (version 0) log-probs, far below any alarm
    gap = trainer_vs_engine(trainer, *_probe_sequences(trainer), adapter="policy")
    assert gap["max"] < 1e-4, gap
    saved = trainer.policy.adapter()
    with pytest.raises(StaleAdapter, match="version 0") as info:
        trainer.step()
    assert "version 1" in str(info.value) and "refresh.mode=skip" in str(info.value)
    assert trainer.step_count == 1 and len(trainer.history) == 1          # nothing was trained on them
    assert torch.equal(trainer.policy.adapter().buffer, saved.buffer)


def _probe_sequences(trainer):
    from lorabench.explain import rollout_sequences
    return rollout_sequences(trainer, n_prompts=2, adapter="policy")


def test_stale_control_is_exempt_from_the_version_check(make_trainer):
    trainer = make_trainer("none", "grpo.lr=1e-3")
    trainer.rewards = [("length", length_reward, 1.0)]
    records = trainer.run(progress=False)
    assert [r.metrics["adapter/served_version"] for r in records] == [0, 0, 0]
    assert [r.metrics["adapter/version"] for r in records] == [1, 2, 3]
    assert trainer.policy.adapter().delta_norm() > 0 and trainer.engine.served_version("policy") == 0


class FailsOnce(TensorRefresh):
    """A refresher whose second refresh (the first step's) fails before it touches the engine."""
    mode = "fails-once"
    help = "fails the first step's refresh once (tests)"

    def _refresh(self, adapter, record):
        if self.refreshes == 1 and not getattr(self, "failed", False):
            self.failed = True
            raise OSError("simulated failure in the refresh")
        super()._refresh(adapter, record)


def test_cloned_copies_every_tensor_into_storage_of_its_own():
    value = {"a": [torch.arange(3.0), torch.tensor(2.0)], "b": (torch.ones(2, 2, dtype=torch.float64), "text", 5)}
    copied = cloned(value)
    assert isinstance(copied["b"], tuple) and copied["b"][1:] == ("text", 5)
    pairs = [(value["a"][0], copied["a"][0]), (value["a"][1], copied["a"][1]), (value["b"][0], copied["b"][0])]
    for old, new in pairs:
        assert torch.equal(old, new) and new.dtype == old.dtype and new.shape == old.shape
        assert new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr()
    value["a"][0].add_(1)
    assert copied["a"][0].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the commit thread's copy to the host needs a GPU")
def test_a_snapshot_reaches_the_host_and_loads_back_as_it_was_when_taken(tmp_path):
    """The background commit's path: snapshot on the GPU, to_host, torch.save, torch.load."""
    from lorabench.commits import snapshot, to_host
    value = {"state": {i: {"exp_avg": torch.randn(5, 3, device="cuda"), "step": torch.tensor(float(i))}
                       for i in range(4)},
             "params": [torch.randn(7, device="cuda", dtype=torch.bfloat16), torch.randn(2, 2, device="cuda").t()]}
    taken = copy.deepcopy(value)   # what the snapshot must hold
    saved, ready = snapshot(value)
    value["state"][0]["exp_avg"].add_(1)   # the next step's in-place update, after the snapshot
    host = to_host(saved, ready)
    torch.save(host, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt")
    assert not torch.equal(loaded["state"][0]["exp_avg"], value["state"][0]["exp_avg"].cpu())
    for i in range(4):
        assert torch.equal(loaded["state"][i]["exp_avg"], taken["state"][i]["exp_avg"].cpu())
        assert torch.equal(loaded["state"][i]["step"], taken["state"][i]["step"])
    for old, new in zip(taken["params"], loaded["params"]):
        assert torch.equal(new, old.cpu()) and new.dtype == old.dtype


def test_policy_snapshot_restores_weights_and_optimizer_moments_exactly(make_trainer):
    trainer = make_trainer("tensor")
    trainer.rewards = [("length", length_reward, 1.0)]
    trainer.step()
    policy = trainer.policy
    saved = policy.snapshot()
    weights = [p.detach().clone() for p in policy.params]
    moments = copy.deepcopy(policy.optimizer.state_dict()["state"])
    trainer.step()   # moves the weights and the moments in place
    assert not all(torch.equal(m["exp_avg"], policy.optimizer.state_dict()["state"][i]["exp_avg"])
                   for i, m in moments.items())
    policy.restore(saved)
    assert all(torch.equal(p, w) for p, w in zip(policy.params, weights)) and policy.version == 1
    restored = policy.optimizer.state_dict()["state"]
    assert restored.keys() == moments.keys()
    assert all(torch.equal(restored[i][k], m[k]) for i, m in moments.items() for k in m)


def test_failed_refresh_rolls_the_step_back_and_the_next_step_resends(make_trainer, monkeypatch):
    monkeypatch.setitem(REFRESH_MODES, "fails-once", FailsOnce)
    trainer = make_trainer("fails-once")
    trainer.rewards = [("length", length_reward, 1.0)]
    before = trainer.policy.adapter()
    with pytest.raises(OSError, match="simulated") as info:
        trainer.step()
    assert any("rolled back" in note for note in getattr(info.value, "__notes__", []))
    assert trainer.step_count == 0 and trainer.history == []
    assert torch.equal(trainer.policy.adapter().buffer, before.buffer)     # the update was undone
    assert trainer.policy.optimizer.state_dict()["state"] == {}            # and so was the optimizer's
    rec = trainer.step()                                                   # re-sends, then steps
    assert rec.step == 1 and rec.metrics["adapter/served_version"] == 0
    assert trainer.engine.served_version("policy") == 1 and trainer.policy.adapter().delta_norm() > 0


@pytest.mark.usefixtures("default_sigint")   # a run started as a background job has SIGINT ignored
def test_a_second_ctrl_c_during_the_rollback_waits_for_it(make_trainer, monkeypatch):
    """One step stale: a failed step's rollback waits for the rollouts sampled ahead (seconds on a GPU). A Ctrl-C
    then used to cut the rollback short, leaving the unpublished update in the trainer (its next step refused as
    stale); now it is delivered once the trainer is back at its step."""
    import signal
    trainer = make_trainer("tensor", "grpo.max_staleness=1")
    trainer.rewards = [("length", length_reward, 1.0)]
    trainer.step()
    before, drop = trainer.policy.adapter(), trainer._drop_ahead

    def ctrl_c_while_waiting():
        signal.raise_signal(signal.SIGINT)   # the second Ctrl-C, while the rollback waits
        drop()
    monkeypatch.setattr(trainer, "_drop_ahead", ctrl_c_while_waiting)
    monkeypatch.setattr(trainer, "probe_gap", lambda: (_ for _ in ()).throw(OSError("simulated probe failure")))
    with pytest.raises(KeyboardInterrupt):
        trainer.step()
    assert trainer.step_count == 1 and torch.equal(trainer.policy.adapter().buffer, before.buffer)
    monkeypatch.undo()
    assert trainer.step().step == 2   # re-sends the adapter, then steps


def test_evaluate_after_a_rolled_back_step_scores_the_trainers_adapter(make_trainer, monkeypatch):
    """A step rolled back after its refresh leaves the engine serving the undone update until the adapter is sent
    again; evaluate sends it first, so its rewards are of the step it is labelled with."""
    trainer = make_trainer("tensor")
    trainer.rewards = [("length", length_reward, 1.0)]
    trainer.step()
    monkeypatch.setattr(trainer, "probe_gap", lambda: (_ for _ in ()).throw(OSError("simulated probe failure")))
    with pytest.raises(OSError, match="simulated"):
        trainer.step()
    assert trainer.engine.served_version("policy") == 2   # the undone update, still in the engine
    monkeypatch.undo()
    assert trainer.evaluate(greedy=True)["step"] == 1 and trainer.engine.served_version("policy") == 1


def test_release_memory_during_training(make_trainer, tiny_model_dir, tokenizer):
    trainer = make_trainer("tensor", "engine.release_memory_during_training=true")
    rec = trainer.step()
    assert rec.step == 1 and not trainer.engine._released            # released for the update, resumed
    cfg = small_config(trainer.config.refresh.file.tmp_dir, "tensor", "engine.release_memory_during_training=true")
    core = CoreOnlyEngine(str(tiny_model_dir))
    try:
        with pytest.raises(EngineError, match="ReleasesMemory") as info:
            build_trainer(cfg, str(tiny_model_dir), core, tokenizer=tokenizer, log=lambda *a: None)
        assert "engine.release_memory_during_training" in str(info.value)
    finally:
        core.close()


def test_merged_pushes_every_weight_again_after_the_engine_released_them(make_trainer):
    """Merged refreshes after the first push only the adapted layers, unless the engine released its
    weights for the update (they come back with undefined contents on SGLang): then every weight."""
    kept = make_trainer("merged")
    released = make_trainer("merged", "engine.release_memory_during_training=true")
    every = sum(t.numel() * t.element_size() for t in kept.policy.base_weights().values())
    adapted = sum(t.numel() * t.element_size() for t in merged_state_dict(kept.model, adapted_only=True).values())
    assert adapted < every
    for _ in range(2):
        assert kept.step().metrics["refresh/bytes"] == adapted
        assert released.step().metrics["refresh/bytes"] == every


def test_policy_gradient_moves_adapter_towards_rewarded_completions(make_trainer):
    """An update on hand-set rewards (the random model earns none): the LoRA moves, the rewarded
    completions become more likely, and a refresh makes the engine agree with the trainer again."""
    trainer = make_trainer("tensor", "grpo.lr=1e-2")
    problems = trainer.source.train_batch(1, 2)
    rollouts = sample(trainer.engine, trainer.tokenizer, problems, 4, trainer.sampling(1), "policy")
    assert rollouts.served_version == 0 and rollouts.group_size == 4
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    batch = collate(rollouts, rewards, trainer.tokenizer.pad_token_id)

    def seq_logp():
        with torch.no_grad():
            lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, 1.0)
        return (lp * batch.completion_mask).sum(1) / batch.completion_mask.sum(1)

    before = seq_logp()
    assert trainer.policy.adapter().delta_norm() == 0
    stats = trainer.policy.train(batch)
    assert stats["mismatch_max"] < 1e-4                          # engine log-probs were the trainer's
    assert stats["grad_norm"] > 0 and trainer.policy.version == 1
    assert stats["tokens"] == int(batch.attention_mask.sum())
    after = seq_logp()
    assert trainer.policy.adapter().delta_norm() > 0
    gain = after - before
    objective_gain = (batch.advantages * gain).mean()
    assert objective_gain > 0
    assert gain[rewards == 1].mean() > gain[rewards == 0].mean()
    # the engine still has the old adapter until the refresh
    seqs = [c.prompt_ids + c.token_ids for c in rollouts.completions]
    lens = [len(c.prompt_ids) for c in rollouts.completions]
    stale = torch.cat(trainer.engine.score(seqs, lens, "policy"))
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        trainer_lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, 1.0)[mask]
    assert (stale - trainer_lp).abs().max() > 1e-4
    assert trainer.engine.served_version("policy") == 0
    trainer.refresher.refresh(trainer.policy.adapter())
    fresh = torch.cat(trainer.engine.score(seqs, lens, "policy"))
    assert (fresh - trainer_lp).abs().max() < 1e-5
    assert trainer.engine.served_version("policy") == 1


def test_kl_to_base_is_zero_before_the_first_update_and_grows_with_updates(make_trainer):
    """kl/mean is KL(policy that sampled || base): exactly 0 at step 1 (LoRA B starts at 0, so the
    adapted model is the base), > 0 once updates with a large learning rate moved the adapter, and
    larger after more of them; the entropy stays in [0, log V]."""
    trainer = make_trainer("tensor", "grpo.lr=5e-2", "grpo.kl_metric=true")
    trainer.rewards = [("length", length_reward, 1.0)]          # a signal in every group: the adapter moves
    rows = [trainer.step().metrics for _ in range(3)]
    assert rows[0]["kl/mean"] == 0.0
    assert 0 < rows[1]["kl/mean"] < rows[2]["kl/mean"], [r["kl/mean"] for r in rows]
    assert all(0 < r["entropy/mean"] <= math.log(trainer.model.config.vocab_size) for r in rows)
    off = make_trainer("tensor", "grpo.kl_metric=false").step().metrics
    assert off["kl/mean"] is None and off["entropy/mean"] > 0


def test_kl_beta_changes_the_update_and_zero_leaves_it_bit_identical(tiny_model_dir, engine, tokenizer, tmp_path):
    """grpo.kl_beta > 0 puts the k3 KL to the base (adapter disabled) into the loss: the gradients
    differ from kl_beta = 0; kl_beta = 0 (with or without the KL metric) is the plain update, bit for bit."""
    problems = [Problem("Tom has 3 apples and buys 4 more. How many?", "#### 7", "7")]
    rollouts = sample(engine, tokenizer, problems, 4, Sampling(8, 1.0, 1.0, seed=5), None)
    batch = collate(rollouts, torch.tensor([len(t) / 40.0 for t in rollouts.texts]), tokenizer.pad_token_id)
    grads, stats = {}, {}
    for name, extra in {"plain": [], "zero": ["grpo.kl_beta=0", "grpo.kl_metric=true"],
                        "kl": ["grpo.kl_beta=0.5"]}.items():
        cfg = small_config(tmp_path, "tensor", "grpo.temperature=0.7", *extra)
        torch.manual_seed(0)
        policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cpu")
        perturb_lora_B(policy.model, seed=2)   # away from the base, so the KL and its gradient are not 0
        stats[name] = policy.train(batch)
        grads[name] = [p.grad.clone() for p in policy.params]
    assert all(torch.equal(a, b) for a, b in zip(grads["plain"], grads["zero"]))
    assert stats["plain"]["loss"] == stats["zero"]["loss"] and stats["plain"]["kl"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(grads["plain"], grads["kl"]))
    assert stats["kl"]["kl"] > 0
    assert stats["kl"]["loss"] == pytest.approx(stats["plain"]["loss"] + 0.5 * stats["kl"]["kl"])


def test_kl_and_entropy_are_metrics_of_the_sampling_policy_not_the_loss(tiny_model_dir, engine, tokenizer, tmp_path):
    """With and without the KL metric the update is the same (gradients equal); kl_to_base is the k3
    estimate on the sampled tokens against the base model's log-probs (adapter disabled) and the
    entropy the token mean of the full softmax's, both computed by hand here."""
    problems = [Problem("Tom has 3 apples and buys 4 more. How many?", "#### 7", "7")]
    rollouts = sample(engine, tokenizer, problems, 4, Sampling(8, 1.0, 1.0, seed=5), None)
    batch = collate(rollouts, torch.tensor([len(t) / 40.0 for t in rollouts.texts]), tokenizer.pad_token_id)
    grads, stats = [], []
    for metric in ("true", "false"):
        cfg = small_config(tmp_path, "tensor", f"grpo.kl_metric={metric}", "grpo.temperature=0.7")
        torch.manual_seed(0)
        policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cpu")
        perturb_lora_B(policy.model, seed=2)
        mask = batch.completion_mask.bool()
        with torch.no_grad():
            logits = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            logp_all = torch.log_softmax(logits[:, :-1].float() / 0.7, -1)                 # [N, L-1, V]
            with policy.model.disable_adapter():
                base = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, 0.7)
        logp = logp_all.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        diff = (base - logp)[mask]
        stats.append(policy.train(batch))
        grads.append([p.grad.clone() for p in policy.params])
    assert stats[0]["kl_to_base"] == pytest.approx((torch.exp(diff) - diff - 1).mean().item(), rel=1e-4)
    assert stats[0]["kl_to_base"] > 0 and stats[1]["kl_to_base"] is None
    entropy = -(logp_all.exp() * logp_all).sum(-1)[mask].mean().item()
    assert stats[0]["entropy"] == pytest.approx(entropy, rel=1e-4) == pytest.approx(stats[1]["entropy"])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_micro_batches_sum_to_the_full_batch_gradient(tiny_model_dir, engine, tokenizer, tmp_path):
    """grpo.micro_batch_tokens changes memory, not the update: a one-sequence budget gives the gradient
    (and loss statistics) of the whole batch in one pass."""
    problems = [Problem("Tom has 3 apples and buys 4 more. How many?", "#### 7", "7"),
                Problem("What is 12 minus 5?", "#### 7", "7")]
    rollouts = sample(engine, tokenizer, problems, 4, Sampling(8, 1.0, 1.0, seed=4), None)
    batch = collate(rollouts, torch.tensor([len(t) / 40.0 for t in rollouts.texts]), tokenizer.pad_token_id)
    assert batch.advantages.abs().sum() > 0
    # and masked columns on the right (compiled layers get widths in multiples of 8) change nothing
    padded = batch.padded_to_multiple(8)
    assert batch.input_ids.shape[1] % 8 and padded.input_ids.shape[1] % 8 == 0
    grads, stats = [], []
    for budget, data in ((1, batch), (10**6, batch), (10**6, padded)):
        cfg = small_config(tmp_path, "tensor", f"grpo.micro_batch_tokens={budget}")
        torch.manual_seed(0)
        policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cpu")
        perturb_lora_B(policy.model, seed=2)                     # non-zero B: A gets gradients too
        stats.append(policy.train(data))
        grads.append([p.grad.clone() for p in policy.params])
    # float32 sums in another order (other padding widths, other head chunks): ~1e-6 relative
    for other in (0, 2):
        for a, b in zip(grads[other], grads[1]):
            assert ((a - b).norm() / b.norm()).item() < 1e-5
        for key in ("loss", "grad_norm", "tokens", "mismatch_mean", "mismatch_max"):
            assert stats[other][key] == pytest.approx(stats[1][key], rel=1e-4, abs=1e-7), key
    assert sum(float(g.abs().sum()) for g in grads[0]) > 0


def test_single_target_module_name(make_trainer):
    """lora.target_modules=q_proj is a valid config (a module name, not a regex): the trainer must
    adapt exactly the q_proj layers, as the SGLang engine would."""
    trainer = make_trainer("tensor", "lora.target_modules=q_proj")
    adapter = trainer.policy.adapter()
    assert {m.split(".")[-1] for m in adapter.modules} == {"q_proj"}
    assert adapter.config["target_modules"] == ["q_proj"]
    assert len(adapter.modules) == 4                             # one per layer


def test_evaluate(make_trainer):
    trainer = make_trainer("tensor")
    result = trainer.evaluate(greedy=True)
    assert result["n"] == 4 and result["greedy"] and result["step"] == 0
    assert all(0 <= result[k] <= 1 for k in ("strict", "flexible", "format"))
    sampled = trainer.evaluate()
    assert sampled["n"] == 4 * trainer.source.eval_samples
    assert trainer.evaluate() == sampled                         # seeded: reproducible


# --- run dir and resume -------------------------------------------------------------------------------
def test_run_dir_contents(make_trainer, tmp_path):
    trainer = make_trainer("tensor", "grpo.steps=2", run_dir=tmp_path / "run")
    runlog = trainer.runlog
    runlog.write_config(trainer.config.to_dict())
    _perturb_and_refresh(trainer)
    records = trainer.run(progress=False)
    assert [r.step for r in records] == [1, 2]
    run = tmp_path / "run"
    assert stat.S_IMODE(os.stat(run).st_mode) & 0o007 == 0     # nothing for other users
    assert Config.from_dict(json.loads((run / "config.json").read_text())) == trainer.config
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2] and runlog.metrics() == metrics
    assert set(metrics[0]) >= METRIC_KEYS
    assert metrics[1]["mismatch/max"] == pytest.approx(records[1].metrics["mismatch/max"])
    assert metrics[1]["time/step_s"] == pytest.approx(records[1].metrics["time/step_s"])
    sync = read_jsonl(run / "sync.jsonl")
    assert [(r["step"], r["version"]) for r in sync if r["row"] == "refresh"] == [(1, 1), (2, 2)]
    assert all(r["mode"] == "tensor" for r in sync)
    assert [r for r in sync if r["row"] == "bucket"]
    rollouts = read_jsonl(run / "rollouts.jsonl")
    assert len(rollouts) == 2 * trainer.runlog.settings.sample_completions
    assert {"step", "completion", "reward", "advantage", "answer", "question", "served_version"} <= set(rollouts[0])
    for step in (1, 2):
        assert (run / "adapters" / f"step_{step}" / "adapter_config.json").is_file()
    current = trainer.policy.adapter()
    final = FlatAdapter.load_peft_dir(run / "adapters" / "step_2")
    assert final.layout == current.layout and torch.equal(final.buffer, current.buffer)
    state, adapter = load_checkpoint(runlog)
    assert state["step"] == 2 and "version" not in state      # the step is the version: one name for it
    assert adapter.version == 2 and torch.equal(adapter.buffer, current.buffer)
    assert not [p for p in run.rglob(".*")]                     # no temp files left behind


def test_checkpoint_every_publishes_rows_with_their_checkpoint(make_trainer, tmp_path):
    trainer = make_trainer("tensor", "run.checkpoint_every=2", run_dir=tmp_path / "run")
    runlog = trainer.runlog
    trainer.step()
    trainer.wait_committed()
    assert runlog.metrics() == [] and load_checkpoint(runlog) == (None, None)     # nothing vouched for yet
    assert read_jsonl(tmp_path / "run" / "sync.jsonl") == [] and len(trainer.history) == 1
    trainer.step()
    trainer.wait_committed()
    assert [r["step"] for r in runlog.metrics()] == [1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "sync.jsonl") if r["row"] == "refresh"] == [1, 2]
    assert load_checkpoint(runlog)[0]["step"] == 2
    trainer.step()                                               # the last step always checkpoints
    trainer.wait_committed()
    assert [r["step"] for r in runlog.metrics()] == [1, 2, 3] and load_checkpoint(runlog)[0]["step"] == 3
    assert runlog.metrics() == json.loads(json.dumps(trainer.history, default=str).replace("NaN", "null"))


def test_a_commit_is_written_while_the_next_step_runs(make_trainer, tmp_path):
    """run.commit_in_background (the default): step() returns before its commit is written; the next
    step trains while it is (here the commit thread is held until step 2's update is done, so the
    order is certain); wait_committed returns once both commits are in the run dir, equal to the
    history, each with its own step's optimizer moments (step 2 changed them in place while commit 1
    waited). The same trainer in line writes before step() returns."""
    trainer = make_trainer("tensor", run_dir=tmp_path / "run")
    trainer.rewards = [("length", length_reward, 1.0)]       # real updates: moments that change every step
    events, release, moments = [], threading.Event(), {}
    commit, train = trainer.runlog.commit, trainer.policy.train

    def tensors(optimizer_state: dict) -> list:
        return [t for _, s in sorted(optimizer_state["state"].items()) for _, t in sorted(s.items())]

    def held_commit(step, state, *args):
        events.append(f"commit {step} starts")
        assert release.wait(timeout=120), "step 2's update never came"
        written = tensors(state["optimizer"])
        assert len(written) == len(moments[step]) and all(map(torch.equal, written, moments[step])), step
        commit(step, state, *args)
        events.append(f"commit {step} written")

    def noted_train(*args):
        stats = train(*args)
        events.append(f"update {trainer.policy.version}")
        moments[trainer.policy.version] = [t.clone() for t in tensors(trainer.policy.optimizer.state_dict())]
        if trainer.policy.version == 2:
            release.set()
        return stats

    trainer.runlog.commit, trainer.policy.train = held_commit, noted_train
    trainer.step()
    assert trainer.runlog.metrics() == [] and len(trainer.history) == 1   # in memory, not yet in the run dir
    trainer.step()
    trainer.wait_committed()
    assert events.index("update 2") < events.index("commit 1 written")   # step 2 trained while 1 was written
    assert not all(map(torch.equal, moments[1], moments[2]))               # so commit 1 could have held step 2's
    assert [e for e in events if e.startswith("commit")] == ["commit 1 starts", "commit 1 written",
                                                            "commit 2 starts", "commit 2 written"]
    assert trainer.runlog.metrics() == json.loads(json.dumps(trainer.history, default=str).replace("NaN", "null"))
    assert all(m["time/commit_wait_s"] >= 0 for m in trainer.history)

    in_line = make_trainer("tensor", "run.commit_in_background=false", run_dir=tmp_path / "in_line")
    in_line.step()
    assert [r["step"] for r in in_line.runlog.metrics()] == [1] and in_line.history[0]["time/commit_wait_s"] == 0


def test_resume_restores_state_and_continues_as_the_uninterrupted_run(make_trainer, tmp_path):
    run = tmp_path / "run"

    def trainer_on(run_dir):
        trainer = make_trainer("tensor", run_dir=run_dir)
        trainer.rewards = [("length", length_reward, 1.0)]       # real updates: non-trivial optimizer state
        return trainer

    # the uninterrupted reference: 3 steps
    reference = trainer_on(tmp_path / "reference")
    _perturb_and_refresh(reference)
    ref_records = reference.run(progress=False)
    # the interrupted run: 2 steps, then a new trainer on the same run dir
    first = trainer_on(run)
    _perturb_and_refresh(first)
    first.run(2, progress=False)
    at_two = first.policy.adapter()

    resumed = trainer_on(run)
    assert resumed.step_count == resumed.policy.version == 2
    assert [h["step"] for h in resumed.history] == [1, 2]
    restored = resumed.policy.adapter()
    assert restored.version == 2 and torch.equal(restored.buffer, at_two.buffer)
    assert resumed.engine.served_version("policy") == 2          # the engine got the resumed adapter
    assert resumed.probe_gap() == pytest.approx(first.probe_gap(), abs=1e-6)
    want = first.policy.optimizer.state_dict()["state"]
    got = resumed.policy.optimizer.state_dict()["state"]
    assert want and got.keys() == want.keys()                    # AdamW moments and step counts
    for i in want:
        assert float(got[i]["step"]) == float(want[i]["step"]) == 2
        assert torch.equal(got[i]["exp_avg"], want[i]["exp_avg"])
        assert torch.equal(got[i]["exp_avg_sq"], want[i]["exp_avg_sq"])
    assert any(float(s["exp_avg"].abs().sum()) > 0 for s in want.values())
    # the resumed step 3 is the step the uninterrupted run made
    rec = resumed.step()
    assert rec.step == 3 and rec.metrics["adapter/served_version"] == 2
    assert rec.metrics["mismatch/max"] < 1e-4
    assert [s["completion"] for s in rec.samples] == [s["completion"] for s in ref_records[2].samples]
    assert rec.metrics["loss/policy"] == pytest.approx(ref_records[2].metrics["loss/policy"], abs=1e-6)
    resumed.wait_committed()
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    final = FlatAdapter.load_peft_dir(run / "adapters" / "step_3")
    ref_final = reference.policy.adapter()
    assert torch.allclose(final.buffer, ref_final.buffer, atol=1e-6)
    assert not torch.allclose(final.buffer, at_two.buffer, atol=1e-6)   # step 3 did move it


def test_write_config_redacts_secrets(tmp_path):
    log = RunLog(tmp_path / "run")
    log.write_config({"engine": {"api_key": "abc", "HF_TOKEN": "xyz", "backend": "hf"},
                      "auth": {"password": "p", "client_secret": "s", "tokenizer": "t"},
                      "grpo": {"max_new_tokens": 48}})
    written = json.loads((tmp_path / "run" / "config.json").read_text())
    assert written == {"engine": {"api_key": "<redacted>", "HF_TOKEN": "<redacted>", "backend": "hf"},
                       "auth": {"password": "<redacted>", "client_secret": "<redacted>", "tokenizer": "t"},
                       "grpo": {"max_new_tokens": 48}}      # a token *count* is not a credential
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "config.json").st_mode) == 0o640


def test_written_config_loads_back(tmp_path):
    """`lorabench resume` reloads RUN_DIR/config.json: every field must survive the write."""
    cfg = Config.load(overrides=["grpo.max_new_tokens=12", "lora.target_modules=q_proj,v_proj",
                                 "grpo.micro_batch_tokens=1024", "run.checkpoint_every=5"])
    log = RunLog(tmp_path / "run")
    log.write_config(cfg.to_dict())
    assert Config.load(tmp_path / "run" / "config.json") == cfg
