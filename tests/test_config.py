"""Config: defaults, typed overrides, .json/.toml files, and errors that name the field and the fix."""
import dataclasses
import json
import math
import os
import time

import pytest

from lorabench.session.config import Config, ConfigError, apply_override, describe, flat, problems


def test_defaults_are_valid():
    cfg = Config()
    assert problems(cfg) == []
    d = cfg.to_dict()
    json.dumps(d)  # a Config is plain JSON
    assert set(d) == {"model", "warmstart", "lora", "data", "grpo", "engine", "refresh", "run"}
    assert Config.load().to_dict() == d
    # every field documents itself, sub-sections (engine.sglang, refresh.file) included
    text = describe()
    keys = flat(cfg)
    assert "engine.sglang.mem_fraction_static" in keys and "refresh.file.tmp_dir" in keys
    for key in keys:
        assert f"{key} =" in text


def test_list_defaults_are_not_shared():
    a, b = Config(), Config()
    a.lora.target_modules = ["q_proj"]
    assert b.lora.target_modules == Config().lora.target_modules


def test_overrides_are_typed():
    cfg = Config.load(overrides=["grpo.steps=7", "grpo.lr=3e-4", "engine.sglang.disable_cuda_graph=true",
                                 "run.seed=11", "refresh.bucket_mb=0.5", "model.enable_thinking=no",
                                 "refresh.mode=file"])
    assert cfg.grpo.steps == 7 and type(cfg.grpo.steps) is int
    assert cfg.grpo.lr == pytest.approx(3e-4) and type(cfg.grpo.lr) is float
    assert cfg.engine.sglang.disable_cuda_graph is True
    assert cfg.model.enable_thinking is False
    assert cfg.run.seed == 11
    assert cfg.refresh.bucket_mb == 0.5
    assert cfg.refresh.mode == "file"


@pytest.mark.parametrize("value, expected", [
    ("q_proj,v_proj", ["q_proj", "v_proj"]),
    ("q_proj, v_proj ,", ["q_proj", "v_proj"]),
    ('["q_proj","o_proj"]', ["q_proj", "o_proj"]),
    ("all-linear", "all-linear"),
    ("q_proj", "q_proj"),
])
def test_target_modules_override(value, expected):
    cfg = Config.load(overrides=[f"lora.target_modules={value}"])
    assert cfg.lora.target_modules == expected
    assert type(cfg.lora.target_modules) is type(expected)


def test_override_value_may_contain_equals_sign():
    cfg = Config.load(overrides=["run.name=a=b"])
    assert cfg.run.name == "a=b"


def test_json_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"grpo": {"steps": 3, "lr": 0.01, "group_size": 4, "micro_batch_tokens": 32},
                                "lora": {"target_modules": ["q_proj", "v_proj"], "r": 8},
                                "refresh": {"mode": "merged"}}))
    cfg = Config.load(path)
    assert (cfg.grpo.steps, cfg.grpo.lr, cfg.grpo.group_size, cfg.grpo.micro_batch_tokens) == (3, 0.01, 4, 32)
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.lora.r == 8
    assert cfg.refresh.mode == "merged"
    assert cfg.grpo.prompts_per_step == Config().grpo.prompts_per_step  # untouched default


def test_toml_file_with_overrides_on_top(tmp_path):
    path = tmp_path / "cfg.toml"
    path.write_text('[grpo]\nsteps = 5\nlr = 2e-3\n\n[engine]\nbackend = "hf"\n'
                    '[engine.sglang]\ndisable_cuda_graph = true\n'
                    '[lora]\ntarget_modules = "all-linear"\n')
    cfg = Config.load(path, overrides=["grpo.steps=9"])
    assert cfg.grpo.steps == 9          # the override wins over the file
    assert cfg.grpo.lr == pytest.approx(2e-3)
    assert cfg.engine.sglang.disable_cuda_graph is True
    assert cfg.lora.target_modules == "all-linear"


