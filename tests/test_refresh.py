"""Refresh modes against the real HFEngine: after refresh(adapter) the engine's log-probs equal the
trainer's and the engine reports the adapter's version, for every mode and bucket size (multi-bucket
sync verified); the registry builds every mode, and a mode refuses up front an engine that lacks a
capability it needs."""
import os
import stat

import pytest
import torch
from conftest import max_abs_diff, merged_state_dict, model_logprobs, perturb_lora_B

from lorabench.adapters import AdapterError, FlatAdapter, base_weights
from lorabench.engines.base import (
    EngineError,
    PushesWeights,
    ReleasesMemory,
    RolloutEngine,
    UpdatesAdapterInPlace,
    require,
)
from lorabench.engines.hf import HFEngine
from lorabench.policy import LoraLayers
from lorabench.refresh import (
    REFRESH_MODES,
    FileRefresh,
    InPlaceRefresh,
    MergedRefresh,
    NoRefresh,
    RefreshRecord,
    RefreshSettings,
    TensorRefresh,
    make_refresher,
    pack_buckets,
    refresh_settings,
)


# --- buckets ------------------------------------------------------------------------------------------
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


# --- the record -----------------------------------------------------------------------------------------
def test_record_rows():
    record = RefreshRecord("tensor", 7, nbytes=300, parts={"stage": 0.25, "load": 0.5},
                           buckets=[{"bucket": 0, "tensors": 2, "bytes": 100, "seconds": 0.1},
                                    {"bucket": 1, "tensors": 1, "bytes": 200, "seconds": 0.15}])
    assert record.total_s == pytest.approx(0.75)
    rows = record.rows(step=8)
    assert [r["row"] for r in rows] == ["bucket", "bucket", "refresh"]
    assert all(r["step"] == 8 and r["mode"] == "tensor" for r in rows)
    assert rows[1]["bytes"] == 200 and rows[1]["bucket"] == 1
    assert rows[-1] == {"step": 8, "mode": "tensor", "row": "refresh", "version": 7, "bytes": 300, "buckets": 2,
                        "total_s": pytest.approx(0.75), "stage_s": 0.25, "load_s": 0.5}
    assert RefreshRecord("none", 3).rows(4) == [{"step": 4, "mode": "none", "row": "refresh", "version": 3,
                                                 "bytes": 0, "buckets": 0, "total_s": 0}]


# --- exact refresh, every mode --------------------------------------------------------------------------
FRESH_MODES = ["file", "tensor", "inplace", "merged"]
PARTS = {"file": {"stage", "write", "unload", "load"}, "tensor": {"stage", "unload", "load"},
         "merged": {"merge", "push"}}


def parts_of(mode: str, refresh_no: int) -> set[str]:
    """In-place: the first refresh loads (as tensor), later ones write into the loaded adapter."""
    if mode == "inplace":
        return PARTS["tensor"] if refresh_no == 1 else {"write"}
    return PARTS[mode]


def _refresher(mode, engine, tmp_path, model, bucket_mb=64.0):
    return make_refresher(settings_for(mode, bucket_mb, tmp_path), engine, "policy", base_weights=base_weights(model))


def settings_for(mode: str, bucket_mb: float, tmp_path) -> RefreshSettings:
    """The mode's refresh section; file refresh writes under tmp_path."""
    return refresh_settings(mode, bucket_mb, **({"tmp_dir": str(tmp_path)} if mode == "file" else {}))


