"""Refresh strategies against the real HFEngine: after refresh(model, step) the engine's log-probs
equal the trainer's, for every mode and bucket size (multi-bucket sync verified)."""
import os
import stat

import pytest
import torch

from conftest import max_abs_diff, model_logprobs, perturb_lora_B
from lorabench.adapters import AdapterError
from lorabench.config import Config
from lorabench.engines.base import AdapterNotLoaded, EngineError
from lorabench.refresh import (FileRefresh, InPlaceRefresh, MergedRefresh, NoRefresh, RefreshRecord, TensorRefresh,
                               make_refresher, pack_buckets)


# --- buckets --------------------------------------------------------------------------------------
def _named(sizes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    names = [f"t{int(i):03d}" for i in torch.randperm(len(sizes), generator=gen)]
    return [(n, torch.zeros(s)) for n, s in zip(names, sizes)]


@pytest.mark.parametrize("bucket_bytes", [1, 16, 40, 100, 400, 10_000])
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_buckets(bucket_bytes, seed):
    gen = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 30, (25,), generator=gen)]   # float32: 4..116 bytes
    named = _named(sizes, seed)
    buckets = pack_buckets(named, bucket_bytes)
    flat = [n for bucket in buckets for n, _ in bucket]
    assert sorted(flat) == sorted(n for n, _ in named)       # every tensor exactly once
    assert flat == sorted(flat)                              # in name order
    assert all(bucket for bucket in buckets)                 # no empty buckets
    by_name = dict(named)
    for i, bucket in enumerate(buckets):
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if len(bucket) > 1:
            assert nbytes <= bucket_bytes                    # the limit holds...
        else:
            assert nbytes <= bucket_bytes or by_name[bucket[0][0]].numel() * 4 > bucket_bytes  # ...or oversize alone
        if i + 1 < len(buckets):                             # greedy: the next tensor did not fit
            first_next = buckets[i + 1][0][1]
            assert nbytes + first_next.numel() * first_next.element_size() > bucket_bytes
    if bucket_bytes >= sum(sizes) * 4:
        assert len(buckets) == 1
    if bucket_bytes == 1:
        assert len(buckets) == len(named)


def test_pack_buckets_keeps_tensors_and_handles_empty():
    named = [("b", torch.arange(3.0)), ("a", torch.arange(5.0))]
    buckets = pack_buckets(named, 1 << 20)
    assert [n for n, _ in buckets[0]] == ["a", "b"]
    assert buckets[0][0][1] is named[1][1]
    assert pack_buckets([], 100) == []


# --- exact refresh, every mode --------------------------------------------------------------------
MODES = {"file": FileRefresh, "tensor": TensorRefresh, "inplace": InPlaceRefresh, "merged": MergedRefresh}
PARTS = {"file": {"snapshot", "stage", "write", "unload", "load"}, "tensor": {"snapshot", "stage", "unload", "load"},
         "merged": {"merge", "push"}}


def parts_of(mode: str, step: int) -> set[str]:
    """In-place: the first refresh loads (as tensor), later ones write into the loaded adapter."""
    if mode == "inplace":
        return PARTS["tensor"] if step == 1 else {"snapshot", "stage", "write"}
    return PARTS[mode]


def _refresher(mode, engine, tmp_path, bucket_mb=64.0):
    kw = {"tmp_dir": str(tmp_path)} if mode == "file" else {}
    return MODES[mode](engine, "policy", bucket_mb=bucket_mb, **kw)


