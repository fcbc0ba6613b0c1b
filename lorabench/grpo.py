"""GRPO with LoRA and a live adapter refresh after every optimizer step.

Each step samples G completions for each of P prompts from the engine serving the current adapter,
scores them, takes the update (loss.py), refreshes the engine (refresh.py) and commits (commits.py).
With grpo.max_staleness >= 1 the next step's rollouts are sampled on a thread while this step trains.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field

import torch

from . import metrics as m
from .adapters import FlatAdapter
from .clock import Clock
from .commits import Commits, TrainerStopped  # noqa: F401 (TrainerStopped: re-exported)
from .data import Problem, ProblemSource, prompt_ids
from .engines.base import GenerateRequest, ReleasesMemory, Sampling, StaleAdapter, generate_served, require
from .interrupts import interrupts_deferred, interrupts_to_the_main_thread, resend_lost_stops, wait_interruptibly
from .metrics import PROBE_GAP, REWARD, STEP_S, memory_of, step_row, time_of
from .policy import Policy
from .refresh import RefreshRecord
from .rewards import gsm8k_reward, has_strict_format, reward_functions
from .rollout import RolloutBatch, Rollouts, collate, rollout_request, rollouts_of, score
from .rundir import BEHIND
from .runlog import NullRunLog
from .settings import ALLOWED, REFUSED, Section, check, setting

_DATA = "it defines the data stream: which problems each step draws"
_SAMPLING = "it defines the sampling distribution: the rollouts and the log-probs the loss uses"
_OBJECTIVE = "it defines the objective; rows before and after would not be one experiment"
LORA_COMPUTE = ("auto", "float32", "bfloat16")
COMPILE = ("off", "head", "all", "auto")


@dataclass
class SampledAhead:
    """A batch sampled on the sampler thread for a step not yet begun (a trainer's step, or {policy: step} for a
    group), and its scoring, whose result is what the step takes ((Rollouts, scored) or {name: that})."""
    for_steps: object
    sampling: Future
    scoring: Future

    def take(self, steps):
        """The scoring's result (its error raised) when sampled for `steps`; else None once both are done: no
        engine call left running, a batch not taken dropped with its error. An interrupt stops either wait."""
        if self.for_steps == steps:
            return wait_interruptibly(self.scoring.result)
        for done in (self.sampling, self.scoring):
            wait_interruptibly(done.exception)
        return None

    def drop(self) -> None:
        """Waited for (no engine call left running) and dropped, an interrupt held until then (closing)."""
        futures_wait([self.sampling, self.scoring])


@dataclass
class GRPOSettings(Section):
    """The `grpo` section: the trainer's loop, its objective and its update (the policy's too)."""
    steps: int = setting(30, "GRPO steps (one optimizer step and one adapter refresh each).",
                         resume=ALLOWED, why="how long the run goes (not below the steps already done)")
    prompts_per_step: int = setting(8, "Distinct prompts per step (fresh every step).", resume=REFUSED, why=_DATA)
    group_size: int = setting(8, "Completions sampled per prompt; advantages are normalised within a group.",
                              resume=REFUSED, why=_DATA)
    max_new_tokens: int = setting(48, "Completion length limit.", resume=REFUSED, why=_SAMPLING)
    temperature: float = setting(0.7, "Sampling temperature for rollouts and the sampled held-out eval "
                                 "(log-probs are of this distribution).", resume=REFUSED, why=_SAMPLING)
    top_p: float = setting(1.0, "Nucleus sampling; keep 1.0 so log-probs cover the whole distribution.",
                           resume=REFUSED, why=_SAMPLING)
    lr: float = setting(1e-3, "AdamW learning rate for the LoRA parameters.", resume=REFUSED,
                        why="it is saved in the checkpoint's optimizer state: a new value would silently not apply")
    clip_eps: float = setting(0.2, "PPO-style ratio clip.", resume=REFUSED, why=_OBJECTIVE)
    kl_beta: float = setting(0.0, "Weight β of the k3 KL to the base model (adapter disabled) added to the loss per "
                             "token. 0 = off (a rule-checked reward cannot be gamed); > 0 (e.g. 0.04) keeps the "
                             "policy near the base at one more forward pass per micro-batch.",
                             resume=REFUSED, why=_OBJECTIVE)
    kl_metric: bool = setting(False, "Log kl/mean, the k3 estimate of KL(policy || base model) on the sampled tokens, "
                              "also when kl_beta = 0 (not in the loss): one more forward pass without gradients.",
                              resume=ALLOWED, why="a metric only: the update is the same")
    micro_batch_tokens: int = setting(16384, "Padded tokens per forward/backward pass (gradient accumulation): "
                                      "sequences are grouped by length into micro-batches under this budget, so "
                                      "trainer memory does not grow with the rollout size.", resume=ALLOWED,
                                      why="memory only: the same gradients, summed in other groups")
    lora_compute: str = setting("auto", "Precision of the LoRA matmuls in training: 'bfloat16' (autocast; the adapter "
                                "and its optimizer state stay fp32), 'float32' or 'auto' (bfloat16 when model.dtype "
                                "is bfloat16, else float32).", resume=ALLOWED,
                                why="the precision of the LoRA matmuls in training; objective, data and adapter "
                                    "are the same")
    activation_checkpointing: bool = setting(True, "Recompute each decoder layer's activations in backward instead "
                                             "of keeping them: far less training memory per token for ~25% more "
                                             "compute. false: keep them.", resume=ALLOWED,
                                             why="memory and speed only: the same gradients, recomputed")
    compile: str = setting("auto", "torch.compile in training: 'all' (every decoder layer and the output head's "
                           "passes over the vocabulary), 'head' (the head only), 'off', or 'auto' ('all' on a CUDA "
                           "GPU, 'off' elsewhere). 'all' compiles while the engine starts (a dummy batch), not in "
                           "the first step.", resume=ALLOWED,
                           why="speed only: the same computation, compiled")
    reward_mode: str = setting("strict", "'strict' (last '#### N') or 'flexible' (last number).",
                               resume=REFUSED, why=_OBJECTIVE)
    format_bonus: float = setting(0.0, "Added to the reward when '#### N' is present, right or wrong.",
                                  resume=REFUSED, why=_OBJECTIVE)
    max_grad_norm: float = setting(1.0, "Gradient clipping.", resume=REFUSED, why=_OBJECTIVE)
    max_delta_ratio: float = setting(1.0, "Divergence bound: an update after which some adapted layer's change "
                                     "||dW|| = ||(alpha/r)·B·A|| exceeds this multiple of its base weight's ||W|| is "
                                     "treated like a non-finite loss: rolled back, never served, saved or "
                                     "checkpointed, and the run stops naming the step and the norms (a healthy run "
                                     "stays far below 1.0). 0 = no bound (non-finite values are always refused).",
                                     resume=ALLOWED, why="a guard: it decides when a diverged update stops the run, "
                                     "not what a step computes")
    epochs: int = setting(1, "Optimizer steps per batch (1 = on-policy; the clip matters only above 1).",
                          resume=REFUSED, why=_OBJECTIVE)
    max_staleness: int = setting(0, "Steps a rollout's adapter may lag behind the trainer. 0: on-policy. 1: the "
                                 "next step's rollouts are sampled while this step trains, from the adapter one "
                                 "update behind, and the loss weights each token by min(π_old / π_sample, tis_cap); "
                                 "a larger value acts as 1. Step 1 samples on-policy; a resumed run samples as the "
                                 "run would have. A rollout older than this is refused. A policy group samples every "
                                 "policy's next batch while its updates run. With SGLang on the trainer's GPU this "
                                 "overlaps only under CUDA MPS (the engine says so when it opens).",
                                 resume=REFUSED, why=_SAMPLING)
    tis_cap: float = setting(2.0, "Truncation C of the importance weight min(π_old / π_sample, C) applied with "
                             "max_staleness > 0 (truncated importance sampling).", resume=REFUSED, why=_OBJECTIVE)

    def problems(self) -> list[str]:
        return [
            *check(self.group_size >= 2, f"grpo.group_size={self.group_size}: group-normalised advantages need at "
                   f"least 2 completions per prompt; set grpo.group_size=8 or more"),
            *check(self.prompts_per_step >= 1, f"grpo.prompts_per_step={self.prompts_per_step}: must be >= 1"),
            *check(self.steps >= 0, f"grpo.steps={self.steps}: must be >= 0"),
            *check(self.micro_batch_tokens >= 1, f"grpo.micro_batch_tokens={self.micro_batch_tokens}: must be >= 1 "
                   f"(e.g. 4096; a sequence longer than the budget forms its own micro-batch)"),
            *check(self.max_new_tokens >= 1, f"grpo.max_new_tokens={self.max_new_tokens}: must be >= 1"),
            *check(self.temperature >= 0.01, f"grpo.temperature={self.temperature}: must be >= 0.01 (below it sampling "
                   f"is greedy in effect: identical groups and zero advantages); e.g. 0.7"),
            *check(0 < self.top_p <= 1, f"grpo.top_p={self.top_p}: must be in (0, 1]"),
            *check(self.lr > 0, f"grpo.lr={self.lr}: must be > 0 (e.g. 1e-3)"),
            *check(self.max_grad_norm > 0, f"grpo.max_grad_norm={self.max_grad_norm}: must be > 0 (e.g. 1.0)"),
            *check(self.max_delta_ratio >= 0, f"grpo.max_delta_ratio={self.max_delta_ratio}: must be >= 0 (1.0 is "
                   f"the default; 0 = no bound)"),
            *check(self.clip_eps > 0, f"grpo.clip_eps={self.clip_eps}: must be > 0 (e.g. 0.2)"),
            *check(self.kl_beta >= 0, f"grpo.kl_beta={self.kl_beta}: must be >= 0 (0 = no KL term)"),
            *check(self.epochs >= 1, f"grpo.epochs={self.epochs}: must be >= 1"),
            *check(self.max_staleness >= 0, f"grpo.max_staleness={self.max_staleness}: must be >= 0 (0 = on-policy)"),
            *check(self.tis_cap >= 1, f"grpo.tis_cap={self.tis_cap}: must be >= 1 (e.g. 2.0; 1 never weights a "
                   f"token up)"),
            *check(self.lora_compute in LORA_COMPUTE,
                   f"grpo.lora_compute={self.lora_compute!r}: use one of {list(LORA_COMPUTE)}"),
            *check(self.compile in COMPILE, f"grpo.compile={self.compile!r}: use one of {list(COMPILE)}"),
            *check(self.reward_mode in ("strict", "flexible"),
                   f"grpo.reward_mode={self.reward_mode!r}: use 'strict' or 'flexible'"),
        ]


@dataclass
class StepRecord:
    step: int
    metrics: dict                      # slash-namespaced scalars (one metrics.jsonl row)
    refresh: RefreshRecord
    samples: list[dict] = field(default_factory=list)   # every completion: prompt index, text, reward, advantage


class StepInProgress(RuntimeError):
    """step() was called while another thread's step() runs on the same trainer."""


