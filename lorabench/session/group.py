"""A policy group opened the way `lorabench run` opens it (group.py says what a group is).

    session = GroupSession.open(cfg, run_dir="runs/ranks")   # cfg.policies names K policies
    session.trainer.step()                                    # {name: StepRecord}, one engine batch
    session.close()

The group's dir holds `group.json` (the policies and what each sets, written once) and one ordinary run
dir per policy, `GROUP/<name>`, resumable alone or with the others (`lorabench resume GROUP`).
"""
from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..group import PolicyGroup, owned_key, parse_policies, shared_differences
from ..rundir import CONFIG, GROUP_FILE, RunDirError
from ..safedir import SafeDir, refusal
from ..settings import unique_keys
from .compat import effective_config, resume_config
from .config import SECTIONS, Config, ConfigError, flat
from .run import RunSession, _SessionLifecycle, checked_model, close_built, engine_and_trainers, plan_run


@dataclass
class GroupSession(_SessionLifecycle):   # resume_command, close_engine, close
    cfg: Config                     # the group's config: the shared sections and `policies`
    members: dict[str, RunSession]  # name -> the policy's session (its runlog, trainer; the engine is shared)
    engine: object
    trainer: object                 # group.PolicyGroup
    run_dir: Path
    model_path: str
    model_seconds: float = 0.0
    before: dict = field(default_factory=dict)   # name -> step-0 held-out evals [sampled, greedy]

    @classmethod
    def open(cls, cfg: Config, run_dir: str | Path | None = None, log=print, evaluate_first: bool = True):
        """A new group in `run_dir` (or run.out_dir/run.name, or a timestamped dir), or the one there, continued."""
        if not cfg.policies:
            raise ConfigError("GroupSession needs a config with policies (a policy group); a single policy is a "
                              "RunSession")
        name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S") + "-group"
        return cls._open(cfg, cfg.members(), Path(run_dir or Path(cfg.run.out_dir) / name), log, evaluate_first)

    @classmethod
    def resume(cls, group_dir: str | Path, overrides: list[str] = (), log=print, evaluate_first: bool = True):
        """The group in `group_dir`, each policy continued from its run dir's effective config plus `overrides`
        and served under its name; refused before anything is written."""
        root = Path(group_dir)
        for item in overrides:
            if item.partition("=")[0].strip() == "engine.adapter_name":
                raise ConfigError(f"override {item!r}: in a policy group each policy's adapter is served under the "
                                  f"policy's name; to serve one under another, resume it alone (lorabench resume "
                                  f"{root}/NAME {item})")
        specs = read_group(root)
        check_group_dir(root, [spec.name for spec in specs])   # its entries; group.json against each config.json
        for spec in specs:
            if not os.path.lexists(root / spec.name):
                raise RunDirError(f"{root / GROUP_FILE} names policy {spec.name!r}, but {root} has no dir {spec.name} "
                                  f"(moved, or the group stopped while it made its dirs); nothing was changed. Put it "
                                  f"back (the `lorabench run` command that made the group makes it again), or resume "
                                  f"the other policies alone (lorabench resume {root}/NAME)")
        # served under its name, as when the group was made (a policy resumed alone may have been renamed)
        members = {spec.name: resume_config(root / spec.name, [*overrides, f"engine.adapter_name={spec.name}"])
                   for spec in specs}
        shared = members[specs[0].name].to_dict()
        # a field a policy leaves to the group takes that policy's value, so cfg.members() are their own configs
        for key in filter(owned_key, flat(members[specs[0].name])):
            if leaving := [spec.name for spec in specs if not spec.sets(key)]:
                section, name = key.split(".")
                shared[section][name] = getattr(getattr(members[leaving[0]], section), name)
        cfg = Config.from_dict({**shared, "policies": [s.to_dict() for s in specs]}, source=str(root / GROUP_FILE))
        return cls._open(cfg, members, root, log, evaluate_first)

    @classmethod
    def _open(cls, cfg: Config, members: dict[str, Config], root: Path, log, evaluate_first: bool):
        if differ := shared_differences({name: flat(m) for name, m in members.items()}):
            raise ConfigError(f"the policies of {root} differ in settings they share: {'; '.join(differ[:4])}; "
                              f"a group steps with one batch, engine and model: continue each policy alone "
                              f"(lorabench resume {root}/NAME) or give them the same values")
        existing = check_group_dir(root, list(members))
        plans = {name: plan_run(m, root / name) for name, m in members.items()}
        model_path, model_seconds, fingerprints = checked_model(plans, members, evaluate_first, log)
        if not existing:
            write_group(root, cfg)
        runlogs, built, session = {}, None, None
        try:
            for name, plan in plans.items():
                runlogs[name] = plan.open(members[name], fingerprints[name], log)
            log(f"one {cfg.engine.backend} engine for {len(members)} policies: "
                + "; ".join(spec.label() for spec in cfg.policies))
            engine, trainers = built = engine_and_trainers(cfg, members, runlogs, model_path, log)
            sessions = {name: RunSession(member, runlogs[name], engine, trainers[name], model_path, model_seconds)
                        for name, member in members.items()}
            session = cls(cfg, sessions, engine, PolicyGroup(trainers, engine), root, model_path, model_seconds)
            for name, plan in plans.items():   # once every policy's checkpoint is loaded and checked
                plan.record_changes(runlogs[name], log)
            if evaluate_first:
                session.evaluate_before()
        except BaseException:   # as a single run's open: what was built closed, each lock file as it was found
            try:
                if session is not None:
                    session.close_engine()   # the group's sampler too
                elif built is not None:
                    close_built(*built)
            finally:
                for runlog in runlogs.values():
                    runlog.close(refused=True)
            raise
        return session

    def evaluate_before(self) -> dict:
        self.before = {name: member.evaluate_before() for name, member in self.members.items()}
        return self.before

    def metrics(self) -> dict[str, list[dict]]:
        """{name: the rows of its metrics.jsonl}, once every step so far is written."""
        return {name: member.metrics() for name, member in self.members.items()}

    def _release_run_dirs(self) -> None:
        for member in self.members.values():
            member.runlog.close()


