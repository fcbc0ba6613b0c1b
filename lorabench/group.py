"""Several LoRA policies trained side by side on one engine and one frozen base model.

    cfg = Config.load(None, ['policies=[{"name": "r1", "lora": {"r": 1}}, {"name": "r16", "lora": {"r": 16}}]'])
    group = GroupSession.open(cfg)          # session/group.py: one run dir per policy, one engine
    group.trainer.step()                    # every policy's rollouts as one engine batch, then K updates

A policy group is K GRPO trainers (grpo.py), each with its own policy, optimizer, refresher and run dir,
sharing the engine (each adapter under its policy's name; a step's requests as one batch) and one PEFT
model holding the K adapters (policy.Policy `beside`). What a policy may set for itself is in OWNED.
"""
from __future__ import annotations

import contextlib
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .clock import synced_time
from .engines.base import generate_each
from .grpo import SampledAhead, finish
from .interrupts import interrupts_to_the_main_thread, wait_interruptibly
from .metrics import REWARD
from .rollout import rollouts_of
from .rundir import GROUP_FILE
from .settings import ConfigError, build, check_types, closest, path_component_problem, to_dict, unique_keys, walk_class

# what a policy of a group may set for itself: section -> fields (None: every field of the section)
OWNED: dict[str, tuple[str, ...] | None] = {
    "lora": None,
    "grpo": ("lr", "clip_eps", "kl_beta", "reward_mode", "format_bonus", "max_grad_norm", "max_delta_ratio", "epochs"),
}
_WHY_SHARED = {"run": "the run's schedule and seed; run.seed also seeds the demo model's build, which they share",
               "grpo": "it shapes the shared rollout batch, the shared model's compilation or the step count",
               "engine": "the engine is shared (each policy's adapter is served under the policy's name)"}


@dataclass
class PolicySpec:
    """One entry of the run config's `policies` list: a name and the fields it sets for itself."""
    name: str
    overrides: dict[str, dict] = field(default_factory=dict)   # {"lora": {"r": 1}, "grpo": {"lr": 0.003}}, typed
    where: str = field(default="", compare=False, repr=False)  # "FILE: policies[1]", for errors found later

    def to_dict(self) -> dict:
        return {"name": self.name, **copy.deepcopy(self.overrides)}

    def sets(self, key: str) -> bool:
        """Whether this policy sets the dotted field `key` itself (else the group's value holds)."""
        section, _, name = key.partition(".")
        return name in self.overrides.get(section, {})

    def label(self) -> str:
        """'r1: lora.r=1, grpo.lr=0.003'."""
        parts = [f"{s}.{k}={v}" for s, fields in self.overrides.items() for k, v in fields.items()]
        return f"{self.name}: {', '.join(parts) or 'the shared settings'}"


def parse_policies(entries, source: str, sections: dict, from_file: bool = False) -> list[PolicySpec]:
    """The `policies` list of a config, each entry checked: a unique name usable as a dir name, and only fields
    a policy may own, typed as outside `policies` (read from JSON or TOML, `from_file`: already of that type)."""
    if entries in (None, []):
        return []
    if isinstance(entries, str):
        import json
        from_file = True
        try:
            entries = json.loads(entries, object_pairs_hook=unique_keys)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{source}: policies={entries!r:.80} is not JSON ({err}); write a list of tables, e.g. "
                              f'policies=[{{"name": "r1", "lora": {{"r": 1}}}}]') from err
        except ConfigError as err:   # a key twice: json would keep the last one silently
            raise ConfigError(f"{source}: policies: {err}") from err
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ConfigError(f"{source}: policies must be a list of tables, e.g. policies = [{{name = \"r1\", "
                          f"lora.r = 1}}, {{name = \"r16\", lora.r = 16}}] in TOML; got {entries!r:.80}")
    if from_file:
        check_policy_types(entries, source, sections)
    specs, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{source}: policies[{i}]"
        name = entry.get("name")
        if name is None:
            raise ConfigError(f"{where} has no name; give each policy one, e.g. name = \"r{i + 1}\"")
        if not isinstance(name, str):
            raise ConfigError(f"{where}: name {name!r} is not a string; write it as text, e.g. name = \"r{i + 1}\"")
        problem = path_component_problem(name) or ("is the group dir's own file" if name == GROUP_FILE else None)
        if problem:
            raise ConfigError(f"{where}: name {name!r} {problem}; it names the policy's run dir and adapter")
        if name in seen:
            raise ConfigError(f"{where}: two policies are named {name!r}; give each its own name")
        seen.add(name)
        overrides = {section: _owned_fields(f"{where} ({name})", section, values, sections)
                     for section, values in entry.items() if section != "name"}
        specs.append(PolicySpec(name, overrides, where))
    return specs


