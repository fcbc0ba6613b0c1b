"""Bad input gets a clear error, and nothing is lost: the catalogue cases that no other test file
covers. Each asserts the error type, that the message names the culprit (file, field or value)
and the fix, and where it matters that nothing was lost (the engine keeps serving, the trainer
keeps its state). The whole catalogue, with the cases tested elsewhere, is the table in
docs/reliability.md."""
from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch

from conftest import perturb_lora_B
from reliability_util import FullDisk, make_trainer  # noqa: F401 (fixture)
from lorabench.adapters import AdapterError, AdapterSnapshot, AdapterWriteError, linear_shapes, validate
from lorabench.config import Config, ConfigError
from lorabench.data import DataError, ProblemSource
from lorabench.engines.base import EngineError
from lorabench.models import ModelError, resolve_model_path


def _comparable(row):
    from lorabench.runlog import _clean
    return {k: v for k, v in _clean(row).items()
            if not k.startswith("time/") and not (k.startswith("refresh/") and k.endswith("_s"))}


# --- model --------------------------------------------------------------------------------------
def test_model_path_missing(tmp_path):
    missing = tmp_path / "no-such-model"
    cfg = Config.load(overrides=[f"model.name_or_path={missing}"])
    with pytest.raises(ModelError) as info:
        resolve_model_path(cfg)
    msg = str(info.value)
    assert "model.name_or_path" in msg and str(missing) in msg and "does not exist" in msg
    assert "existing model dir" in msg and "'tiny'" in msg                     # the fix


def test_model_dir_without_config_json(tmp_path):
    (tmp_path / "weights-only").mkdir()
    cfg = Config.load(overrides=[f"model.name_or_path={tmp_path / 'weights-only'}"])
    with pytest.raises(ModelError) as info:
        resolve_model_path(cfg)
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
    with pytest.raises(ConfigError) as info:
        sglang_target_modules(target)
    msg = str(info.value)
    assert repr(target) in msg and "regular expression" in msg and "q_proj" in msg
    assert sglang_target_modules("all-linear") == ["all"]
    with pytest.raises(ConfigError, match="not module names"):
        sglang_target_modules(["q_proj", target])


