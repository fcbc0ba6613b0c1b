"""The SGLang backend against real SGLang on a GPU (marker `gpu`; run: bash dev/gpu_suite.sh).

Skips with the reason on machines without CUDA or sglang. Figures go to $LORABENCH_GPU_OUT
(JSON per test) so a device run can bring them back.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

try:
    import sglang  # noqa: F401
    _SGLANG = True
except ImportError:
    _SGLANG = False
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run dev/gpu_suite.sh on the GPU machine)", allow_module_level=True)
if not _SGLANG:
    pytest.skip("needs sglang (pip install -e .[sglang], or .sglang/with-sglang.sh on the GPU machine)",
                allow_module_level=True)

from sglang_calls import call_sglang  # noqa: E402  (benchmarks/, on sys.path by conftest)
from synthetic import peft_adapter  # noqa: E402  (benchmarks/, as above)

from lorabench.adapters import FlatAdapter  # noqa: E402
from lorabench.data import prompt_ids, synthetic_problems  # noqa: E402
from lorabench.engines.base import AdapterNotLoaded, EngineError, GenerateRequest, Sampling  # noqa: E402
from lorabench.engines.hf import HFEngine  # noqa: E402
from lorabench.models import load_tokenizer  # noqa: E402
from lorabench.session import start_engine  # noqa: E402
from lorabench.session.config import Config  # noqa: E402
from lorabench.tiny import tiny_model_dir  # noqa: E402

OUT = Path(os.environ.get("LORABENCH_GPU_OUT", "gpu_results"))
# run dirs: many files, kept out of OUT; one folder per pytest process, because a run dir an earlier
# session left (a warm GPU machine keeps /tmp) is resumed at its last step, not started afresh
RUNS = str(Path(os.environ.get("LORABENCH_GPU_RUNS", "/tmp/lorabench-gpu-runs"))
           / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
# the offline GPU stack lacks FlashInfer/FA3/xgrammar; a full install needs none of these. Prefill
# CUDA graphs off: faster starts; decode graphs stay on (the refresh benchmark keeps SGLang's defaults)
STACK = ["engine.backend=sglang", "engine.sglang.attention_backend=triton", "engine.sglang.grammar_backend=none",
         'engine.sglang.extra_args={"disable_prefill_cuda_graph": true}']


def record(name: str, data: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    import peft
    import sglang
    import transformers
    data = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sglang": sglang.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M"), **data}
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=1))


def gpu_config(*overrides) -> Config:
    cfg = Config.load(None, [*STACK, "engine.sglang.dtype=bfloat16", "engine.sglang.mem_fraction_static=0.3",
                             "run.out_dir=" + RUNS, *overrides])
    # every engine these tests start is SGLang: start_engine starts what engine.backend names
    assert cfg.engine.backend == "sglang", f"the GPU suite tests SGLang, not engine.backend={cfg.engine.backend}"
    return cfg


@pytest.fixture(scope="session")
def tiny_path():
    cfg = Config()
    return str(tiny_model_dir(os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"), cfg.warmstart, 0))


def random_adapter(model_path: str, seed: int, r: int = 16, scale: float = 0.1, version: int = 0) -> FlatAdapter:
    """A LoRA adapter with non-trivial B (PEFT initialises B = 0), as a FlatAdapter."""
    from peft import LoraConfig, get_peft_model

    from lorabench.models import load_model
    torch.manual_seed(seed)
    model = get_peft_model(load_model(model_path), LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, scale)
    return peft_adapter(model, version=version)


def probe_sequences(model_path: str, n: int = 8) -> tuple[list[list[int]], list[int]]:
    tok = load_tokenizer(model_path)
    seqs, plens = [], []
    for p in synthetic_problems(n, "gpu-probe"):
        prompt = prompt_ids(tok, p.messages)
        seqs.append(prompt + tok(p.answer, add_special_tokens=False)["input_ids"])
        plens.append(len(prompt))
    return seqs, plens


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    d = torch.cat([(x.float() - y.float()).abs() for x, y in zip(a, b)])
    return d.max().item(), d.mean().item()


def parity_run(model_path: str, tmp_path: Path, cfg, check_greedy: bool) -> dict:
    """Engine vs transformers+PEFT (bf16) log-probs for base, A (file), base while A is loaded,
    B after a same-name refresh by file, A again by tensors; optionally greedy outputs after the
    dynamic refresh vs an engine started with the adapter."""
    a, b = random_adapter(model_path, 1), random_adapter(model_path, 2)
    dir_a, dir_b = a.save_peft_dir(tmp_path / "A"), b.save_peft_dir(tmp_path / "B")
    seqs, plens = probe_sequences(model_path)
    hf = HFEngine(model_path, device="cuda", dtype="bfloat16")
    hf.load_adapter("A", dir_a)
    hf.load_adapter("B", dir_b)
    ref = {"base": hf.score(seqs, plens, None), "A": hf.score(seqs, plens, "A"), "B": hf.score(seqs, plens, "B")}
    hf.close()
    torch.cuda.empty_cache()
    prompts = [s[:p] for s, p in zip(seqs, plens)]
    greedy = Sampling(max_new_tokens=24, temperature=0.0)
    results, out = {}, {}
    with start_engine(cfg, model_path) as eng:
        results["base"] = diff(eng.score(seqs, plens, None), ref["base"])
        eng.load_adapter("policy", dir_a)
        got_a = eng.score(seqs, plens, "policy")
        results["A_by_file"] = diff(got_a, ref["A"])
        # a request without the name while the adapter is loaded runs the base model: it matches the
        # reference base (not bit-exactly: the LoRA batch path and prefix cache change bf16 rounding)
        # and is far from the adapter's log-probs
        base_during = eng.score(seqs, plens, None)
        results["base_while_adapter_loaded"] = diff(base_during, ref["base"])
        out["base_while_loaded_vs_adapter"] = diff(base_during, got_a)
        eng.unload_adapter("policy")
        eng.load_adapter("policy", dir_b)  # same-name refresh by file
        results["B_by_file_refresh"] = diff(eng.score(seqs, plens, "policy"), ref["B"])
        greedy_dynamic_b = [c.token_ids for c in eng.generate(prompts, greedy, "policy")]
        greedy_base = [c.token_ids for c in eng.generate(prompts, greedy, None)]
        eng.unload_adapter("policy")
        eng.load_adapter_tensors("policy", a.to("cuda"))
        results["A_by_tensor_refresh"] = diff(eng.score(seqs, plens, "policy"), ref["A"])
        # in place (the adapter's pool slot mapped once, then written by the copy plan): A -> B -> A
        eng.update_adapter_in_place("policy", FlatAdapter(b.buffer.cuda(), b.layout, b.config, 1))
        results["B_in_place"] = diff(eng.score(seqs, plens, "policy"), ref["B"])
        out["greedy_in_place_equals_file_refresh"] = greedy_dynamic_b == [
            c.token_ids for c in eng.generate(prompts, greedy, "policy")]
        eng.update_adapter_in_place("policy", FlatAdapter(a.buffer.cuda().bfloat16(), a.layout, a.config, 2))
        results["A_in_place_bf16"] = diff(eng.score(seqs, plens, "policy"), ref["A"])
        out["served_version_after_in_place"] = eng.served_version("policy")
        wrong = random_adapter(model_path, 3, r=8)  # another rank: refused before anything is written
        with pytest.raises(EngineError, match="lora_alpha|r:"):
            eng.update_adapter_in_place("policy", FlatAdapter(wrong.buffer.cuda(), wrong.layout, wrong.config, 3))
        results["A_after_refused_in_place"] = diff(eng.score(seqs, plens, "policy"), ref["A"])
        out["served_version_after_refused"] = eng.served_version("policy")
        with pytest.raises(AdapterNotLoaded):
            eng.unload_adapter("never-loaded")
        with pytest.raises(AdapterNotLoaded):
            eng.generate(prompts[:1], greedy, "never-loaded")
        # generate's own log-probs agree with score on the same tokens
        sampled = eng.generate(prompts, Sampling(24, 1.0, 1.0, seed=3), "policy")
        rescored = eng.score([c.prompt_ids + c.token_ids for c in sampled], [len(c.prompt_ids) for c in sampled],
                             "policy")
        out["generate_vs_score"] = diff([torch.tensor(c.logprobs) for c in sampled], rescored)
    out.update(max_mean_abs_diff=results, adapter_effect_A=diff(ref["A"], ref["base"]),
               adapter_effect_B=diff(ref["B"], ref["base"]),
               greedy_adapter_differs_from_base=greedy_dynamic_b != greedy_base)
    if check_greedy:
        with start_engine(cfg, model_path, lora_paths=[f"policy={dir_b}"]) as static:
            static._adapters.add("policy")  # loaded at start by the engine itself
            out["greedy_dynamic_equals_static"] = greedy_dynamic_b == [
                c.token_ids for c in static.generate(prompts, greedy, "policy")]
    return out


def assert_parity(out: dict, max_tol: float, mean_tol: float = 0.02) -> None:
    for key, (mx, mean) in out["max_mean_abs_diff"].items():
        assert mx < max_tol and mean < mean_tol, f"{key}: max {mx:.4f} mean {mean:.4f}"
    worst_mean = max(mean for _, mean in out["max_mean_abs_diff"].values())
    assert out["adapter_effect_A"][1] > 5 * worst_mean, "the adapter's own effect must dwarf the engine error"
    assert out["base_while_loaded_vs_adapter"][1] > 5 * out["max_mean_abs_diff"]["base_while_adapter_loaded"][1]
    assert out["greedy_adapter_differs_from_base"]
    assert out["served_version_after_in_place"] == 2 and out["served_version_after_refused"] == 2, out


def test_parity_and_refresh_semantics_tiny(tiny_path, tmp_path):
    """The tiny warm-started model (peaked 640-token vocab): single tokens moved by up to 0.10-0.15
    in earlier H200 runs with the base model alone at 0.06, so bf16 rounding of both engines, not
    the refresh, sets the max here. The mean bar (0.02) is the issue's; the max bar is 0.25 here,
    and the issue's 0.1 is checked on the 0.6B shape below."""
    out = parity_run(tiny_path, tmp_path, gpu_config(), check_greedy=True)
    record("parity_tiny", out)
    assert_parity(out, max_tol=0.25)
    assert out["greedy_dynamic_equals_static"]
    assert out["greedy_in_place_equals_file_refresh"]


