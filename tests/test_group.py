"""Policy groups (group.py, session/group.py): the `policies` config, K policies on one engine and
one base model, each policy's rows equal to the same policy run alone, every rollout checked
against its own policy, the group dir's refusals (through the CLI: exit 2, one line, nothing
written), and resume together or alone."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reliability_util import refused, tree_state

from lorabench.cli import main
from lorabench.engines import StaleAdapter
from lorabench.engines.base import generate_each
from lorabench.rollout import rollouts_of
from lorabench.runlog import RunDirError, read_jsonl
from lorabench.session import Config, ConfigError, GroupSession, RunSession, resolve_model

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["grpo.prompts_per_step=2", "grpo.group_size=2", "grpo.max_new_tokens=4", "data.eval_size=2",
         "run.threads=1"]
QUIET = dict(log=lambda *a: None)


def policies(*entries: dict) -> str:
    return "policies=" + json.dumps(list(entries))


def group_cfg(model, out, name, *extra, ranks=(2, 8)) -> Config:
    return Config.load(None, [policies(*({"name": f"r{r}", "lora": {"r": r, "alpha": 2 * r}} for r in ranks)),
                              f"model.name_or_path={model}", f"run.out_dir={out}", f"run.name={name}",
                              f"refresh.file.tmp_dir={out}", *extra])


# --- the config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("entries, words", [
    ([{"name": "a", "grpo": {"steps": 3}}], "grpo.steps is shared by all policies"),
    ([{"name": "a", "lora": {"rank": 3}}], "did you mean lora.r"),
    ([{"name": "a/b"}], "is a path, not a name"),
    ([{"name": "a"}, {"name": "a"}], "two policies are named 'a'"),
    ([{"lora": {"r": 2}}], "has no name"),
    ([{"name": "a", "lora": {"r": 0}}], "policies[0] (a): lora.r=0"),
    ([{"name": "a", "engine": {"backend": "sglang"}}], "engine.* is shared"),
    # a shared section without a reason of its own: the line names it and the fields a policy may set
    ([{"name": "a", "refresh": {"mode": "tensor"}}], "refresh.* is shared by all policies of a run; set it outside "
                                                     "`policies`. A policy may set lora.*, grpo.lr"),
])
def test_a_policy_may_set_only_its_own_fields_and_bad_entries_say_which(entries, words):
    with pytest.raises(ConfigError, match="policies") as err:
        Config.load(None, [policies(*entries)])
    assert words in str(err.value)


def test_a_merged_refresh_is_refused_for_a_group():
    with pytest.raises(ConfigError, match="refresh.mode=merged with policies"):
        Config.load(None, [policies({"name": "a"}, {"name": "b"}), "refresh.mode=merged"])


def test_each_policy_is_a_whole_run_config_and_the_engine_has_room_for_all():
    from lorabench.session.config import engine_needs
    cfg = Config.load(None, [policies({"name": "r1", "lora": {"r": 1, "target_modules": ["q_proj"]}},
                                      {"name": "r8", "lora": {"r": 8, "target_modules": ["v_proj"]},
                                       "grpo": {"lr": 0.003}})])
    members = cfg.members()
    assert {n: (m.lora.r, m.grpo.lr, m.engine.adapter_name, m.policies) for n, m in members.items()} == {
        "r1": (1, 0.001, "r1", []), "r8": (8, 0.003, "r8", [])}
    needs = engine_needs(cfg)
    assert (needs.lora_rank, needs.target_modules, needs.adapters) == (8, ("q_proj", "v_proj"), 2)
    assert needs.largest_batch >= 2 * cfg.grpo.prompts_per_step * cfg.grpo.group_size
    again = Config.from_dict(json.loads(json.dumps(cfg.to_dict())))   # group.json's round trip
    assert again.to_dict() == cfg.to_dict()


# --- the group dir: a fortress like a run dir ------------------------------------------------------
def test_the_group_dir_refuses_links_strangers_and_other_policies(tiny_model_dir, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "linked").symlink_to(target)
    with pytest.raises(RunDirError, match="is a symbolic link"):
        GroupSession.open(group_cfg(tiny_model_dir, tmp_path, "linked", *SMALL), **QUIET)
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="notes.txt"):
        GroupSession.open(group_cfg(tiny_model_dir, tmp_path, "stranger", *SMALL), **QUIET)
    assert sorted(os.listdir(stranger)) == ["notes.txt"] and os.listdir(target) == []
    made = GroupSession.open(group_cfg(tiny_model_dir, tmp_path, "g", *SMALL, "grpo.steps=1"), **QUIET)
    made.close()
    with pytest.raises(RunDirError, match=r"a policy group of \['r2', 'r8'\]"):
        GroupSession.open(group_cfg(tiny_model_dir, tmp_path, "g", *SMALL, ranks=(2, 4)), **QUIET)
    (tmp_path / "g" / "group.json").unlink()
    (tmp_path / "g" / "group.json").symlink_to(target)
    with pytest.raises(RunDirError, match="link"):
        GroupSession.resume(tmp_path / "g", **QUIET)


def test_group_json_is_written_through_the_dir_not_a_link_swapped_in_after_the_check(tiny_model_dir, tmp_path):
    """The window between check_group_dir and write_group: a group dir replaced by a link to another dir, or a
    group.json put there meanwhile, is refused and nothing is written through it."""
    from lorabench.session.group import write_group
    cfg = group_cfg(tiny_model_dir, tmp_path, "g", *SMALL)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "g").symlink_to(target)   # what a swap after the check would leave
    with pytest.raises(RunDirError, match="is a symbolic link"):
        write_group(tmp_path / "g", cfg)
    assert os.listdir(target) == []
    (tmp_path / "g").unlink()
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "group.json").write_text("theirs")
    with pytest.raises(RunDirError, match="written once"):
        write_group(tmp_path / "g", cfg)
    assert (tmp_path / "g" / "group.json").read_text() == "theirs"
    (tmp_path / "g" / "group.json").unlink()
    write_group(tmp_path / "g", cfg)
    assert [p["name"] for p in json.loads((tmp_path / "g" / "group.json").read_text())["policies"]] == ["r2", "r8"]


# --- the group dir as strict as a run dir, through the CLI ------------------------------------------
# Each case: exit 2, one 'lorabench: ...' line naming the culprit, no traceback (reliability_util.refused), and
# nothing written: no run.out_dir for a bad config, the group dir unchanged (tree_state) for a refused resume.
RANKS = ({"name": "r2", "lora": {"r": 2}}, {"name": "r16"})   # r16 leaves lora.r to the group (16, the default)


def cli_run(model, out, entries, *extra) -> list[str]:
    """`lorabench run` of a group `out/g` on the tiny model, two steps."""
    listed = entries if isinstance(entries, str) else json.dumps(list(entries))
    return ["run", f"policies={listed}", f"model.name_or_path={model}", f"run.out_dir={out}", "run.name=g",
            f"refresh.file.tmp_dir={out}", "grpo.steps=2", *SMALL, *extra]


@pytest.fixture(scope="module")
def finished_group(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("group")
    assert main(cli_run(tiny_model_dir, out, RANKS)) == 0
    return out / "g"


@pytest.fixture
def group_dir(finished_group, tmp_path) -> Path:
    copy = tmp_path / "g"
    shutil.copytree(finished_group, copy, symlinks=True)
    return copy


@pytest.mark.parametrize("key, value", [("lora.r", "16"), ("lora.r", 16.0), ("lora.r", "abc"), ("lora.r", 2.5),
                                        ("lora.r", True), ("grpo.lr", "3e-4"), ("grpo.lr", "fast"),
                                        ("lora.target_modules", "q_proj,v_proj")])
def test_a_policy_field_is_read_as_the_same_field_outside_policies(key, value):
    """{"lora": {"r": "16"}} in a policy was kept as the string "16" (group.json recorded it so) and
    converted only where the policy's config was built; a wrong type was named twice over. A policy's
    field is now converted, or refused, by the code that reads the same field outside `policies`."""
    section, name = key.split(".")

    def outcome(data):
        try:
            return Config.from_dict(data)
        except ConfigError as err:
            return err
    alone = outcome({section: {name: value}})
    grouped = outcome({"policies": [{"name": "a", section: {name: value}}]})
    if isinstance(alone, ConfigError):
        assert isinstance(grouped, ConfigError), grouped.policies
        assert f"config: policies[0] (a): {key}: {value!r}" in str(grouped)
        assert str(grouped).split(f"{key}: ")[1] == str(alone).split(f"{key}: ")[1]   # the same words
    else:
        typed = getattr(getattr(alone, section), name)
        assert json.dumps(grouped.policies[0].overrides) == json.dumps({section: {name: typed}})   # group.json's
        assert getattr(getattr(grouped.members()["a"], section), name) == typed


@pytest.mark.parametrize("entries, words", [
    ('[{"name": "a", "lora": {"r": "abc"}}]', "policies[0].lora.r: 'abc' is a string (in quotes)"),
    ('[{"name": "a", "lora": {"r": "16"}}]',   # was run as r=16, where a config file refuses the same JSON
     "policies[0].lora.r: '16' is a string (in quotes), not a whole number; write one without quotes"),
    ('[{"name": "a", "lora": {"r": 16.0}}]', "policies[0].lora.r: 16.0 is a float, not a whole number"),
    ('[{"name": "a", "grpo": {"lr": "3e-4"}}]', "policies[0].grpo.lr: '3e-4' is a string (in quotes), not a number"),
    ('[{"name": "a"}, {"name": "b", "lora": {"r": 0}}]', "policies[1] (b): lora.r=0: the LoRA rank"),
    ('[{"name": "a", "grpo": {"lr": Infinity}}]', "policies[0] (a): grpo.lr=inf: must be a finite number"),
    ('[{"name": 5}]', "policies[0]: name 5 is not a string"),
    ('[{"name": "group.json"}, {"name": "b"}]', "name 'group.json' is the group dir's own file"),
    ('[{"name": "a", "lora": {"r": 1}, "lora": {"r": 16}}]', "policies: key 'lora' appears twice"),
    ('[{"name": "a", "name": "b"}]', "key 'name' appears twice in one table"),
])
def test_a_bad_policy_entry_is_one_line_before_anything_exists(tiny_model_dir, tmp_path, capsys, entries, words):
    """A policy named group.json used to get as far as writing group.json, then fail on the dir; a key
    given twice in an entry was dropped unseen (json keeps the last)."""
    line = refused(capsys, *cli_run(tiny_model_dir, tmp_path / "out", entries))
    assert words in line, line
    assert not (tmp_path / "out").exists()


def test_a_key_twice_in_a_json_config_file(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "policies.json"
    path.write_text('{"policies": [{"name": "a", "lora": {"r": 1}, "lora": {"r": 16}}]}')
    line = refused(capsys, "run", "--config", path, *cli_run(tiny_model_dir, tmp_path / "out", RANKS)[2:])
    assert f"config file {path}: policies" in line and "lora is given twice" in line, line
    assert not (tmp_path / "out").exists()


def _rewrite(edit):
    """A group.json edit: `edit(data)` returns the new data, or the new text as a string."""
    def apply(group: Path) -> None:
        data = edit(json.loads((group / "group.json").read_text()))
        (group / "group.json").write_text(data if isinstance(data, str) else json.dumps(data))
    return apply


def _set(data, i, section, key, value):
    data["policies"][i][section][key] = value
    return data


def _swap_dirs(group: Path) -> None:
    os.rename(group / "r2", group / "tmp")
    os.rename(group / "r16", group / "r2")
    os.rename(group / "tmp", group / "r16")


@pytest.mark.parametrize("change, words", [
    (_rewrite(lambda d: _set(d, 0, "lora", "r", 4)),   # resumed with exit 0, training r=2 while the log said r=4
     "G/group.json has lora.r=4 for policy 'r2', but G/r2/config.json has lora.r=2 (was group.json edited?); "
     "nothing was changed. Put policies[0].lora.r back to 2 in G/group.json, or resume that policy alone"),
    (_rewrite(lambda d: {"policies": [{"name": p["name"]} for p in d["policies"]]}),
     "G/group.json sets no lora.r for policies 'r2' and 'r16' (they take the group's value), but G/r2/config.json "
     "has lora.r=2 and G/r16/config.json has lora.r=16"),
    (_rewrite(lambda d: {"policies": [d["policies"][0], {"name": "r16", "lora": {"r": 8}}]}),
     "G/group.json has lora.r=8 for policy 'r16', but G/r16/config.json has lora.r=16"),
    (_rewrite(lambda d: _set(d, 0, "lora", "r", "abc")),
     "G/group.json cannot be read as a policy group (G/group.json: policies[0].lora.r: 'abc' is a string (in quotes)"),
    (_rewrite(lambda d: _set(d, 0, "lora", "r", "2")),   # its run dir's own rank, as text: was read as 2
     "G/group.json: policies[0].lora.r: '2' is a string (in quotes), not a whole number"),
    (_rewrite(lambda d: d["policies"]), "(it holds a list, not an object with the one key 'policies')"),
    (_rewrite(lambda d: {**d, "note": "mine"}), "(it holds keys ['note', 'policies'], not an object with the one"),
    (_rewrite(lambda d: {"policies": []}), "('policies' is [], not the non-empty list"),   # was a traceback
    (_rewrite(lambda d: '{"policies": [{"name": "r2"}, {"name": "r16"}], "policies": []}'),
     "G/group.json cannot be read as a policy group (key 'policies' appears twice in one table"),
    (_rewrite(lambda d: {"policies": [*d["policies"], {"name": "r4", "lora": {"r": 4}}]}),
     "G/group.json names policy 'r4', but G has no dir r4 (moved, or the group stopped while it made its dirs)"),
    (lambda g: shutil.rmtree(g / "r16"), "G/group.json names policy 'r16', but G has no dir r16"),
    (lambda g: os.truncate(g / "group.json", 10**12),      # sparse: read whole, it would exhaust the memory
     "G/group.json is 1,000,000,000,000 bytes; the group.json lorabench writes holds a few lines per policy"),
    (_rewrite(lambda d: {"policies": d["policies"][:1]}),
     "G holds ['r16'], which are not the dirs of the policies its group.json names ['r2']"),
    (_swap_dirs, "G/r2/config.json has engine.adapter_name='r16', but G/group.json names that dir's policy 'r2': "
                 "the dir holds another policy's run"),
])
def test_resume_refuses_a_group_json_that_is_not_its_run_dirs(group_dir, capsys, change, words):
    change(group_dir)
    before = tree_state(group_dir)
    line = refused(capsys, "resume", group_dir)
    assert words.replace("G/", f"{group_dir}/").replace("G ", f"{group_dir} ") in line, line
    assert tree_state(group_dir) == before


def test_run_naming_a_group_refuses_a_group_json_that_is_not_its_run_dirs(group_dir, tiny_model_dir, capsys):
    """`lorabench run` naming the group continues it: the same check as resume, before anything is written."""
    _rewrite(lambda d: _set(d, 0, "lora", "r", 4))(group_dir)
    before = tree_state(group_dir)
    line = refused(capsys, *cli_run(tiny_model_dir, group_dir.parent, RANKS))
    assert f"{group_dir}/group.json has lora.r=4 for policy 'r2', but {group_dir}/r2/config.json has lora.r=2" in line
    assert tree_state(group_dir) == before


@pytest.mark.parametrize("overrides, words", [
    (["lora.r=4"], "G/r2 cannot continue with a changed lora.r 2 -> 4 (it defines the adapter's shape"),
    (['policies=[{"name": "r2", "lora": {"r": 4}}]'], "a continued run keeps its policies"),   # resumed, exit 0
    (["engine.adapter_name=x", "grpo.steps=3"],   # both policies served as 'x': the run died at its next step
     "override 'engine.adapter_name=x': in a policy group each policy's adapter is served under the policy's name"),
])
def test_resume_refuses_an_override_a_group_cannot_take(group_dir, capsys, overrides, words):
    before = tree_state(group_dir)
    line = refused(capsys, "resume", group_dir, *overrides)
    assert words.replace("G/", f"{group_dir}/") in line, line
    assert tree_state(group_dir) == before


def test_resume_of_a_group_without_its_group_json_names_what_it_holds(group_dir, capsys):
    """Without group.json the group's dir was told it "is not a lorabench run dir: it has no config.json"."""
    (group_dir / "group.json").unlink()
    before = tree_state(group_dir)
    line = refused(capsys, "resume", group_dir)
    assert (f"{group_dir} is not a run dir: it has no config.json but holds the run dirs ['r16', 'r2'] (the runs' "
            f"parent dir, or a policy group whose group.json is gone); nothing was changed. Resume one of them "
            f"(lorabench resume {group_dir}/r16)") in line, line
    assert tree_state(group_dir) == before


