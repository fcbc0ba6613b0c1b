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
from notebook_helpers import load_results
from refresh_sweep import refresh_sweep_figure, sweep  # benchmarks/
from synthetic import peft_adapter  # benchmarks/, on sys.path by conftest

from lorabench import explain
from lorabench import refresh_bench as rb
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
    adapter = peft_adapter(model)
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
    # every repeat kept: the call's median is the row's, end to end is call + first request per repeat
    samples = row["samples"]
    assert [len(samples[k]) for k in ("total_s", "first_request_s", "end_to_end_s")] == [3, 3, 3]
    assert set(samples["parts"]) == PARTS[mode] and all(len(v) == 3 for v in samples["parts"].values())
    assert sorted(samples["total_s"])[1] == row["total_s"]
    assert [sum(p) for p in zip(*samples["parts"].values())] == pytest.approx(samples["total_s"])
    assert samples["end_to_end_s"] == pytest.approx([c + f for c, f in zip(samples["total_s"],
                                                                            samples["first_request_s"])])
    assert row["end_to_end_s"] == pytest.approx(sorted(samples["end_to_end_s"])[1]) and row["threads"] == 1
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
    loaded = load_results(path)
    assert loaded["rows"] == json.loads(json.dumps(rows)) and loaded["bandwidth_gbps"] == 12.5
    assert load_results(ROOT / "benchmarks" / "results" / "gpu" / "parity_tiny.json") is None

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
    engine.load_adapter_tensors("a", peft_adapter(model))
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


# --- notebook 02: threads, bucket sizes from the tensors, ranks, the engine's memory, computed text --------
def test_timings_run_with_the_thread_count_asked_and_restore_it(engine, tiny_model_dir):
    model = rb.adapter_model(str(tiny_model_dir), LORA_R)
    before = torch.get_num_threads()
    seen = []
    generate = engine.generate
    engine.generate = lambda *a: seen.append(torch.get_num_threads()) or generate(*a)
    try:
        rows = rb.thread_probe(engine, model, [1, 2], repeats=2)
    finally:
        del engine.generate
    assert seen == [1] + [1, 2] * 2 and [r["threads"] for r in rows] == [1, 2]   # untimed first, then turns
    assert [r["repeats"] for r in rows] == [2, 2] and all(len(r["samples"]["end_to_end_s"]) == 2 for r in rows)
    assert engine.loaded_adapters() == []
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), rb.torch_threads(1):
        raise RuntimeError("a failed measurement")
    assert torch.get_num_threads() == before


def _qwen3_06b_weights():
    """The adapted weights of Qwen3-0.6B's shape (bf16, 28 layers), as meta tensors: sizes without memory."""
    shapes = {"self_attn.q_proj": (2048, 1024), "self_attn.k_proj": (1024, 1024), "self_attn.v_proj": (1024, 1024),
              "self_attn.o_proj": (1024, 2048), "mlp.gate_proj": (3072, 1024), "mlp.up_proj": (3072, 1024),
              "mlp.down_proj": (1024, 3072)}
    return [(f"model.layers.{i}.{m}.weight", torch.empty(s, dtype=torch.bfloat16, device="meta"))
            for i in range(28) for m, s in shapes.items()]


@pytest.mark.parametrize("points", [3, 6, 8])
def test_bucket_sizes_give_distinct_push_counts(tiny_model_dir, points):
    tiny = rb.merged_push_tensors(rb.adapter_model(str(tiny_model_dir), LORA_R))
    for named in (tiny, _qwen3_06b_weights()):
        sizes = rb.distinct_push_buckets(named, points)
        counts = [len(pack_buckets(named, int(mb * 2**20))) for mb in sizes]   # the refresher's own packing
        assert len(sizes) == points and sizes == sorted(sizes)
        assert counts == sorted(set(counts), reverse=True)                    # distinct, fewer as buckets grow
        assert counts[0] == len(named) and counts[-1] == 1                    # one tensor per push ... one push
        assert counts == [rb.push_count(named, mb) for mb in sizes]
        smallest = min(t.numel() * t.element_size() for _, t in named)
        assert sizes[0] * 2**20 >= smallest                                   # a bucket holds a whole tensor
    three = tiny[:3]
    assert len(rb.distinct_push_buckets(three, 10)) <= 3                      # no more counts than tensors allow


