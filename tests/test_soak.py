"""Long runs on the CPU engine: 1,000 refresh cycles (file and tensor refresh alternating, a short
generation between them) and a 200-step GRPO run, each with host RSS sampled along the way.

Both assert no failure, exact refreshes throughout, and no RSS growth over the last 80% of the
run beyond a noise bound. The bound, 25 MB: on this model the allocator's noise measured over
1,000 cycles is 0.4-2.5 MB, while leaking even a quarter of an adapter per cycle (the q/v adapter
below is 56 KB) would add > 11 MB over 800 cycles, and leaking the adapters themselves > 45 MB.
With LORABENCH_RECORD=1 the series go to benchmarks/results/cpu_soak.json and cpu_soak.png."""
from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch
from conftest import max_abs_diff, model_logprobs
from reliability_util import ROOT, rss_mb

pytestmark = pytest.mark.slow

RESULTS = ROOT / "benchmarks" / "results"
NOISE_MB = 25.0
WARMUP = 0.2  # the first 20%: allocator arenas, optimizer state, first PEFT wrap


def _growth(series: list[dict], key: str = "rss_mb") -> dict:
    """RSS at the end of the warm-up and the most it rose above that afterwards."""
    start = int(len(series) * WARMUP)
    base = series[start][key]
    return {"rss_start_mb": round(series[0][key], 1), "rss_after_warmup_mb": round(base, 1),
            "rss_end_mb": round(series[-1][key], 1),
            "rss_max_growth_after_warmup_mb": round(max(s[key] for s in series[start:]) - base, 2)}


def _save(key: str, record: dict) -> None:
    """Merge this test's record into cpu_soak.json (atomically) and redraw cpu_soak.png — only with
    LORABENCH_RECORD=1, so an ordinary test run leaves the committed record alone."""
    from lorabench.safedir import SafeDir
    if not os.environ.get("LORABENCH_RECORD"):
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "cpu_soak.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[key] = record
    with SafeDir.open(RESULTS) as results:   # a fsynced temp renamed onto the file
        results.write_atomic(path.name, (json.dumps(data, indent=1) + "\n").encode(), mode=0o644)
    _plot(data, RESULTS / "cpu_soak.png")


def _plot(data: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(k, data[k]) for k in ("refresh_cycles", "grpo_long_run") if k in data]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.2), squeeze=False)
    for ax, (_, rec) in zip(axes[0], panels):
        xs = [s[rec["x"]] for s in rec["series"]]
        ax.plot(xs, [s["rss_mb"] for s in rec["series"]], lw=1.2, color="tab:blue")
        ax.axvline(xs[int(len(xs) * WARMUP)], color="grey", ls=":", lw=1, label="end of warm-up (20%)")
        ax.legend(fontsize=7, loc="upper left")
        ax.set_title(rec["title"], fontsize=9)
        ax.set_xlabel(rec["x"], fontsize=8)
        ax.set_ylabel("host RSS (MB)", fontsize=8)
        lo = min(s["rss_mb"] for s in rec["series"])
        ax.set_ylim(lo - 5, lo + max(30, rec["rss_max_growth_after_warmup_mb"] + 10))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.{os.getpid()}.png")
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, out)


