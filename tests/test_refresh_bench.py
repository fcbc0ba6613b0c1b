"""Refresh latency measurements on the real HFEngine (tiny random model): rows per mode, bucket and
rank with bytes and bucket counts that follow from the adapter's tensors, the bandwidth floor, the
sweep and its figure (benchmarks/refresh_sweep.py), and the teaching helpers of notebook 03."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch
from conftest import LORA_R, merged_state_dict
from refresh_sweep import refresh_sweep_figure, sweep  # benchmarks/

from lorabench import explain
from lorabench import refresh_bench as rb
from lorabench.adapters import FlatAdapter
from lorabench.refresh import pack_buckets

ROOT = Path(__file__).resolve().parents[1]
# the refresher's parts, after the policy's snapshot (LoraLayers -> FlatAdapter) timed as `snapshot`; the timed
# in-place refreshes come after the untimed loading one, so they are writes
PARTS = {"file": {"snapshot", "stage", "write", "unload", "load"}, "tensor": {"snapshot", "stage", "unload", "load"},
         "inplace": {"snapshot", "write"}, "merged": {"snapshot", "merge", "push"}}


def test_bandwidth_is_measured():
    gbps = rb.measure_bandwidth(megabytes=32, repeats=3)
    assert 0.1 < gbps < 1000, gbps
    assert rb.floor_seconds(2 * 10**9, gbps) == pytest.approx(2 / gbps)


@pytest.mark.parametrize("mode", ["file", "tensor", "inplace", "merged"])
def test_measure_refresh_row(engine, tiny_model_dir, mode, monkeypatch):
    model = rb.adapter_model(str(tiny_model_dir), LORA_R)
    adapter = FlatAdapter.from_peft(model)
    bucket_mb = 0.01
    served, generate = [], engine.generate
    monkeypatch.setattr(engine, "generate", lambda p, s, a: served.append((a, s.max_new_tokens)) or generate(p, s, a))
    row = rb.measure_refresh(engine, model, mode, bucket_mb, repeats=3, warmup=1)
    # after each refresh one 1-token request with what the refresh made current (merged: the base)
    assert served == [(None if mode == "merged" else "bench", 1)] * 4 and row["first_request_s"] > 0
    assert (row["mode"], row["rank"], row["bucket_mb"], row["engine"]) == (mode, LORA_R, bucket_mb, "hf")
    assert set(row["parts"]) == PARTS[mode]
    assert row["total_s"] == pytest.approx(sum(row["parts"].values()))
    assert 0 < row["min_s"] <= row["total_s"]
    bucket_bytes = int(bucket_mb * 2**20)
    if mode == "merged":
        merged = merged_state_dict(model, adapted_only=True)   # the timed pushes follow the warm-up's full one
        assert row["bytes"] == sum(t.numel() * t.element_size() for t in merged.values())
        assert row["buckets"] == len(pack_buckets(list(merged.items()), bucket_bytes))
    else:
        assert row["bytes"] == adapter.nbytes
        expected = len(pack_buckets(list(adapter.tensors.items()), bucket_bytes))
        if mode == "inplace":
            assert row["buckets"] == 0                 # one write into the resident adapter, no staging
        else:
            assert row["buckets"] == expected and expected > 1  # file and tensor stage bucket by bucket
        assert engine.loaded_adapters() == []          # the scratch adapter is gone afterwards
        assert engine.served_version("bench") is None
    assert row["total_s"] > rb.floor_seconds(row["bytes"], rb.measure_bandwidth(megabytes=32))


def test_merged_refresh_really_reaches_the_engine(engine, tiny_model_dir, sample_sequences):
    """The timed merged refresh moves W + ΔW into the engine: its base requests now score as the
    adapter model does, and restore_base_weights undoes it."""
    from conftest import max_abs_diff, model_logprobs
    seqs, lens = sample_sequences
    model = rb.adapter_model(str(tiny_model_dir), LORA_R)
    with model.disable_adapter():
        base = model_logprobs(model, seqs, lens)
    rb.measure_refresh(engine, model, "merged", 1.0, repeats=2, warmup=1)
    assert max_abs_diff(engine.score(seqs, lens, None), model_logprobs(model, seqs, lens)) < 1e-4
    assert engine.served_version(None) == 2                 # the last of versions 0, 1, 2 pushed
    explain.restore_base_weights(engine, model)
    assert max_abs_diff(engine.score(seqs, lens, None), base) < 1e-5
    assert engine.served_version(None) == 0                 # the plain base weights again


def test_measure_refresh_rejects_bad_arguments(engine, tiny_model_dir):
    model = rb.adapter_model(str(tiny_model_dir), LORA_R)
    with pytest.raises(ValueError, match="mode"):
        rb.measure_refresh(engine, model, "carrier-pigeon", 1.0)
    with pytest.raises(ValueError, match="mode"):
        rb.measure_refresh(engine, model, "none", 1.0)   # the stale control does not refresh: nothing to time
    assert rb.MODES == ("file", "tensor", "inplace", "merged")
    with pytest.raises(ValueError, match="repeats"):
        rb.measure_refresh(engine, model, "file", 1.0, repeats=0)


def test_sweep_covers_every_combination_and_saves(engine, tiny_model_dir, tmp_path):
    rows = sweep(engine, str(tiny_model_dir), modes=("file", "tensor", "merged"), ranks=(2, 8),
                    buckets_mb=(0.01, 64), repeats=1, warmup=0,
                    log=lambda *a: None)
    assert sorted((r["mode"], r["rank"], r["bucket_mb"]) for r in rows) == sorted(
        (m, r, b) for m in ("file", "tensor", "merged") for r in (2, 8) for b in (0.01, 64))
    assert [r["mode"] for r in rows[:6]] == ["file", "file", "tensor", "tensor", "merged", "merged"]  # merged last
    size = {r["rank"]: r["bytes"] for r in rows if r["mode"] == "tensor"}
    assert size[8] == 4 * size[2]                          # adapter bytes grow linearly with the rank
    assert len({r["bytes"] for r in rows if r["mode"] == "merged"}) == 1   # merged: the model, any rank
    path = rb.save_results(tmp_path / "sweep.json", rows, 12.5, engine="hf engine, CPU (not SGLang)")
    loaded = rb.load_results(path)
    assert loaded["rows"] == json.loads(json.dumps(rows)) and loaded["bandwidth_gbps"] == 12.5
    assert rb.load_results(ROOT / "benchmarks" / "results" / "gpu" / "parity_tiny.json") is None

    fig = refresh_sweep_figure(rows, 12.5, label="hf engine, CPU (not SGLang)")
    try:
        axes = fig.axes
        assert len(axes) == 2 * 3 and "hf engine, CPU (not SGLang)" in fig._suptitle.get_text()
        for ax, (rank, mode) in zip(axes, [(r, m) for r in (2, 8) for m in ("file", "tensor", "merged")]):
            assert ax.get_title().startswith(f"{mode}, r={rank}") and ax.get_xscale() == "log"
            nbytes = next(r["bytes"] for r in rows if r["mode"] == mode and r["rank"] == rank)
            (floor,) = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
            assert floor.get_ydata()[0] == pytest.approx(1e3 * nbytes / 12.5e9)
            tops: dict[float, float] = {}
            for p in ax.patches:                            # the highest segment of each bar
                tops[p.get_x()] = max(tops.get(p.get_x(), 0.0), p.get_y() + p.get_height())
            totals = [1e3 * r["total_s"] for r in sorted(rows, key=lambda r: r["bucket_mb"])
                      if r["mode"] == mode and r["rank"] == rank]
            assert [tops[x] for x in sorted(tops)] == pytest.approx(totals)   # stacked parts reach each total
    finally:
        plt.close(fig)


# --- teaching helpers ---------------------------------------------------------------------------------
def test_lora_factors_are_the_merged_delta(make_peft_model):
    model = make_peft_model(seed=3)
    f = explain.lora_factors(model, "model.layers.1.mlp.down_proj")
    merged = merged_state_dict(model)["model.layers.1.mlp.down_proj.weight"]
    assert torch.allclose(f["W"] + f["delta"], merged, atol=1e-6)
    assert f["scaling"] == 2.0 and torch.linalg.matrix_rank(f["delta"]) <= f["A"].shape[0]
    fig = explain.plot_lora_factors(f)
    assert len(fig.axes) == 4   # B and A and their colour bars
    plt.close(fig)


def test_topk_and_logprob_difference(make_peft_model, tokenizer, engine, sample_sequences):
    model = make_peft_model(seed=4)
    seqs, lens = sample_sequences
    topk = explain.next_token_topk(model, tokenizer, seqs[0][:lens[0]], k=5)
    assert 5 <= len(topk["tokens"]) <= 10
    assert torch.all(topk["adapter"][:-1] >= topk["adapter"][1:])              # sorted by the adapter
    assert not torch.allclose(topk["base"], topk["adapter"])
    engine.load_adapter_tensors("a", FlatAdapter.from_peft(model))
    diff = explain.logprob_difference(engine, seqs[0], lens[0], "a")
    assert diff.shape == (len(seqs[0]) - lens[0],) and diff.abs().max() > 1e-3
    with model.disable_adapter():
        from conftest import model_logprobs
        base = model_logprobs(model, seqs[:1], lens[:1])[0]
    assert torch.allclose(diff, model_logprobs(model, seqs[:1], lens[:1])[0] - base, atol=1e-4)
    plt.close(explain.plot_topk(topk).figure)


def test_refresh_timeline_lays_parts_end_to_end():
    rows = [{"mode": "file", "bytes": 2**20, "total_s": 0.006,
             "parts": {"write": 0.001, "unload": 0.002, "load": 0.003}}]
    ax = explain.plot_refresh_timeline(rows)
    bars = sorted(ax.patches, key=lambda p: p.get_x())
    assert [round(b.get_x(), 6) for b in bars] == [0.0, 1.0, 3.0] and bars[-1].get_width() == pytest.approx(3.0)
    plt.close(ax.figure)