@pytest.mark.parametrize("bucket_mb", [64.0, 0.01])
@pytest.mark.parametrize("mode", FRESH_MODES)
def test_refresh_is_exact(mode, bucket_mb, engine, make_peft_model, sample_sequences, tmp_path):
    model = make_peft_model(seed=0)
    layers = LoraLayers(model)
    seqs, lens = sample_sequences
    base = engine.score(seqs, lens, None)
    refresher = _refresher(mode, engine, tmp_path, model, bucket_mb)
    try:
        for version in (1, 2):       # the second refresh replaces the first (unload + load / overwrite)
            perturb_lora_B(model, seed=10 + version)
            adapter = layers.snapshot(version)
            record = refresher.refresh(adapter)
            want = model_logprobs(model, seqs, lens)
            got = engine.score(seqs, lens, refresher.serving_adapter)
            assert max_abs_diff(got, want) < 1e-5
            assert max_abs_diff(got, base) > 1e-3           # not trivially the base model
            assert engine.served_version(refresher.serving_adapter) == version

            assert isinstance(record, RefreshRecord)
            assert (record.mode, record.version) == (mode, version)
            assert set(record.parts) == parts_of(mode, version)
            assert all(v >= 0 for v in record.parts.values())
            assert record.total_s == pytest.approx(sum(record.parts.values()))
            if mode == "merged":   # every weight first, then only the adapted layers' (the rest never change)
                pushed = merged_state_dict(model, adapted_only=version > 1)
                assert sum(b["tensors"] for b in record.buckets) == len(pushed)
                assert (len(pushed) < len(base_weights(model))) == (version > 1)
                assert record.nbytes == sum(t.numel() * t.element_size() for t in pushed.values())
            else:
                assert record.nbytes == adapter.nbytes
            if parts_of(mode, version) == {"write"}:           # in place: one write, no staging buckets
                assert record.buckets == []
            else:
                if mode != "merged":
                    assert sum(b["tensors"] for b in record.buckets) == len(adapter.tensors)
                assert sum(b["bytes"] for b in record.buckets) == record.nbytes
                if bucket_mb < 1:
                    assert len(record.buckets) > 5            # many buckets: multi-bucket sync verified
                else:
                    assert len(record.buckets) == 1
                assert [b["bucket"] for b in record.buckets] == list(range(len(record.buckets)))
            rows = record.rows(step=version)
            assert [r["row"] for r in rows] == ["bucket"] * len(record.buckets) + ["refresh"]
            total = rows[-1]
            assert total["step"] == version and total["mode"] == mode and total["bytes"] == record.nbytes
            assert total["version"] == version and total["buckets"] == len(record.buckets)
            assert {f"{p}_s" for p in parts_of(mode, version)} <= set(total)
        assert refresher.refreshes == 2
        if mode == "merged":
            assert refresher.serving_adapter is None and engine.loaded_adapters() == []
        else:
            assert refresher.serving_adapter == "policy" and engine.loaded_adapters() == ["policy"]
    finally:
        refresher.close()


@pytest.mark.parametrize("mode", sorted(REFRESH_MODES))
def test_refresh_leaves_trainer_and_adapter_untouched(mode, engine, make_peft_model, tmp_path):
    """A refresher reads the adapter and never writes it back; the trainer's weights do not move."""
    model = make_peft_model(seed=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = LoraLayers(model).snapshot(0)
    buffer = adapter.buffer.clone()
    refresher = _refresher(mode, engine, tmp_path, model)
    try:
        refresher.refresh(adapter)
        refresher.refresh(FlatAdapter(adapter.buffer, adapter.layout, adapter.config, 1))
    finally:
        refresher.close()
    assert torch.equal(adapter.buffer, buffer)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_file_refresh_private_dirs_and_cleanup(engine, make_peft_model, tmp_path):
    model = make_peft_model()
    layers = LoraLayers(model)
    refresher = FileRefresh(engine, "policy", tmp_dir=str(tmp_path))
    root = refresher.root
    assert root.parent == tmp_path and stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert root.name.startswith(f"lorabench-adapters-{os.getpid()}-")
    refresher.refresh(layers.snapshot(1))
    first = sorted(root.iterdir())
    assert len(first) == 1 and stat.S_IMODE(os.stat(first[0]).st_mode) == 0o700
    assert first[0].name.endswith("000001")                 # named by the version it holds
    for f in first[0].iterdir():
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    refresher.refresh(layers.snapshot(2))
    second = sorted(root.iterdir())
    assert len(second) == 1 and second != first            # the previous adapter dir is gone
    assert not first[0].exists()
    refresher.close()
    assert not root.exists()


def test_file_refresh_removes_roots_of_dead_processes(engine, tmp_path):
    """A killed process leaves its adapter root (RAM, on tmpfs); the next refresher removes it, and
    never a live process's (names as tempfile.mkdtemp makes them: 8 characters after the PID)."""
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_root = tmp_path / f"lorabench-adapters-{int(dead.stdout)}-abcd_123"
    (dead_root / "policy-000003").mkdir(parents=True)
    live_root = tmp_path / f"lorabench-adapters-{os.getppid()}-wxyz_456"
    live_root.mkdir()
    refresher = FileRefresh(engine, "policy", tmp_dir=str(tmp_path))
    try:
        assert not dead_root.exists() and live_root.exists()
    finally:
        refresher.close()


def test_no_refresh_keeps_stale_adapter(engine, make_peft_model, sample_sequences):
    model = make_peft_model(seed=0)
    layers = LoraLayers(model)
    seqs, lens = sample_sequences
    refresher = NoRefresh(engine, "policy")
    assert not refresher.keeps_engine_fresh
    first = refresher.refresh(layers.snapshot(0))
    assert first.mode == "none" and first.nbytes > 0 and engine.loaded_adapters() == ["policy"]
    loaded = model_logprobs(model, seqs, lens)
    assert max_abs_diff(engine.score(seqs, lens, "policy"), loaded) < 1e-5
    perturb_lora_B(model, seed=5)
    later = refresher.refresh(layers.snapshot(1))
    assert later.mode == "none" and later.version == 1
    assert later.nbytes == 0 and later.parts == {} and later.buckets == []
    stale = engine.score(seqs, lens, "policy")
    assert max_abs_diff(stale, loaded) < 1e-6                        # still the first adapter
    assert max_abs_diff(stale, model_logprobs(model, seqs, lens)) > 1e-3  # and the trainer moved on
    assert engine.served_version("policy") == 0                      # and the engine says so


def test_policy_refuses_nan_before_any_refresh(engine, make_peft_model, sample_sequences, tmp_path):
    """A diverged update never reaches a refresher: the policy's snapshot refuses it, and the engine
    keeps serving the previous adapter."""
    model = make_peft_model(seed=0)
    layers = LoraLayers(model)
    seqs, lens = sample_sequences
    refresher = FileRefresh(engine, "policy", tmp_dir=str(tmp_path))
    refresher.refresh(layers.snapshot(1))
    serving = engine.score(seqs, lens, "policy")
    files_before = sorted(refresher.root.iterdir())
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n)[0, 0] = float("nan")
    with pytest.raises(AdapterError, match="NaN"):
        refresher.refresh(layers.snapshot(2))
    after = engine.score(seqs, lens, "policy")
    assert all(torch.equal(a, b) for a, b in zip(serving, after))    # still the previous adapter
    assert sorted(refresher.root.iterdir()) == files_before          # nothing new written
    assert engine.served_version("policy") == 1
    refresher.close()