def check_group_dir(root: Path, names: list[str]) -> bool:
    """Whether `root` holds this group (True) or is free for it (False: absent or empty); else refused."""
    if not os.path.lexists(root):
        return False
    if os.path.islink(root):   # entered only through itself, as a run dir is
        raise refusal(root, os.lstat(root), "dir", is_root=True)
    if not root.is_dir():
        raise RunDirError(f"{root} is not a directory; a policy group is made in a directory of its own: choose "
                          f"another run.name or run.out_dir")
    entries = sorted(os.listdir(root))
    if links := [e for e in entries if e != GROUP_FILE and os.path.islink(root / e)]:
        raise RunDirError(f"{root} holds links {links[:5]}; a policy group's dir holds {GROUP_FILE} and one run dir "
                          f"per policy only: choose another run.name or run.out_dir")
    if not entries:
        return False
    if GROUP_FILE not in entries:
        raise RunDirError(f"{root} holds {entries[:5]} but no {GROUP_FILE}: it is not a policy group lorabench made; "
                          f"choose another run.name or run.out_dir")
    specs = read_group(root)   # refuses a link or an unreadable file
    recorded = [spec.name for spec in specs]
    if recorded != list(names):
        raise RunDirError(f"{root} is a policy group of {recorded}, not {list(names)}: continue it with its own "
                          f"policies (lorabench resume {root}), or choose another run.name for a new group")
    if odd := [e for e in entries if e != GROUP_FILE and e not in names]:
        raise RunDirError(f"{root} holds {odd[:5]}, which are not the dirs of the policies its {GROUP_FILE} names "
                          f"{names}; a policy group's dir holds {GROUP_FILE} and one run dir per policy only: move "
                          f"them out, or choose another run.name or run.out_dir")
    check_recorded(root, specs)
    return True