def test_merged_push_tensors_are_what_a_timed_merged_refresh_pushes(engine, tiny_model_dir):
    model = rb.adapter_model(str(tiny_model_dir), LORA_R)
    named = rb.merged_push_tensors(model)
    merged = merged_state_dict(model, adapted_only=True)
    assert [n for n, _ in named] == sorted(merged) and all(t.shape == merged[n].shape for n, t in named)
    curve = rb.push_curve(named)
    assert [c for _, c in curve] == sorted((c for _, c in curve), reverse=True)   # the count never grows
    assert curve[0][1] == len(named) and curve[-1][1] == 1
    for mb in rb.distinct_push_buckets(named, 3):
        row = rb.measure_refresh(engine, model, "merged", mb, repeats=1)
        assert row["buckets"] == rb.push_count(named, mb)


def test_rank_sweep_measures_every_mode_at_every_rank(engine, tiny_model_dir):
    done = []
    rows = rb.rank_sweep(engine, str(tiny_model_dir), [2, 8], 64.0, repeats=2,
                         progress=lambda i, n: done.append((i, n)))
    assert [(r["rank"], r["mode"]) for r in rows] == [(k, m) for k in (2, 8)
                                                      for m in ("file", "tensor", "inplace", "merged")]
    assert done == [(i, 8) for i in range(1, 9)]
    size = {(r["mode"], r["rank"]): r["bytes"] for r in rows}
    assert size[("tensor", 8)] == 4 * size[("tensor", 2)] and size[("merged", 8)] == size[("merged", 2)]
    assert all(len(r["samples"]["end_to_end_s"]) == 2 for r in rows) and engine.loaded_adapters() == []


def test_in_place_keeps_the_engines_storage_and_tensor_allocates_anew(engine, tiny_model_dir):
    model = rb.adapter_model(str(tiny_model_dir), LORA_R)
    inplace = explain.storage_across_refresh(engine, model, "inplace")
    tensor = explain.storage_across_refresh(engine, model, "tensor")
    assert inplace["storage before"] == inplace["storage after"]
    assert inplace["data_ptr before"] == inplace["data_ptr after"]
    assert inplace["values changed"] and inplace["engine = trainer"] and inplace["old handle reads"] == "the new values"
    assert tensor["storage before"] != tensor["storage after"]
    assert tensor["values changed"] and tensor["engine = trainer"] and tensor["old handle reads"] == "the old values"
    assert engine.loaded_adapters() == []
    text = explain.storage_markdown([inplace, tensor])
    assert "`inplace`: the engine's tensor is the same storage" in text
    assert "`tensor`: the engine's tensor is a new storage" in text
    with pytest.raises(ValueError, match="hf engine holding adapter"):
        explain.engine_lora_weight(engine, "storage", "model.layers.0.self_attn.q_proj")   # unloaded: refused


def _row(mode, ends_ms, parts=None, **extra):
    parts = parts or {"load": 1e-3 * min(ends_ms)}
    return {"mode": mode, "bytes": 2**20, "parts": parts, "total_s": sum(parts.values()),
            "samples": {"end_to_end_s": [1e-3 * e for e in ends_ms], "total_s": [1e-3 * e for e in ends_ms]},
            **extra}


def test_section_2_text_states_the_order_the_spread_allows():
    rows = [_row("file", [70, 75, 80]), _row("tensor", [72, 78, 90]), _row("inplace", [15, 16, 17]),
            _row("merged", [30, 31, 33])]
    assert explain.mode_groups(rows) == [["inplace"], ["merged"], ["file", "tensor"]]
    text = explain.modes_markdown(rows, bandwidth_gbps=10.0)
    assert "`inplace` 16 ms < `merged` 31 ms < `file` 75 ms ≈ `tensor` 78 ms" in text and "can swap" in text
    apart = [_row("inplace", [15, 16, 17]), _row("file", [70, 75, 80])]
    assert "clear of the next one's" in explain.modes_markdown(apart, 10.0)


def test_section_3_text_says_whether_the_time_grows_with_the_pushes():
    def rows(medians, rest_ms=5.0):
        """Merged rows whose push part has these medians; the rest of each call (snapshot, merge) is rest_ms."""
        made = []
        for n, m in zip((1, 2, 4, 8), medians):
            push = [m - 1, m, m + 1]
            row = _row("merged", [p + rest_ms for p in push], parts={"merge": 1e-3 * rest_ms, "push": 1e-3 * m})
            row["samples"]["parts"] = {"push": [1e-3 * p for p in push]}
            made.append({**row, "buckets": n, "bucket_mb": 1.0 / n})
        return made
    grows = explain.buckets_markdown(rows([10, 12, 16, 24]))
    assert "grows at every step" in grows and "8 ms + 2 ms per push" in grows and "within 0 ms" in grows
    assert "a median of 5 to 5 ms" in grows                                  # call − push, every bucket size
    falls = explain.buckets_markdown(rows([10, 14, 13.5, 24]))
    assert "does not grow at every step" in falls and "2 -> 4 pushes (within the spread)" in falls
    apart = explain.buckets_markdown(rows([10, 14, 11, 24]))   # middle halves [13.5, 14.5] and [10.5, 11.5]
    assert "2 -> 4 pushes." in apart