def check_policy_types(entries, source: str, sections: dict) -> None:
    """Each value of a policy entry read from JSON or TOML has its field's type (settings.check_types)."""
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        for name, values in entry.items() if isinstance(entry, dict) else ():
            if name in sections:
                check_types(sections[name], values, f"{source}: policies[{i}].{name}")


def _owned_fields(where: str, section: str, values, sections: dict) -> dict:
    if section not in OWNED:
        if section not in sections:
            near = closest(section, list(OWNED))
            raise ConfigError(f"{where}: unknown key {section!r}{f' (did you mean {near!r}?)' if near else ''}; a "
                              f"policy may set {_owned_names()}")
        why = f" ({_WHY_SHARED[section]})" if section in _WHY_SHARED else ""
        raise ConfigError(f"{where}: {section}.* is shared by all policies of a run{why}; set it outside "
                          f"`policies`. A policy may set {_owned_names()}")
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: {section} must be a table of fields, e.g. {section}.r = 4; got {values!r:.60}")
    known = [name for name, _ in walk_class(sections[section], section)]
    allowed = OWNED[section]
    for key in values:
        dotted = f"{section}.{key}"
        if dotted not in known:
            near = closest(dotted, known)
            raise ConfigError(f"{where}: unknown field {dotted}{f' (did you mean {near}?)' if near else ''}")
        if allowed is not None and key not in allowed:
            raise ConfigError(f"{where}: {dotted} is shared by all policies of a run ({_WHY_SHARED[section]}); set it "
                              f"outside `policies`. A policy may set {_owned_names()}")
    typed = to_dict(build(sections[section], values, f"{where}: {section}", section))   # the top level's types
    return {key: typed[key] for key in values}


def _owned_names() -> str:
    return ", ".join(f"{s}.*" if fields is None else ", ".join(f"{s}.{f}" for f in fields)
                     for s, fields in OWNED.items())


def member_dict(shared: dict, spec: PolicySpec) -> dict:
    """A policy's whole run config (as to_dict): the shared sections, its own fields on top, its adapter
    served under its name, no `policies`."""
    data = copy.deepcopy({k: v for k, v in shared.items() if k != "policies"})
    for section, values in spec.overrides.items():
        data.setdefault(section, {}).update(copy.deepcopy(values))
    data.setdefault("engine", {})["adapter_name"] = spec.name
    return data


def shared_differences(configs: dict[str, dict]) -> list[str]:
    """Shared fields that differ between the policies' flat configs: such a group cannot step together."""
    where = ("engine.adapter_name", "run.out_dir", "run.name")   # a policy's own, by its name and run dir
    flats = {name: {k: v for k, v in flat.items() if k not in where and not owned_key(k)}
             for name, flat in configs.items()}
    first_name, first = next(iter(flats.items()))
    found = []
    for name, flat in list(flats.items())[1:]:
        for key in sorted(set(first) | set(flat)):
            if first.get(key) != flat.get(key):
                found.append(f"{key}: {first.get(key)!r} in {first_name}, {flat.get(key)!r} in {name}")
    return found


def owned_key(key: str) -> bool:
    """Whether a policy may set the dotted field `key` for itself (OWNED)."""
    section, _, rest = key.partition(".")
    return section in OWNED and (OWNED[section] is None or rest in OWNED[section])


