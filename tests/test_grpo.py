"""GRPO: advantages and the clipped loss on hand-made tensors; the trainer end to end on the tiny
random model with a real HFEngine (refresh exactness through mismatch/max); the run dir and resume."""
import json
import math
import os
import stat

import pytest
import torch

from conftest import perturb_lora_B
from lorabench.adapters import AdapterSnapshot
from lorabench.config import Config
from lorabench.engines.hf import HFEngine
from lorabench.grpo import GRPOTrainer, group_advantages, grpo_loss, token_logprobs
from lorabench.rewards import gsm8k_reward
from lorabench.runlog import RunLog, read_jsonl


# --- advantages -----------------------------------------------------------------------------------
def test_equal_groups_get_zero_advantage():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert torch.equal(group_advantages(rewards, 4), torch.zeros(8))


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


def test_advantages_group_layout():
    """Groups are consecutive blocks: one right answer in each group gets the same advantage."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    adv = group_advantages(rewards, 4)
    assert adv[0] == pytest.approx(adv[7].item()) and adv[0] > 0
    assert adv[0] == pytest.approx(math.sqrt(3), rel=1e-3)     # (1 - 1/4) / sqrt(3/16)
    assert torch.all(adv[1:7] < 0)


# --- loss -----------------------------------------------------------------------------------------
def _loss(ratio, adv, clip=0.2, mask=None):
    logp = torch.log(torch.tensor(ratio)).requires_grad_(True)
    old = torch.zeros_like(logp)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask)
    loss, metrics = grpo_loss(logp, old, torch.tensor(adv), mask, clip)
    loss.backward()
    return loss.item(), logp.grad, metrics


def test_loss_on_policy_is_minus_mean_advantage():
    loss, grad, metrics = _loss([[1.0, 1.0], [1.0, 1.0]], [2.0, -1.0])
    assert loss == pytest.approx(-(2.0 - 1.0) / 2)
    # descent direction: raise log-probs of positive-advantage tokens, lower the negative ones
    assert torch.all(grad[0] < 0) and torch.all(grad[1] > 0)
    assert metrics["clip_fraction"] == 0.0


def test_loss_clips_positive_advantage_above_one_plus_eps():
    loss, grad, metrics = _loss([[1.5]], [1.0])
    assert loss == pytest.approx(-1.2)                           # -(1 + eps) * A
    assert grad.abs().sum() == 0                                 # no gradient once clipped
    assert metrics["clip_fraction"] == 1.0
    loss, grad, _ = _loss([[0.5]], [1.0])                        # below 1 - eps: not clipped (pessimistic)
    assert loss == pytest.approx(-0.5) and grad.abs().sum() > 0


def test_loss_clips_negative_advantage_below_one_minus_eps():
    loss, grad, _ = _loss([[0.5]], [-1.0])
    assert loss == pytest.approx(0.8)                            # -(1 - eps) * A
    assert grad.abs().sum() == 0
    loss, grad, _ = _loss([[1.5]], [-1.0])                       # above 1 + eps: unclipped, full penalty
    assert loss == pytest.approx(1.5) and grad.abs().sum() > 0


def test_loss_masks_tokens_and_averages_per_sequence():
    # sequence 0 has 1 real token, sequence 1 has 3: each sequence weighs the same
    ratio = [[1.0, 9.0, 9.0], [1.0, 1.0, 1.0]]
    loss, grad, metrics = _loss(ratio, [1.0, 1.0], mask=[[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    assert loss == pytest.approx(-1.0)
    assert torch.all(grad[0, 1:] == 0)                           # padding gets no gradient
    assert grad[0, 0] == pytest.approx(3 * grad[1, 0].item())    # 1/|o| per sequence
    assert metrics["clip_fraction"] == 0.0                       # masked ratios do not count


def test_loss_kl_term():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones_like(logp)
    adv = torch.tensor([0.0])
    loss, metrics = grpo_loss(logp, logp, adv, mask, 0.2, ref_logp=logp.clone(), kl_beta=0.5)
    assert loss.item() == pytest.approx(0.0) and metrics["kl"] == pytest.approx(0.0)
    ref = torch.tensor([[-1.5, -1.0]])
    loss, metrics = grpo_loss(logp, logp, adv, mask, 0.2, ref_logp=ref, kl_beta=0.5)
    diff = ref - logp
    k3 = (torch.exp(diff) - diff - 1).mean().item()
    assert metrics["kl"] == pytest.approx(k3) and k3 > 0
    assert loss.item() == pytest.approx(0.5 * k3)
    _, metrics = grpo_loss(logp, logp, adv, mask, 0.2, ref_logp=ref, kl_beta=0.0)
    assert "kl" not in metrics


# --- the trainer ----------------------------------------------------------------------------------
METRIC_KEYS = {
    "step", "reward/mean", "reward/std", "reward/strict_format", "advantage/abs_mean",
    "advantage/active_groups", "loss/policy", "loss/clip_fraction", "kl/mean", "grad_norm",
    "completions/mean_length", "completions/stop_fraction", "mismatch/mean", "mismatch/max",
    "mismatch/active_mean", "probe/adapter_gap", "adapter/delta_norm", "refresh/mode", "refresh/bytes",
    "refresh/total_s", "time/rollout_s", "time/reward_s", "time/train_s", "time/refresh_s", "time/step_s",
}
REFRESH_PARTS = {"file": {"snapshot", "stage", "write", "unload", "load"},
                 "tensor": {"snapshot", "stage", "unload", "load"}, "inplace": {"snapshot", "stage", "write"},
                 "merged": {"merge", "push"}, "none": set()}


def small_config(tmp_path, mode="tensor", *extra) -> Config:
    return Config.load(overrides=[
        "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.max_new_tokens=8", "grpo.micro_batch=8",
        "data.eval_size=4", "grpo.steps=3", "grpo.lr=5e-2", "lora.r=4", "lora.alpha=8",
        "engine.device=cpu", f"refresh.mode={mode}", f"refresh.tmp_dir={tmp_path}", "run.save_adapter_every=1",
        *extra])


@pytest.fixture
def make_trainer(tiny_model_dir, tokenizer, tmp_path):
    made = []

    def make(mode="tensor", *extra, runlog=None):
        cfg = small_config(tmp_path, mode, *extra)
        engine = HFEngine(str(tiny_model_dir), cfg)
        trainer = GRPOTrainer(cfg, str(tiny_model_dir), engine, runlog, tokenizer=tokenizer, log=lambda *a: None)
        made.append((trainer, engine))
        return trainer
    yield make
    for trainer, engine in made:
        trainer.close()
        engine.close()


def _perturb_and_refresh(trainer, seed=0):
    """A non-trivial adapter in the trainer, pushed to the engine as the trainer would."""
    perturb_lora_B(trainer.model, seed, scale=0.3)
    trainer.refresher.refresh(trainer.model, trainer.step_count)


def test_trainer_starts_with_its_adapter_in_engine(make_trainer):
    trainer = make_trainer("tensor")
    assert trainer.engine.loaded_adapters() == [trainer.cfg.engine.adapter_name]
    assert trainer.refresher.refreshes == 1
    assert trainer.probe_gap() < 1e-6                           # fresh LoRA (B = 0) == base
    _perturb_and_refresh(trainer)
    assert trainer.probe_gap() > 1e-3


def test_step_record_and_exact_tensor_refresh(make_trainer):
    trainer = make_trainer("tensor")
    _perturb_and_refresh(trainer)
    for expected_step in (1, 2, 3):
        rec = trainer.step()
        m = rec.metrics
        assert rec.step == m["step"] == expected_step == trainer.step_count
        assert set(m) == METRIC_KEYS | {f"refresh/{p}_s" for p in REFRESH_PARTS["tensor"]}
        assert m["mismatch/max"] < 1e-4, m["mismatch/max"]     # the engine served the trainer's policy
        assert m["probe/adapter_gap"] > 1e-3                    # and it is not the base model
        assert m["refresh/mode"] == "tensor" and m["refresh/bytes"] == trainer.snapshot().nbytes
        assert rec.refresh.step == expected_step and set(rec.refresh.parts) == REFRESH_PARTS["tensor"]
        assert m["kl/mean"] is None                             # kl_beta = 0
        assert m["adapter/delta_norm"] > 0
        assert 0 <= m["reward/mean"] <= 1 and 0 <= m["completions/stop_fraction"] <= 1
        assert 1 <= m["completions/mean_length"] <= 8
        assert all(math.isfinite(v) for k, v in m.items() if isinstance(v, float) and k != "mismatch/active_mean")
        # every completion is in the record, with the reward it really earned and its group advantage
        assert len(rec.samples) == 2 * 4
        rewards = torch.tensor([s["reward"] for s in rec.samples])
        for s in rec.samples:
            assert s["step"] == expected_step and s["prompt"] in (0, 1)
            assert s["reward"] == gsm8k_reward(s["completion"], s["answer"], "strict")
        assert torch.allclose(torch.tensor([s["advantage"] for s in rec.samples]), group_advantages(rewards, 4))
        assert m["reward/mean"] == pytest.approx(rewards.mean().item())
    assert len(trainer.history) == 3


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
    else:
        assert third["mismatch/max"] < 1e-4                      # step 2's refresh made the engine exact
        assert third["refresh/bytes"] > 0
    assert set(k[len("refresh/"):-2] for k in third if k.startswith("refresh/") and k.endswith("_s")
               and k != "refresh/total_s") == REFRESH_PARTS[mode]
    if mode == "merged":
        assert math.isnan(third["probe/adapter_gap"]) and trainer.engine.loaded_adapters() == []


def test_policy_gradient_moves_adapter_towards_rewarded_completions(make_trainer):
    """train_on with hand-set rewards (the random model earns none): the LoRA moves, the rewarded
    completions become more likely, and a refresh makes the engine agree with the trainer again."""
    trainer = make_trainer("tensor", "grpo.lr=1e-2")
    problems = trainer.source.train_batch(1, 2)
    completions = trainer.rollout(problems, 1)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    batch = trainer._batch(completions, rewards)

    def seq_logp():
        with torch.no_grad():
            lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, 1.0)
        return (lp * batch.completion_mask).sum(1) / batch.completion_mask.sum(1)

    before = seq_logp()
    assert trainer.snapshot().delta_norm() == 0
    stats = trainer.train_on(batch)
    assert stats["mismatch_max"] < 1e-4                          # engine log-probs were the trainer's
    assert stats["grad_norm"] > 0
    after = seq_logp()
    assert trainer.snapshot().delta_norm() > 0
    gain = after - before
    objective_gain = (batch.advantages * gain).mean()
    assert objective_gain > 0
    assert gain[rewards == 1].mean() > gain[rewards == 0].mean()
    # the engine still has the old adapter until the refresh
    seqs = [c.prompt_ids + c.token_ids for c in completions]
    lens = [len(c.prompt_ids) for c in completions]
    stale = torch.cat(trainer.engine.score(seqs, lens, "policy"))
    mask = batch.completion_mask.bool()
    with torch.no_grad():
        trainer_lp = token_logprobs(trainer.model, batch.input_ids, batch.attention_mask, 1.0)[mask]
    assert (stale - trainer_lp).abs().max() > 1e-4
    trainer.refresher.refresh(trainer.model, 1)
    fresh = torch.cat(trainer.engine.score(seqs, lens, "policy"))
    assert (fresh - trainer_lp).abs().max() < 1e-5


def test_single_target_module_name(make_trainer):
    """lora.target_modules=q_proj is a valid config (a module name, not a regex): the trainer must
    adapt exactly the q_proj layers, as the SGLang engine would."""
    trainer = make_trainer("tensor", "lora.target_modules=q_proj")
    snap = trainer.snapshot()
    assert {m.split(".")[-1] for m in snap.modules} == {"q_proj"}
    assert snap.config["target_modules"] == ["q_proj"]
    assert len(snap.modules) == 4                                # one per layer


def test_evaluate(make_trainer):
    trainer = make_trainer("tensor")
    result = trainer.evaluate(greedy=True)
    assert result["n"] == 4 and result["greedy"] and result["step"] == 0
    assert all(0 <= result[k] <= 1 for k in ("strict", "flexible", "format"))
    sampled = trainer.evaluate()
    assert sampled["n"] == 4 * trainer.cfg.data.eval_samples
    assert trainer.evaluate() == sampled                         # seeded: reproducible


# --- run dir and resume -----------------------------------------------------------------------------
def test_run_dir_contents(make_trainer, tmp_path):
    runlog = RunLog(tmp_path / "run")
    trainer = make_trainer("tensor", "grpo.steps=2", runlog=runlog)
    runlog.write_config(trainer.cfg.to_dict())
    _perturb_and_refresh(trainer)
    records = trainer.run(progress=False)
    assert [r.step for r in records] == [1, 2]
    run = tmp_path / "run"
    assert stat.S_IMODE(os.stat(run).st_mode) & 0o007 == 0     # nothing for other users
    assert Config.from_dict(json.loads((run / "config.json").read_text())) == trainer.cfg
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2] and runlog.metrics() == metrics
    assert set(metrics[0]) >= METRIC_KEYS
    assert metrics[1]["mismatch/max"] == pytest.approx(records[1].metrics["mismatch/max"])
    sync = read_jsonl(run / "sync.jsonl")
    assert [r["step"] for r in sync if r["row"] == "refresh"] == [1, 2]
    assert all(r["mode"] == "tensor" for r in sync)
    rollouts = read_jsonl(run / "rollouts.jsonl")
    assert len(rollouts) == 2 * trainer.cfg.run.sample_completions
    assert {"step", "completion", "reward", "advantage", "answer", "question"} <= set(rollouts[0])
    for step in (1, 2):
        assert (run / "adapters" / f"step_{step}" / "adapter_config.json").is_file()
    final = AdapterSnapshot.load_peft_dir(run / "adapters" / "step_2")
    current = trainer.snapshot()
    assert all(torch.equal(final.tensors[k], current.tensors[k]) for k in current.tensors)
    assert (run / "checkpoint" / "trainer_state.pt").is_file()
    assert (run / "checkpoint" / "adapter" / "adapter_model.safetensors").is_file()
    assert not [p for p in run.rglob(".*")]                     # no temp files left behind


def test_resume_restores_state_and_drops_later_rows(make_trainer, tmp_path):
    run = tmp_path / "run"
    # the uninterrupted reference: 3 steps
    reference = make_trainer("tensor", runlog=RunLog(tmp_path / "reference"))
    _perturb_and_refresh(reference)
    ref_records = reference.run(progress=False)
    # the interrupted run: 2 steps, then a kill after step 3 was logged but before its checkpoint
    first = make_trainer("tensor", runlog=RunLog(run))
    _perturb_and_refresh(first)
    first.run(2, progress=False)
    RunLog(run).log_metrics({"step": 3, "reward/mean": 0.0})
    RunLog(run).log_sync([{"step": 3, "mode": "tensor", "row": "refresh"}])
    state_snapshot = first.snapshot()

    resumed = make_trainer("tensor", runlog=RunLog(run))
    assert resumed.step_count == 2
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in read_jsonl(run / "sync.jsonl") if r["row"] == "refresh"] == [1, 2]
    assert [h["step"] for h in resumed.history] == [1, 2]
    restored = resumed.snapshot()
    assert all(torch.equal(restored.tensors[k], state_snapshot.tensors[k]) for k in restored.tensors)
    assert resumed.probe_gap() == pytest.approx(first.probe_gap(), abs=1e-6)  # engine got the adapter
    want, got = first.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert want and got.keys() == want.keys()                    # AdamW moments and step counts
    for i in want:
        assert float(got[i]["step"]) == float(want[i]["step"]) == 2
        assert torch.equal(got[i]["exp_avg_sq"], want[i]["exp_avg_sq"])
    # the resumed step 3 is the step the uninterrupted run made
    rec = resumed.step()
    assert rec.step == 3
    assert rec.metrics["mismatch/max"] < 1e-4
    assert [s["completion"] for s in rec.samples] == [s["completion"] for s in ref_records[2].samples]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    final = AdapterSnapshot.load_peft_dir(run / "adapters" / "step_3")
    ref_final = reference.snapshot()
    assert all(torch.allclose(final.tensors[k], ref_final.tensors[k], atol=1e-6) for k in final.tensors)


def test_truncate_after(tmp_path):
    log = RunLog(tmp_path / "run")
    for step in (1, 2, 3, 4):
        log.log_metrics({"step": step, "reward/mean": step / 10})
        log.log_sync([{"step": step, "row": "bucket"}, {"step": step, "row": "refresh"}])
        log.log_rollouts([{"step": step, "completion": "x"}])
    with open(tmp_path / "run" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "rew')                              # a torn last line from a kill
    assert [r["step"] for r in log.metrics()] == [1, 2, 3, 4]
    log.truncate_after(2)
    assert [r["step"] for r in log.metrics()] == [1, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "sync.jsonl")] == [1, 1, 2, 2]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "rollouts.jsonl")] == [1, 2]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().endswith("\n")
    log.log_metrics({"step": 3, "reward/mean": float("nan")})     # NaN is written as null
    assert log.metrics()[-1] == {"step": 3, "reward/mean": None}


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
    cfg = Config.load(overrides=["grpo.max_new_tokens=12", "lora.target_modules=q_proj,v_proj"])
    log = RunLog(tmp_path / "run")
    log.write_config(cfg.to_dict())
    assert Config.load(tmp_path / "run" / "config.json") == cfg