def test_a_key_of_the_flat_engine_section_is_refused_naming_it(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text('[engine]\nbackend = "sglang"\nmem_fraction_static = 0.4\n')
    msg = _error(path=path)
    assert "unknown key(s) ['mem_fraction_static']" in msg and str(path) in msg
    assert "engine.sglang.mem_fraction_static" in msg and "valid keys" in msg
    assert "refresh.file.tmp_dir" in _error(["refresh.tmp_dir=/tmp"])


def test_roundtrip_through_json_file(tmp_path):
    cfg = Config.load(overrides=["grpo.steps=3", "lora.target_modules=q_proj,v_proj"])
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg.to_dict()))
    assert Config.load(path) == cfg


def _error(overrides=(), path=None) -> str:
    with pytest.raises(ConfigError) as info:
        Config.load(path, overrides=list(overrides))
    return str(info.value)


def test_unknown_key_names_key_and_valid_keys():
    msg = _error(["grpo.learning_rate=1e-3"])
    assert "learning_rate" in msg and "grpo" in msg
    assert "valid keys" in msg and "'lr'" in msg


@pytest.mark.parametrize("override, suggestion", [
    ("grpo.learning_rate=1e-3", "did you mean grpo.lr?"),        # another tool's name for it
    ("grpo.micro_batch=8", "did you mean grpo.micro_batch_tokens?"),  # the field before its rename
    ("grpo.tempreature=0.5", "did you mean grpo.temperature?"),  # a typo
    ("grpo.seed=3", "did you mean run.seed?"),                   # the right key in another section
    ("lora.rank=8", "did you mean lora.r?"),
])
def test_unknown_key_did_you_mean(override, suggestion):
    assert suggestion in _error([override])


def test_unknown_section_did_you_mean(tmp_path):
    assert "(did you mean 'lora'?)" in _error(["lroa.r=8"])
    path = tmp_path / "c.toml"
    path.write_text("[grpoo]\nsteps = 3\n")
    msg = _error(path=path)
    assert str(path) in msg and "(did you mean 'grpo'?)" in msg


def test_unknown_section_names_section_and_valid_sections():
    msg = _error(["optim.lr=1e-3"])
    assert "optim" in msg and "valid sections" in msg and "grpo" in msg


def test_wrong_type_names_field_and_example():
    msg = _error(["grpo.lr=abc"])
    assert "grpo.lr" in msg and "'abc'" in msg and "float" in msg and "1e-3" in msg
    msg = _error(["grpo.steps=2.5"])
    assert "grpo.steps" in msg and "int" in msg
    msg = _error(["engine.sglang.disable_cuda_graph=maybe"])
    assert "engine.sglang.disable_cuda_graph" in msg and "true or false" in msg


def test_wrong_type_in_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"grpo": {"steps": 2.5}}))
    msg = _error(path=path)
    assert "grpo.steps" in msg and "whole number" in msg
    path.write_text(json.dumps({"grpo": {"steps": True}}))
    assert "boolean" in _error(path=path)
    path.write_text(json.dumps({"grpo": 3}))
    assert "grpo" in _error(path=path) and "table" in _error(path=path)


def test_group_size_one():
    msg = _error(["grpo.group_size=1"])
    assert "grpo.group_size=1" in msg and "group_size=8" in msg


def test_micro_batch_tokens_must_be_positive():
    msg = _error(["grpo.micro_batch_tokens=0"])
    assert "grpo.micro_batch_tokens=0" in msg and ">= 1" in msg and "4096" in msg
    # any positive budget is fine: a sequence longer than it forms its own micro-batch
    assert Config.load(overrides=["grpo.micro_batch_tokens=1"]).grpo.micro_batch_tokens == 1


@pytest.mark.parametrize("override, field_name", [
    ("grpo.lr=inf", "grpo.lr"), ("grpo.lr=-inf", "grpo.lr"), ("grpo.max_grad_norm=nan", "grpo.max_grad_norm"),
    ("grpo.temperature=nan", "grpo.temperature"), ("refresh.bucket_mb=inf", "refresh.bucket_mb"),
    ("grpo.kl_beta=nan", "grpo.kl_beta"), ("warmstart.lr=inf", "warmstart.lr"),
])
def test_non_finite_numbers_refused(override, field_name):
    """inf/nan parse as floats; each is refused at config time naming the field and the default
    (max_grad_norm=nan used to pass and fail at step 1 blaming the lr)."""
    msg = _error([override])
    assert msg.startswith(f"{field_name}=") and "finite number" in msg and "default is" in msg