def test_refresh_soak_1000_cycles(tiny_model_dir, make_peft_model, sample_sequences, tmp_path):
    """1,000 refreshes (file into /dev/shm when writable, and tensor, alternating) of a changing
    adapter into one HF engine, a 4-token generation after each; exact every 100 cycles."""
    from lorabench.engines.base import Sampling
    from lorabench.engines.hf import HFEngine
    from lorabench.policy import LoraLayers
    from lorabench.refresh import FileRefresh, TensorRefresh
    cycles, every = 1000, 10
    seqs, lens = sample_sequences
    model = make_peft_model(seed=0, target_modules=["q_proj", "v_proj"])
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    layers = LoraLayers(model)
    engine = HFEngine(str(tiny_model_dir), device="cpu", dtype="float32")
    refreshers = [FileRefresh(engine, "policy"), TensorRefresh(engine, "policy")]
    prompt = seqs[0][: lens[0]]
    series, objects, t0 = [], [], time.perf_counter()
    try:
        for cycle in range(1, cycles + 1):
            with torch.no_grad():
                for p in lora_b:
                    p.mul_(0.9).add_(0.01 * torch.randn_like(p))  # a new adapter every cycle
            record = refreshers[cycle % 2].refresh(layers.snapshot(cycle))
            assert record.nbytes > 0 and engine.served_version("policy") == cycle
            out = engine.generate([prompt], Sampling(4, 1.0, 1.0, seed=cycle), adapter="policy")
            assert len(out[0].token_ids) >= 1 and all(map(torch.isfinite, map(torch.tensor, out[0].logprobs)))
            if cycle % 100 == 0:
                assert max_abs_diff(engine.score(seqs, lens, "policy"), model_logprobs(model, seqs, lens)) < 1e-5
                gc.collect()
                objects.append({"cycle": cycle, "python_objects": len(gc.get_objects())})
            if cycle % every == 0 or cycle == 1:
                series.append({"cycle": cycle, "rss_mb": round(rss_mb(), 2),
                               "seconds": round(time.perf_counter() - t0, 2)})
        assert engine.loaded_adapters() == ["policy"]
        assert len(list(refreshers[0].root.iterdir())) == 1   # only the adapter being served
    finally:
        for r in refreshers:
            r.close()
        engine.close()
    summary = {"title": "1,000 refresh cycles (file/tensor alternating) + generate, HF engine, CPU",
               "x": "cycle", "cycles": cycles, "failures": 0, "modes": ["tensor", "file"],
               "adapter_bytes": record.nbytes, "file_refresh_dir": str(refreshers[0].root.parent),
               "seconds": round(time.perf_counter() - t0, 1),
               "python_objects_growth_after_warmup": objects[-1]["python_objects"] - objects[1]["python_objects"],
               "python_objects": objects,
               "noise_bound_mb": NOISE_MB, **_growth(series), "series": series}
    _save("refresh_cycles", summary)
    print(f"\nrefresh soak: { {k: v for k, v in summary.items() if k not in ('series', 'python_objects')} }")
    assert summary["rss_max_growth_after_warmup_mb"] < NOISE_MB
    # no per-cycle pile-up of Python objects (PEFT modules, tensors, records): 800 cycles would
    # leave thousands; the bound allows the few hundred that caches take while warming up
    assert summary["python_objects_growth_after_warmup"] < 800


@pytest.fixture
def long_run_trainer(tiny_model_dir, tokenizer, tmp_path):
    """A GRPOTrainer on a real HFEngine writing a run dir: 1 prompt x 2 completions of 4 tokens, tensor
    refresh, a checkpoint every step, an adapter dir every 50."""
    from lorabench.runlog import RunLog
    from lorabench.session import build_trainer, start_engine
    from lorabench.session.config import Config
    cfg = Config.load(overrides=[
        "grpo.steps=200", "grpo.prompts_per_step=1", "grpo.group_size=2", "grpo.max_new_tokens=4",
        "grpo.micro_batch_tokens=128", "refresh.mode=tensor", 'lora.target_modules=["q_proj","v_proj"]',
        "lora.r=4", "lora.alpha=8", "run.save_adapter_every=50", "grpo.lr=1e-3", "engine.hf.device=cpu",
        "data.eval_size=4"])
    engine = start_engine(cfg, str(tiny_model_dir))
    trainer = build_trainer(cfg, str(tiny_model_dir), engine, RunLog(tmp_path / "run", settings=cfg.run),
                            tokenizer=tokenizer, log=lambda *a: None)
    yield trainer
    trainer.close()
    engine.close()


def test_grpo_long_run_200_steps(long_run_trainer, tmp_path):
    """200 GRPO steps (1 prompt x 2 completions, 4 tokens, tensor refresh, run dir with a
    checkpoint every step): no failure, exact refresh every step, RSS flat after warm-up."""
    trainer = long_run_trainer
    series, t0 = [], time.perf_counter()
    for _ in range(200):
        rec = trainer.step()
        assert rec.metrics["mismatch/max"] < 1e-4        # the engine served the current adapter
        assert rec.metrics["adapter/served_version"] == rec.step - 1
        if rec.step % 5 == 0 or rec.step == 1:
            series.append({"step": rec.step, "rss_mb": round(rss_mb(), 2),
                           "seconds": round(time.perf_counter() - t0, 2)})
    trainer.wait_committed()   # step 200's commit may still be on the commit thread
    rows = trainer.runlog.metrics()
    assert [r["step"] for r in rows] == list(range(1, 201))
    assert sorted(p.name for p in (tmp_path / "run" / "adapters").iterdir()) == [
        "step_100", "step_150", "step_200", "step_50"]
    summary = {"title": "200 GRPO steps, HF engine, CPU (tiny random model)", "x": "step", "steps": 200,
               "failures": 0, "seconds": round(time.perf_counter() - t0, 1), "noise_bound_mb": NOISE_MB,
               **_growth(series), "series": series}
    _save("grpo_long_run", summary)
    print(f"\nGRPO long run: { {k: v for k, v in summary.items() if k != 'series'} }")
    assert summary["rss_max_growth_after_warmup_mb"] < NOISE_MB
