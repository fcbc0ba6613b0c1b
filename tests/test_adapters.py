"""Adapter snapshots: plain-JSON config, private atomic PEFT dirs, validation, name mapping, merging."""
import copy
import json
import os
import stat

import pytest
import torch

from conftest import max_abs_diff, model_logprobs
from lorabench.adapters import (CONFIG_NAME, PEFT_PREFIX, WEIGHTS_NAME, AdapterError, AdapterSnapshot,
                                base_param_name, linear_shapes, merged_state_dict, plain_config,
                                split_lora_key, validate)

PROJECTIONS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def peft_model(make_peft_model):
    return make_peft_model()


@pytest.fixture
def snapshot(peft_model):
    return AdapterSnapshot.from_peft(peft_model, step=3)


# --- config ---------------------------------------------------------------------------------------
def test_from_peft_config_is_plain_json(snapshot, peft_model):
    cfg = snapshot.config
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["peft_type"] == "LORA" and type(cfg["peft_type"]) is str
    assert "task_type" not in cfg or type(cfg["task_type"]) is str
    assert cfg["r"] == peft_model.peft_config["default"].r
    assert cfg["lora_alpha"] == peft_model.peft_config["default"].lora_alpha
    # 'all-linear' resolved by PEFT: the leaf names the adapter really covers, as a list
    assert cfg["target_modules"] == PROJECTIONS
    assert snapshot.step == 3
    assert snapshot.rank == cfg["r"] and snapshot.scaling == cfg["lora_alpha"] / cfg["r"]


def test_from_peft_task_type_becomes_string(tiny_model_dir):
    from peft import LoraConfig, TaskType, get_peft_model
    from lorabench.models import load_model
    model = get_peft_model(load_model(str(tiny_model_dir)),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                      task_type=TaskType.CAUSAL_LM))
    cfg = AdapterSnapshot.from_peft(model).config
    assert cfg["task_type"] == "CAUSAL_LM" and type(cfg["task_type"]) is str
    assert cfg["peft_type"] == "LORA" and type(cfg["peft_type"]) is str
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    json.dumps(cfg)