def test_section_4_text_compares_ranks_from_the_rows():
    rows = [{**_row(m, [base * f for f in (0.9, 1, 1.1)]), "rank": k, "bytes": k * 2**16}
            for k, grow in ((4, 1), (64, 2)) for m, base in (("tensor", 50 * grow), ("inplace", 10 * grow))]
    text = explain.rank_markdown(rows)
    assert "grows ×16 (0.25 MB -> 4 MB)" in text and "`tensor` ×2.00," in text and "`inplace` ×2.00." in text
    assert "At every rank: `inplace` < `tensor`" in text
    rows[-1]["samples"]["end_to_end_s"] = [1.0, 1.0, 1.0]                 # inplace at r=64 now the slowest
    text = explain.rank_markdown(rows)
    assert "No mode's middle half is clear" in text and "r=4: `inplace`, r=64: `tensor`" in text
    rows[-1]["samples"]["end_to_end_s"] = [0.0095, 0.0105, 0.03]          # r=64: inplace as at r=4, a slow repeat
    text = explain.rank_markdown(rows)
    assert "`inplace` ×1.05 (within the spread)" in text and "`tensor` ×2.00," in text
    three = [{**_row(m, [base * f for f in (0.9, 1, 1.1)]), "rank": k, "bytes": k * 2**16}
             for k in (4, 64) for m, base in (("file", 52), ("tensor", 50), ("inplace", 10 if k == 4 else 12))]
    assert "At every rank: `inplace` < `tensor`, `file`" in explain.rank_markdown(three)   # file ≈ tensor: one group
    probe = [{**_row("inplace", [10, 11, 12]), "threads": 1}, {**_row("inplace", [10, 50, 2820]), "threads": 2}]
    text = explain.threads_markdown(probe, 2, 3.5, rb.steadiest_threads(probe))
    assert "2 threads: median 50 ms, upper quartile 1,435 ms, slowest 2,820 ms (load average 3.5" in text
    assert "Sections 2-4 time with 1 thread: the fewest threads whose upper quartile is within 10%" in text
    assert "as `THREADS` asks" in explain.threads_markdown(probe, 2, 3.5, 2, asked=True)


def test_the_steadiest_thread_count_is_the_fewest_within_a_tenth_of_the_lowest_upper_quartile():
    def probe(*uppers):   # three repeats each, the upper quartile at `upper`
        return [{**_row("inplace", [u - 2, u - 1, u + 1]), "threads": n} for n, u in zip((1, 2, 4), uppers)]
    assert rb.steadiest_threads(probe(10, 20, 30)) == 1
    assert rb.steadiest_threads(probe(30, 10, 20)) == 2              # a loaded single core: more threads help
    assert rb.steadiest_threads(probe(10.5, 10, 20)) == 1            # a near tie goes to fewer threads
    assert rb.steadiest_threads(probe(12, 10.9, 10)) == 2


def test_load_label_states_the_load_and_the_cpus():
    import os
    import re
    found = re.fullmatch(r"load average (\d+\.\d) on (\d+) CPUs", rb.load_label())
    assert found and abs(float(found[1]) - os.getloadavg()[0]) <= 0.5 and int(found[2]) == len(os.sched_getaffinity(0))


def test_the_floors_bandwidth_is_the_fastest_copy_measured(monkeypatch):
    bandwidth, size_mb = rb.fastest_copy_bandwidth("cpu", sizes_mb=(1, 64))   # real copies
    assert size_mb in (1, 64) and bandwidth > 0
    # which size wins depends on the machine (caches on a CPU, launches on a GPU): either way, the fastest
    for speeds, winner in (({1: 40.0, 16: 30.0, 256: 3.0}, 1), ({1: 0.5, 16: 20.0, 256: 3000.0}, 256)):
        monkeypatch.setattr(rb, "measure_bandwidth", lambda device, megabytes, repeats, s=speeds: s[megabytes])
        assert rb.fastest_copy_bandwidth("cpu") == (speeds[winner], winner)
    # one thread or the current count, whichever copies faster (on a loaded machine: one)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(rb, "measure_bandwidth", lambda device, megabytes, repeats: 10.0 / torch.get_num_threads())
        assert rb.fastest_copy_bandwidth("cpu", sizes_mb=(1,)) == (10.0, 1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