class StepClock(Clock):
    """A step's parts (clock.Clock); on a GPU also this process's peak memory per part."""

    def __init__(self):
        super().__init__()
        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.peak_gb: dict[str, float] = {}
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def lap(self, part: str) -> float:
        seconds = super().lap(part)
        if self.cuda:
            self.peak_gb[part] = max(self.peak_gb.get(part, 0.0), torch.cuda.max_memory_allocated() / 1e9)
            torch.cuda.reset_peak_memory_stats()
        return seconds

    def metrics(self) -> dict[str, float]:
        return {**{time_of(k): v for k, v in self.parts.items()}, STEP_S: self.total,
                **{memory_of(k): v for k, v in self.peak_gb.items()}}


class GRPOTrainer:
    """The loop as an object: `step()` does one GRPO step and returns its StepRecord; `seed` seeds the sampling."""

    def __init__(self, settings: GRPOSettings, policy: Policy, engine, refresher, source: ProblemSource, tokenizer,
                 runlog=None, *, seed: int = 0, enable_thinking: bool = False, release_engine_memory: bool = False,
                 log=print, repair_later: bool = False):
        self.settings, self.policy, self.engine, self.refresher = settings, policy, engine, refresher
        self.source, self.tokenizer, self.log = source, tokenizer, log
        self.runlog = runlog or NullRunLog()
        self.seed, self.enable_thinking, self.release_engine_memory = seed, enable_thinking, release_engine_memory
        if release_engine_memory:
            require(engine, ReleasesMemory, "engine.release_memory_during_training")
        self.rewards = reward_functions(settings.reward_mode, settings.format_bonus)
        self.history: list[dict] = []
        problem = self.source.eval_set(1)[0] if self.source.source == "synthetic" else None   # the fixed probe
        prompt = prompt_ids(tokenizer, problem.messages if problem else [{"role": "user", "content": "What is 2 + 3?"}],
                            enable_thinking)
        self._probe = prompt + tokenizer(problem.answer if problem else "2 + 3 = 5\n#### 5",
                                         add_special_tokens=False)["input_ids"], len(prompt)
        self._probe_base = None                # the base's log-probs on it: scored once, the base never changes
        self._engine_stale = False             # a failed step was rolled back: re-send the adapter first
        self._stepping = threading.Lock()      # one step at a time (a panel's and a cell's would interleave)
        self._commits = Commits(self.runlog, settings.steps, self._state, lambda: self.policy.version)
        # max_staleness: the next step's batch, sampled on a thread; a refresh waits for its sampling
        self._ahead: SampledAhead | None = None
        self._sampler = ThreadPoolExecutor(1, "lorabench-rollouts", interrupts_to_the_main_thread) \
            if settings.max_staleness else None
        self._current = self._behind = None   # the adapter the engine serves, and (max_staleness) the one before it
        self._resumed = self.runlog.check_checkpoint(take=self._take)   # checked before any repair is written
        if not repair_later:   # a policy group's repairs wait until every policy's checkpoint passed its checks
            self.repair_run_dir()
        self._serve(self.policy.adapter())

    def repair_run_dir(self) -> None:
        """The run dir made to agree with the checkpoint taken (rows cut or appended, the adapter exported again);
        called by __init__, or with repair_later=True by the caller once nothing else can refuse the resume."""
        if self._resumed is None:
            return
        (state, _, found), self._resumed = self._resumed, None
        self.runlog.repair(found)
        if state is not None:
            self.runlog.export_if_missing(self.policy.adapter(), self.settings.steps)   # with the policy's own config
            self.history = self.runlog.metrics()
            self.log(f"resumed from {self.runlog.dir} at step {self.step_count}")

    @property
    def step_count(self) -> int:
        return self.policy.version

    @property
    def model(self):
        return self.policy.model

    @property
    def device(self) -> str:
        return self.policy.device

    def step(self, rollouts: Rollouts | None = None, rollout_s: float = 0.0) -> StepRecord:
        """Rollout -> reward -> update -> refresh -> commit (maybe written after return: wait_committed).
        `rollouts`: sampled by the caller for `rollout_request()` in `rollout_s` s, checked like our own."""
        with self.stepping():
            phases = self.phases(rollouts, rollout_s=rollout_s)
            next(phases)
            return finish(phases)

    @contextlib.contextmanager
    def stepping(self):
        """This trainer's steps one at a time: StepInProgress if another thread's step runs."""
        resend_lost_stops()   # a Ctrl-C that a finaliser swallowed is sent again
        if not self._stepping.acquire(blocking=False):
            raise StepInProgress(f"step {self.policy.version + 1} is running in another thread (a step panel's "
                                 f"Run N?); Stop it or wait for it (panel.wait()), then step again")
        try:
            yield
        finally:
            self._stepping.release()

    def rollout_request(self, ahead: bool = False) -> tuple[list[Problem], GenerateRequest]:
        """The next step's problems and engine request (ahead=True: the step after it), once the engine is fresh."""
        if not ahead:
            self.resend_if_stale()
        return self._request_for(self.policy.version + (2 if ahead else 1))

    def serve_behind(self) -> None:
        """With max_staleness, the engine serves the adapter one version behind until `resend_if_stale`."""
        if self._behind is not None:
            self._engine_stale = True   # until the engine serves the current adapter again
            self.refresher.refresh(self._behind)

    def resend_if_stale(self) -> None:
        """After a rolled-back step or `serve_behind`, send the current adapter again."""
        if self._engine_stale:
            self.refresher.refresh(self._current)
            self._engine_stale = False

    def _serve(self, adapter: FlatAdapter) -> None:
        self._current = adapter
        self.refresher.refresh(adapter)

    def _request_for(self, step: int) -> tuple[list[Problem], GenerateRequest]:
        g = self.settings
        problems = self.source.train_batch(step, g.prompts_per_step)
        return problems, rollout_request(self.tokenizer, problems, g.group_size, self.sampling(step),
                                         self.refresher.serving_adapter, self.enable_thinking)

    def _sample(self, step: int) -> Rollouts:
        """Step `step`'s rollouts with the version that served them, read in the same engine call."""
        problems, request = self._request_for(step)
        completions, served = generate_served(self.engine, request.prompt_ids, request.sampling, request.adapter)
        return rollouts_of(self.engine, self.tokenizer, problems, request, completions, served)

    def phases(self, rollouts: Rollouts | None, scored: tuple | None = None, rollout_s: float = 0.0):
        """One step as a generator (under `stepping()`): next() samples (or checks `rollouts`), scores and
        updates; `finish` then refreshes, probes and commits. Closed between the two, the update is rolled back."""
        self._commits.check(wait=False)
        g, step, clock = self.settings, self.policy.version + 1, StepClock()
        self.clock = clock   # the step under way (a step panel shows which part runs)
        if rollouts is None:
            self.resend_if_stale()
            ahead, self._ahead = self._ahead, None
            ahead = ahead and ahead.take(step)
            if ahead is None:   # as the pipeline samples: from the adapter one version behind (max_staleness)
                self.serve_behind()
                ahead = self._sample(step), None
                self.resend_if_stale()
            rollouts, scored = ahead
            clock.lap("rollout")
            if self._sampler is not None and step < g.steps:   # the next step's, sampled while this one trains
                sampled = self._sampler.submit(self._sample, step + 1)
                scoring = self._sampler.submit(lambda: (sampled.result(), self.scored(sampled.result())))
                self._ahead = SampledAhead(step + 1, sampled, scoring)
        else:   # a policy group's (scored too, when sampled ahead)
            self._check_given(rollouts, step)
            clock.add("rollout", rollout_s)
        self._check_served(rollouts)
        batch, reward_means = scored or self.scored(rollouts)
        clock.lap("reward")
        with contextlib.ExitStack() as committing:
            with self._whole_step(step):
                with self._engine_memory_released():
                    stats = self.policy.train(batch)
                clock.lap("train")
                if (yield):   # held between its update and its publish by a policy group (finish: waited)
                    clock.lap("group_wait")
                if self._ahead is not None:   # sampled from this adapter whatever the timing: the refresh waits
                    wait_interruptibly(self._ahead.sampling.exception)
                    clock.lap("rollout_wait")
                adapter = self.policy.adapter()
                refresh = self.refresher.refresh(adapter)
                clock.lap("refresh")
                metrics = step_row(step, rollouts, batch, stats, reward_means, refresh, adapter.delta_norm())
                metrics[PROBE_GAP] = self.probe_gap()
                if self.refresher.serving_adapter is not None and not math.isfinite(metrics[PROBE_GAP]):
                    raise self.policy.diverged_output(adapter)   # the engine could not sample from it
                clock.lap("probe")
                committing.enter_context(interrupts_deferred())   # from here on the step is committed whole
            self._behind, self._current = (self._current if g.max_staleness else None), adapter
            record = StepRecord(step, metrics, refresh, step_samples(step, rollouts, batch))
            self._commits.commit(record, adapter, clock, self.history)
        return record

    def _check_given(self, rollouts: Rollouts, step: int) -> None:
        """Given rollouts must be of this step's rollout_request(), under this trainer's adapter."""
        expected = self.source.train_batch(step, self.settings.prompts_per_step)
        if [p.question for p in rollouts.problems] != [p.question for p in expected]:
            raise ValueError(f"step {step}: the rollouts given are not of this step's problems; sample them for "
                             f"trainer.rollout_request() of this step")
        if rollouts.adapter != self.refresher.serving_adapter:
            raise StaleAdapter(f"step {step}: the rollouts given were served by adapter {rollouts.adapter!r}, this "
                               f"trainer's is {self.refresher.serving_adapter!r}; nothing was trained on them")

    def scored(self, rollouts: Rollouts) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollouts rewarded and collated, with each reward function's mean (pure: on any thread)."""
        rewards, reward_means = score(rollouts, self.rewards)
        return collate(rollouts, rewards, self.tokenizer.pad_token_id), reward_means

    def _drop_ahead(self) -> None:
        """Rollouts sampled ahead for a step that will not follow: waited for (no engine call left running), dropped."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            ahead.drop()

    def _check_served(self, rollouts: Rollouts) -> None:
        """The engine served the trainer's version or one at most max_staleness older (not checked for 'none')."""
        lag = self.policy.version - (rollouts.served_version if rollouts.served_version is not None else -1)
        if self.refresher.keeps_engine_fresh and not 0 <= lag <= self.settings.max_staleness:
            allowed = (f"the trainer is at version {self.policy.version}" if not self.settings.max_staleness else
                       f"more than grpo.max_staleness={self.settings.max_staleness} behind the trainer's version "
                       f"{self.policy.version}")
            raise StaleAdapter(f"step {self.policy.version + 1}: the engine served adapter "
                               f"{rollouts.adapter!r} at version {rollouts.served_version}, {allowed}; the last "
                               f"refresh did not reach the engine (refresh.mode={self.refresher.mode}). Nothing "
                               f"was trained on these rollouts")

    @contextlib.contextmanager
    def _whole_step(self, step: int):
        """The update, the refresh and the probe happen whole or not at all: a failure or an interrupt rolls back."""
        saved = self.policy.snapshot()
        try:
            yield
        except BaseException as err:
            # whole, also against a second Ctrl-C: cut short, the unpublished update would stay in the trainer
            with interrupts_deferred():
                self.policy.restore(saved)
                self._engine_stale = True  # the engine may have lost the adapter mid-refresh (unloaded, not loaded)
                err.add_note(f"lorabench: GRPO step {step} was rolled back; the trainer is still at step "
                             f"{self.policy.version} (adapter and optimizer unchanged), the next step() re-sends its "
                             f"adapter to the engine, and `lorabench resume` continues from the last checkpoint")
                self._drop_ahead()   # sampled for the step after this one, which does not come next (waited for)
            raise

    @contextlib.contextmanager
    def _engine_memory_released(self):
        """engine.release_memory_during_training: released during the update, resumed after it, also a failed one."""
        if not self.release_engine_memory:
            yield
            return
        tags = list(self.refresher.release_tags)
        self.engine.release_memory(tags)
        try:
            yield
        finally:
            self.engine.resume_memory()
            self.refresher.engine_memory_resumed(tags)

    def wait_committed(self) -> None:
        """Return once every step so far is in the run dir; TrainerStopped if one could not be written."""
        self._commits.check(wait=True)

    def run(self, n: int | None = None, progress: bool = True) -> list[StepRecord]:
        """Steps until `n` more have run (default: up to grpo.steps in total)."""
        from tqdm.auto import tqdm
        records = []
        for _ in (bar := tqdm(range(self.settings.steps - self.step_count if n is None else n), desc="GRPO",
                              disable=not progress)):
            records.append(rec := self.step())
            bar.set_postfix(reward=f"{rec.metrics[REWARD]:.2f}", refresh_ms=f"{1e3 * rec.refresh.total_s:.1f}")
        self.wait_committed()
        return records

    def _state(self) -> dict:
        """The checkpoint's trainer state: the policy's, and the adapter one version behind (max_staleness)."""
        state = self.policy.state()
        if self._behind is not None:
            state[BEHIND] = self._behind.buffer
        return state

    def load_state(self, state: dict, adapter: FlatAdapter, history: list[dict]) -> None:
        """The trainer at a checkpoint's step (`adapter`, its version), the engine serving its adapter."""
        self._take(state, adapter)
        self.history = history
        self._serve(self.policy.adapter())

    def _take(self, state: dict, adapter: FlatAdapter) -> None:
        """A checkpoint's state, checked by the policy, with the adapter one version behind (max_staleness)."""
        # laid out as adapter_buffer: read_checkpoint checked it with every *_buffer field (checkpoint_problem)
        behind = state.get(BEHIND) if self.settings.max_staleness else None
        self.policy.load(state, adapter)
        self._behind = None if behind is None else FlatAdapter(behind, adapter.layout, adapter.config,
                                                               adapter.version - 1).to(self.device)
        if self.settings.max_staleness and behind is None:
            self.log(f"note: the checkpoint of step {adapter.version} holds no adapter one version behind (written "
                     f"before lorabench kept it): step {adapter.version + 1} is sampled on-policy (adapter/lag 0), "
                     f"the steps after it one version behind as before")

    def commits_held(self):
        """A block whose background commits reach the commit thread when it ends (commits.Commits.held)."""
        return self._commits.held()

    def probe_gap(self) -> float:
        """Mean |adapter - base| engine log-prob on the fixed probe (NaN when merged: no base left)."""
        adapter = self.refresher.serving_adapter
        if adapter is None:
            return float("nan")
        seq, plen = self._probe
        with_adapter = self.engine.score([seq], [plen], adapter)[0]
        if self._probe_base is None:   # a refresh that serves an adapter leaves the engine's base weights as they are
            self._probe_base = self.engine.score([seq], [plen], None)[0]
        return (with_adapter - self._probe_base).abs().mean().item()

    def sampling(self, step: int | None = None, greedy: bool = False) -> Sampling:
        g = self.settings
        seed = None if step is None else self.seed * 1_000_003 + step
        return Sampling(g.max_new_tokens, 0.0 if greedy else g.temperature, g.top_p, seed)

    def evaluate(self, problems=None, greedy: bool = False, samples: int | None = None) -> dict:
        """Held-out rewards through the engine, at the training sampling settings (or greedy), of the trainer's
        adapter at its step: not while a step runs (StepInProgress), and after a rolled-back step it is sent again."""
        problems = problems if problems is not None else self.source.eval_set(self.source.eval_size)
        k = 1 if greedy else (samples or self.source.eval_samples)
        prompts = [prompt_ids(self.tokenizer, p.messages, self.enable_thinking) for p in problems]
        with self.stepping():
            self.resend_if_stale()
            outs = self.engine.generate([p for p in prompts for _ in range(k)],
                                        dataclasses.replace(self.sampling(greedy=greedy), seed=self.seed + 7),
                                        adapter=self.refresher.serving_adapter)
        texts = self.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)
        truth = [p.ground_truth for p in problems for _ in range(k)]
        return {"step": self.step_count, m.HELD_GREEDY: greedy, m.HELD_COUNT: len(texts),
                **{mode: sum(gsm8k_reward(t, a, mode) for t, a in zip(texts, truth)) / len(texts)
                   for mode in (m.HELD_STRICT, m.HELD_FLEXIBLE)},
                m.HELD_FORMAT: sum(map(has_strict_format, texts)) / len(texts)}

    def close(self) -> None:
        """Once the last commit is written (its error if no step raised it yet), release the threads and refresher.
        An interrupt waits for the commit in flight, then is raised: the run dir is closed next (RunLog.close)."""
        try:
            self._drop_ahead()
            with interrupts_deferred():
                self._commits.raise_if_failed(wait=True)
        finally:
            if self._sampler is not None:
                self._sampler.shutdown()
            with interrupts_deferred():
                self._commits.shutdown()
                self.refresher.close()


def finish(phases, waited: bool = False) -> StepRecord:
    """The publish of a step updated by next(phases): its StepRecord. waited: held between update and
    publish (a policy group), timed as time/group_wait_s."""
    try:
        phases.send(waited)
    except StopIteration as done:
        return done.value
    raise RuntimeError("GRPOTrainer.phases has two phases: update, then publish")


def step_samples(step: int, rollouts: Rollouts, batch: RolloutBatch) -> list[dict]:
    """Every completion of the step with its prompt index, reward, advantage and the version served."""
    g = rollouts.group_size
    return [{"step": step, "prompt": i // g, "question": rollouts.problems[i // g].question,
             "answer": answer, "completion": text, "reward": r.item(), "advantage": a.item(),
             "served_version": rollouts.served_version}
            for i, (answer, text, r, a) in enumerate(zip(rollouts.answers, rollouts.texts, batch.rewards,
                                                         batch.advantages))]