@pytest.mark.parametrize("mode", ["file", "tensor"])
def test_engine_refusal_propagates_and_leaves_no_files(mode, engine, make_peft_model, tmp_path):
    """An adapter the engine refuses (its own validation) raises the engine's error from refresh();
    a file refresh removes the dir it wrote for it."""
    model = make_peft_model(seed=0)
    refresher = _refresher(mode, engine, tmp_path, model)
    good = LoraLayers(model).snapshot(1)
    refresher.refresh(good)
    bad = FlatAdapter(good.buffer.clone(), good.layout, good.config, 2)
    bad.buffer[-1] = float("nan")
    try:
        with pytest.raises(AdapterError, match="NaN"):
            refresher.refresh(bad)
        if mode == "file":
            assert [p.name for p in refresher.root.iterdir()] == ["policy-000001"]
        # unload came first: the engine lost the adapter, which the trainer re-sends on its next step
        assert engine.served_version("policy") is None
        refresher.refresh(good)
        assert engine.served_version("policy") == 1
    finally:
        refresher.close()


def test_inplace_reloads_after_the_engine_lost_the_adapter(engine, make_peft_model, sample_sequences):
    model = make_peft_model(seed=0)
    layers = LoraLayers(model)
    seqs, lens = sample_sequences
    refresher = InPlaceRefresh(engine, "policy")
    refresher.refresh(layers.snapshot(1))
    engine.unload_adapter("policy")                                   # an engine restart, say
    perturb_lora_B(model, seed=6)
    record = refresher.refresh(layers.snapshot(2))
    assert set(record.parts) == PARTS["tensor"]                       # a full load, not a write
    assert engine.served_version("policy") == 2
    assert max_abs_diff(engine.score(seqs, lens, "policy"), model_logprobs(model, seqs, lens)) < 1e-5


class BF16AdapterHFEngine(HFEngine):
    """An HF engine that keeps adapters in bfloat16 (as SGLang does in a bf16 model)."""
    adapter_dtype = torch.bfloat16


def test_staging_casts_to_the_engine_adapter_dtype(tiny_model_dir, make_peft_model, sample_sequences):
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    engine = BF16AdapterHFEngine(str(tiny_model_dir), device="cpu")
    refresher = TensorRefresh(engine, "policy", bucket_mb=0.01)
    try:
        adapter = LoraLayers(model).snapshot(1)
        record = refresher.refresh(adapter)
        assert record.nbytes == adapter.nbytes // 2 == sum(b["bytes"] for b in record.buckets)
        got = engine.score(seqs, lens, "policy")
        cast = FlatAdapter(adapter.buffer.to(torch.bfloat16).float(), adapter.layout, adapter.config)
        reference = HFEngine(str(tiny_model_dir), device="cpu")
        reference.load_adapter_tensors("policy", cast)
        assert max_abs_diff(got, reference.score(seqs, lens, "policy")) < 1e-6   # exactly the bf16 values
        assert max_abs_diff(got, model_logprobs(model, seqs, lens)) > 0
        reference.close()
    finally:
        refresher.close()
        engine.close()