def test_resume_through_a_link_to_a_group_names_its_real_path(group_dir, capsys):
    """A link to a group was refused with "choose another run.name or run.out_dir", a new run's fix."""
    link = group_dir.parent / "link"
    link.symlink_to(group_dir.name)
    before = tree_state(group_dir)
    line = refused(capsys, "resume", link)
    assert f"{link} is a symbolic link (to g), not a run directory" in line and f"realpath {link}" in line, line
    assert tree_state(group_dir) == before and os.readlink(link) == "g"


def test_resume_of_one_policy_refuses_policies(group_dir, capsys):
    """A single run resumed with `policies=...` was told its run dir "is not a policy group lorabench made"."""
    before = tree_state(group_dir)
    line = refused(capsys, "resume", group_dir / "r2", 'policies=[{"name": "a"}]')
    assert "override policies=[{\"name\": \"a\"}]: a continued run keeps its policies" in line, line
    assert tree_state(group_dir) == before


def test_a_policy_refused_at_its_checkpoint_leaves_the_others_unrepaired(group_dir, capsys):
    """r2 needs repairs (a torn last metrics row, its adapter export gone) and r16's checkpointed adapter
    is past the divergence bound: r2's repairs were written (its metrics.jsonl cut, its adapter exported
    again) before r16's checkpoint was checked, under a refusal saying "nothing was changed". With r16's
    checkpoint put back, the group resumes and r2 is repaired then."""
    with open(group_dir / "r2" / "metrics.jsonl", "ab") as fh:
        fh.write(b'{"step": 3, "reward/me')   # a kill mid-append
    shutil.rmtree(group_dir / "r2" / "adapters" / "step_2")
    checkpoint = group_dir / "r16" / "checkpoint" / "trainer_state.pt"
    kept = checkpoint.read_bytes()
    state = torch.load(checkpoint, weights_only=True)
    noise = torch.randn(state["adapter_buffer"].shape, generator=torch.Generator().manual_seed(0))
    state["adapter_buffer"] = (noise * 10).to(state["adapter_buffer"].dtype)   # a diverged update's adapter
    torch.save(state, checkpoint)
    before = tree_state(group_dir)
    line = refused(capsys, "resume", group_dir)
    assert "policy 'r16': " in line and "the checkpoint's adapter (step 2) changes" in line, line
    assert "nothing was changed" in line, line
    assert tree_state(group_dir) == before
    checkpoint.write_bytes(kept)
    assert main(["resume", str(group_dir)]) == 0   # at its last step: checked, repaired, evaluated
    assert [r["step"] for r in read_jsonl(group_dir / "r2" / "metrics.jsonl")] == [1, 2]
    assert (group_dir / "r2" / "adapters" / "step_2" / "adapter_model.safetensors").is_file()


