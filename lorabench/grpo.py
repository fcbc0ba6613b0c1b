"""GRPO with LoRA and a live adapter refresh after every optimizer step.

Which GRPO this is
------------------
Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath"), outcome supervision:
- each step samples G completions for each of P fresh prompts from the rollout *engine*, which
  serves the current adapter (the name is passed on every request; base requests say adapter=None);
- advantage of completion i in its group: A_i = (r_i - mean(r)) / (std(r) + 1e-4), the same for
  every token of the completion; a group whose rewards are all equal contributes nothing;
- loss: PPO-clip surrogate per token, -min(ρ·A, clip(ρ, 1-ε, 1+ε)·A) with ρ = π_θ / π_old,
  averaged over each completion's tokens, then over completions (the paper's 1/G Σ 1/|o| Σ);
- π_old is the trainer's own log-prob of the sampled tokens before the update (not the engine's:
  those are only compared with it, as the trainer-vs-engine mismatch that proves the refresh);
- `grpo.epochs` optimizer steps per batch (default 1: then ρ = 1 at the gradient and the clip is
  inactive, i.e. plain on-policy policy gradient with group-normalised advantages);
- optional KL to the base model (adapter disabled), k3 estimator exp(q-p)-(q-p)-1, weight β
  (default 0, as in DAPO / Dr. GRPO); no entropy bonus, no reward model, no value function;
- log-probs of the sampling distribution (logits / temperature), as the engine reports them;
- after the last optimizer step of a GRPO step, the refresher moves the adapter into the engine
  (file, tensor or merged) and the step record carries its timings.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from .adapters import AdapterSnapshot, linear_shapes
from .config import ConfigError
from .data import ProblemSource
from .engines.base import Sampling
from .models import load_model, pick_device, prompt_ids
from .refresh import RefreshRecord, make_refresher
from .rewards import gsm8k_reward, has_strict_format
from .runlog import NullRunLog


@dataclass
class RolloutBatch:
    """One step's rollouts, right-padded to L = longest prompt + completion."""
    input_ids: torch.Tensor        # [N, L] prompt + completion tokens, N = P * G
    attention_mask: torch.Tensor   # [N, L] 1 on real tokens
    completion_mask: torch.Tensor  # [N, L-1] 1 where token t+1 is a completion token (log-prob targets)
    engine_logprobs: torch.Tensor  # [N, L-1] the engine's log-prob of token t+1 (0 off the mask)
    rewards: torch.Tensor          # [N]
    advantages: torch.Tensor       # [N]
    group: torch.Tensor            # [N] prompt index within the step


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (group std + eps), rewards laid out group by group: [P*G] -> [P*G]."""
    r = rewards.view(-1, group_size)                    # [P, G]
    std = r.std(dim=1, keepdim=True, unbiased=False)    # population std: a group of equal rewards -> 0
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def token_logprobs(model, input_ids, attention_mask, temperature: float) -> torch.Tensor:
    """Log-prob of each next token under logits / temperature: [N, L] -> [N, L-1]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def grpo_loss(logp, old_logp, advantages, mask, clip_eps: float, ref_logp=None, kl_beta: float = 0.0):
    """Returns (loss, metrics). logp, old_logp, ref_logp, mask: [n, L-1]; advantages: [n]."""
    ratio = torch.exp(logp - old_logp)                                          # [n, L-1]
    adv = advantages[:, None]                                                   # [n, 1]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    metrics = {"clip_fraction": ((ratio - 1).abs() > clip_eps).float()[mask.bool()].mean().item()}
    if ref_logp is not None and kl_beta > 0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1                                         # k3, >= 0
        per_token = per_token + kl_beta * kl
        metrics["kl"] = (kl * mask).sum().item() / mask.sum().clamp(min=1).item()
    per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)              # [n] token mean
    return per_seq.mean(), metrics


@dataclass
class StepRecord:
    step: int
    metrics: dict                      # slash-namespaced scalars (one metrics.jsonl row)
    refresh: RefreshRecord
    samples: list[dict] = field(default_factory=list)   # every completion: prompt index, text, reward, advantage


