"""Bad input gets a clear error, and nothing is lost: the catalogue cases that no other test file
covers. Each asserts the error type, that the message names the culprit (file, field or value)
and the fix, and where it matters that nothing was lost (the engine keeps serving, the trainer
keeps its state). The whole catalogue, with the cases tested elsewhere, is the table in
docs/reliability.md.

The `lorabench` command line cases run `cli.main` in this process (the process tests are in
tests/test_rundir.py): each asserts exit code 2, one 'lorabench: ...' line on stderr naming the
thing and the fix, no traceback, and that nothing was created (the checks run before the run dir
or the model exists)."""
from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from reliability_util import QUICK_RUN, ROOT, cli, make_trainer, mounted_disk, one_line_error  # noqa: F401 (fixture)
from synthetic import peft_adapter  # benchmarks/, on sys.path by conftest

from lorabench.adapters import CONFIG_NAME, AdapterError, AdapterWriteError, FlatAdapter, validate
from lorabench.data import DataError, ProblemSource
from lorabench.engines.base import EngineError
from lorabench.models import ModelError
from lorabench.session import resolve_model
from lorabench.session.config import Config, ConfigError


def _comparable(row):
    from lorabench.rundir import clean
    return {k: v for k, v in clean(row).items()
            if not k.startswith("time/") and not (k.startswith("refresh/") and k.endswith("_s"))}


# --- model --------------------------------------------------------------------------------------
def test_model_path_missing(tmp_path):
    missing = tmp_path / "no-such-model"
    cfg = Config.load(overrides=[f"model.name_or_path={missing}"])
    with pytest.raises(ModelError) as info:
        resolve_model(cfg)
    msg = str(info.value)
    assert "model.name_or_path" in msg and str(missing) in msg and "does not exist" in msg
    assert "existing model dir" in msg and "'tiny'" in msg                     # the fix


def test_model_dir_without_config_json(tmp_path):
    (tmp_path / "weights-only").mkdir()
    cfg = Config.load(overrides=[f"model.name_or_path={tmp_path / 'weights-only'}"])
    with pytest.raises(ModelError) as info:
        resolve_model(cfg)
    msg = str(info.value)
    assert str(tmp_path / "weights-only") in msg and "config.json" in msg and "Hugging Face model dir" in msg


# --- LoRA target modules --------------------------------------------------------------------------
def test_target_module_the_model_lacks(make_trainer, tiny_model_dir):
    with pytest.raises(ConfigError) as info:
        make_trainer(None, 'lora.target_modules=["q_proj","qkv_proj"]')
    msg = str(info.value)
    assert "lora.target_modules" in msg and "'qkv_proj'" in msg and str(tiny_model_dir) in msg  # culprit
    assert "q_proj" in msg and "down_proj" in msg and "all-linear" in msg      # the fix: what exists
    assert "'q_proj'" not in msg.split("no module named")[1].split(";")[0]    # only the missing one named


@pytest.mark.parametrize("target", [".*proj", r"q_proj|v_proj"])
def test_regex_target_modules_for_sglang(target):
    """Config validation refuses these already (tests/test_config.py); the SGLang engine's own
    mapping refuses them too, so a Config built some other way cannot reach the engine."""
    from lorabench.engines.sglang import sglang_target_modules  # importable without sglang
    with pytest.raises(EngineError) as info:
        sglang_target_modules(target)
    msg = str(info.value)
    assert repr(target) in msg and "regular expression" in msg and "q_proj" in msg
    assert sglang_target_modules("all-linear") == ["all"]
    with pytest.raises(EngineError, match="not module names"):
        sglang_target_modules(["q_proj", target])