@pytest.mark.parametrize("bucket_mb", [64.0, 0.01])
@pytest.mark.parametrize("mode", ["file", "tensor", "inplace", "merged"])
def test_refresh_is_exact(mode, bucket_mb, engine, make_peft_model, sample_sequences, tmp_path):
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    base = engine.score(seqs, lens, None)
    refresher = _refresher(mode, engine, tmp_path, bucket_mb)
    try:
        for step in (1, 2):          # the second refresh replaces the first (unload + load / overwrite)
            perturb_lora_B(model, seed=10 + step)
            record = refresher.refresh(model, step)
            want = model_logprobs(model, seqs, lens)
            got = engine.score(seqs, lens, refresher.serving_adapter)
            assert max_abs_diff(got, want) < 1e-5
            assert max_abs_diff(got, base) > 1e-3           # not trivially the base model

            assert isinstance(record, RefreshRecord)
            assert (record.mode, record.step) == (mode, step)
            assert set(record.parts) == parts_of(mode, step)
            assert all(v >= 0 for v in record.parts.values())
            assert record.total_s == pytest.approx(sum(record.parts.values()))
            assert record.nbytes > 0
            assert sum(b["tensors"] for b in record.buckets) == (
                len(record.buckets) and (len(_tensors(mode, model))))
            assert sum(b["bytes"] for b in record.buckets) == record.nbytes
            if bucket_mb < 1:
                assert len(record.buckets) > 5                # many buckets: multi-bucket sync verified
            else:
                assert len(record.buckets) == 1
            assert [b["bucket"] for b in record.buckets] == list(range(len(record.buckets)))
            rows = record.rows()
            assert [r["row"] for r in rows] == ["bucket"] * len(record.buckets) + ["refresh"]
            total = rows[-1]
            assert total["step"] == step and total["mode"] == mode and total["bytes"] == record.nbytes
            assert total["buckets"] == len(record.buckets)
            assert {f"{p}_s" for p in parts_of(mode, step)} <= set(total)
        assert refresher.refreshes == 2
        if mode == "merged":
            assert refresher.serving_adapter is None and engine.loaded_adapters() == []
        else:
            assert refresher.serving_adapter == "policy" and engine.loaded_adapters() == ["policy"]
    finally:
        refresher.close()


def _tensors(mode, model):
    from lorabench.adapters import AdapterSnapshot, merged_state_dict
    return merged_state_dict(model) if mode == "merged" else AdapterSnapshot.from_peft(model).tensors