def test_non_finite_in_toml_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[grpo]\nlr = inf\n")           # TOML has inf and nan literals
    msg = _error(path=path)
    assert "grpo.lr=inf" in msg and "finite" in msg
    assert math.isfinite(Config().grpo.lr)


@pytest.mark.parametrize("override, needle, fix", [
    ("data.eval_size=0", "data.eval_size=0", "data.eval_size=128"),
    ("lora.dropout=1.5", "lora.dropout=1.5", "[0, 1)"),
    ("lora.dropout=-0.1", "lora.dropout=-0.1", "[0, 1)"),
    ("grpo.max_grad_norm=0", "grpo.max_grad_norm=0.0", "> 0"),
    ("data.max_prompt_tokens=-1", "data.max_prompt_tokens=-1", ">= 0"),
])
def test_values_that_failed_late_are_refused_at_config_time(override, needle, fix):
    msg = _error([override])
    assert needle in msg and fix in msg


def test_bom_accepted_in_config_files(tmp_path):
    toml, js = tmp_path / "c.toml", tmp_path / "c.json"
    toml.write_bytes("\ufeff[grpo]\nsteps = 5\n".encode())
    js.write_bytes("\ufeff".encode() + json.dumps({"grpo": {"steps": 6}}).encode())
    assert Config.load(toml).grpo.steps == 5 and Config.load(js).grpo.steps == 6


def test_config_file_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes("[grpo]\n# sch\xf6n\nsteps = 5\n".encode("latin-1"))
    msg = _error(path=path)
    assert str(path) in msg and "not UTF-8" in msg and "0xf6" in msg and "save it as UTF-8" in msg


def test_bad_extra_args_json_is_a_config_error():
    msg = _error(["engine.backend=sglang", "engine.sglang.extra_args={bad"])
    assert "engine.sglang.extra_args" in msg and "not JSON" in msg and "enable_memory_saver" in msg
    assert "JSON object" in _error(["engine.sglang.extra_args=[1, 2]"])


@pytest.mark.parametrize("value", [".*proj", "model.*q_proj", r"q_proj|v_proj"])
def test_regex_target_modules_refused(value):
    msg = _error([f"lora.target_modules={value}"])
    assert "lora.target_modules" in msg and "all-linear" in msg and "regular expression" in msg


def test_list_with_regex_refused():
    msg = _error(['lora.target_modules=["q_proj", ".*"]'])
    assert "lora.target_modules" in msg and "module names" in msg


def test_bad_json_list_override():
    msg = _error(['lora.target_modules=["q_proj",'])
    assert "lora.target_modules" in msg and "JSON list" in msg


def test_bad_refresh_mode():
    msg = _error(["refresh.mode=ipc"])
    assert "refresh.mode='ipc'" in msg
    for mode in ("file", "tensor", "merged", "none"):
        assert mode in msg


@pytest.mark.parametrize("override, field_name", [
    ("grpo.temperature=0", "grpo.temperature"),
    ("grpo.top_p=1.5", "grpo.top_p"),
    ("grpo.reward_mode=loose", "grpo.reward_mode"),
    ("engine.backend=vllm", "engine.backend"),
    ("engine.backend=sglang engine.sglang.max_loras_per_batch=1", "engine.sglang.max_loras_per_batch"),
    ("engine.backend=sglang engine.sglang.mem_fraction_static=1.5", "engine.sglang.mem_fraction_static"),
    ("engine.backend=sglang engine.sglang.lora_backend=cutlass", "engine.sglang.lora_backend"),
    ("refresh.bucket_mb=0", "refresh.bucket_mb"),
    ("model.dtype=float8", "model.dtype"),
    ("lora.r=0", "lora.r"),
    ("engine.sglang.cuda_graph_max_bs=-1", "engine.sglang.cuda_graph_max_bs"),
])
def test_other_invalid_values_name_the_field(override, field_name):
    assert field_name in _error(override.split())