def check_recorded(root: Path, specs: list) -> None:
    """group.json must describe the policies' config.json files: a field a policy sets has that value there, one
    it leaves to the group that of every other policy leaving it; each dir serves its own policy."""
    path = root / GROUP_FILE
    configs = {spec.name: flat(effective_config(root / spec.name, changes=False))
               for spec in specs if os.path.lexists(root / spec.name / CONFIG)}
    left = {}   # a field some policies leave to the group -> (the first of them, its value)
    for i, spec in enumerate(specs):
        has, file = configs.get(spec.name), root / spec.name / CONFIG
        if has is None:
            continue
        if has["engine.adapter_name"] != spec.name:
            raise RunDirError(f"{file} has engine.adapter_name={has['engine.adapter_name']!r}, but {path} names that "
                              f"dir's policy {spec.name!r}: the dir holds another policy's run (renamed or copied?); "
                              f"nothing was changed. Put the policies' dirs back under their names, or resume that "
                              f"dir alone (lorabench resume {root / spec.name})")
        for key in (k for k in has if owned_key(k)):
            if spec.sets(key):
                said = spec.overrides[key.split(".")[0]][key.split(".")[1]]
                if json.dumps(has[key]) != json.dumps(said):
                    raise RunDirError(f"{path} has {key}={said!r} for policy {spec.name!r}, but {file} has "
                                      f"{key}={has[key]!r} (was {GROUP_FILE} edited?); nothing was changed. Put "
                                      f"policies[{i}].{key} back to {json.dumps(has[key])} in {path}, or resume "
                                      f"that policy alone (lorabench resume {root / spec.name})")
                continue
            first, value = left.setdefault(key, (spec.name, has[key]))
            if json.dumps(has[key]) != json.dumps(value):
                raise RunDirError(f"{path} sets no {key} for policies {first!r} and {spec.name!r} (they take the "
                                  f"group's value), but {root / first / CONFIG} has {key}={value!r} and {file} has "
                                  f"{key}={has[key]!r} (was {GROUP_FILE} edited?); nothing was changed. Give each "
                                  f"its {key} in {path}, or resume each policy alone (lorabench resume {root}/NAME)")


def read_group(root: Path) -> list:
    """The policies `root/group.json` (a regular file, not a link) names."""
    path = root / GROUP_FILE
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise RunDirError(f"{root} has no {GROUP_FILE}: it is not a policy group (a single run dir is resumed as "
                          f"lorabench resume RUN_DIR)") from None
    if not stat.S_ISREG(info.st_mode):
        raise RunDirError(f"{path} is not a regular file (a link?); a policy group's {GROUP_FILE} is a file lorabench "
                          f"wrote: restore it, or resume each policy's run dir alone")
    if info.st_size > 1 << 20:   # it is read whole: a sparse file costs its sender nothing, the reader its memory
        raise RunDirError(f"{path} is {info.st_size:,} bytes; the {GROUP_FILE} lorabench writes holds a few lines per "
                          f"policy (is it this group's file?); nothing was changed: restore it, or resume each "
                          f"policy's run dir alone (lorabench resume {root}/NAME)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        if not isinstance(data, dict) or set(data) != {"policies"}:   # what write_group writes, and nothing else
            found = f"keys {sorted(data)}" if isinstance(data, dict) else f"a {type(data).__name__}"
            raise ConfigError(f"it holds {found}, not an object with the one key 'policies'")
        if not isinstance(data["policies"], list) or not data["policies"]:
            raise ConfigError(f"'policies' is {data['policies']!r:.60}, not the non-empty list lorabench writes")
        return parse_policies(data["policies"], str(path), SECTIONS, from_file=True)
    except (UnicodeDecodeError, json.JSONDecodeError, ConfigError) as err:
        raise RunDirError(f"{path} cannot be read as a policy group ({err}); nothing was changed: restore it, or "
                          f"resume each policy's run dir alone (lorabench resume {root}/NAME)") from err


def write_group(root: Path, cfg: Config) -> None:
    """group.json, once, atomically, through the dir's own fd (made if needed)."""
    with SafeDir.open(root, create=True) as group_dir:
        group_dir.write_atomic(GROUP_FILE, json.dumps({"policies": [p.to_dict() for p in cfg.policies]},
                                                      indent=1).encode(), exclusive=True)