# --- engine start ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.2"])
def test_sglang_bad_mem_fraction_refused_before_start(fraction, capsys):
    """A memory fraction SGLang cannot start with is refused at config time: the CLI exits with
    a one-line message (no traceback, no engine process, nothing that could kill a kernel)."""
    overrides = ["engine.backend=sglang", f"engine.sglang.mem_fraction_static={fraction}"]
    with pytest.raises(ConfigError) as info:
        Config.load(overrides=overrides)
    msg = str(info.value)
    assert f"engine.sglang.mem_fraction_static={float(fraction)}" in msg and "between 0 and 1" in msg
    from lorabench.cli import main
    assert main(["run", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lorabench: config error: engine.sglang.mem_fraction_static") and "Traceback" not in err


def test_engine_refuses_model_of_another_shape(make_trainer, tiny_model_dir, tmp_path):
    """Trainer and engine loaded from different models: the engine's own check refuses the
    adapter at the first refresh, and the error carries the engine's message."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lorabench.session import build_trainer, start_engine
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = AutoConfig.from_pretrained(other)
    config.intermediate_size = 384
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    cfg = Config.load(overrides=["engine.hf.device=cpu", "refresh.mode=tensor", "lora.r=4", "lora.alpha=8"])
    engine = start_engine(cfg, str(other))
    try:
        with pytest.raises(AdapterError) as info:
            build_trainer(cfg, str(tiny_model_dir), engine, log=lambda *a: None)
        msg = str(info.value)
        assert "mlp." in msg and "512" in msg and "384" in msg and "another model" in msg
        assert engine.loaded_adapters() == []
    finally:
        engine.close()


# --- adapters the engine refuses -----------------------------------------------------------------
def test_engine_refusal_keeps_previous_adapter(engine, make_peft_model, sample_sequences):
    """Validation passes (every module exists, shapes fit) but the config adapts only layer 0
    while the tensors cover every layer: the engine's own load refuses it with its message, and
    the adapter loaded before is served unchanged."""
    seqs, lens = sample_sequences
    good = peft_adapter(make_peft_model(seed=0))
    engine.load_adapter_tensors("policy", good)
    serving = engine.score(seqs, lens, "policy")
    bad_config = dict(good.config, layers_to_transform=[0])
    validate(good.tensors, bad_config, engine._shapes)  # nothing wrong on its face
    with pytest.raises(EngineError) as info:
        engine.load_adapter_tensors("candidate", FlatAdapter(good.buffer, good.layout, bad_config))
    msg = str(info.value)
    assert "'candidate'" in msg and "model.layers.1." in msg and "unexpected" in msg   # culprit
    assert "layers_to_transform" in msg and "target_modules" in msg                     # the fix
    assert engine.loaded_adapters() == ["policy"]
    assert all(torch.equal(a, b) for a, b in zip(serving, engine.score(seqs, lens, "policy")))


def test_inf_adapter_never_reaches_engine(make_trainer, sample_sequences):
    """Inf (NaN is tests/test_refresh.py) in the trainer's adapter: the policy refuses to publish it,
    naming the tensor; the step is rolled back and the engine serves the previous adapter."""
    seqs, lens = sample_sequences
    trainer = make_trainer(None)
    serving = trainer.engine.score(seqs, lens, "policy")
    before = trainer.policy.adapter()
    owner = trainer.policy.lora_layers.owners[0]
    with torch.no_grad():
        owner.weight[0, 0] = float("inf")
    with pytest.raises(AdapterError) as info:
        trainer.step()
    msg = str(info.value)
    assert "NaN/Inf" in msg and "grpo.lr" in msg and "not sent to the engine" in msg
    assert trainer.policy.layout.names[0] in msg
    assert any("rolled back" in note for note in info.value.__notes__)
    assert trainer.step_count == 0
    assert all(torch.equal(a, b) for a, b in zip(serving, trainer.engine.score(seqs, lens, "policy")))
    assert trainer.engine.served_version("policy") == before.version


def test_adapter_config_without_lora_alpha_refused(engine, make_peft_model, tmp_path):
    """A PEFT dir whose adapter_config.json lacks lora_alpha (PEFT would silently use its default
    and change the scaling alpha/r): the engine refuses it naming the field and the fix."""
    adapter_dir = peft_adapter(make_peft_model(seed=0)).save_peft_dir(tmp_path / "no-alpha")
    config = json.loads((adapter_dir / CONFIG_NAME).read_text())
    del config["lora_alpha"]
    (adapter_dir / CONFIG_NAME).write_text(json.dumps(config))
    with pytest.raises(AdapterError) as info:
        engine.load_adapter("policy", adapter_dir)
    msg = str(info.value)
    assert "lora_alpha=None" in msg and "PEFT would silently use its default" in msg and "write the alpha" in msg
    assert engine.loaded_adapters() == []


# --- a refresh that fails mid-run: the trainer keeps its state -------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    with mounted_disk(tmp_path / "tmpfs", 8192) as disk:   # room for two r=16 adapters (1 MB each)
        yield disk


def test_failed_refresh_rolls_the_step_back(make_trainer, small_disk, tmp_path, sample_sequences):
    """File refresh onto a filesystem that fills up mid-run (a real ENOSPC): step() raises a
    clear error; the trainer keeps its state (adapter, optimizer, step count, history, run dir
    rows, checkpoint); the engine keeps serving the last good adapter; once there is space again
    the run continues exactly as an uninterrupted run."""
    seqs, lens = sample_sequences
    reference = [r.metrics for r in make_trainer(tmp_path / "reference").run(progress=False)]
    trainer = make_trainer(tmp_path / "run", f"refresh.file.tmp_dir={small_disk.path}")
    trainer.step()
    state = (trainer.policy.adapter(), json.dumps(trainer.policy.optimizer.state_dict()["state"],
                                                  default=lambda t: t.tolist()))
    serving = trainer.engine.score(seqs, lens, "policy")
    small_disk.fill()
    with pytest.raises(AdapterWriteError) as info:
        trainer.step()
    err = info.value
    assert err.errno == errno.ENOSPC
    assert "no space left" in str(err) and str(trainer.refresher.root) in str(err)
    assert "refresh.file.tmp_dir" in str(err) and "run.out_dir" not in str(err)   # a resume refuses run.out_dir=
    assert any("rolled back" in note and "step 1" in note for note in err.__notes__)
    # nothing lost, nothing half-done
    assert trainer.step_count == 1 and len(trainer.history) == 1
    assert torch.equal(trainer.policy.adapter().buffer, state[0].buffer)
    assert json.dumps(trainer.policy.optimizer.state_dict()["state"], default=lambda t: t.tolist()) == state[1]
    trainer.wait_committed()                   # step 1's commit may still be on the commit thread
    assert [r["step"] for r in trainer.runlog.metrics()] == [1]
    assert torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(serving, trainer.engine.score(seqs, lens, "policy")))
    # space again: the same step 2, then step 3, as if nothing had happened
    small_disk.free()
    assert _comparable(trainer.step().metrics) == _comparable(reference[1])
    assert _comparable(trainer.step().metrics) == _comparable(reference[2])
    trainer.wait_committed()
    assert [r["step"] for r in trainer.runlog.metrics()] == [1, 2, 3]


# --- data ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["data.source", "data.eval_source"])
def test_dataset_file_missing_fails_at_start(tmp_path, field):
    missing = tmp_path / "gsm8k.jsonl"
    kwargs = {"source": str(missing)} if field == "data.source" else {"source": "synthetic",
                                                                       "eval_source": str(missing)}
    with pytest.raises(DataError) as info:
        ProblemSource(seed=0, **kwargs)      # constructed by GRPOTrainer.__init__, before any step
    msg = str(info.value)
    assert field in msg and str(missing) in msg and ".jsonl" in msg and "'synthetic'" in msg


def test_dataset_bad_row_fails_at_start(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n" +
                    json.dumps({"question": "2+2?", "answer": "it is 4"}) + "\n")
    with pytest.raises(DataError) as info:
        ProblemSource(str(path), seed=0)
    msg = str(info.value)
    assert str(path) in msg and "line 2" in msg and "####" in msg and "'it is 4'" in msg


def test_dataset_non_string_field_and_bad_json_line(tmp_path):
    from lorabench.data import load_gsm8k
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg and "line 1" in msg and "'answer' is a int (4)" in msg and "write it as text" in msg
    path.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n" + '{"question": "3+3?", \n')
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg and "line 2" in msg and "fix or remove that line" in msg


# --- the command line: one line, exit 2, nothing created --------------------------------------------
@pytest.fixture
def run_cli(tiny_model_dir, tmp_path, capsys):
    """`lorabench run` in this process on the tiny model with QUICK_RUN settings plus `extra`; returns
    the error line of a refusal after checking exit code 2, no traceback and that run.out_dir was
    never created."""
    out = tmp_path / "out"

    def refused(*extra, model=str(tiny_model_dir), command="run") -> str:
        from lorabench.cli import main
        args = [command] if command == "resume" else [command, f"model.name_or_path={model}",
                                                      f"run.out_dir={out}", "run.name=r", *QUICK_RUN]
        assert main([*args, *extra]) == 2, capsys.readouterr()
        line = one_line_error(capsys.readouterr().err)
        assert not out.exists(), sorted(out.rglob("*"))
        return line
    return refused


def test_resume_of_a_dir_that_is_not_a_run(tmp_path, run_cli):
    line = run_cli(str(tmp_path), command="resume")
    assert str(tmp_path) in line and "no config.json" in line and "run dir written by lorabench" in line
    assert "start a run there" not in line   # refused by `lorabench run` in a dir that holds other files
    line = run_cli(str(tmp_path / "nope"), command="resume")
    assert f"{tmp_path / 'nope'} does not exist" in line and "that `lorabench run` wrote" in line


@pytest.mark.parametrize("override, needle, fix", [
    ("data.eval_size=0", "data.eval_size=0", "data.eval_size=128"),
    ("lora.dropout=1.5", "lora.dropout=1.5", "[0, 1)"),
    ("grpo.lr=inf", "grpo.lr=inf", "finite number"),
    ("grpo.max_grad_norm=nan", "grpo.max_grad_norm=nan", "finite number"),
    ("grpo.micro_batch=8", "'micro_batch'", "did you mean grpo.micro_batch_tokens?"),
])
def test_config_values_refused_on_the_command_line(run_cli, override, needle, fix):
    line = run_cli(override)
    assert line.startswith("lorabench: config error: ") and needle in line and fix in line


def test_config_file_not_utf8_on_the_command_line(run_cli, tmp_path):
    path = tmp_path / "c.toml"
    path.write_bytes("[grpo]\n# gr\xfc\xdfe\nsteps = 2\n".encode("latin-1"))
    line = run_cli("--config", str(path))
    assert str(path) in line and "not UTF-8" in line and "save it as UTF-8" in line


def test_mistyped_relative_model_dir_fails_fast(run_cli, tmp_path, monkeypatch):
    """A relative dir that does not exist: as a hub name it is looked up once with a short timeout
    (here an endpoint that refuses at once, as an offline machine's DNS does), not for 49 s."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    t0 = time.monotonic()
    line = run_cli(model="modles/tiny-qwen")
    assert time.monotonic() - t0 < 15
    assert "model.name_or_path='modles/tiny-qwen'" in line and f"relative to {os.getcwd()}" in line
    assert "cannot be reached" in line and "HF_HUB_OFFLINE=1" in line and "existing model dir" in line
    line = run_cli(model="models/a/b")                # cannot be a hub name: refused without asking
    assert "does not exist" in line and "existing model dir" in line


def test_hub_model_and_dataset_without_network(run_cli, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    t0 = time.monotonic()
    line = run_cli(model="Qwen/Qwen3-0.6B")
    assert "Qwen/Qwen3-0.6B" in line and "http://127.0.0.1:9" in line and "cannot be reached" in line
    line = run_cli("data.source=hub")
    assert line.startswith("lorabench: error: data.source='hub'") and "cannot be reached" in line
    assert "HF_HUB_OFFLINE=1" in line
    assert time.monotonic() - t0 < 20


def test_hub_offline_mode_needs_a_cached_copy(tiny_model_dir, tmp_path):
    """HF_HUB_OFFLINE=1 with an empty Hugging Face cache, in real processes (the libraries read the
    variable when imported): the model and the dataset are refused at once, naming the cache."""
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = tmp_path / "out"
    base = ["run", f"run.out_dir={out}", "run.name=r", *QUICK_RUN]
    for extra, needles in ((["model.name_or_path=Qwen/Qwen3-0.6B"], ["not in the Hugging Face cache", "hf download"]),
                           ([f"model.name_or_path={tiny_model_dir}", "data.source=hub"],
                            ["not in the datasets cache", "data/gsm8k_sample.jsonl"])):
        proc = cli(*base, *extra, env_extra=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err[-2000:]
        line = one_line_error(err)
        assert all(n in line for n in needles), line
    assert not out.exists()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_sglang_backend_without_sglang(run_cli):
    line = run_cli("engine.backend=sglang")
    assert "engine.backend='sglang'" in line and "sglang package" in line and "engine.backend=hf" in line


def test_engine_device_cuda_without_gpu(run_cli):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = run_cli("engine.hf.device=cuda")
    assert "engine.hf.device='cuda'" in line and "no CUDA GPU" in line and "engine.hf.device=cpu" in line


@pytest.fixture
def read_only_dir(tmp_path):
    """A real read-only filesystem (root writes anywhere else, whatever the modes say)."""
    path = tmp_path / "ro"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True,
                          check=False)
    if done.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root and CAP_SYS_ADMIN)")
    yield path
    subprocess.run(["umount", str(path)], capture_output=True, check=False)


@pytest.mark.parametrize("field_name", ["run.out_dir", "model.cache_dir", "refresh.file.tmp_dir"])
def test_read_only_dirs(run_cli, read_only_dir, tiny_model_dir, field_name):
    """Each dir a run writes, on a read-only filesystem: refused before anything is built (the
    tiny model's cache only matters while the model is not cached yet)."""
    target = read_only_dir / "sub"
    model = "tiny" if field_name == "model.cache_dir" else str(tiny_model_dir)
    line = run_cli(f"{field_name}={target}", model=model)
    assert f"{field_name}='{target}'" in line and f"{read_only_dir} is on a read-only filesystem" in line
    assert f"point {field_name} at a writable directory" in line


def test_engine_log_file_in_a_missing_directory(run_cli, tmp_path):
    """engine.sglang.log_file is opened, not created, when the engine starts: a missing directory is found
    before the run dir or the model exists (the engine's own check is in test_sglang_inplace_unit)."""
    target = tmp_path / "no-such-dir" / "engine.log"
    line = run_cli(f"engine.sglang.log_file={target}")
    assert f"engine.sglang.log_file='{target}'" in line and f"the directory {target.parent} does not exist" in line
    assert "create it, or name a file in an existing directory" in line
    assert not target.parent.exists()


# --- data on the command line: found before the run dir or the model exists ------------------------
def test_dataset_not_utf8_on_the_command_line(run_cli, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes('{"question": "Ren\xe9e has 2 pens?", "answer": "#### 2"}\n'.encode("latin-1"))
    line = run_cli(f"data.source={path}")
    assert f"{path} line 1: not UTF-8" in line and "0xe9" in line and "save the file as UTF-8" in line


def test_dataset_bad_row_on_the_command_line(run_cli, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"question": "q?", "answer": "#### 1"}) + "\n" + '{"question": "3+3?", \n')
    line = run_cli(f"data.source={path}")
    assert f"{path} line 2: not valid JSON" in line and "fix or remove that line" in line


def test_prompts_longer_than_the_context(run_cli, tmp_path):
    """Rows whose prompt does not fit (the tiny model: 512 positions minus grpo.max_new_tokens=4):
    refused with the count and the first offending row, found by tokens or, for a question too
    long in bytes to fit however it tokenises, by its length alone."""
    path = tmp_path / "d.jsonl"
    rows = [{"question": f"Tom has {i} apples. How many?", "answer": f"#### {i}"} for i in range(5)]
    rows[2]["question"] = "Tom has one apple and " * 150 + "how many?"     # ~750 tokens, 3 KB
    rows[4]["question"] = "z" * 50_000                                        # too long in bytes alone
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = run_cli(f"data.source={path}")
    assert "data.source=" in line and "2 of 5 prompts are longer than 508 tokens" in line
    assert "the model's context of 512 minus grpo.max_new_tokens=4" in line
    assert f"the first is {path} line 3 (" in line and "tokens)" in line and "Shorten or remove those rows" in line
    line = run_cli(f"data.source={path}", "data.max_prompt_tokens=600")
    assert "data.max_prompt_tokens=600 plus grpo.max_new_tokens=4 exceeds the model's context of 512" in line
    rows[2]["question"] = "short?"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = run_cli(f"data.source={path}", "data.max_prompt_tokens=100")
    assert "1 of 5 prompts are longer than 100 tokens (data.max_prompt_tokens=100)" in line
    assert f"{path} line 5 (50,000 bytes, so more than 100 tokens; not tokenised)" in line
    assert "raise data.max_prompt_tokens" in line


def test_fifty_megabyte_row_refused_with_bounded_memory(tiny_model_dir, tmp_path):
    """The row that ran 130 s, reached 10 GB and died asking for 214 GB: now refused in seconds by
    its length, read in 1 MiB pieces; the whole process stays far below the row's size."""
    path = tmp_path / "huge.jsonl"
    huge = '{"question": "' + "7" * (50 << 20) + '", "answer": "#### 7"}\n'
    with open(path, "w") as fh:
        fh.write(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
        fh.write(huge)
    out = tmp_path / "out"
    t0 = time.monotonic()
    # the CLI runs as a grandchild, forked from a small launcher: a child forked straight from this
    # test process would start with pytest's whole resident memory counted in its ru_maxrss
    launcher = ("import os, subprocess, sys; p = subprocess.Popen(sys.argv[1:]); _, st, ru = os.wait4(p.pid, 0); "
                "sys.stdout.write(str(ru.ru_maxrss)); sys.exit(os.waitstatus_to_exitcode(st))")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "lorabench.cli", "run",
                           f"model.name_or_path={tiny_model_dir}", f"run.out_dir={out}", f"data.source={path}",
                           *QUICK_RUN], cwd=ROOT, env=env, capture_output=True, text=True)
    err = proc.stderr
    assert proc.returncode == 2, err[-2000:]
    line = one_line_error(err)
    assert f"{path}: 1 line(s) longer than 1,048,576 bytes" in line and f"line 2 ({len(huge):,} bytes)" in line
    peak_mb = int(proc.stdout.strip().splitlines()[-1]) / 1024
    print(f"\n50 MB row: refused in {time.monotonic() - t0:.1f} s, peak RSS {peak_mb:.0f} MB")
    assert peak_mb < 1500 and not out.exists()   # torch and transformers alone are ~400 MB


def test_dataset_file_missing_on_the_command_line(run_cli, tmp_path):
    line = run_cli(f"data.eval_source={tmp_path / 'test.jsonl'}")
    assert f"data.eval_source='{tmp_path / 'test.jsonl'}': dataset file" in line and "does not exist" in line
    assert "'synthetic'" in line


# --- every input whole, before anything exists: rows as the reward reads them, sizes, config files ----------
def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD_ROWS = [{"question": f"Tom has {i} apples. How many?", "answer": f"#### {i}"} for i in range(4)]


@pytest.mark.parametrize("field", ["data.source", "data.eval_source"])
@pytest.mark.parametrize("final", ["five", "5 apples", "NaN", "1e999999999", "7" * 1001])
def test_answer_the_reward_cannot_read_is_refused_before_the_run(run_cli, tmp_path, field, final):
    """A row whose '#### N' the reward cannot read as a number used to pass the check and end the run
    with a traceback when it was drawn (a training row at its step, a held-out row at the first
    evaluation); the fixed file was then refused on resume as changed data. Now it is found with the
    reward's own reading of a number (rewards.normalize_number), before the run dir exists."""
    path = _jsonl(tmp_path / "d.jsonl", [*GOOD_ROWS[:2], {"question": "How many?", "answer": f"so\n#### {final}"},
                                         *GOOD_ROWS[2:]])
    line = run_cli(f"{field}={path}")
    shown = final if len(final) <= 40 else f"{final[:40]}..."
    assert line.startswith(f"lorabench: error: {path} line 3: field 'answer' ends with '#### {shown}'"), line
    assert "which the reward cannot read as a number" in line and "write the answer's last line as '#### N'" in line


@pytest.mark.parametrize("field", ["question", "answer"])
def test_lone_surrogate_in_a_row(run_cli, tmp_path, field):
    """JSON's '\\ud800' escape without its pair: json reads it, and it used to end the check with a
    UnicodeEncodeError traceback (question) or pass it (answer)."""
    row = {"question": "Ana has 2 pens?", "answer": "#### 2"}
    row[field] = row[field].replace("2", "\ud8002", 1)
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD_ROWS[0]) + "\n" + json.dumps(row) + "\n")   # ensure_ascii: the escape
    line = run_cli(f"data.source={path}")
    assert f"{path} line 2: field '{field}' holds '\\ud800'" in line and "lone UTF-16 surrogate" in line