@pytest.mark.parametrize("overrides, names, fix", [
    (["engine.backend=sglang", "engine.sglang.tp_size=0"], ["engine.sglang.tp_size=0"], ">= 1"),
    (["engine.backend=sglang", 'engine.sglang.extra_args={"dp_size": 2}'], ["dp_size=2"], "engine.sglang.tp_size"),
    (["engine.backend=sglang", 'engine.sglang.extra_args={"tp_size": 2}'], ["tp_size=2"], "use engine.sglang.tp_size"),
    (["engine.backend=sglang", "engine.sglang.base_gpu_id=-1"], ["engine.sglang.base_gpu_id=-1"], ">= 0"),
    (["engine.backend=sglang", 'engine.sglang.extra_args={"base_gpu_id": 1}'], ["base_gpu_id=1"],
     "use engine.sglang.base_gpu_id"),
])
def test_parallelism_settings_name_value_and_fix(overrides, names, fix):
    msg = _error(overrides)
    assert all(n in msg for n in names) and fix in msg, msg


def test_tensor_parallel_engine_accepted():
    from lorabench.session.config import Config
    assert Config.load(None, ["engine.backend=sglang", "engine.sglang.tp_size=2"]).engine.sglang.tp_size == 2


def test_engine_on_gpus_of_its_own_reaches_sglang_and_must_exist():
    """engine.sglang.base_gpu_id is passed to sglang.Engine (which also places the in-place staging
    buffers there) only when set, and a placement past the visible GPUs is named with the fix."""
    from lorabench.session.config import Config, engine_needs
    cfg = Config.load(None, ["engine.backend=sglang", "engine.sglang.base_gpu_id=1", "engine.sglang.tp_size=2"])
    kwargs = cfg.engine.sglang.engine_kwargs("/m", engine_needs(cfg))
    assert (kwargs["base_gpu_id"], kwargs["tp_size"]) == (1, 2)
    assert "base_gpu_id" not in Config.load(None, ["engine.backend=sglang"]).engine.sglang.engine_kwargs(
        "/m", engine_needs(cfg))
    assert cfg.engine.sglang.gpu_problems(3) == []
    (problem,) = cfg.engine.sglang.gpu_problems(2)
    assert "GPUs 1..2" in problem and "sees 2" in problem and "lower base_gpu_id or tp_size" in problem


def test_kv_cache_too_small_for_the_largest_batch_is_said_with_the_fix():
    """A group's largest batch that SGLang's KV cache cannot hold at once decodes in waves, silently
    slower: the engine's note names both sizes and a mem_fraction_static that holds it."""
    from lorabench.engines.sglang import kv_capacity_note
    from lorabench.session.config import Config, engine_needs
    entries = [{"name": f"p{i}"} for i in range(4)]
    cfg = Config.load(None, ["engine.backend=sglang", "grpo.prompts_per_step=64", "grpo.group_size=8",
                             "grpo.max_new_tokens=256", f"policies={json.dumps(entries)}"])
    needs = engine_needs(cfg)                                   # 4 x 64 x 8 sequences of 256 new tokens
    note = kv_capacity_note(340_000, needs, 0.3)
    assert "340,000 tokens" in note and "524,288" in note and "mem_fraction_static=0.47 (now 0.3)" in note
    assert kv_capacity_note(600_000, needs, 0.3) == "" and kv_capacity_note(None, needs, 0.3) == ""
    assert "mem_fraction_static=0.9 " in kv_capacity_note(10_000, needs, 0.3)   # never all of the GPU


def test_sampling_ahead_beside_the_trainer_without_mps_is_said_with_the_fix(tmp_path, monkeypatch):
    """One step stale with the engine on the trainer's GPU overlaps little unless CUDA MPS runs (the GPU
    takes the two processes' kernels in turns): the engine's note says so and how to fix it, and only then."""
    from lorabench.engines.sglang import overlap_note
    from lorabench.session.config import Config, engine_needs
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))       # an MPS pipe dir with no daemon in it
    stale = engine_needs(Config.load(None, ["engine.backend=sglang", "grpo.max_staleness=1"]))
    note = overlap_note(stale, base_gpu_id=0)
    assert f"no CUDA MPS daemon runs (no {tmp_path / 'control'})" in note
    assert "nvidia-cuda-mps-control -d" in note and "engine.sglang.base_gpu_id=1" in note
    assert overlap_note(stale, base_gpu_id=1) == ""                     # a GPU of its own
    assert overlap_note(engine_needs(Config.load(None, ["engine.backend=sglang"])), base_gpu_id=0) == ""  # on-policy
    (tmp_path / "control").touch()                                      # the daemon's control pipe
    assert overlap_note(stale, base_gpu_id=0) == ""