def test_refresh_first_time_and_trainer_untouched(engine, make_peft_model, sample_sequences, tmp_path):
    """The first refresh has nothing to unload; the trainer's weights are not changed by any mode."""
    model = make_peft_model(seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for mode in MODES:
        (tmp_path / mode).mkdir()
        refresher = _refresher(mode, engine, tmp_path / mode)
        refresher.refresh(model, 0)
        refresher.close()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_file_refresh_private_dirs_and_cleanup(engine, make_peft_model, tmp_path):
    model = make_peft_model()
    refresher = FileRefresh(engine, "policy", tmp_dir=str(tmp_path))
    root = refresher.root
    assert root.parent == tmp_path and stat.S_IMODE(os.stat(root).st_mode) == 0o700
    refresher.refresh(model, 1)
    first = sorted(root.iterdir())
    assert len(first) == 1 and stat.S_IMODE(os.stat(first[0]).st_mode) == 0o700
    for f in first[0].iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    refresher.refresh(model, 2)
    second = sorted(root.iterdir())
    assert len(second) == 1 and second != first            # the previous adapter dir is gone
    assert not first[0].exists()
    refresher.close()
    assert not root.exists()


def test_no_refresh_keeps_stale_adapter(engine, make_peft_model, sample_sequences):
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    refresher = NoRefresh(engine, "policy", device="cpu")
    first = refresher.refresh(model, 0)
    assert first.mode == "none" and first.nbytes > 0 and engine.loaded_adapters() == ["policy"]
    loaded = model_logprobs(model, seqs, lens)
    assert max_abs_diff(engine.score(seqs, lens, "policy"), loaded) < 1e-5
    perturb_lora_B(model, seed=5)
    later = refresher.refresh(model, 1)
    assert later.mode == "none" and later.nbytes == 0 and later.parts == {} and later.buckets == []
    stale = engine.score(seqs, lens, "policy")
    assert max_abs_diff(stale, loaded) < 1e-6                        # still the first adapter
    assert max_abs_diff(stale, model_logprobs(model, seqs, lens)) > 1e-3  # and the trainer moved on


@pytest.mark.parametrize("mode", ["file", "tensor", "inplace", "merged"])
def test_validation_refuses_nan_before_engine(mode, engine, make_peft_model, sample_sequences, tmp_path):
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    refresher = _refresher(mode, engine, tmp_path)
    refresher.refresh(model, 1)
    serving = engine.score(seqs, lens, refresher.serving_adapter)
    files_before = sorted(refresher.root.iterdir()) if mode == "file" else None
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
    with pytest.raises(AdapterError, match="NaN"):
        refresher.refresh(model, 2)
    after = engine.score(seqs, lens, refresher.serving_adapter)
    assert all(torch.equal(a, b) for a, b in zip(serving, after))    # still the previous adapter
    assert all(torch.isfinite(t).all() for t in after)
    if mode == "file":
        assert sorted(refresher.root.iterdir()) == files_before      # nothing new written
    else:
        assert engine.loaded_adapters() == ([] if mode == "merged" else ["policy"])
    refresher.close()


def test_max_rank_refused_before_engine(engine, make_peft_model):
    model = make_peft_model()
    refresher = TensorRefresh(engine, "policy", max_rank=2, device="cpu")
    with pytest.raises(AdapterError, match="max_lora_rank"):
        refresher.refresh(model, 1)
    assert engine.loaded_adapters() == []


@pytest.mark.parametrize("mode, cls", [("file", FileRefresh), ("tensor", TensorRefresh), ("inplace", InPlaceRefresh),
                                       ("merged", MergedRefresh), ("none", NoRefresh)])
def test_make_refresher(mode, cls, engine, tmp_path):
    cfg = Config.load(overrides=[f"refresh.mode={mode}", "refresh.bucket_mb=2", "engine.adapter_name=pol",
                                 f"refresh.tmp_dir={tmp_path}"])
    refresher = make_refresher(cfg, engine)
    try:
        assert type(refresher) is cls and refresher.mode == mode
        assert refresher.adapter_name == "pol" and refresher.bucket_bytes == 2 * 2**20
        assert refresher.max_rank is None                    # hf engine: no rank limit
        if mode == "file":
            assert refresher.root.parent == tmp_path
    finally:
        refresher.close()


def test_inplace_refuses_changed_config_and_keeps_serving(engine, make_peft_model, sample_sequences):
    """An in-place update keeps the engine's scaling: a changed alpha is refused, nothing written."""
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    refresher = InPlaceRefresh(engine, "policy", device="cpu")
    refresher.refresh(model, 1)
    serving = engine.score(seqs, lens, "policy")
    perturb_lora_B(model, seed=4)
    snapshot = refresher._snapshotter.snapshot(2)
    config = dict(snapshot.config, lora_alpha=snapshot.config["lora_alpha"] * 2)
    with pytest.raises(EngineError, match="lora_alpha"):
        engine.update_adapter_in_place("policy", snapshot.tensors, config)
    wrong = dict(snapshot.tensors)
    wrong.pop(next(iter(wrong)))
    with pytest.raises(EngineError, match="whole adapter"):
        engine.update_adapter_in_place("policy", wrong, snapshot.config)
    assert all(torch.equal(a, b) for a, b in zip(serving, engine.score(seqs, lens, "policy")))
    with pytest.raises(AdapterNotLoaded):
        engine.update_adapter_in_place("other", snapshot.tensors, snapshot.config)
    refresher.close()


def test_flat_snapshot_matches_peft_state_dict(make_peft_model, tmp_path):
    """The flat snapshot equals PEFT's state dict; its file (our safetensors writer) loads in PEFT's loader."""
    from lorabench.adapters import AdapterSnapshot, FlatSnapshotter
    model = make_peft_model(seed=2)
    perturb_lora_B(model, seed=3)
    reference = AdapterSnapshot.from_peft(model)
    snap = FlatSnapshotter(model).snapshot(7)
    assert snap.flat is not None and snap.flat.numel() == sum(t.numel() for t in reference.tensors.values())
    assert set(snap.tensors) == set(reference.tensors) and snap.config == reference.config
    assert all(torch.equal(snap.tensors[k], reference.tensors[k]) for k in reference.tensors)
    with torch.no_grad():                                  # a copy, not a view of the trainer's parameters
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
    assert all(torch.equal(snap.tensors[k], reference.tensors[k]) for k in reference.tensors)
    back = AdapterSnapshot.load_peft_dir(snap.save_peft_dir(tmp_path / "a"))
    assert all(torch.equal(back.tensors[k], reference.tensors[k]) for k in reference.tensors)
    from peft import PeftModel
    from lorabench.models import load_model
    PeftModel.from_pretrained(load_model(model.peft_config["default"].base_model_name_or_path), tmp_path / "a")