def test_training_file_smaller_than_a_step(run_cli, tmp_path):
    """Fewer rows than grpo.prompts_per_step: every step would hold some problem twice."""
    path = _jsonl(tmp_path / "d.jsonl", GOOD_ROWS[:1])
    line = run_cli(f"data.source={path}")
    assert f"data.source='{path}' has 1 row(s), fewer than grpo.prompts_per_step=2" in line
    assert "set grpo.prompts_per_step <= 1, or give more rows" in line


@pytest.mark.parametrize("field", ["data.source", "data.eval_source"])
def test_data_file_larger_than_half_the_memory(run_cli, tmp_path, field):
    """A sparse 1 TB jsonl used to be read through in 1 MiB pieces for hours; refused by its size."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD_ROWS[0]) + "\n")
    os.truncate(path, 10**12)
    line = run_cli(f"{field}={path}")
    assert f"dataset file {path} is 1,000,000,000,000 bytes, more than half" in line
    assert "held in memory for the whole run" in line


def test_parquet_text_larger_than_half_the_memory(run_cli, tmp_path, monkeypatch):
    """Parquet by its question and answer columns uncompressed (its metadata: nothing is read);
    the machine made small here, as a 1 TB parquet file is not."""
    pd = pytest.importorskip("pandas")
    import lorabench.machine
    path = tmp_path / "d.parquet"
    rows = [{"question": f"Tom has {i} apples. How many?", "answer": f"#### {i}"} for i in range(200)]
    pd.DataFrame(rows).to_parquet(path)    # ~4.4 KB on disk, ~9.4 KB of text uncompressed
    monkeypatch.setattr(lorabench.machine, "machine_memory", lambda device: (16_000, "the memory of this machine"))
    line = run_cli(f"data.source={path}")
    assert f"dataset file {path} holds question and answer columns of" in line and "more than half" in line


def test_warm_start_batch_beyond_the_machine(run_cli, tmp_path):
    """The tiny model's warm-start batch (only while it is still to be built): refused before the
    cache entry exists, instead of an allocation that exhausts the machine."""
    cache = tmp_path / "cache"
    line = run_cli("warmstart.steps=1", "warmstart.batch_size=1000000000", f"model.cache_dir={cache}", model="tiny")
    assert "the tiny model's warm-start: float32 logits of 1,000,000,000 sequences" in line
    assert "lower warmstart.batch_size (now 1000000000" in line
    assert not cache.exists()


@pytest.mark.parametrize("override, needle", [
    ("grpo.temperature=1e-300", "grpo.temperature=1e-300: must be >= 0.01"),   # NaN probabilities at step 0
    ("refresh.bucket_mb=1e308", "refresh.bucket_mb=1e+308: must be in (0, 1048576]"),   # int(inf) building it
    ("run.sample_completions=-1", "run.sample_completions=-1: must be >= 0"),            # rows[:-1]: all but one
    ("grpo.epochs=" + "1" * 5000, "grpo.epochs: '1111111111"),                           # printed whole before
])
def test_numbers_later_code_cannot_take(run_cli, override, needle):
    line = run_cli(override)
    assert needle in line and len(line) < 400, line


@pytest.mark.parametrize("text, needle", [
    ('{"grpo": {"epochs": "2"}}', "grpo.epochs: '2' is a string (in quotes), not a whole number"),
    ('{"grpo": {"epochs": 2.0}}', "grpo.epochs: 2.0 is a float, not a whole number"),
    ('{"grpo": {"epochs": Infinity}}', "grpo.epochs: inf is a float, not a whole number"),   # was OverflowError
    ('{"grpo": {"kl_metric": "false"}}', "grpo.kl_metric: 'false' is a string (in quotes), not a boolean"),
    ('{"grpo": {"lr": true}}', "grpo.lr: True is a boolean, not a number"),
    ('{"run": {"name": 5}}', "run.name: 5 is an integer, not a string; put it in quotes"),
    ('{"lora": {"target_modules": ["q_proj", 1]}}', "lora.target_modules: ['q_proj', 1] is a list with an integer"),
    ('{"grpo": 5}', "grpo must be a table/object, got 5"),
    ('{"policies": [{"name": "a", "lora": {"r": "4"}}]}', "policies[0].lora.r: '4' is a string (in quotes)"),
])
def test_config_file_values_must_have_their_type(run_cli, tmp_path, text, needle):
    """A file's values are typed: '2' for an int, 2.0 for an int or 'false' for a boolean were taken
    (and Infinity for an int was an OverflowError traceback); text is converted only from overrides."""
    path = tmp_path / "c.json"
    path.write_text(text)
    line = run_cli("--config", str(path))
    assert line.startswith(f"lorabench: config error: {path}: {needle}"), line


def test_config_file_values_must_have_their_type_in_toml(run_cli, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[grpo]\nepochs = inf\n")
    assert f"{path}: grpo.epochs: inf is a float, not a whole number" in run_cli("--config", str(path))
    path.write_text('[run]\nseed = "7"\n')
    assert f"{path}: run.seed: '7' is a string (in quotes), not a whole number" in run_cli("--config", str(path))


@pytest.mark.parametrize("text, needle", [
    ('{"grpo": {\n  "epochs": 2,\n  "epochs": 3\n}}', "grpo.epochs is given twice (lines 2 and 3), 2 then 3"),
    ('{"grpo": {"epochs": 2}, "grpo": {"lr": 0.1}}', "grpo is given twice (line 1), {'epochs': 2} then {'lr': 0.1}"),
    ('{"policies": [{"name": "a", "name": "b"}]}', "policies[0].name is given twice (line 1), 'a' then 'b'"),
])
def test_json_key_given_twice(run_cli, tmp_path, text, needle):
    """json.loads keeps the last of two values; TOML refuses the file (tomllib: 'Cannot overwrite a
    value'), and so does lorabench for JSON now."""
    path = tmp_path / "c.json"
    path.write_text(text)
    line = run_cli("--config", str(path))
    assert f"config file {path}: {needle}" in line and "keep the one you mean" in line, line
    toml = tmp_path / "c.toml"
    toml.write_text("[grpo]\nepochs = 2\nepochs = 3\n")
    line = run_cli("--config", str(toml))
    assert f"config file {toml} is not valid toml: Cannot overwrite a value (at line 3" in line


def test_config_file_that_is_not_an_object(run_cli, tmp_path):
    """A JSON list at the top level (an AttributeError traceback once an override was applied to it)."""
    path = tmp_path / "c.json"
    path.write_text("[1]")
    assert f"config file {path}: the top level must be an object of sections, got [1]" in run_cli("--config", str(path))


@pytest.mark.parametrize("suffix, text", [(".json", '{"grpo": {"epochs": 1' + "0" * 5000 + "}}"),
                                          (".toml", "[grpo]\nepochs = 1" + "0" * 5000 + "\n")])
def test_config_file_number_longer_than_python_reads(run_cli, tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    line = run_cli("--config", str(path))
    assert f"config file {path} holds a number of more than 4,300 digits" in line and "shorten it" in line


@pytest.mark.parametrize("where", ["after", "before"])
def test_override_errors_name_the_override_not_the_file(run_cli, tmp_path, where):
    """With --config, an override's bad value was reported as the file's; overrides after --config
    were refused by argparse ('unrecognized arguments')."""
    path = tmp_path / "c.json"
    path.write_text('{"grpo": {"epochs": 1}, "model": {"dtype": "float32"}}')

    def refused(override):
        return run_cli(*(["--config", str(path), override] if where == "after" else [override, "--config", str(path)]))
    line = refused("grpo.lr=abc")
    assert line.startswith("lorabench: config error: override 'grpo.lr=abc': grpo.lr: 'abc' is not a float"), line
    assert str(path) not in line
    line = refused("grpo.lrr=1")
    assert line.startswith("lorabench: config error: override 'grpo.lrr=1': grpo: unknown key(s) ['lrr']"), line
    line = refused("grpo.group_size=1")
    assert line.startswith("lorabench: config error: override 'grpo.group_size=1': grpo.group_size=1: "), line
    line = refused("grpo.lora_compute=bfloat16")   # a problem of two values from two places names both
    assert line.startswith(f"lorabench: config error: override 'grpo.lora_compute=bfloat16' (grpo.lora_compute), "
                           f"{path} (model.dtype): grpo.lora_compute=bfloat16 with model.dtype=float32"), line


def test_file_problems_name_the_file(run_cli, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[grpo]\nepochs = 0\n")
    line = run_cli("--config", str(path))
    assert line.startswith(f"lorabench: config error: {path}: grpo.epochs=0: must be >= 1"), line


@pytest.mark.parametrize("section, value, key", [
    ("model", {"cache_dir": "a\0b"}, "model.cache_dir='a\\x00b'"),
    ("refresh", {"file": {"tmp_dir": "a\0b"}}, "refresh.file.tmp_dir='a\\x00b'"),
    ("data", {"source": "a\0b.jsonl"}, "data.source='a\\x00b.jsonl'"),
    ("lora", {"target_modules": ["q_proj", "v\0"]}, "lora.target_modules=['q_proj', 'v\\x00']"),
])
def test_nul_character_in_a_string_setting(run_cli, tmp_path, section, value, key):
    """A NUL passed the checks of every path but run.out_dir, and the OS call that first used it raised
    ValueError (or the message printed it raw)."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({section: value}))
    line = run_cli("--config", str(path))
    assert f"{path}: {key} contains a NUL character; no setting can hold one: remove it" in line, line


def test_bad_row_with_the_tiny_model_leaves_no_cache_entry(run_cli, tmp_path):
    """With model 'tiny' not cached yet, the rows are checked before the model is built: no cache entry."""
    cache = tmp_path / "cache"
    path = _jsonl(tmp_path / "d.jsonl", [*GOOD_ROWS, {"question": "How many?", "answer": "#### five"}])
    line = run_cli("warmstart.steps=1", f"model.cache_dir={cache}", f"data.source={path}", model="tiny")
    assert f"{path} line 5: field 'answer' ends with '#### five'" in line
    assert not cache.exists()


def test_held_out_file_smaller_than_eval_size_is_a_note(tiny_model_dir, tmp_path):
    """Not an error: the evaluation scores every held-out row (each evals.jsonl row carries its n), as
    `data.source=data/gsm8k_sample.jsonl` (48 rows) does at the default data.eval_size=128."""
    from lorabench.session.preflight import preflight
    held_out = _jsonl(tmp_path / "test.jsonl", GOOD_ROWS[:3])
    cfg = Config.load(overrides=[f"model.name_or_path={tiny_model_dir}", f"run.out_dir={tmp_path / 'out'}", *QUICK_RUN,
                                 f"data.eval_source={held_out}", "data.eval_size=4"])
    notes = []
    preflight(cfg, log=notes.append)
    assert f"note: {held_out} has 3 rows, fewer than data.eval_size=4; all are used" in notes
    assert not (tmp_path / "out").exists()