def test_plain_config_keeps_all_linear_string():
    from peft import LoraConfig
    cfg = plain_config(LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    assert cfg["target_modules"] == "all-linear"      # never list('all-linear')
    assert cfg["peft_type"] == "LORA"
    json.dumps(cfg)
    # also from a plain dict (an adapter_config.json read back)
    assert plain_config({"r": 4, "lora_alpha": 8, "target_modules": "all-linear"})["target_modules"] == "all-linear"


def test_plain_config_sets_to_sorted_leaf_names():
    cfg = plain_config({"r": 4, "lora_alpha": 8, "peft_type": "LORA",
                        "target_modules": {"model.layers.0.self_attn.v_proj", "q_proj"}})
    assert cfg["target_modules"] == ["q_proj", "v_proj"]


def test_snapshot_tensors_are_detached_copies(peft_model, snapshot):
    assert all(not t.requires_grad for t in snapshot.tensors.values())
    name = next(n for n, _ in peft_model.named_parameters() if "lora_B" in n)
    key = name.replace(".default.", ".")
    before = snapshot.tensors[key].clone()
    with torch.no_grad():
        dict(peft_model.named_parameters())[name].add_(1.0)
    assert torch.equal(snapshot.tensors[key], before)   # training on does not change a snapshot
    assert snapshot.nbytes == sum(t.numel() * 4 for t in snapshot.tensors.values())
    assert snapshot.delta_norm() > 0


def test_fresh_adapter_has_zero_delta(make_peft_model):
    assert AdapterSnapshot.from_peft(make_peft_model(perturb=False)).delta_norm() == 0.0


# --- files ----------------------------------------------------------------------------------------
def test_save_peft_dir_private_and_atomic(snapshot, tmp_path):
    parent = tmp_path / "adapters"
    path = snapshot.save_peft_dir(parent / "policy")
    assert _mode(path) == 0o700
    assert sorted(os.listdir(path)) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        assert _mode(path / name) == 0o600
    assert os.listdir(parent) == ["policy"]            # no temp dirs left next to it
    back = AdapterSnapshot.load_peft_dir(path)
    assert back.config == snapshot.config
    assert back.tensors.keys() == snapshot.tensors.keys()
    assert all(torch.equal(back.tensors[k], snapshot.tensors[k]) for k in snapshot.tensors)


def test_save_peft_dir_overwrites_existing(snapshot, tmp_path, make_peft_model):
    path = snapshot.save_peft_dir(tmp_path / "policy")
    (path / "stale.txt").write_text("from an older write")
    other = AdapterSnapshot.from_peft(make_peft_model(seed=1))
    other.save_peft_dir(path)
    assert sorted(os.listdir(path)) == sorted([CONFIG_NAME, WEIGHTS_NAME])
    assert os.listdir(tmp_path) == ["policy"]
    assert _mode(path) == 0o700
    back = AdapterSnapshot.load_peft_dir(path)
    assert all(torch.equal(back.tensors[k], other.tensors[k]) for k in other.tensors)
    assert not all(torch.equal(back.tensors[k], snapshot.tensors[k]) for k in other.tensors)


def test_saved_dir_loads_in_peft_with_identical_logits(tiny_model_dir, peft_model, snapshot, tmp_path,
                                                       sample_sequences):
    from peft import PeftModel
    from lorabench.models import load_model
    path = snapshot.save_peft_dir(tmp_path / "policy")
    loaded = PeftModel.from_pretrained(load_model(str(tiny_model_dir)), str(path)).eval()
    ids = torch.tensor([sample_sequences[0][0]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        base = loaded.get_base_model()
        with loaded.disable_adapter():
            base_logits = base(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert (got - base_logits).abs().max() > 1e-3      # the adapter is not a no-op


def test_peft_save_pretrained_loads_into_engine(engine, peft_model, tmp_path, sample_sequences):
    peft_model.save_pretrained(str(tmp_path / "peft-saved"))
    engine.load_adapter("policy", tmp_path / "peft-saved")
    seqs, lens = sample_sequences
    got = engine.score(seqs, lens, "policy")
    want = model_logprobs(peft_model, seqs, lens)
    assert max_abs_diff(got, want) < 1e-5
    with peft_model.disable_adapter():
        base = model_logprobs(peft_model, seqs, lens)
    assert max_abs_diff(got, base) > 1e-3


def test_load_peft_dir_errors(snapshot, tmp_path):
    with pytest.raises(AdapterError, match="does not exist"):
        AdapterSnapshot.load_peft_dir(tmp_path / "missing")
    path = snapshot.save_peft_dir(tmp_path / "a")
    (path / CONFIG_NAME).unlink()
    with pytest.raises(AdapterError, match=CONFIG_NAME):
        AdapterSnapshot.load_peft_dir(path)

    path = snapshot.save_peft_dir(tmp_path / "b")
    (path / WEIGHTS_NAME).unlink()
    with pytest.raises(AdapterError, match=WEIGHTS_NAME):
        AdapterSnapshot.load_peft_dir(path)

    path = snapshot.save_peft_dir(tmp_path / "c")
    (path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        AdapterSnapshot.load_peft_dir(path)


def test_load_peft_dir_truncated_weights(snapshot, tmp_path):
    path = snapshot.save_peft_dir(tmp_path / "a")
    data = (path / WEIGHTS_NAME).read_bytes()
    (path / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="truncated or corrupt") as info:
        AdapterSnapshot.load_peft_dir(path)
    assert str(path / WEIGHTS_NAME) in str(info.value)


def test_engine_refuses_truncated_dir(engine, snapshot, tmp_path):
    path = snapshot.save_peft_dir(tmp_path / "a")
    data = (path / WEIGHTS_NAME).read_bytes()
    (path / WEIGHTS_NAME).write_bytes(data[:100])
    with pytest.raises(AdapterError):
        engine.load_adapter("policy", path)
    assert engine.loaded_adapters() == []


# --- validation -----------------------------------------------------------------------------------
def _first_key(snapshot, half="lora_A"):
    return next(k for k in sorted(snapshot.tensors) if k.endswith(f"{half}.weight"))


def test_validate_accepts_real_snapshot(snapshot, peft_model):
    validate(snapshot, linear_shapes(peft_model), max_rank=snapshot.rank)
    validate(snapshot)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_validate_refuses_non_finite(snapshot, bad):
    key = _first_key(snapshot, "lora_B")
    snapshot.tensors[key][0, 0] = bad
    with pytest.raises(AdapterError, match="NaN/Inf") as info:
        validate(snapshot)
    assert key in str(info.value)


def test_validate_rank_mismatch(snapshot):
    snapshot.config["r"] = snapshot.rank + 1
    with pytest.raises(AdapterError, match="rank"):
        validate(snapshot)


def test_validate_missing_lora_B(snapshot):
    key = _first_key(snapshot, "lora_B")
    del snapshot.tensors[key]
    with pytest.raises(AdapterError, match="lora_B") as info:
        validate(snapshot)
    assert split_lora_key(key)[0] in str(info.value)


def test_validate_module_not_in_model(snapshot, peft_model):
    a = snapshot.tensors[_first_key(snapshot, "lora_A")]
    b = snapshot.tensors[_first_key(snapshot, "lora_B")]
    snapshot.tensors[f"{PEFT_PREFIX}model.layers.99.self_attn.q_proj.lora_A.weight"] = a.clone()
    snapshot.tensors[f"{PEFT_PREFIX}model.layers.99.self_attn.q_proj.lora_B.weight"] = b.clone()
    validate(snapshot)  # nothing wrong without the model's shapes
    with pytest.raises(AdapterError, match="layers.99") as info:
        validate(snapshot, linear_shapes(peft_model))
    assert "does not have" in str(info.value)


def test_validate_shape_mismatch(snapshot, peft_model):
    key = _first_key(snapshot, "lora_A")
    r, n_in = snapshot.tensors[key].shape
    snapshot.tensors[key] = torch.zeros(r, n_in + 1)
    with pytest.raises(AdapterError, match="another model"):
        validate(snapshot, linear_shapes(peft_model))


def test_validate_rank_above_engine_max(snapshot):
    with pytest.raises(AdapterError, match="max_lora_rank"):
        validate(snapshot, max_rank=snapshot.rank - 1)


def test_validate_target_modules_split_into_characters(snapshot):
    snapshot.config["target_modules"] = list("all-linear")
    with pytest.raises(AdapterError, match="characters"):
        validate(snapshot)


def test_validate_module_outside_target_modules(snapshot):
    snapshot.config["target_modules"] = ["q_proj"]
    with pytest.raises(AdapterError, match="target_modules"):
        validate(snapshot)


def test_validate_non_lora_and_empty(snapshot):
    bad = AdapterSnapshot(dict(snapshot.tensors), {**snapshot.config, "peft_type": "IA3"})
    with pytest.raises(AdapterError, match="LORA"):
        validate(bad)
    with pytest.raises(AdapterError, match="no tensors"):
        validate(AdapterSnapshot({}, dict(snapshot.config)))
    with pytest.raises(AdapterError, match="not a LoRA weight"):
        validate(AdapterSnapshot({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}, dict(snapshot.config)))


# --- names ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, expected", [
    ("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight", ("model.layers.0.mlp.up_proj", "lora_A")),
    ("base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight",
     ("model.layers.3.self_attn.q_proj", "lora_B")),
    ("model.layers.1.self_attn.o_proj.lora_B.weight", ("model.layers.1.self_attn.o_proj", "lora_B")),
])
def test_split_lora_key(key, expected):
    assert split_lora_key(key) == expected


@pytest.mark.parametrize("key", ["base_model.model.model.layers.0.mlp.up_proj.base_layer.weight",
                                 "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight",
                                 "lora_A.weight", "model.layers.0.mlp.up_proj.lora_A.bias"])
def test_split_lora_key_refuses_other_names(key):
    with pytest.raises(AdapterError):
        split_lora_key(key)


@pytest.mark.parametrize("name, expected", [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("base_model.model.model.norm.weight", "model.norm.weight"),
    ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
])
def test_base_param_name(name, expected):
    assert base_param_name(name) == expected


def test_base_param_names_match_plain_model(peft_model, tiny_model_dir):
    from lorabench.models import load_model
    plain = {n for n, _ in load_model(str(tiny_model_dir)).named_parameters()}
    mapped = {base_param_name(n) for n, _ in peft_model.named_parameters() if ".lora_" not in n}
    assert mapped == plain
    # and the engine-facing adapter names cover exactly the plain model's Linear layers (no lm_head)
    modules = AdapterSnapshot.from_peft(peft_model).modules
    shapes = linear_shapes(peft_model)
    assert shapes == linear_shapes(load_model(str(tiny_model_dir)))  # PEFT wrappers unwrapped
    assert set(modules) <= set(shapes)
    assert set(shapes) - set(modules) == {"lm_head"}


# --- merging --------------------------------------------------------------------------------------
def test_merged_state_dict_equals_peft_merge(peft_model):
    base_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if ".lora_" not in n}
    merged = merged_state_dict(peft_model)
    reference = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) <= set(reference)
    assert set(merged) == {base_param_name(n) for n in base_before}
    changed = 0
    for name, tensor in merged.items():
        assert tensor.dtype == reference[name].dtype
        assert torch.allclose(tensor, reference[name], atol=1e-6, rtol=0), name
        changed += not torch.equal(tensor, base_before[next(n for n in base_before if base_param_name(n) == name)])
    assert changed == len(AdapterSnapshot.from_peft(peft_model).modules)   # every adapted layer moved
    # the trainer's base weights are untouched (bit-identical) and still not merged
    after = {n: p.detach() for n, p in peft_model.named_parameters() if ".lora_" not in n}
    assert all(torch.equal(after[n], base_before[n]) for n in base_before)
    assert not any(getattr(m, "merged", False) for m in peft_model.modules())


def test_merged_weights_give_adapter_logits(peft_model, tiny_model_dir, sample_sequences):
    from lorabench.models import load_model
    plain = load_model(str(tiny_model_dir))
    missing, unexpected = plain.load_state_dict(merged_state_dict(peft_model), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to embed_tokens
    seqs, lens = sample_sequences
    assert max_abs_diff(model_logprobs(plain, seqs, lens), model_logprobs(peft_model, seqs, lens)) < 1e-5