class GRPOTrainer:
    """The loop as an object: `step()` does one GRPO step and returns its StepRecord."""

    def __init__(self, cfg, model_path: str, engine, runlog=None, tokenizer=None, log=print):
        from peft import LoraConfig, get_peft_model
        from .models import load_tokenizer
        self.cfg, self.engine, self.log = cfg, engine, log
        self.runlog = runlog or NullRunLog()
        self.tokenizer = tokenizer or load_tokenizer(model_path)
        self.device = pick_device(cfg.engine.device if cfg.engine.backend == "hf" else "")
        torch.manual_seed(cfg.run.seed)
        base = load_model(model_path, cfg.model.dtype, self.device)
        targets = cfg.lora.target_modules
        if isinstance(targets, str) and targets != "all-linear":
            targets = [targets]  # one module name; PEFT would treat a bare string as a full-name regex
        if targets != "all-linear":
            have = sorted({name.split(".")[-1] for name in linear_shapes(base)} - {"lm_head"})
            missing = [t for t in targets if t not in have]
            if missing:
                raise ConfigError(f"lora.target_modules={cfg.lora.target_modules!r}: the model {model_path} has "
                                  f"no module named {missing}; its linear modules are {have} (or use "
                                  f"'all-linear')")
        lora = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, target_modules=targets,
                          lora_dropout=cfg.lora.dropout, bias="none")
        self.model = get_peft_model(base, lora)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.grpo.lr, weight_decay=0.0)
        self.refresher = make_refresher(cfg, engine)
        self.source = ProblemSource(cfg.data.source, cfg.run.seed, cfg.data.eval_source)
        self.step_count = 0
        self.history: list[dict] = []
        self._probe = self._make_probe()
        self._engine_stale = False  # set when a failed step was rolled back: re-send the adapter first
        self._restore()
        self.refresher.refresh(self.model, self.step_count)  # the engine starts with the trainer's adapter

    # -- state ----------------------------------------------------------------------------------
    def _restore(self) -> None:
        state, snapshot = self.runlog.load_checkpoint()
        if state is None:
            self.runlog.truncate_after(0)  # rows of a first step that was killed before its checkpoint
            return
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in snapshot.tensors.items()})
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.step_count = state["step"]
        self.runlog.truncate_after(self.step_count)
        self.history = self.runlog.metrics()
        self.log(f"resumed from {self.runlog.dir} at step {self.step_count}")

    def _state(self) -> tuple:
        """What a failed step must not change: LoRA weights, optimizer state, step count."""
        return ([p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict()),
                self.step_count)

    @torch.no_grad()
    def _rollback(self, state: tuple) -> None:
        params, optimizer, step = state
        for p, saved in zip(self.params, params):
            p.copy_(saved)
        self.optimizer.load_state_dict(optimizer)
        self.step_count = step
        self._engine_stale = True  # the engine may have lost the adapter mid-refresh (unloaded, not loaded)

    def snapshot(self) -> AdapterSnapshot:
        return AdapterSnapshot.from_peft(self.model, step=self.step_count)

    def _make_probe(self):
        """A fixed (prompt, reference answer) pair whose log-probs show whether the adapter is live."""
        problem = self.source.eval_set(1)[0] if self.cfg.data.source == "synthetic" else None
        question = problem.messages if problem else [{"role": "user", "content": "What is 2 + 3?"}]
        answer = problem.answer if problem else "2 + 3 = 5\n#### 5"
        prompt = prompt_ids(self.tokenizer, question, self.cfg.model.enable_thinking)
        target = self.tokenizer(answer, add_special_tokens=False)["input_ids"]
        return prompt + target, len(prompt)

    # -- one step ---------------------------------------------------------------------------------
    def sampling(self, step: int | None = None, greedy: bool = False) -> Sampling:
        g = self.cfg.grpo
        seed = None if step is None else self.cfg.run.seed * 1_000_003 + step
        return Sampling(g.max_new_tokens, 0.0 if greedy else g.temperature, g.top_p, seed)

    def rollout(self, problems, step: int):
        g = self.cfg.grpo
        prompts = [prompt_ids(self.tokenizer, p.messages, self.cfg.model.enable_thinking) for p in problems]
        repeated = [p for p in prompts for _ in range(g.group_size)]  # group by group
        return self.engine.generate(repeated, self.sampling(step), adapter=self.refresher.serving_adapter)

    def _batch(self, completions, rewards: torch.Tensor) -> RolloutBatch:
        g = self.cfg.grpo
        seqs = [c.prompt_ids + c.token_ids for c in completions]
        width = max(map(len, seqs))
        n = len(seqs)
        ids = torch.full((n, width), self.tokenizer.pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        cmask = torch.zeros((n, width - 1))
        elp = torch.zeros((n, width - 1))
        for i, (c, s) in enumerate(zip(completions, seqs)):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            start = len(c.prompt_ids) - 1  # log-prob row t predicts token t+1
            cmask[i, start:start + len(c.token_ids)] = 1
            elp[i, start:start + len(c.token_ids)] = torch.tensor(c.logprobs)
        return RolloutBatch(ids, attn, cmask, elp, rewards, group_advantages(rewards, g.group_size),
                            torch.arange(n) // g.group_size)

    def train_on(self, batch: RolloutBatch) -> dict:
        """`epochs` optimizer steps on the batch; returns loss and trainer-vs-engine mismatch."""
        g = self.cfg.grpo
        n = batch.input_ids.shape[0]
        micro = min(g.micro_batch, n)
        old_logp = torch.zeros_like(batch.engine_logprobs)
        stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "grad_norm": 0.0}
        self.model.train()
        for epoch in range(g.epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for s in range(0, n, micro):
                sl = slice(s, s + micro)
                ids, attn = batch.input_ids[sl].to(self.device), batch.attention_mask[sl].to(self.device)
                mask = batch.completion_mask[sl].to(self.device)
                logp = token_logprobs(self.model, ids, attn, g.temperature)                # [m, L-1]
                if epoch == 0:
                    old_logp[sl] = logp.detach().cpu()
                ref = None
                if g.kl_beta > 0:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref = token_logprobs(self.model, ids, attn, g.temperature)
                loss, m = grpo_loss(logp, old_logp[sl].to(self.device), batch.advantages[sl].to(self.device),
                                    mask, g.clip_eps, ref, g.kl_beta)
                (loss * (ids.shape[0] / n)).backward()  # micro-batches sum to the batch mean
                stats["loss"] += loss.item() * ids.shape[0] / n / g.epochs
                stats["clip_fraction"] += m["clip_fraction"] * ids.shape[0] / n / g.epochs
                stats["kl"] += m.get("kl", 0.0) * ids.shape[0] / n / g.epochs
            stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, g.max_grad_norm))
            self.optimizer.step()
        self.model.eval()
        # trainer (before the update) vs engine log-probs on the sampled tokens
        mask = batch.completion_mask.bool()
        diff = (old_logp - batch.engine_logprobs).abs()
        active = mask & (batch.advantages != 0)[:, None]
        stats["mismatch_mean"] = diff[mask].mean().item()
        stats["mismatch_max"] = diff[mask].max().item()
        stats["mismatch_active_mean"] = diff[active].mean().item() if active.any() else float("nan")
        return stats

    def probe_gap(self) -> float:
        """Mean |adapter - base| engine log-prob on the fixed probe (NaN when merged: no base left)."""
        adapter = self.refresher.serving_adapter
        if adapter is None:
            return float("nan")
        seq, plen = self._probe
        with_adapter = self.engine.score([seq], [plen], adapter)[0]
        base = self.engine.score([seq], [plen], None)[0]
        return (with_adapter - base).abs().mean().item()

    def step(self) -> StepRecord:
        g, step = self.cfg.grpo, self.step_count + 1
        if self._engine_stale:  # a previous step failed and was rolled back: the engine gets our adapter again
            self.refresher.refresh(self.model, self.step_count)
            self._engine_stale = False
        t0 = time.perf_counter()
        problems = self.source.train_batch(step, g.prompts_per_step)
        completions = self.rollout(problems, step)
        t_rollout = time.perf_counter()
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        answers = [p.ground_truth for p in problems for _ in range(g.group_size)]
        rewards = torch.tensor([gsm8k_reward(t, a, g.reward_mode, g.format_bonus) for t, a in zip(texts, answers)])
        t_reward = time.perf_counter()
        batch = self._batch(completions, rewards)
        released = self.cfg.engine.release_memory_during_training and self.cfg.engine.backend == "sglang"
        saved = self._state()
        try:  # the step happens whole or not at all: a failed update or refresh is rolled back
            if released:
                # the KV cache always; the weights only when the merged refresh re-pushes all of them
                # (SGLang does not keep released weights unless started with a CPU backup)
                self.engine.release_memory(["kv_cache", "weights"] if self.cfg.refresh.mode == "merged"
                                           else ["kv_cache"])
                try:
                    stats = self.train_on(batch)
                finally:
                    self.engine.resume_memory()  # also after a failed update: release/resume stay paired
            else:
                stats = self.train_on(batch)
            t_train = time.perf_counter()
            self.step_count = step
            refresh = self.refresher.refresh(self.model, step)
        except BaseException as err:
            self._rollback(saved)
            err.add_note(f"lorabench: GRPO step {step} was rolled back; the trainer is still at step "
                         f"{self.step_count} (adapter and optimizer unchanged), the next step() re-sends its "
                         f"adapter to the engine, and `lorabench resume` continues from the last checkpoint")
            raise
        t_refresh = time.perf_counter()
        snapshot = refresh.snapshot or self.snapshot()  # the refresher's copy, when it took one
        groups = batch.rewards.view(-1, g.group_size)
        metrics = {
            "step": step,
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "reward/strict_format": sum(map(has_strict_format, texts)) / len(texts),
            "advantage/abs_mean": batch.advantages.abs().mean().item(),
            "advantage/active_groups": (groups.std(1) > 0).float().mean().item(),
            "loss/policy": stats["loss"],
            "loss/clip_fraction": stats["clip_fraction"],
            "kl/mean": stats["kl"] if g.kl_beta > 0 else None,
            "grad_norm": stats["grad_norm"],
            "completions/mean_length": sum(len(c.token_ids) for c in completions) / len(completions),
            "completions/stop_fraction": sum(c.finish_reason == "stop" for c in completions) / len(completions),
            "mismatch/mean": stats["mismatch_mean"],
            "mismatch/max": stats["mismatch_max"],
            "mismatch/active_mean": stats["mismatch_active_mean"],
            "probe/adapter_gap": self.probe_gap(),
            "adapter/delta_norm": snapshot.delta_norm(),
            "refresh/mode": refresh.mode,
            "refresh/bytes": refresh.nbytes,
            "refresh/total_s": refresh.total_s,
            **{f"refresh/{k}_s": v for k, v in refresh.parts.items()},
            "time/rollout_s": t_rollout - t0,
            "time/reward_s": t_reward - t_rollout,
            "time/train_s": t_train - t_reward,
            "time/refresh_s": t_refresh - t_train,
            "time/step_s": t_refresh - t0,
        }
        samples = [{"step": step, "prompt": i // g.group_size, "question": problems[i // g.group_size].question,
                    "answer": answers[i], "completion": t, "reward": r.item(), "advantage": a.item()}
                   for i, (t, r, a) in enumerate(zip(texts, rewards, batch.advantages))]
        self._log(step, metrics, refresh, samples, snapshot)
        return StepRecord(step, metrics, refresh, samples)

    def _log(self, step, metrics, refresh, samples, snapshot) -> None:
        self.history.append(metrics)
        self.runlog.log_metrics(metrics)
        self.runlog.log_sync(refresh.rows())
        self.runlog.log_rollouts(samples[: self.cfg.run.sample_completions])
        if step % self.cfg.run.save_adapter_every == 0 or step == self.cfg.grpo.steps:
            self.runlog.save_adapter(snapshot, step)
        self.runlog.save_checkpoint({"step": step, "optimizer": self.optimizer.state_dict(),
                                     "torch_rng": torch.get_rng_state()}, snapshot)

    def run(self, n: int | None = None, progress: bool = True) -> list[StepRecord]:
        """Steps until `n` more have run (default: up to grpo.steps in total)."""
        from tqdm.auto import tqdm
        n = self.cfg.grpo.steps - self.step_count if n is None else n
        records = []
        bar = tqdm(range(n), desc="GRPO", disable=not progress)
        for _ in bar:
            rec = self.step()
            records.append(rec)
            bar.set_postfix(reward=f"{rec.metrics['reward/mean']:.2f}",
                            refresh_ms=f"{1e3 * rec.refresh.total_s:.1f}")
        return records

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate(self, problems=None, greedy: bool = False, samples: int | None = None) -> dict:
        """Held-out rewards through the engine, at the training sampling settings (or greedy)."""
        d, g = self.cfg.data, self.cfg.grpo
        problems = problems if problems is not None else self.source.eval_set(d.eval_size)
        k = 1 if greedy else (samples or d.eval_samples)
        prompts = [prompt_ids(self.tokenizer, p.messages, self.cfg.model.enable_thinking) for p in problems]
        outs = self.engine.generate([p for p in prompts for _ in range(k)],
                                    Sampling(g.max_new_tokens, 0.0 if greedy else g.temperature, g.top_p,
                                             seed=self.cfg.run.seed + 7),
                                    adapter=self.refresher.serving_adapter)
        texts = self.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)
        truth = [p.ground_truth for p in problems for _ in range(k)]
        return {"step": self.step_count, "greedy": greedy, "n": len(texts),
                "strict": sum(gsm8k_reward(t, a, "strict") for t, a in zip(texts, truth)) / len(texts),
                "flexible": sum(gsm8k_reward(t, a, "flexible") for t, a in zip(texts, truth)) / len(texts),
                "format": sum(map(has_strict_format, texts)) / len(texts)}

    def close(self) -> None:
        self.refresher.close()