def test_max_lora_rank_below_r():
    msg = _error(["engine.backend=sglang", "engine.sglang.max_lora_rank=8", "lora.r=16"])
    assert "engine.sglang.max_lora_rank=8" in msg and "lora.r=16" in msg


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.toml"
    msg = _error(path=missing)
    assert str(missing) in msg and "does not exist" in msg


def test_unsupported_or_malformed_file(tmp_path):
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("grpo:\n  steps: 3\n")
    assert ".yaml" in _error(path=yaml_path) and ".toml" in _error(path=yaml_path)
    bad = tmp_path / "c.toml"
    bad.write_text("[grpo\nsteps = 3")
    assert "not valid toml" in _error(path=bad)
    bad_json = tmp_path / "c.json"
    bad_json.write_text("{")
    assert "not valid json" in _error(path=bad_json)


@pytest.mark.parametrize("item", ["grpo.lr", "lr=3", "grpo.=3", "=3"])
def test_malformed_override(item):
    msg = _error([item])
    assert repr(item) in msg and "section.field=value" in msg
    with pytest.raises(ConfigError):
        apply_override({}, item)


def test_direct_construction_is_validated():
    cfg = Config()
    with pytest.raises(ConfigError, match="group_size"):
        dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, group_size=1))


def test_compile_setting_resolves_and_refuses_booleans():
    """grpo.compile: 'auto' compiles everything on a CUDA device and nothing on the CPU; a boolean
    is refused, naming the key and the valid values."""
    from lorabench.policy import compile_mode
    assert compile_mode("auto", "cuda") == "all" and compile_mode("auto", "cuda:1") == "all"
    assert compile_mode("auto", "cpu") == "off" and compile_mode("head", "cpu") == "head"
    with pytest.raises(ConfigError, match=r"grpo.compile='true': use one of \['off', 'head', 'all', 'auto'\]"):
        Config.load(None, ["grpo.compile=true"])
    with pytest.raises(ConfigError, match=r"grpo.compile='fast': use one of \['off', 'head', 'all', 'auto'\]"):
        Config.load(None, ["grpo.compile=fast"])


def test_auto_threads_leave_the_cpus_other_work_keeps_busy(monkeypatch):
    """run.threads=0: torch's default count less the CPUs other work keeps busy, at least 1: the load
    average, or fewer where /proc/stat shows fewer busy now (an idle VM's load average of ~0.8 chose one
    thread); a positive setting is kept."""
    import os

    from lorabench import machine
    monkeypatch.setattr(machine, "_TORCH_DEFAULT_THREADS", [2])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for load, now, threads in ((0.2, None, 2), (0.7, None, 1), (1.4, None, 1), (6.0, None, 1),
                               (0.8, 0.0, 2), (1.4, 1.1, 1), (0.3, 1.0, 2), (6.0, 2.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        monkeypatch.setattr(machine, "busy_now", lambda cpus, now=now: now)
        threads_set, how = machine.cpu_threads(0)
        assert threads_set == threads, (load, now)
        assert f"{load:.2f}" in how and (now is None or f"{now:.2f} busy in /proc/stat now" in how), how
    assert machine.cpu_threads(2) == (2, "2 (run.threads)")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert machine.cpu_threads(0)[0] == 2        # never above torch's own default


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="busy_now reads /proc/stat (Linux)")
def test_busy_now_sees_a_process_that_keeps_a_cpu_busy():
    import subprocess
    import sys

    from lorabench import machine
    cpu = min(os.sched_getaffinity(0))
    loop = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.5)
        assert machine.busy_now({cpu}) > 0.7
    finally:
        loop.kill()
        loop.wait()


def test_a_written_config_reads_back_under_the_strict_file_rules(tmp_path):
    """What lorabench writes (config.json: to_dict) passes the file checks it asks of a user's file:
    `lorabench run --config RUN/config.json` starts a new run from it."""
    cfg = Config.load(None, ['lora.target_modules=["q_proj","v_proj"]', "grpo.lr=3e-4", "run.name=x",
                             'policies=[{"name": "a", "lora": {"r": 2}}, {"name": "b", "grpo": {"lr": 0.01}}]'])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict(), indent=1))
    assert Config.load(path).to_dict() == cfg.to_dict()