# --- engine start ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", ["0", "1.5", "-0.2"])
def test_sglang_bad_mem_fraction_refused_before_start(fraction, capsys):
    """A memory fraction SGLang cannot start with is refused at config time: the CLI exits with
    a one-line message (no traceback, no engine process, nothing that could kill a kernel)."""
    overrides = ["engine.backend=sglang", f"engine.mem_fraction_static={fraction}"]
    with pytest.raises(ConfigError) as info:
        Config.load(overrides=overrides)
    msg = str(info.value)
    assert f"engine.mem_fraction_static={float(fraction)}" in msg and "between 0 and 1" in msg
    from lorabench.cli import main
    assert main(["run", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lorabench: config error: engine.mem_fraction_static") and "Traceback" not in err


def test_engine_refuses_model_of_another_shape(make_trainer, tiny_model_dir, tmp_path):
    """Trainer and engine loaded from different models: the engine's own check refuses the
    adapter at the first refresh, and the error carries the engine's message."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from lorabench.engines.hf import HFEngine
    from lorabench.grpo import GRPOTrainer
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    config = AutoConfig.from_pretrained(other)
    config.intermediate_size = 384
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    cfg = Config.load(overrides=["engine.device=cpu", "refresh.mode=tensor", "lora.r=4", "lora.alpha=8"])
    engine = HFEngine(str(other), cfg)
    try:
        with pytest.raises(AdapterError) as info:
            GRPOTrainer(cfg, str(tiny_model_dir), engine, log=lambda *a: None)
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
    good = AdapterSnapshot.from_peft(make_peft_model(seed=0))
    engine.load_adapter_tensors("policy", good.tensors, good.config)
    serving = engine.score(seqs, lens, "policy")
    bad_config = dict(good.config, layers_to_transform=[0])
    validate(AdapterSnapshot(good.tensors, bad_config), engine._shapes)  # nothing wrong on its face
    with pytest.raises(EngineError) as info:
        engine.load_adapter_tensors("candidate", good.tensors, bad_config)
    msg = str(info.value)
    assert "'candidate'" in msg and "model.layers.1." in msg and "unexpected" in msg   # culprit
    assert "layers_to_transform" in msg and "target_modules" in msg                     # the fix
    assert engine.loaded_adapters() == ["policy"]
    assert all(torch.equal(a, b) for a, b in zip(serving, engine.score(seqs, lens, "policy")))


def test_nan_adapter_never_reaches_engine(engine, make_peft_model, sample_sequences, tmp_path):
    """Inf (NaN is tests/test_refresh.py) in the trainer's adapter: the refresh is refused
    before the engine is called, naming the tensor; the engine serves the previous adapter."""
    from lorabench.refresh import TensorRefresh
    seqs, lens = sample_sequences
    model = make_peft_model(seed=0)
    refresher = TensorRefresh(engine, "policy", device="cpu")
    refresher.refresh(model, 1)
    serving = engine.score(seqs, lens, "policy")
    name, param = next((n, p) for n, p in model.named_parameters() if "lora_A" in n)
    with torch.no_grad():
        param[0, 0] = float("inf")
    with pytest.raises(AdapterError) as info:
        refresher.refresh(model, 2)
    msg = str(info.value)
    assert "NaN/Inf" in msg and "grpo.lr" in msg and "not sent to the engine" in msg
    assert name.replace(".default", "").split("lora_A")[0] in msg
    assert all(torch.equal(a, b) for a, b in zip(serving, engine.score(seqs, lens, "policy")))
    assert refresher.refreshes == 1


# --- a refresh that fails mid-run: the trainer keeps its state -------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    disk = FullDisk(tmp_path / "tmpfs", size_kb=8192)  # room for two r=16 adapters (1 MB each)
    if not disk.mount():
        pytest.skip("cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)")
    yield disk
    disk.unmount()


def test_failed_refresh_rolls_the_step_back(make_trainer, small_disk, tmp_path, sample_sequences):
    """File refresh onto a filesystem that fills up mid-run (a real ENOSPC): step() raises a
    clear error; the trainer keeps its state (adapter, optimizer, step count, history, run dir
    rows, checkpoint); the engine keeps serving the last good adapter; once there is space again
    the run continues exactly as an uninterrupted run."""
    seqs, lens = sample_sequences
    reference = [r.metrics for r in make_trainer(tmp_path / "reference").run(progress=False)]
    trainer = make_trainer(tmp_path / "run", f"refresh.tmp_dir={small_disk.path}")
    trainer.step()
    state = (trainer.snapshot(), json.dumps(trainer.optimizer.state_dict()["state"], default=lambda t: t.tolist()))
    serving = trainer.engine.score(seqs, lens, "policy")
    small_disk.fill()
    with pytest.raises(AdapterWriteError) as info:
        trainer.step()
    err = info.value
    assert err.errno == errno.ENOSPC
    assert "no space left" in str(err) and str(trainer.refresher.root) in str(err) and "refresh.tmp_dir" in str(err)
    assert any("rolled back" in note and "step 1" in note for note in err.__notes__)
    # nothing lost, nothing half-done
    assert trainer.step_count == 1 and len(trainer.history) == 1
    snap = trainer.snapshot()
    assert all(torch.equal(snap.tensors[k], state[0].tensors[k]) for k in snap.tensors)
    assert json.dumps(trainer.optimizer.state_dict()["state"], default=lambda t: t.tolist()) == state[1]
    assert [r["step"] for r in trainer.runlog.metrics()] == [1]
    assert torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(serving, trainer.engine.score(seqs, lens, "policy")))
    # space again: the same step 2, then step 3, as if nothing had happened
    small_disk.free()
    assert _comparable(trainer.step().metrics) == _comparable(reference[1])
    assert _comparable(trainer.step().metrics) == _comparable(reference[2])
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
    assert str(path) in msg and "row 2" in msg and "####" in msg and "'it is 4'" in msg


def test_dataset_non_string_field_and_bad_json_line(tmp_path):
    from lorabench.data import load_gsm8k
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "answer": 4}) + "\n")
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg and "row 1" in msg and "'answer' is a int (4)" in msg and "write it as text" in msg
    path.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n" + '{"question": "3+3?", \n')
    with pytest.raises(DataError) as info:
        load_gsm8k("train", str(path))
    msg = str(info.value)
    assert str(path) in msg and "line 2" in msg and "fix or remove that line" in msg


# --- resume ------------------------------------------------------------------------------------------
def test_resume_of_a_dir_that_is_not_a_run(tmp_path, capsys):
    from lorabench.cli import main
    assert main(["resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "config.json" in err and "run dir written by lorabench" in err