class PolicyGroup:
    """K policies' loop. `step()` samples every policy's rollouts in one engine batch, updates every policy,
    then refreshes, probes and commits each; with grpo.max_staleness the next batch is sampled meanwhile."""

    def __init__(self, trainers: dict, engine):
        self.trainers = trainers      # name -> GRPOTrainer, all on `engine`, their policies on one model
        self.engine = engine
        self.current = None           # the policy whose step is under way; after step() raised, the one that did
        stale = next(iter(trainers.values())).settings.max_staleness   # a shared setting
        self._sampler = ThreadPoolExecutor(1, "lorabench-group-rollouts", interrupts_to_the_main_thread) \
            if stale else None
        # the next steps' batch ({name: step}) on the sampler's thread; a refresh waits for its sampling only
        self._ahead: SampledAhead | None = None

    @property
    def step_count(self) -> int:
        """The step every policy has reached (policies resumed from different checkpoints may differ)."""
        return min(t.step_count for t in self.trainers.values())

    def step(self, names=None) -> dict:
        """One GRPO step of each policy in `names` (default: all): {name: StepRecord}. A failure rolls back every
        policy whose update was not yet published and is raised, naming the policy (`current`)."""
        names = list(self.trainers) if names is None else list(names)
        with contextlib.ExitStack() as stepping:
            for name in names:
                stepping.enter_context(self.trainers[name].stepping())
            rollouts, rollout_s = self._rollouts(names)
            return self._update_then_publish(names, rollouts, rollout_s)

    def _rollouts(self, names: list[str]) -> tuple[dict, float]:
        """{name: (Rollouts, scored or None)} of each policy's next step from one engine batch, and its time;
        with staleness, the batch of the step after is submitted."""
        steps = {name: self.trainers[name].step_count + 1 for name in names}
        t0 = synced_time()
        previous, self._ahead = self._ahead, None
        taken = previous and previous.take(steps)
        if taken is None:
            asked = {}
            for name in names:
                self.current = name
                asked[name] = self.trainers[name].rollout_request()
            self.current = None   # the shared batch: a failure there is no one policy's
            for name in names:
                self.trainers[name].serve_behind()
            served = self._sample(asked)
            for name in names:
                self.trainers[name].resend_if_stale()
            rollout_s = synced_time() - t0
            rollouts = {name: (self._rollouts_of(name, asked, served), None) for name in asked}
        else:
            rollouts, rollout_s = taken, synced_time() - t0
        ahead = {name: step + 1 for name, step in steps.items() if step < self.trainers[name].settings.steps}
        if self._sampler is not None and ahead:
            requests = {name: self.trainers[name].rollout_request(ahead=True) for name in ahead}
            sampled = self._sampler.submit(self._sample, requests)
            scoring = self._sampler.submit(lambda: self._scored(requests, sampled.result()))
            self._ahead = SampledAhead(ahead, sampled, scoring)
        return rollouts, rollout_s

    def _rollouts_of(self, name: str, asked: dict, served: dict):
        problems, request = asked[name]
        return rollouts_of(self.engine, self.trainers[name].tokenizer, problems, request, *served[name])

    def _scored(self, asked: dict, served: dict) -> dict:
        """{name: (Rollouts, (batch, reward means))}: each policy's rollouts scored and collated (on any thread)."""
        scored = {}
        for name in asked:
            rollouts = self._rollouts_of(name, asked, served)
            scored[name] = (rollouts, self.trainers[name].scored(rollouts))
        return scored

    def _sample(self, asked: dict) -> dict:
        """{name: (completions, the version that served them)}: the requests as one batch."""
        done = generate_each(self.engine, [request for _, request in asked.values()])
        return {name: (out, self.engine.served_version(request.adapter))
                for (name, (_, request)), out in zip(asked.items(), done)}

    def _update_then_publish(self, names: list[str], rollouts: dict, rollout_s: float) -> dict:
        started, records = [], {}
        try:
            for name in names:
                self.current = name
                phases = self.trainers[name].phases(*rollouts[name], rollout_s=rollout_s)
                next(phases)   # scored and updated
                started.append((name, phases))
            self.current = None
            if self._ahead is not None:   # sampled from the adapters the engine serves now: the refreshes wait
                wait_interruptibly(self._ahead.sampling.exception)
            with contextlib.ExitStack() as held:   # every policy refreshed and probed before any commit is written
                for name, _ in started:
                    held.enter_context(self.trainers[name].commits_held())
                while started:
                    self.current = started[0][0]
                    records[self.current] = finish(started[0][1], waited=True)   # refreshed, probed, committed
                    started.pop(0)
        finally:
            for _, phases in started:   # updated, not published: rolled back
                phases.close()
        self.current = None
        return records

    def run(self, n: int | None = None, progress: bool = True) -> list[dict]:
        """Steps until `n` more have run (default: until every policy reaches its grpo.steps)."""
        from tqdm.auto import tqdm
        target = {name: (t.settings.steps if n is None else t.step_count + n) for name, t in self.trainers.items()}
        total = max(target[name] - t.step_count for name, t in self.trainers.items())
        done = []
        bar = tqdm(range(max(0, total)), desc=f"GRPO x{len(self.trainers)}", disable=not progress)
        for _ in bar:
            due = [name for name, t in self.trainers.items() if t.step_count < target[name]]
            records = self.step(due)
            done.append(records)
            bar.set_postfix({name: f"{r.metrics[REWARD]:.2f}" for name, r in records.items()})
        self.wait_committed()
        return done

    def evaluate(self, greedy: bool = False) -> dict:
        """{name: held-out evaluation}."""
        return {name: t.evaluate(greedy=greedy) for name, t in self.trainers.items()}

    def wait_committed(self) -> None:
        for trainer in self.trainers.values():
            trainer.wait_committed()

    def close(self) -> None:
        """A batch sampled ahead waited for, then each trainer closed (not the engine), also when one raises."""
        with contextlib.ExitStack() as closing:
            for trainer in self.trainers.values():
                closing.callback(trainer.close)
            if self._sampler is not None:
                closing.callback(self._sampler.shutdown)
            if self._ahead is not None:
                self._ahead.drop()
                self._ahead = None