# --- the registry and capabilities ------------------------------------------------------------------
def test_registry_lists_every_mode():
    assert set(REFRESH_MODES) == {"file", "tensor", "inplace", "merged", "none"}
    for mode, cls in REFRESH_MODES.items():
        assert cls.mode == mode and cls.help
    assert [m for m, cls in REFRESH_MODES.items() if not cls.keeps_engine_fresh] == ["none"]
    assert REFRESH_MODES["inplace"].needs == (UpdatesAdapterInPlace,)
    assert REFRESH_MODES["merged"].needs == (PushesWeights,)
    assert "weights" in REFRESH_MODES["merged"].release_tags
    assert all("weights" not in cls.release_tags for m, cls in REFRESH_MODES.items() if m != "merged")


@pytest.mark.parametrize("mode", sorted(REFRESH_MODES))
def test_every_registered_mode_builds_and_refreshes(mode, engine, make_peft_model, sample_sequences, tmp_path):
    model = make_peft_model(seed=1)
    seqs, lens = sample_sequences
    refresher = make_refresher(settings_for(mode, 2, tmp_path), engine, "pol", base_weights=base_weights(model))
    try:
        assert type(refresher) is REFRESH_MODES[mode] and refresher.mode == mode
        assert refresher.adapter_name == "pol" and refresher.bucket_bytes == 2 * 2**20
        if mode == "file":
            assert refresher.root.parent == tmp_path
        record = refresher.refresh(LoraLayers(model).snapshot(4))
        assert record.mode == mode and record.version == 4 and record.nbytes > 0
        assert refresher.serving_adapter == (None if mode == "merged" else "pol")
        assert engine.served_version(refresher.serving_adapter) == 4
        got = engine.score(seqs, lens, refresher.serving_adapter)
        assert max_abs_diff(got, model_logprobs(model, seqs, lens)) < 1e-5
    finally:
        refresher.close()


def test_make_refresher_refuses_unknown_mode_and_merged_without_base(engine):
    with pytest.raises(ValueError, match="carrier-pigeon") as info:
        make_refresher("carrier-pigeon", engine, "policy")
    assert all(m in str(info.value) for m in REFRESH_MODES)
    with pytest.raises(ValueError, match="base_weights"):
        make_refresher("merged", engine, "policy")
    with pytest.raises(ValueError, match="base_weights"):
        MergedRefresh(engine, "policy")


def test_core_only_engine_is_an_engine_without_capabilities(core_engine):
    assert isinstance(core_engine, RolloutEngine)
    for capability in (UpdatesAdapterInPlace, PushesWeights, ReleasesMemory):
        assert not isinstance(core_engine, capability), capability.__name__


@pytest.mark.parametrize("mode, capability", [("inplace", "UpdatesAdapterInPlace"), ("merged", "PushesWeights")])
def test_mode_refuses_engine_lacking_its_capability(mode, capability, core_engine, make_peft_model):
    model = make_peft_model()
    with pytest.raises(EngineError) as info:
        make_refresher(mode, core_engine, "policy", base_weights=base_weights(model))
    message = str(info.value)
    assert capability in message and "core-only" in message and f"refresh.mode={mode}" in message
    assert core_engine.loaded_adapters() == [] and core_engine.served_version(None) == 0   # nothing sent


@pytest.mark.parametrize("mode", ["file", "tensor", "none"])
def test_core_modes_work_on_a_core_only_engine(mode, core_engine, make_peft_model, sample_sequences, tmp_path):
    """Modes that need only the core protocol work on any engine: capabilities, not engine names."""
    model = make_peft_model(seed=2)
    seqs, lens = sample_sequences
    refresher = make_refresher(settings_for(mode, 64.0, tmp_path), core_engine, "policy")
    try:
        refresher.refresh(LoraLayers(model).snapshot(1))
        assert core_engine.served_version("policy") == 1
        assert max_abs_diff(core_engine.score(seqs, lens, "policy"), model_logprobs(model, seqs, lens)) < 1e-5
    finally:
        refresher.close()


def test_require_names_the_capability_and_the_engine(core_engine, engine):
    require(engine, ReleasesMemory, "engine.release_memory_during_training")
    with pytest.raises(EngineError) as info:
        require(core_engine, ReleasesMemory, "engine.release_memory_during_training")
    message = str(info.value)
    assert "engine.release_memory_during_training" in message and "ReleasesMemory" in message
    assert "core-only" in message and "give gpu memory back" in message