def test_a_policy_renamed_alone_is_served_under_its_name_in_the_group(group_dir):
    """`resume GROUP/NAME engine.adapter_name=x` is a single run's allowed change; resumed with the
    group, the policy is served under its name again (recorded in its config_changes.jsonl)."""
    assert main(["resume", str(group_dir / "r16"), "engine.adapter_name=x", "grpo.steps=3"]) == 0
    assert main(["resume", str(group_dir), "grpo.steps=4"]) == 0
    rows = read_jsonl(group_dir / "r16" / "config_changes.jsonl")
    assert [r["changes"].get("engine.adapter_name") for r in rows] == [["r16", "x"], ["x", "r16"]]
    assert [r["step"] for r in read_jsonl(group_dir / "r2" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_resumed_group_is_its_policies_own_configs(group_dir):
    """The resumed group took its shared settings from its first policy: r16, which leaves lora.r to the
    group, counted as rank 2 there, and the engine was sized for rank 2 while r16 trained rank 16 (an
    SGLang engine sized so cannot hold r16's adapter)."""
    from lorabench.session.config import engine_needs
    group = GroupSession.resume(group_dir, evaluate_first=False, **QUIET)
    try:
        assert {name: m.lora.r for name, m in group.cfg.members().items()} == {"r2": 2, "r16": 16}
        assert engine_needs(group.cfg).lora_rank == 16
    finally:
        group.close()


def test_a_policy_that_diverges_is_named(tiny_model_dir, tmp_path, capsys):
    """grpo.lr=1e30 in one policy: the run stopped with the single run's message, which did not say
    which policy, and offered `lorabench resume`, which repeats the same seeded step. The new run it
    gives for that policy trains, beside the group dir."""
    entries = [{"name": "calm"}, {"name": "wild", "grpo": {"lr": 1e30}}]
    line = refused(capsys, *cli_run(tiny_model_dir, tmp_path, entries, "grpo.steps=10", "grpo.reward_mode=flexible",
                                   "grpo.group_size=4", "grpo.max_new_tokens=8"))
    assert line.startswith("lorabench: error: policy 'wild': GRPO step ") and "diverged" in line, line
    assert f"{tmp_path}/g/wild is intact" in line and "Lower grpo.lr (now 1e+30" in line
    command = f"run --config {tmp_path}/g/wild/config.json run.name=NEW grpo.lr=0.001"
    assert f"lorabench {command}" in line and "without the bound" not in line, line   # 1e+29 diverged too
    assert main(command.replace("NEW", "tamed").split()) == 0   # a single run beside the group, which it leaves
    assert len(read_jsonl(tmp_path / "tamed" / "metrics.jsonl")) == 10 and sorted(os.listdir(tmp_path / "g")) == [
        "calm", "group.json", "wild"]


# --- on the demo model: the same as alone, every rollout its own policy's ---------------------------
@pytest.fixture(scope="module")
def warm_model() -> str:
    """The demo's warm-started model (the recipe `lorabench demo` builds and caches)."""
    return resolve_model(Config(), log=print)


COMPARED = ("reward/mean", "loss/policy", "grad_norm", "mismatch/mean", "adapter/delta_norm", "advantage/abs_mean",
            "completions/mean_length", "adapter/served_version")


@pytest.mark.slow
def test_a_policy_in_a_group_equals_the_same_policy_run_alone(warm_model, tmp_path):
    """Sharing the engine and the base model changes nothing but speed: the same problems, rollouts
    and updates as the same policy's config run alone (the CPU engine serves each request as if it
    came alone; SGLang batches them)."""
    steps = 3
    cfg = group_cfg(warm_model, tmp_path, "g", f"grpo.steps={steps}", "run.threads=1", "data.eval_size=8",
                    ranks=(2, 8))
    group = GroupSession.open(cfg, **QUIET)
    try:
        group.trainer.run(progress=False)
        together = group.metrics()
    finally:
        group.close()
    alone = RunSession.open(cfg.members()["r8"], tmp_path / "alone", **QUIET)
    try:
        alone.trainer.run(progress=False)
        rows = alone.metrics()
    finally:
        alone.close()
    assert [r["step"] for r in rows] == [r["step"] for r in together["r8"]] == list(range(1, steps + 1))
    for mine, theirs in zip(together["r8"], rows):
        for key in COMPARED:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (mine["step"], key)
    assert read_jsonl(tmp_path / "g" / "r8" / "evals.jsonl") == read_jsonl(tmp_path / "alone" / "evals.jsonl")
    assert together["r2"][-1]["adapter/delta_norm"] != together["r8"][-1]["adapter/delta_norm"]


def test_a_group_step_hands_no_commit_to_its_thread_before_every_policy_is_published(tiny_model_dir, tmp_path):
    """A commit thread pickling a checkpoint beside the next policy's refresh slows that refresh (they share the
    interpreter): a group's step refreshes and probes every policy first, then each commit reaches its thread,
    and every step is still in the run dirs at the end."""
    cfg = group_cfg(tiny_model_dir, tmp_path, "g", "grpo.steps=2", "run.commit_in_background=true", *SMALL,
                    ranks=(2, 4, 8))
    group = GroupSession.open(cfg, evaluate_first=False, **QUIET)
    events = []
    try:
        for name, trainer in group.trainer.trainers.items():
            def refresh(adapter, name=name, original=trainer.refresher.refresh):
                events.append(("refresh", name))
                return original(adapter)

            def submit(*args, name=name, original=trainer._commits._pool.submit):
                events.append(("commit", name))
                return original(*args)
            trainer.refresher.refresh, trainer._commits._pool.submit = refresh, submit
        for _ in range(2):
            group.trainer.step()
            kinds = [kind for kind, _ in events]
            assert kinds == ["refresh"] * 3 + ["commit"] * 3, events
            assert sorted(name for _, name in events[3:]) == ["r2", "r4", "r8"]
            events.clear()
        group.trainer.wait_committed()
    finally:
        group.close()
    for name in ("r2", "r4", "r8"):
        assert [row["step"] for row in read_jsonl(tmp_path / "g" / name / "metrics.jsonl")] == [1, 2]


@pytest.mark.slow
def test_every_rollout_is_checked_against_its_own_policy(warm_model, tmp_path):
    """Rollouts of one policy handed to another's trainer are refused before anything trains; and if
    they were served under another policy's (here very different) adapter, the mismatch shows it."""
    cfg = group_cfg(warm_model, tmp_path, "g", "grpo.steps=2", "data.eval_size=2", "run.threads=1", ranks=(2, 8))
    group = GroupSession.open(cfg, evaluate_first=False, **QUIET)
    try:
        a, b = group.trainer.trainers["r2"], group.trainer.trainers["r8"]
        with torch.no_grad():   # make r8's adapter far from r2's (a fresh LoRA serves the base model)
            for p in b.policy.params:
                p.add_(0.05 * torch.randn_like(p))
        b.refresher.refresh(b.policy.adapter())
        (problems_a, request_a), (_, request_b) = a.rollout_request(), b.rollout_request()
        done_a, done_b = generate_each(group.engine, [request_a, request_b])
        with pytest.raises(StaleAdapter, match="served by adapter 'r8'"):
            a.step(rollouts_of(group.engine, a.tokenizer, problems_a, request_b, done_b))
        assert a.step_count == 0
        # the same problems, sampled under r8's adapter but labelled as r2's: the mismatch is far above its own
        wrong = rollouts_of(group.engine, a.tokenizer, problems_a, request_a, done_b)
        mixed = a.step(wrong).metrics["mismatch/mean"]
        own = b.step(rollouts_of(group.engine, b.tokenizer, problems_a, request_b, done_b)).metrics["mismatch/mean"]
        assert mixed > 100 * max(own, 1e-6), (mixed, own)
    finally:
        group.close()


@pytest.mark.slow
def test_four_ranks_learn_side_by_side_through_the_cli(warm_model, tmp_path):
    """`lorabench run` with four policies (ranks 1, 4, 16, 32, lora.alpha fixed at its default, so the
    update's scale alpha/r grows as the rank falls) on the demo: each policy's training reward rises,
    each run dir is a whole run, and one policy resumes alone while the group resumes together. At
    grpo.lr=0.002 every rank's reward rises by 0.3-0.4 in 12 steps; at 0.003 rank 16 (scale 2) can rise and
    then collapse to 0 within them."""
    ranks = (1, 4, 16, 32)
    entries = [{"name": f"r{r}", "lora": {"r": r}} for r in ranks]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def lorabench(*args):
        done = subprocess.run([sys.executable, "-m", "lorabench.cli", *args], cwd=tmp_path, capture_output=True,
                              text=True, env=env, timeout=1800)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout
    out = lorabench("run", f"policies={json.dumps(entries)}", "grpo.steps=12", "grpo.lr=0.002", "data.eval_size=16",
                    f"run.out_dir={tmp_path}", "run.name=ranks")
    assert "4 policies on one engine" in out
    group = tmp_path / "ranks"
    assert sorted(os.listdir(group)) == ["group.json", *sorted(f"r{r}" for r in ranks)]
    for r in ranks:
        rows = read_jsonl(group / f"r{r}" / "metrics.jsonl")
        assert [row["adapter/served_version"] for row in rows] == list(range(12))
        first, last = (sum(row["reward/mean"] for row in part) / 4 for part in (rows[:4], rows[-4:]))
        assert last > first + 0.1, (r, [round(row["reward/mean"], 2) for row in rows])
        assert (group / f"r{r}" / "summary.json").is_file()
    lorabench("resume", str(group / "r1"), "grpo.steps=13", "data.eval_size=16")
    lorabench("resume", str(group), "grpo.steps=14", "data.eval_size=16")
    assert {r: len(read_jsonl(group / f"r{r}" / "metrics.jsonl")) for r in ranks} == {r: 14 for r in ranks}


def test_the_group_panel_steps_every_policy_and_shows_them_side_by_side(tiny_model_dir, tmp_path):
    from lorabench.widgets import GroupPanel
    group = GroupSession.open(group_cfg(tiny_model_dir, tmp_path, "g", *SMALL, "grpo.steps=5"), **QUIET)
    try:
        panel = GroupPanel(group.trainer)
        assert "no step yet" in panel.status.value
        panel.step_button.click()          # as a click's widget message does
        panel.wait(timeout=300)
        panel.start(2)
        last = panel.wait(timeout=300)
        assert set(last) == {"r2", "r8"} and all(r.step == 3 for r in last.values())
        assert {name: len(t.history) for name, t in group.trainer.trainers.items()} == {"r2": 3, "r8": 3}
        assert all(f"<b>{name}</b>" in panel.status.value for name in ("r2", "r8")) and panel.plot.value
        panel.close()
    finally:
        group.close()


def test_a_step_interrupted_in_one_policy_rolls_it_back_and_the_group_evens_out(tiny_model_dir, tmp_path):
    """Ctrl-C (Kernel -> Interrupt) during one policy's update: every policy updated but not yet published
    (all update before any publishes) is rolled back with it, and `run` brings every policy to grpo.steps
    with each step in its run dir exactly once."""
    group = GroupSession.open(group_cfg(tiny_model_dir, tmp_path, "g", *SMALL, "grpo.steps=3"), **QUIET)
    try:
        second = group.trainer.trainers["r8"]
        train = second.policy.train

        def interrupted(*args, **kwargs):
            second.policy.train = train        # once
            raise KeyboardInterrupt
        second.policy.train = interrupted
        with pytest.raises(KeyboardInterrupt):
            group.trainer.step()
        assert group.trainer.current == "r8"
        assert {n: t.step_count for n, t in group.trainer.trainers.items()} == {"r2": 0, "r8": 0}
        group.trainer.run(progress=False)
        assert {n: t.step_count for n, t in group.trainer.trainers.items()} == {"r2": 3, "r8": 3}
    finally:
        group.close()
    for name in ("r2", "r8"):
        rows = read_jsonl(tmp_path / "g" / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert [r["adapter/served_version"] for r in rows] == [0, 1, 2]


def test_one_pass_update_of_a_group_matches_each_policys_own(tiny_model_dir):
    """benchmarks/group_update.py's one-pass update of K policies (each row's LoRA term from its own adapter)
    gives every policy the gradient of its own `Policy.train`; a row served by another adapter would be far off."""
    from group_update import check_exact
    found = check_exact(str(tiny_model_dir), 3, "2x4x12")
    assert found["max_gap_own"] < 1e-5 < 0.1 < found["min_gap_other"]
    assert found["max_gradient_diff_over_max_gradient"] < 1e-4


@pytest.mark.parametrize("group", [True, False])
def test_an_open_failing_after_the_engine_started_closes_what_it_built(group_dir, monkeypatch, group):
    """A resume whose recorded changes fail to write (a full disk): a group closed its run dirs but left its
    engine and trainers open (a notebook that tried again held two engines), and a single run left its trainer
    (its commit thread, its refresher's temp dirs). Now both close every trainer and the engine, and put each lock
    file back as found (all of it: a refusal kept the first 64 bytes)."""
    from lorabench.engines.hf import HFEngine
    from lorabench.grpo import GRPOTrainer
    from lorabench.session.compat import resume_config
    from lorabench.session.run import RunPlan
    closed = []
    for cls, what in ((HFEngine, "engine"), (GRPOTrainer, "trainer")):
        real_close = cls.close
        monkeypatch.setattr(cls, "close", lambda self, real_close=real_close, what=what: (closed.append(what),
                                                                                          real_close(self))[1])

    def disk_full(self, runlog, log=print):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RunPlan, "record_changes", disk_full)
    (group_dir / "r2" / "lock").write_bytes(b"a note longer than a PID: " + b"x" * 100)   # put back whole
    before = tree_state(group_dir)
    with pytest.raises(OSError, match="No space left"):
        if group:
            GroupSession.resume(group_dir, ["grpo.steps=3"], **QUIET)
        else:
            RunSession.open(resume_config(group_dir / "r2", ["grpo.steps=3"]), group_dir / "r2", **QUIET)
    assert sorted(closed) == ["engine", *["trainer"] * (2 if group else 1)]
    assert tree_state(group_dir) == before