def chi_square_999(dof: int) -> float:
    """The chi-square distribution's 99.9% quantile (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


def test_one_pass_sampler_draws_and_serves_as_sglangs_does(tiny_path):
    """engine.sglang.sampling_backend=lorabench. SGLang stops an engine whose backend nobody registered, so an
    engine that starts samples with lorabench's plugin. Its draws follow softmax(x/T) (2M draws, chi-square), its
    log-probs are log_softmax's at Qwen3's vocabulary, and a rollout's log-probs agree with a rescoring of its
    tokens as closely as with SGLang's own sampler."""
    from lorabench.engines.one_pass_sampler import gumbel_sample
    torch.manual_seed(0)
    base, draws = torch.randn(64, device="cuda") * 2, 2_000_000
    ids, _ = gumbel_sample(base.expand(draws, 64), torch.full((draws,), 0.8, device="cuda"))
    p = torch.softmax(base.double() / 0.8, -1)
    freq = torch.bincount(ids.long(), minlength=64).double() / draws
    kept = p * draws >= 5
    out = {"chi2": float(((freq - p) ** 2 / p)[kept].sum() * draws), "dof": int(kept.sum()) - 1}
    logits, temperatures = torch.randn(512, 151936, device="cuda") * 3, torch.rand(512, 1, device="cuda") + 0.5
    ids, logprobs = gumbel_sample(logits, temperatures)
    expected = torch.log_softmax(logits / temperatures, -1)[torch.arange(512, device="cuda"), ids.long()]
    out["logprob_gap"] = (logprobs - expected).abs().max().item()
    seqs, plens = probe_sequences(tiny_path)
    prompts = [s[:n] for s, n in zip(seqs, plens)] * 8
    for backend in ("lorabench", "pytorch"):
        with start_engine(gpu_config(f"engine.sglang.sampling_backend={backend}"), tiny_path) as eng:
            sampled = eng.generate(prompts, Sampling(24, 1.0, 1.0), None)
            rescored = eng.score([c.prompt_ids + c.token_ids for c in sampled], [len(c.prompt_ids) for c in sampled],
                                 None)
            out[f"generate_vs_score_{backend}"] = diff([torch.tensor(c.logprobs) for c in sampled], rescored)
            out[f"distinct_completions_{backend}"] = len({tuple(c.token_ids) for c in sampled})
            # batches the plugin leaves to SGLang: greedy rows beside sampled ones, and top-p (on SAMPLER,
            # SGLang's own dispatch raised and its scheduler died, taking this process with it)
            greedy, nucleus = eng.generate_mixed([GenerateRequest(prompts[:4], Sampling(16, 0.0), None),
                                                  GenerateRequest(prompts[4:12], Sampling(16, 1.0, 0.9), None)])
            out[f"left_to_sglang_rows_{backend}"] = sum(len(c.token_ids) > 0 for c in greedy + nucleus)
    record("one_pass_sampler", out)
    assert out["chi2"] < chi_square_999(out["dof"]), out
    assert out["logprob_gap"] < 1e-4, out
    ours, sglangs = out["generate_vs_score_lorabench"], out["generate_vs_score_pytorch"]
    assert ours[0] < 0.25 and ours[1] < max(2 * sglangs[1], 0.01), out
    # the same noise at every step (a seed fixed once) would repeat draws of a repeated prompt
    assert out["distinct_completions_lorabench"] >= out["distinct_completions_pytorch"] / 2, out
    assert out["left_to_sglang_rows_lorabench"] == 12, out


def test_parity_qwen3_06b_shape(q06_model, tmp_path):
    out = parity_run(str(q06_model), tmp_path, gpu_config("lora.r=16"), check_greedy=False)
    record("parity_qwen3_06b_shape", out)
    assert_parity(out, max_tol=0.1)


def run_grpo(cfg, model_path, engine, steps):
    from lorabench.runlog import RunLog
    from lorabench.session import build_trainer
    trainer = build_trainer(cfg, model_path, engine, RunLog(Path(cfg.run.out_dir) / cfg.run.name, settings=cfg.run),
                            log=print)
    before = trainer.evaluate()
    rows = []
    for _ in range(steps):
        rows.append(trainer.step().metrics)
        progress(f"{cfg.run.name} step {len(rows)}: {rows[-1]['time/step_s']:.2f} s "
                 f"(train {rows[-1]['time/train_s']:.2f} s)")
    after = trainer.evaluate()
    trainer.close()
    return before, rows, after


def progress(line: str) -> None:
    """To the real stderr, so a device call cut off by its limit still shows how far a test got
    (dev/gpu_session.sh runs pytest with --capture=tee-sys and writes each part's log under $OUT
    as it runs; under pytest's default fd capture the line waits for the test's end)."""
    print(line, file=sys.__stderr__, flush=True)


def grpo_per_mode(engine, model_path, modes, steps: int, *overrides, name: str = "grpo") -> dict:
    """A short GRPO run per refresh mode on one engine: held-out reward before/after, training
    reward, mismatch per step, refresh and step time."""
    summary = {}
    for mode in modes:
        cfg = gpu_config(*overrides, f"refresh.mode={mode}", f"run.name={name}-{mode}")
        t0 = time.perf_counter()
        before, rows, after = run_grpo(cfg, model_path, engine, steps)
        summary[mode] = {
            "seconds": time.perf_counter() - t0, "heldout_strict_before": before["strict"],
            "heldout_strict_after": after["strict"],
            "reward_first5": sum(r["reward/mean"] for r in rows[:5]) / 5,
            "reward_last5": sum(r["reward/mean"] for r in rows[-5:]) / 5,
            "mismatch_active_mean_per_step": [r["mismatch/active_mean"] for r in rows],
            "mismatch_max_per_step": [r["mismatch/max"] for r in rows],
            "mismatch_p99_per_step": [r["mismatch/p99"] for r in rows],
            "served_versions": [r["adapter/served_version"] for r in rows],
            "refresh_ms_p50": sorted(1e3 * r["refresh/total_s"] for r in rows)[len(rows) // 2],
            "step_s_p50": sorted(r["time/step_s"] for r in rows)[len(rows) // 2],
            "rows": rows,
        }
    return summary


def test_grpo_with_sglang_rollouts(tiny_path):
    """Reward rises with file and tensor refresh; mismatch stays at the parity level on every step
    with non-zero advantages; with refresh off (stale adapter) the mismatch grows."""
    steps = int(os.environ.get("LORABENCH_GPU_STEPS", "40"))
    with start_engine(gpu_config(), tiny_path) as engine:
        summary = grpo_per_mode(engine, tiny_path, ("inplace", "tensor", "file", "none"), steps)
    record("grpo_sglang", summary)
    for mode in ("inplace", "tensor", "file"):   # every rollout was served by the trainer's version
        assert summary[mode]["served_versions"] == list(range(steps)), (mode, summary[mode]["served_versions"])
    for mode in ("inplace", "tensor", "file"):
        s = summary[mode]
        gain = s["heldout_strict_after"] - s["heldout_strict_before"]
        assert gain >= 0.2, (mode, s["heldout_strict_before"], s["heldout_strict_after"])
        active = [m for m in s["mismatch_active_mean_per_step"] if m == m and m is not None]
        assert active and max(active) < 0.05, (mode, max(active))
    stale = [m for m in summary["none"]["mismatch_active_mean_per_step"] if m == m and m is not None]
    fresh = [m for m in summary["tensor"]["mismatch_active_mean_per_step"] if m == m and m is not None]
    assert stale[-1] > 3 * max(fresh), (stale[-1], max(fresh))


@pytest.fixture(scope="session")
def q06_model(tiny_path, tmp_path_factory):
    """A random-init model of Qwen3-0.6B's shape (bf16), with the tiny tokenizer, in a local dir."""
    from synthetic import random_qwen3_dir  # benchmarks/
    return random_qwen3_dir("0.6B", tiny_path, tmp_path_factory.mktemp("q06") / "qwen3-0.6b-random")


def tree_rss_bytes(root: int) -> int:
    """Resident memory of `root` and all its descendants (the engine's scheduler and detokenizer)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while we looked
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def open_watched(what: str, cfg, model_path: str, deadline_s: float):
    """start_engine under benchmarks/watch.py: a line every 10 s while it opens and the stacks (the engine's
    processes' too) if it passes deadline_s; the engine is watched from then on."""
    import watch  # benchmarks/
    watch.stacks_in_children()
    with watch.phase(what, deadline_s):
        watch.engine = start_engine(cfg, model_path)
    return watch.engine


def test_soak_sglang_refresh_cycles(tiny_path):
    """>= 300 refresh cycles per mode (file, tensor, inplace) with generation between them: no failure,
    and neither host RSS (this process + engine processes) nor GPU memory grows beyond noise."""
    from lorabench.policy import LoraLayers
    from lorabench.refresh import make_refresher
    from lorabench.refresh_bench import adapter_model
    cycles = int(os.environ.get("LORABENCH_GPU_SOAK", "300"))
    model = adapter_model(tiny_path, 16, device="cuda")
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    prompts = [s[:p] for s, p in zip(*probe_sequences(tiny_path))]
    sampling = Sampling(max_new_tokens=16, temperature=1.0, seed=0)
    out = {"cycles_per_mode": cycles, "rows": []}
    layers = LoraLayers(model)
    import watch  # benchmarks/
    with open_watched("soak: engine open", gpu_config(), tiny_path, 120) as eng:
        for mode in ("file", "tensor", "inplace"):
            refresher = make_refresher(mode, eng, "soak")
            t0 = time.perf_counter()
            for cycle in range(cycles):
                if cycle % 100 == 0:
                    watch.say(f"soak {mode}: cycle {cycle} of {cycles}")
                with torch.no_grad():
                    for p in lora_b:
                        p.mul_(0.999).add_(1e-4)
                record_ = refresher.refresh(layers.snapshot(cycle))
                done = eng.generate(prompts, sampling, "soak")
                assert len(done) == len(prompts) and all(c.token_ids for c in done)
                if cycle % 10 == 0 or cycle == cycles - 1:
                    free, total = torch.cuda.mem_get_info()
                    out["rows"].append({"mode": mode, "cycle": cycle, "refresh_ms": 1e3 * record_.total_s,
                                        "host_rss_mb": tree_rss_bytes(os.getpid()) / 2**20,
                                        "gpu_used_mb": (total - free) / 2**20,
                                        "torch_allocated_mb": torch.cuda.memory_allocated() / 2**20})
            if mode == "file":
                assert len(list(refresher.root.iterdir())) == 1  # old adapter dirs are removed
            refresher.close()
            out[f"{mode}_seconds"] = time.perf_counter() - t0
            watch.say(f"soak {mode}: {cycles} cycles in {out[f'{mode}_seconds']:.1f} s")
            eng.unload_adapter("soak")
    record("soak_sglang", out)
    for mode in ("file", "tensor", "inplace"):
        rows = [r for r in out["rows"] if r["mode"] == mode]
        settled, last = rows[len(rows) // 4], rows[-1]  # after warm-up (caches, pinned pools) vs the end
        for key, slack in (("host_rss_mb", 128), ("gpu_used_mb", 64)):  # one leaked adapter per cycle: > 100 MB
            growth = last[key] - settled[key]
            assert growth < slack, f"{mode}: {key} grew by {growth:.0f} MB over {cycles * 3 // 4} cycles"


def free_per_gpu(gpus: int) -> list[int]:
    for d in range(gpus):
        torch.cuda.synchronize(d)
    return [torch.cuda.mem_get_info(d)[0] for d in range(gpus)]


def release_resume_run(model_path: str, gpus: int, *overrides, name: str = "grpo-release") -> dict:
    """One release/resume cycle of the KV cache (engine started with enable_memory_saver) on an
    engine spanning `gpus` GPUs: memory freed and taken back on each, greedy outputs before vs
    after, the refusals of a second release and of a resume without release, then 6 GRPO steps
    that release the engine while the trainer trains."""
    saver = [*overrides, 'engine.sglang.extra_args={"disable_prefill_cuda_graph": true, "enable_memory_saver": true}',
             "engine.release_memory_during_training=true"]
    a = random_adapter(model_path, 1)
    prompts = [s[:p] for s, p in zip(*probe_sequences(model_path))]
    greedy = Sampling(max_new_tokens=24, temperature=0.0)
    out = {}
    import watch  # benchmarks/
    with open_watched("release/resume: engine open with the memory saver", gpu_config(*saver), model_path, 150) as eng:
        eng.load_adapter_tensors("policy", a.to("cuda"))
        before = {n: [c.token_ids for c in eng.generate(prompts, greedy, n)] for n in ("policy", None)}
        watch.say("release/resume: greedy outputs before the release")
        free0 = free_per_gpu(gpus)
        eng.release_memory(["kv_cache"])
        free1 = free_per_gpu(gpus)
        with pytest.raises(EngineError, match="already released"):
            eng.release_memory(["kv_cache"])
        eng.resume_memory()
        free2 = free_per_gpu(gpus)
        with pytest.raises(EngineError, match="without release_memory"):
            eng.resume_memory()
        watch.say("release/resume: released, refused twice, resumed")
        after = {n: [c.token_ids for c in eng.generate(prompts, greedy, n)] for n in ("policy", None)}
        out.update(freed_gb_per_gpu=[(f1 - f0) / 1e9 for f0, f1 in zip(free0, free1)],
                   taken_back_gb_per_gpu=[(f1 - f2) / 1e9 for f1, f2 in zip(free1, free2)],
                   greedy_same_after_resume=before == after)
        eng.unload_adapter("policy")
        with watch.phase("release/resume: 6 GRPO steps releasing the engine while training", 150):
            _, rows, _ = run_grpo(gpu_config(*saver, "refresh.mode=inplace", f"run.name={name}"), model_path, eng, 6)
        out["grpo_mismatch_active"] = [r["mismatch/active_mean"] for r in rows]
        out["grpo_reward"] = [r["reward/mean"] for r in rows]
    return out


def test_release_resume_memory(tiny_path):
    """Colocated with the trainer: with enable_memory_saver, releasing the KV cache frees GPU memory,
    resuming brings the engine back with the same greedy outputs, and a GRPO run with
    engine.release_memory_during_training keeps trainer and engine in sync."""
    pytest.importorskip("torch_memory_saver", reason="needs torch_memory_saver (SGLang's memory saver)")
    out = release_resume_run(tiny_path, 1)
    out["freed_gb"], = out.pop("freed_gb_per_gpu")
    out["taken_back_gb"], = out.pop("taken_back_gb_per_gpu")
    record("release_resume", out)
    assert out["freed_gb"] > 1.0, out          # the KV cache of a 0.3 memory fraction is tens of GB
    assert out["taken_back_gb"] > 0.9 * out["freed_gb"], out
    assert out["greedy_same_after_resume"]
    active = [m for m in out["grpo_mismatch_active"] if m == m and m is not None]
    assert active and max(active) < 0.05, active


# --- the in-place pool writer: versions and hazards ----------------------------------------------
def _versions_and_references(model_path: str, n: int):
    """n different adapters (versions 0..n-1) and transformers+PEFT (bf16) log-probs of each."""
    seqs, plens = probe_sequences(model_path)
    # scale 0.3: versions far enough apart that the >= 10x staleness margin is a real test
    versions = [random_adapter(model_path, 10 + v, scale=0.3, version=v) for v in range(n)]
    hf = HFEngine(model_path, device="cuda", dtype="bfloat16")
    refs = []
    for v, a in enumerate(versions):
        hf.load_adapter_tensors(f"v{v}", a.to("cuda"))
        refs.append(hf.score(seqs, plens, f"v{v}"))
    hf.close()
    torch.cuda.empty_cache()
    return versions, refs, seqs, plens


def test_inplace_versions_and_hazards(tiny_path):
    """The in-place path end to end: after every write the engine matches the trainer's weights and
    is >= 10x further from the previous version; versions follow the writes; the pinned adapter is
    never evicted (so SGLang never reloads its stale host copy) while other adapters churn the pool;
    a write sent while a request runs waits for it (calls run one at a time on the engine's thread); a
    plan the engine lost is re-mapped;
    a new engine gets a full load; a refresher that skips its write is caught by the version check."""
    from lorabench.refresh import InPlaceRefresh, make_refresher
    t0 = time.monotonic()

    def phase(what: str) -> None:
        progress(f"in place hazards: {what} at {time.monotonic() - t0:.0f} s")
    versions, refs, seqs, plens = _versions_and_references(tiny_path, 7)
    out = {"parity": [], "previous": [], "full_load": [], "vs_full_load": []}
    phase("references made")

    def check(eng, v):
        got = eng.score(seqs, plens, "policy")
        out["parity"].append(diff(got, refs[v]))
        out["previous"].append(diff(got, refs[v - 1]) if v else (float("nan"), float("nan")))
        assert eng.served_version("policy") == v, (eng.served_version("policy"), v)
        # the same version loaded whole under another name, on the same engine: what in place must equal
        eng.load_adapter_tensors("full-load", versions[v].to("cuda"))
        full = eng.score(seqs, plens, "full-load")
        eng.unload_adapter("full-load")
        out["full_load"].append(diff(full, refs[v]))
        out["vs_full_load"].append(diff(got, full))

    cfg = gpu_config("engine.sglang.max_loras_per_batch=3")
    with start_engine(cfg, tiny_path) as eng:
        phase("engine open")
        refresher = make_refresher("inplace", eng, "policy")
        for v in (0, 1):                                  # a full load, then the first in-place write (map)
            refresher.refresh(versions[v].to("cuda"))
            check(eng, v)
        for k in range(3):                                # churn: every other slot is taken and evicted
            eng.load_adapter_tensors(f"other{k}", random_adapter(tiny_path, 50 + k).to("cuda"))
            eng.score(seqs[:2], plens[:2], f"other{k}")
        phase("versions 0-1 checked, other adapters churned")
        refresher.refresh(versions[2].to("cuda"))
        check(eng, 2)
        for k in range(3):
            eng.score(seqs[:2], plens[:2], f"other{k}")
        check(eng, 2)                                     # still v2 after more churn: not reloaded from host
        # the check above reuses the first check's cached prompt KV (an extend, another kernel path: ~0.006 from
        # the full load); with SGLang's prefix cache emptied v2 scores as the full load does, bit for bit
        call_sglang(eng, lambda e: e.flush_cache())
        check(eng, 2)
        prompts = [s[:p] for s, p in zip(seqs, plens)] * 16
        finished = {}

        def generate_then_note():
            eng.generate(prompts, Sampling(256, 1.0, seed=1), "policy")
            finished["generate"] = time.monotonic()
        worker = threading.Thread(target=generate_then_note)
        worker.start()
        deadline = time.monotonic() + 10
        while not eng._thread.running_call and time.monotonic() < deadline:
            time.sleep(0.001)
        out["write_during_generate_waited"] = bool(eng._thread.running_call)
        refresher.refresh(versions[3].to("cuda"))          # handed to the engine thread: runs after the request
        finished["write"] = time.monotonic()
        worker.join()
        phase("a write during a request waited")
        out["write_after_generate"] = finished["write"] > finished["generate"]
        check(eng, 3)
        # the engine loses the plan
        call_sglang(eng, lambda _: eng.pool._send("forget", eng.pool.mapped["policy"], [], flush_cache=False))
        record_ = refresher.refresh(versions[4].to("cuda"))
        out["remapped"] = record_.engine_ms.get("remapped")
        check(eng, 4)

        class SkipsWrites(InPlaceRefresh):                # a refresh that silently does nothing
            def _refresh(self, adapter, record):
                if self.adapter_name not in self.engine.loaded_adapters():
                    super()._refresh(adapter, record)
        phase("lost plan re-mapped")
        out["stale_caught"] = _stale_adapter_caught(eng, tiny_path, SkipsWrites)
        phase("skipped write caught")
    with start_engine(cfg, tiny_path) as eng:  # a new engine: nothing mapped, a full load first
        phase("second engine open")
        refresher = make_refresher("inplace", eng, "policy")
        for v in (5, 6):
            refresher.refresh(versions[v].to("cuda"))
            check(eng, v)
    phase("second engine closed")
    record("inplace_hazards", out)
    assert out["remapped"] == 1.0 and out["stale_caught"], out
    assert out["write_during_generate_waited"] and out["write_after_generate"], out
    for (_, mean), (_, prev), (_, full), (_, apart) in zip(out["parity"], out["previous"], out["full_load"],
                                                           out["vs_full_load"]):
        # against transformers+PEFT both sides round in bf16, and with these strong adapters the mean gap
        # depends on the model (0.009-0.017 on one tiny model, 0.014-0.020 on another): in place must be as
        # close as a full load of the same version on the same engine is, and far closer to it than to the
        # previous version; the per-token max is recorded, not judged
        assert mean < 0.03 and mean <= 1.1 * full + 2e-3, out
        assert apart < 0.1 * prev if prev == prev else apart < 0.5 * full + 2e-3, out
        assert not prev == prev or prev > 10 * mean, out  # the previous version is >= 10x further


def _stale_adapter_caught(engine, model_path, refresher_cls) -> bool:
    """A GRPO run whose refresher skips its writes fails at the next rollout with StaleAdapter, at a
    learning rate so small that the log-prob mismatch alone would not show it."""
    from lorabench.engines.base import StaleAdapter
    from lorabench.session import build_trainer
    cfg = gpu_config("refresh.mode=inplace", "grpo.lr=1e-7", "engine.adapter_name=skipper", "run.name=skipper")
    trainer = build_trainer(cfg, model_path, engine)    # loads version 0 into the engine
    trainer.refresher = refresher_cls(engine, "skipper")
    trainer.step()                                     # served version 0 = the trainer's: fine
    try:
        trainer.step()                                 # the engine still holds version 0, the trainer 1
    except StaleAdapter:
        return True
    finally:
        trainer.close()
        engine.unload_adapter("skipper")
    return False


# --- no open doors: the engine's sockets ------------------------------------------------------------
def socket_summary(watch) -> dict:
    """What a SocketWatch saw listen, split into loopback and not, and any peer off the host."""
    from test_security import is_loopback, listening
    listeners = {(c.laddr.ip, c.laddr.port, "tcp" if c.type == 1 else "udp") for c in listening(watch.seen)}
    return {"samples": watch.samples, "sockets_seen": len({(c.fd, c.laddr) for c in watch.seen}),
            "listeners_loopback": sorted(x for x in listeners if is_loopback(x[0])),
            "listeners_other": sorted(x for x in listeners if not is_loopback(x[0])),
            "connected_other": sorted({(c.raddr.ip, c.raddr.port) for c in watch.seen
                                       if c.raddr and not is_loopback(c.raddr.ip)})}


def socket_check(model_path: str, cfg) -> dict:
    """Start the engine and load, refresh (in place) and generate with an adapter while every inet
    socket of this process tree is sampled (the engine's scheduler ranks and detokenizer are its
    children)."""
    from test_security import SocketWatch  # the CPU suite's checker
    a, b = random_adapter(model_path, 1), random_adapter(model_path, 2)
    prompts = [s[:p] for s, p in zip(*probe_sequences(model_path))]
    with SocketWatch(interval=0.02) as watch:
        with start_engine(cfg, model_path) as eng:
            eng.load_adapter_tensors("policy", a.to("cuda"))
            eng.update_adapter_in_place("policy", FlatAdapter(b.buffer.cuda(), b.layout, b.config, 1))
            eng.generate(prompts, Sampling(max_new_tokens=16, temperature=1.0, seed=0), "policy")
            eng.score(*probe_sequences(model_path), "policy")
    return socket_summary(watch)


@pytest.mark.parametrize("mode", ["inplace", "tensor"])
def test_writes_right_after_interrupted_calls(tiny_path, mode):
    """Ctrl-C mid-call, then at once the refresh a rolled-back step sends: 16 times, at random moments of a
    rollout (a batch of 1024) or a probe (a score). SGLang's scheduler may still hold an aborted call's requests
    when its call returns, and the cache flush that ends a weight write stops a scheduler that is not idle; a
    request aborted in its queue keeps its adapter's in-use count, on which a tensor refresh's unload waits.
    Every refresh must land (served version right), and the engine must serve after each."""
    import _thread
    import dataclasses
    import random

    from lorabench.refresh import make_refresher
    t0, rng, seen = time.monotonic(), random.Random(0), []
    versions = [random_adapter(tiny_path, seed) for seed in (0, 1)]
    seqs, plens = probe_sequences(tiny_path, 64)
    with start_engine(gpu_config(), tiny_path) as eng:
        refresher = make_refresher(mode, eng, "policy")
        refresher.refresh(versions[0].to("cuda"))
        refresher.refresh(dataclasses.replace(versions[1], version=1).to("cuda"))   # in place: mapped from here on
        # each call takes seconds, far longer than the interrupt's delay: 1024 rows x 400 tokens past EOS (the tiny
        # model stops after ~30), sent as lorabench sends a rollout; 300 probes in a row
        long_rollout = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}
        calls = {"rollout": lambda: eng._thread.call(lambda e: e.generate(input_ids=seqs[:1] * 1024, lora_path=[
                     "policy"] * 1024, sampling_params=long_rollout), eng.engine, on_interrupt=eng._abort),
                 "probe": lambda: [eng.score(seqs, plens, "policy") for _ in range(300)]}
        for i in range(16):
            what, delay = ("rollout", "probe")[i % 2], rng.uniform(0.02, 0.6)
            timer = threading.Timer(delay, _thread.interrupt_main)
            timer.start()
            finished = False
            try:
                calls[what]()
                finished = True
                timer.join()   # a call that ended first: its interrupt lands here, not in the refresh below
            except KeyboardInterrupt:
                pass
            timer.join()
            interrupted = not finished
            # at once, as a rolled-back step's re-send
            refresher.refresh(dataclasses.replace(versions[i % 2], version=i + 2).to("cuda"))
            served = eng.served_version("policy")
            out = eng.generate(seqs[:4], Sampling(max_new_tokens=8, temperature=1.0), "policy")
            seen.append({"call": what, "delay_s": round(delay, 3), "interrupted": interrupted, "served": served})
            progress(f"interrupted writes, {mode}: {i + 1}/16 {what} after {delay:.2f} s (interrupted: "
                     f"{interrupted}) at {time.monotonic() - t0:.0f} s")
            assert served == i + 2 and all(c.token_ids for c in out), seen[-1]
    record(f"interrupted_writes_{mode}", {"seconds": round(time.monotonic() - t0, 1), "rounds": seen})
    assert sum(r["interrupted"] for r in seen) >= 8, seen   # most rounds did interrupt their call


def test_engine_opens_no_door(tiny_path):
    """While the SGLang engine starts, refreshes and serves: nothing listens on a non-loopback
    address and nothing connects off the host. (SGLang's control plane is ipc:// sockets; the
    torch.distributed store of its scheduler listens on 127.0.0.1.)"""
    out = socket_check(tiny_path, gpu_config())
    record("sockets_tp1", out)
    assert out["samples"] > 20, out
    assert out["listeners_other"] == [] and out["connected_other"] == [], out


# --- the scheduler dies mid-run -------------------------------------------------------------------
def test_scheduler_death_mid_run(tiny_path, tmp_path):
    """SGLang's scheduler killed (SIGKILL, as an OOM kill or a fatal CUDA error ends it) during a
    `lorabench run`: SGLang's watchdog signals the lorabench process, which fails the engine instead
    of dying (a notebook kernel would live on): the run ends with one line naming the failed process
    (exit 2, no hang), no engine process survives, the GPU memory comes back, the run dir holds whole
    step rows up to its last committed checkpoint, and `lorabench resume` on a new engine finishes
    the run with every step exactly once."""
    import subprocess
    import sys

    import psutil

    from lorabench.runlog import read_jsonl
    steps, run_dir, log = 8, tmp_path / "runs" / "killed", tmp_path / "log.txt"
    args = ["run", f"model.name_or_path={tiny_path}", *STACK, "engine.sglang.dtype=bfloat16",
            "engine.sglang.mem_fraction_static=0.3", f"run.out_dir={run_dir.parent}", "run.name=killed",
            f"grpo.steps={steps}", "run.save_adapter_every=2", "refresh.mode=inplace",
            "grpo.compile=off"]   # what is tested starts after step 3; compiling would be most of the wait
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]

    def start(*cli_args):
        with open(log, "ab") as fh:
            return subprocess.Popen([sys.executable, "-m", "lorabench.cli", *cli_args], stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def step_rows():
        path = run_dir / "metrics.jsonl"
        return [r["step"] for r in read_jsonl(path)] if path.exists() else []

    proc = start(*args)
    t0 = time.monotonic()
    while len(step_rows()) < 3:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() - t0 < 400, "the run did not reach step 3"
        time.sleep(0.05)
    tree = psutil.Process(proc.pid).children(recursive=True)
    schedulers = [p for p in tree if p.cmdline() and p.cmdline()[0].startswith("sglang::scheduler")]
    assert schedulers, [p.cmdline()[:1] for p in tree]
    rows_at_kill = step_rows()
    t_kill = time.monotonic()
    schedulers[0].kill()
    try:
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run process did not end within 120 s of its scheduler's death")
    died_after_s = time.monotonic() - t_kill
    death_log = log.read_text()[-2000:]
    _, survivors = psutil.wait_procs(tree, timeout=30)
    time.sleep(2)
    free_after = torch.cuda.mem_get_info()[0]
    rows_after = step_rows()
    out = {"rows_at_kill": rows_at_kill, "rows_after_death": rows_after, "returncode": rc, "death_log": death_log,
           "died_after_s": died_after_s, "survivors": [p.pid for p in survivors],
           "gpu_free_gb_before_after": [free_before / 1e9, free_after / 1e9],
           "checkpoint_committed": (run_dir / "checkpoint" / "trainer_state.pt").is_file()}
    proc = start("resume", str(run_dir))
    try:
        out["resume_returncode"] = proc.wait(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("resume did not finish in 400 s")
    out["rows_final"] = step_rows()
    out["log_tail"] = log.read_text()[-3000:]
    record("scheduler_death", out)
    assert rc == 2 and survivors == [], out
    assert "the SGLang engine failed: process" in death_log and "Traceback" not in death_log, out
    assert free_after > free_before - 1e9, out           # the dead engine's ~40 GB came back
    assert rows_after == list(range(1, len(rows_after) + 1)), out   # whole rows, in order
    assert out["resume_returncode"] == 0 and out["rows_final"] == list(range(1, steps + 1)), out


# --- several policies on one engine (group.py) --------------------------------------------------------
def drawn_adapters(model_path: str, k: int, r: int, scale: float, seed: int, version: int = 0) -> list[FlatAdapter]:
    """k LoRA adapters drawn far apart (A ~ N(0, 1/in), B ~ N(0, scale)): a row served by another of
    them moves its log-probs by far more than the engine's rounding."""
    from peft import LoraConfig, get_peft_model

    from lorabench.models import load_model
    model = get_peft_model(load_model(model_path), LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear"))
    adapters = []
    for i in range(k):
        torch.manual_seed(seed + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.normal_(0, p.shape[1] ** -0.5)
                elif "lora_B" in name:
                    p.normal_(0, scale)
        adapters.append(peft_adapter(model, version=version))
    return adapters


def served_by(distance: dict[str, dict[str, float]], owner: dict[str, str], margin: float = 10.0) -> dict[str, str]:
    """Which rows were not served by their owner's adapter: `distance[rows][adapter]` is the mean
    |sampled - scored| log-prob of the rows sampled for `rows` re-scored alone under `adapter`; the
    rows of `rows` pass when their owner's adapter is the nearest by `margin` over every other one.
    {rows: why} for each that fails (empty: every row was served by its owner's adapter)."""
    failed = {}
    for rows, owner_name in owner.items():
        own = distance[rows][owner_name]
        nearest_other = min(d for name, d in distance[rows].items() if name != owner_name)
        if not nearest_other > margin * own:
            failed[rows] = f"own {owner_name} {own:.4f} vs nearest other {nearest_other:.4f}"
    return failed


def mixed_batch_distances(engine, names: list[str], prompts: list[list[int]], new_tokens: int = 32) -> dict:
    """One mixed batch (each policy's prompts name its adapter), then every policy's rows re-scored
    alone under every adapter: {rows: {adapter: mean |sampled - scored|}}."""
    from lorabench.engines.base import GenerateRequest, generate_each
    requests = [GenerateRequest(prompts, Sampling(new_tokens, 1.0, seed=i), name) for i, name in enumerate(names)]
    done = generate_each(engine, requests)
    seqs = [c.prompt_ids + c.token_ids for per in done for c in per]
    plens = [len(c.prompt_ids) for per in done for c in per]
    scored = {adapter: engine.score(seqs, plens, adapter) for adapter in names}
    distance, start = {}, 0
    for name, per in zip(names, done):
        sampled = [torch.tensor(c.logprobs) for c in per]
        distance[name] = {adapter: diff(sampled, s[start:start + len(per)])[1] for adapter, s in scored.items()}
        start += len(per)
    return distance


def test_mixed_batch_right_adapter_06b(q06_model):
    """Policies' rollouts in one SGLang batch, each prompt naming its policy's adapter, at K=2, 4 and
    8 on the 0.6B shape: every policy's rows carry its own adapter's log-probs (re-scored alone) and
    are >= 10x further from every other adapter's, with the adapters loaded by tensors, then mapped
    and written in place, then written in place again. The same numbers with the owners rotated (what
    a batch that served each policy's rows with its neighbour's adapter would give) must fail."""
    from lorabench.refresh import make_refresher
    model_path, k_max, out = str(q06_model), 8, {}
    seqs, plens = probe_sequences(model_path, 4)
    prompts = [s[:p] for s, p in zip(seqs, plens)] * 4              # 16 rows per policy
    names = [f"p{i}" for i in range(k_max)]
    cfg = gpu_config("lora.r=32", f"engine.sglang.max_loras_per_batch={k_max + 1}")
    t0 = time.perf_counter()
    with start_engine(cfg, model_path) as engine:
        progress(f"mixed batch: engine open in {time.perf_counter() - t0:.0f} s")
        rounds = [("tensor", 0), ("inplace", 1), ("inplace", 2)]   # load; map (first in-place write); apply
        refreshers = {}
        for mode, version in rounds:
            adapters = drawn_adapters(model_path, k_max, 32, 0.1, seed=100 * (version + 1), version=version)
            for name, adapter in zip(names, adapters):
                if refreshers.get(name, ("",))[0] != mode:   # the in-place refresher takes over the loaded adapter
                    refreshers[name] = (mode, make_refresher(mode, engine, name))
                refreshers[name][1].refresh(adapter.to("cuda"))
            for k in (2, 4, 8):
                distance = mixed_batch_distances(engine, names[:k], prompts)
                rotated = {rows: names[(i + 1) % k] for i, rows in enumerate(names[:k])}
                key = f"{mode}-v{version}-K{k}"
                out[key] = {"distance": distance, "served_versions": [engine.served_version(n) for n in names[:k]],
                            "failed": served_by(distance, {n: n for n in names[:k]}),
                            "rotated_owners_failed": sorted(served_by(distance, rotated))}
                progress(f"mixed batch {key}: {len(out[key]['failed'])} policies failed, rotated owners: "
                         f"{len(out[key]['rotated_owners_failed'])} of {k} failed "
                         f"({time.perf_counter() - t0:.0f} s)")
    record("mixed_batch_06b", out)
    for key, result in out.items():
        k = int(key.split("K")[1])
        assert not result["failed"], (key, result)
        assert len(result["rotated_owners_failed"]) == k, (key, result)   # the check can fail for this reason
        assert result["served_versions"] == [int(key.split("-v")[1][0])] * k, (key, result)


def test_policy_group_on_sglang(tiny_path, tmp_path):
    """Two policies of different rank on one SGLang engine through GroupSession, refreshed in place:
    one mixed batch per step, every rollout served by its own policy's version, each policy's
    mismatch at the single-policy level; then with the two adapters drawn far apart, each policy's
    rows of a mixed batch are nearest its own adapter (by >= 10x), and would fail the check if the
    batch had swapped them."""
    from lorabench.session import GroupSession
    entries = [{"name": "r4", "lora": {"r": 4}}, {"name": "r16", "lora": {"r": 16}}]
    cfg = gpu_config(f"policies={json.dumps(entries)}", "grpo.steps=6", "refresh.mode=inplace", "grpo.compile=off")
    t0 = time.perf_counter()
    group = GroupSession.open(cfg, tmp_path / "group", log=print, evaluate_first=False)
    progress(f"group of 2: open in {time.perf_counter() - t0:.0f} s")
    out = {}
    try:
        records = []
        for _ in range(6):
            records.append(group.trainer.step())
            progress(f"group of 2: step {len(records)} at {time.perf_counter() - t0:.0f} s")
        rows = {name: [r[name].metrics for r in records] for name in group.trainer.trainers}
        out["served_versions"] = {n: [r["adapter/served_version"] for r in policy] for n, policy in rows.items()}
        out["mismatch_active_mean"] = {n: [r["mismatch/active_mean"] for r in policy] for n, policy in rows.items()}
        for i, trainer in enumerate(group.trainer.trainers.values()):   # drawn apart, written in place
            adapter = trainer.policy.adapter()          # a copy: the policy's own weights stay
            torch.manual_seed(7 + i)
            with torch.no_grad():
                for tensor_name, t in adapter.tensors.items():
                    t.normal_(0, t.shape[1] ** -0.5 if ".lora_A." in tensor_name else 0.3)
            trainer.refresher.refresh(adapter)
        seqs, plens = probe_sequences(tiny_path, 4)
        prompts = [s[:p] for s, p in zip(seqs, plens)] * 4
        names = list(group.trainer.trainers)
        distance = mixed_batch_distances(group.engine, names, prompts)
        out.update(distance=distance, failed=served_by(distance, {n: n for n in names}),
                   swapped_failed=sorted(served_by(distance, dict(zip(names, names[::-1])))))
    finally:
        group.close()
    record("group_sglang", out)
    for name, versions in out["served_versions"].items():
        assert versions == list(range(6)), (name, versions)
        active = [m for m in out["mismatch_active_mean"][name] if m == m and m is not None]
        assert not active or max(active) < 0.05, (name, active)
    assert not out["failed"], out
    assert out["swapped_failed"] == sorted(names), out   # the check fails when the two are swapped


# one step stale: the batch sampled ahead reads its versions on the sampler's thread while the compiled updates'
# kernels are queued ahead on the trainer's (the in-place pool's status buffer once lost its reply there at step 3)
GROUP_OF_FOUR = {"inplace": ["grpo.compile=off"], "tensor": ["grpo.compile=off"],
                 "inplace-stale": ["grpo.max_staleness=1", "grpo.activation_checkpointing=false"]}


@pytest.mark.parametrize("case", list(GROUP_OF_FOUR))
def test_policy_group_of_four_06b(q06_model, tmp_path, case):
    """Four policies of the 0.6B shape (r=32, differing in grpo.lr) opened as `lorabench run` opens a
    group (GroupSession.open with its held-out evaluation first) and stepped, every phase bounded: a step
    that waits past its deadline prints every stack here and in the engine's processes and ends the test
    (benchmarks/watch.py), so a hang shows where it is. Every rollout is served by its own policy's
    version (one step stale: the version before, from step 2 on), and every policy's log-probs match the
    trainer's at the engine's bf16 floor on every step (mean ~0.0075, max ~0.05 on the H200; on the random
    model the adapters barely move, so a larger gap is the engine or the trainer computing something else:
    0.026-0.059, max 7.7-9.7, was seen with the engine held to 60% of the SMs)."""
    import watch  # benchmarks/

    from lorabench.session import GroupSession
    watch.stacks_in_children()
    stale = "grpo.max_staleness=1" in GROUP_OF_FOUR[case]
    entries = [{"name": f"lr{i}", "grpo": {"lr": lr}} for i, lr in enumerate((1e-4, 3e-4, 1e-3, 3e-3))]
    cfg = gpu_config(f"model.name_or_path={q06_model}", "model.dtype=bfloat16", "lora.r=32", "lora.alpha=64",
                     f"refresh.mode={case.split('-')[0]}", "grpo.prompts_per_step=16", "grpo.group_size=8",
                     "grpo.max_new_tokens=128", "grpo.temperature=1.0", f"policies={json.dumps(entries)}",
                     *GROUP_OF_FOUR[case])
    with watch.phase(f"group of four ({case}): GroupSession.open with its held-out evaluation", 300):
        group = GroupSession.open(cfg, tmp_path / "group", log=progress)
    watch.engine = group.engine
    try:
        records = []
        for step in range(1, 6 if stale else 4):
            with watch.phase(f"group of four ({case}): step {step}", 120):
                records.append(group.trainer.step())
    finally:
        with watch.phase(f"group of four ({case}): close", 120):
            group.close()
    versions = {name: [r[name].metrics["adapter/served_version"] for r in records] for name in records[0]}
    gaps = {name: [(r[name].metrics["mismatch/mean"], r[name].metrics["mismatch/max"]) for r in records]
            for name in records[0]}
    record(f"group_of_four_06b_{case}", {"served_versions": versions, "mismatch_mean_max": gaps,
                                         "step_s": [max(r[n].metrics["time/step_s"] for n in r) for r in records]})
    expected = [0, 0, 1, 2, 3] if stale else [0, 1, 2]
    assert all(v == expected for v in versions.values()), versions
    assert all(mean < 0.02 and top < 1.0 for steps in gaps.values() for mean, top in steps), gaps


def test_stale_run_on_sglang_keeps_its_lags_across_a_resume(tiny_path, tmp_path):
    """grpo.max_staleness=1 through RunSession.open (`lorabench run`'s path) on SGLang: step s+1 is
    sampled by adapter s-1 (lag 1 from step 2 on, every served version the one asked for), and a
    resume of the stopped run samples its first step from the checkpoint's adapter behind (lag 1
    again, not 0), as the uninterrupted run would. Every phase bounded (benchmarks/watch.py)."""
    import watch  # benchmarks/

    from lorabench.session import RunSession
    watch.stacks_in_children()
    run_dir, metrics = tmp_path / "stale", []
    for steps in (3, 5):   # a run of 3 steps, then resumed and extended to 5 (a new engine: the user's path)
        cfg = gpu_config("grpo.max_staleness=1", f"grpo.steps={steps}", "grpo.compile=off", "run.checkpoint_every=1")
        with watch.phase(f"stale run to step {steps}: RunSession.open", 150):
            session = RunSession.open(cfg, run_dir, log=progress, evaluate_first=False)
        watch.engine = session.engine
        try:
            while session.trainer.step_count < steps:
                with watch.phase(f"stale run: step {session.trainer.step_count + 1}", 60):
                    metrics.append(session.trainer.step().metrics)
        finally:
            with watch.phase("stale run: close", 60):
                session.close()
    out = {"lag": [m["adapter/lag"] for m in metrics], "served": [m["adapter/served_version"] for m in metrics],
           "rollout_wait_s": [m.get("time/rollout_wait_s") for m in metrics],
           "step_s": [m["time/step_s"] for m in metrics]}
    record("stale_sglang", out)
    assert out["lag"] == [0, 1, 1, 1, 1], out
    assert out["served"] == [0, 0, 1, 2, 3], out


def test_stale_group_on_sglang_samples_ahead_and_resumes_its_lags(tiny_path, tmp_path):
    """A group of two policies, grpo.max_staleness=1, through GroupSession (`lorabench run`'s path) on SGLang,
    refreshed in place: from step 2 on each step's batch was sampled while the previous step's updates ran
    (lag 1, served version step - 2, every policy's mismatch at its single-policy level), and the group
    closed after 3 steps and resumed to 5 samples its first step in line from the adapters behind (lag 1 again,
    not 0). Every phase bounded (benchmarks/watch.py)."""
    import watch  # benchmarks/

    from lorabench.session import GroupSession
    watch.stacks_in_children()
    entries = [{"name": "r4", "lora": {"r": 4}}, {"name": "r16", "lora": {"r": 16}}]
    run_dir, records = tmp_path / "stale-group", []
    for steps in (3, 5):
        cfg = gpu_config(f"policies={json.dumps(entries)}", "grpo.max_staleness=1", f"grpo.steps={steps}",
                         "refresh.mode=inplace", "grpo.compile=off")
        with watch.phase(f"stale group to step {steps}: open", 150):
            group = (GroupSession.open(cfg, run_dir, log=progress, evaluate_first=False) if steps == 3 else
                     GroupSession.resume(run_dir, [f"grpo.steps={steps}"], log=progress, evaluate_first=False))
        watch.engine = group.engine
        try:
            while group.trainer.step_count < steps:
                with watch.phase(f"stale group: step {group.trainer.step_count + 1}", 60):
                    records.append(group.trainer.step())
        finally:
            with watch.phase("stale group: close", 60):
                group.close()
    rows = {name: [r[name].metrics for r in records] for name in records[0]}
    out = {"lag": {n: [m["adapter/lag"] for m in ms] for n, ms in rows.items()},
           "served": {n: [m["adapter/served_version"] for m in ms] for n, ms in rows.items()},
           "mismatch_active_mean": {n: [m["mismatch/active_mean"] for m in ms] for n, ms in rows.items()},
           "step_s": [max(r[n].metrics["time/step_s"] for n in r) for r in records]}
    record("stale_group_sglang", out)
    for name in rows:
        assert out["lag"][name] == [0, 1, 1, 1, 1], out
        assert out["served"][name] == [0, 0, 1, 2, 3], out
        active = [m for m in out["mismatch_active_mean"][name] if m == m and m is not None]
        assert not active or max(active) < 0.05, out
