"""A GRPO step near the engine's limit: step parts, tokens/s, MFU and trainer memory per phase at
several rollout sizes, next to SGLang's own decode of the same batch, in one run.

    python benchmarks/step_gpu.py --out results/step.json [--sizes 16x8x128,32x8x256,64x8x256,128x8x256]

Setting: a random-init model of Qwen3-0.6B's shape in bf16 (trainer and engine), LoRA r=32 on the
7 projections, GSM8K-format local data (generated), refresh.mode=inplace (or each of --modes), the
whole `trainer.step()` timed from outside, p50 of steps 2-4 (step 1 warms up). For each size, the same prompts are also
decoded by SGLang directly (`sglang.Engine.generate`): with the base model, with the adapter, and
with the adapter returning log-probs as a rollout does: the reference a rollout is compared with,
and the split of any gap into the LoRA kernels' share, the log-prob return's share and ours
(three rounds, interleaved; the median of each).
A second part checks that the README's real-model command and the 64x8x256 setting fit a 24 GB GPU
next to the engine: each in a fresh process that finds only 24 GB of the device free (this process
holds the rest as ballast), the engine at the README's mem_fraction_static=0.3 (of the memory free
when it starts), the trainer capped (--trainer-cap-gb, 12) with
torch.cuda.set_per_process_memory_fraction; two steps must run without running out of memory, and
device-wide use less the ballast is read after each step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meters import trained_flops  # noqa: E402  (this folder)
from sglang_calls import call_sglang  # noqa: E402
from synthetic import STACK, random_qwen3_dir  # noqa: E402,F401  (STACK: the stack's engine arguments)

from lorabench.clock import synced_time  # noqa: E402
from lorabench.data import prompt_ids, synthetic_problems  # noqa: E402
from lorabench.models import load_tokenizer  # noqa: E402
from lorabench.session import build_trainer, start_engine  # noqa: E402
from lorabench.session.config import Config  # noqa: E402
from lorabench.tiny import build_tiny_tokenizer  # noqa: E402

PEAK_BF16_TFLOPS = 989.0     # H200 SXM dense bf16, the vendor's figure (a large matmul measured ~790 here)
HBM_TBPS = 4.8               # H200 HBM3e, the vendor's figure


def config(data: Path, size: tuple[int, int, int], *extra) -> Config:
    p, g, t = size
    return Config.load(None, [*STACK, "lora.r=32", "lora.alpha=64", f"data.source={data}", "data.eval_size=4",
                              f"grpo.prompts_per_step={p}", f"grpo.group_size={g}", f"grpo.max_new_tokens={t}",
                              "grpo.temperature=1.0", "refresh.mode=inplace", "run.save_adapter_every=1000",
                              *extra])


def decode_reference(engine, ids: list[list[int]], new_tokens: int, adapter, logprobs: bool = False) -> dict:
    """SGLang's own decode of the step's batch (`ids`: one prompt per sequence): fixed length,
    tokens/s; with `logprobs` it also returns each sampled token's log-prob, as a rollout asks (the
    log-prob return's share)."""
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    t0 = synced_time()
    outs = call_sglang(engine, lambda e: e.generate(input_ids=ids, sampling_params=params,
                                                   lora_path=[adapter] * len(ids), return_logprob=logprobs))
    seconds = synced_time() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}


def _median_run(runs: list[dict]) -> dict:
    """The run of median speed, with every round's tokens/s beside it."""
    middle = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
    return {**middle, "tok_s_rounds": [r["tok_s"] for r in runs]}


def decode_bytes_estimate(model_config, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes read per decode step, summed over the steps: the weights (bf16) once per step plus
    every sequence's KV cache so far (the physical floor of a memory-bound decode)."""
    c = model_config
    weights = 2 * sum(p for p in _param_counts(c))
    kv_per_token = 2 * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim  # K and V, bf16
    return sum(weights + batch * kv_per_token * (prompt_len + t) for t in range(new_tokens))


def _param_counts(c):
    h, i, n = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    yield n * (h * q + 2 * h * kv + q * h + 3 * h * i)
    yield c.vocab_size * h   # embeddings (tied with the head)


def measure_size(engine, model_dir: str, data: Path, size, tokenizer, overrides: list[str], steps: int = 4) -> dict:
    cfg = config(data, size, *overrides, f"run.name=step-{'x'.join(map(str, size))}")
    trainer = build_trainer(cfg, model_dir, engine, log=lambda *a: None)
    walls, rows = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        record = trainer.step()
        walls.append(time.perf_counter() - t0)
        rows.append(record.metrics)
    timed = rows[1:]
    p, g, t = size
    problems = trainer.source.train_batch(99, p)
    # SGLang's own decode moved 15% between back-to-back engines (docs/results.md): three rounds,
    # the three references interleaved, the median of each
    served = trainer.refresher.serving_adapter
    ids = [prompt_ids(tokenizer, p.messages) for p in problems for _ in range(g)]
    rounds = [(decode_reference(engine, ids, t, None), decode_reference(engine, ids, t, served),
               decode_reference(engine, ids, t, served, logprobs=True)) for _ in range(3)]
    base, adapter, adapter_logprobs = (_median_run([r[i] for r in rounds]) for i in range(3))
    if served is None:      # merged: the engine's base weights are the policy; put the base back
        from lorabench.explain import restore_base_weights  # here: explain needs ipywidgets (the notebook extras)
        restore_base_weights(engine, trainer.model)
    else:
        engine.unload_adapter(cfg.engine.adapter_name)
    trainer.close()
    med = {k: statistics.median(r[k] for r in timed) for k in timed[-1] if isinstance(timed[-1][k], (int, float))}
    rollout_tokens = p * g * med["completions/mean_length"]
    train_tokens = med["train/tokens"]
    mc = trainer.policy.model.get_base_model().config
    flops = trained_flops(mc, train_tokens, p * g)
    prompt_len = int(train_tokens / (p * g) - med["completions/mean_length"])
    est_decode_s = decode_bytes_estimate(mc, p * g, prompt_len, t) / (HBM_TBPS * 1e12)
    return {
        "size": "x".join(map(str, size)), "refresh_mode": cfg.refresh.mode,
        "step_wall_s_p50": statistics.median(walls[1:]), "step_wall_s": walls,
        "parts_s_p50": {k[5:-2]: v for k, v in med.items() if k.startswith("time/")},
        "memory_peak_gb_p50": {k[7:-8]: v for k, v in med.items() if k.startswith("memory/")},
        "rollout_tok_s": rollout_tokens / med["time/rollout_s"],
        "sglang_base_decode": base, "sglang_adapter_decode": adapter,
        "sglang_adapter_decode_logprobs": adapter_logprobs,
        "rollout_vs_base_decode": rollout_tokens / med["time/rollout_s"] / base["tok_s"],
        "adapter_decode_vs_base": adapter["tok_s"] / base["tok_s"],
        "adapter_logprobs_decode_vs_base": adapter_logprobs["tok_s"] / base["tok_s"],
        "train_tokens": train_tokens, "train_tok_s": train_tokens / med["time/train_s"],
        "train_mfu": flops / med["time/train_s"] / (PEAK_BF16_TFLOPS * 1e12),
        "estimate": {"decode_s_at_hbm_peak": est_decode_s, "train_s_at_bf16_peak": flops / (PEAK_BF16_TFLOPS * 1e12)},
        "mismatch_mean_p50": med["mismatch/mean"], "mismatch_p99_max": max(r["mismatch/p99"] for r in timed),
        "served_versions": [r["adapter/served_version"] for r in rows],
    }


# The README's real-model command, less what needs the hub (model, data) and the run length.
README_COMMAND = ["lora.r=32", "lora.alpha=64", "refresh.mode=inplace", "grpo.max_new_tokens=512",
                  "grpo.prompts_per_step=32", "grpo.group_size=8", "grpo.temperature=1.0",
                  "engine.sglang.mem_fraction_static=0.3"]
FITS = {"readme_command": (32, 8, 512), "step_benchmark": (64, 8, 256)}
GPU_GB = 24.0


def fits_24gb_child(model_dir: str, data: Path, which: str, trainer_gb: float, ballast_gb: float,
                    overrides: list[str]) -> dict:
    """In a fresh process, on a GPU of which only GPU_GB is free (the parent holds the rest as
    ballast): the README's engine settings (mem_fraction_static=0.3: sglang 0.5.17 sizes its static
    memory from what is free when it starts, so 0.3 means 0.3 of this 24 GB), the trainer capped at
    `trainer_gb` with set_per_process_memory_fraction, two steps. A process that outgrows the 24 GB
    gets a real out-of-memory error. Device-wide use less the ballast is read after each step."""
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    torch.cuda.set_per_process_memory_fraction(trainer_gb / total_gb)
    cfg = config(data, FITS[which], *README_COMMAND, *overrides, f"run.name=fit24-{which}")
    free_gb = torch.cuda.mem_get_info()[0] / 1e9
    out = {"which": which, "size": "x".join(map(str, FITS[which])), "trainer_cap_gb": trainer_gb,
           "engine_mem_fraction_static": cfg.engine.sglang.mem_fraction_static, "gpu_gb": GPU_GB,
           "ballast_gb": ballast_gb,
           "free_gb_at_start": free_gb, "overrides": overrides}
    used = []
    try:
        with start_engine(cfg, model_dir) as engine:
            free, total = torch.cuda.mem_get_info()
            out["engine_gb_after_start"] = (total - free) / 1e9 - ballast_gb
            trainer = build_trainer(cfg, model_dir, engine, log=lambda *a: None)
            rows = []
            for _ in range(2):
                rows.append(trainer.step().metrics)
                free, total = torch.cuda.mem_get_info()
                used.append((total - free) / 1e9 - ballast_gb)
            trainer_reserved = torch.cuda.max_memory_reserved() / 1e9
            trainer.close()
        out.update(ok=max(used) <= GPU_GB, device_used_gb_after_steps=used, trainer_max_reserved_gb=trainer_reserved,
                   trainer_peak_gb={k: v for k, v in rows[-1].items() if k.startswith("memory/")},
                   step_s=rows[-1]["time/step_s"])
    except torch.OutOfMemoryError as err:
        out.update(ok=False, error=str(err)[:500], device_used_gb_after_steps=used)
    return out


def fits_24gb(model_dir: str, data: Path, which: str, trainer_gb: float, overrides: list[str]) -> dict:
    """fits_24gb_child in a new process (a cap set after memory was reserved checks nothing), with
    all but GPU_GB of the device held here as ballast, so that the engine (which sizes itself from
    free memory) and every allocation in both processes meet a 24 GB device."""
    import subprocess
    torch.cuda.empty_cache()
    ballast_bytes = torch.cuda.mem_get_info()[0] - int(GPU_GB * 1e9)
    ballast = torch.empty(ballast_bytes, dtype=torch.uint8, device="cuda")
    try:
        proc = subprocess.run([sys.executable, __file__, "--fit-child",
                               f"{model_dir},{data},{which},{trainer_gb},{ballast_bytes / 1e9}",
                               "--fit-overrides", " ".join(overrides)],
                              capture_output=True, text=True, timeout=400)
    finally:
        del ballast
        torch.cuda.empty_cache()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FIT ")]
    if not lines:
        return {"which": which, "ok": False, "error": f"child exited {proc.returncode}: {proc.stderr[-800:]}"}
    return json.loads(lines[-1][4:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="", help="the JSON to write (required, except in a --fit-child)")
    parser.add_argument("--sizes", default="16x8x128,32x8x256,64x8x256,128x8x256")
    parser.add_argument("--mem", type=float, default=0.5, help="engine mem_fraction_static for the size sweep")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    parser.add_argument("--skip-24gb", action="store_true")
    parser.add_argument("--fits-only", action="store_true", help="only the 24 GB check, no size sweep")
    parser.add_argument("--fit-overrides", default="", help="config overrides on top of the README's command "
                        "for the 24 GB check, space-separated, e.g. 'engine.sglang.mem_fraction_static=0.3'")
    parser.add_argument("--fits-which", default=",".join(FITS), help="which settings the 24 GB check runs, "
                        f"comma-separated, of {list(FITS)}")
    parser.add_argument("--trainer-cap-gb", type=float, default=12.0, help="the trainer's share of a 24 GB GPU")
    parser.add_argument("--engine-extra", default="", help="engine.sglang.extra_args for the size sweep's engine "
                        "(JSON), "
                        "e.g. '{\"lora_backend\": \"triton\"}': a LoRA kernel setting measured inside the step")
    parser.add_argument("--overrides", nargs="*", default=[], help="config overrides for the sweep's trainers, "
                        "e.g. grpo.compile=head (step 1, the warm-up, then holds the compile)")
    parser.add_argument("--modes", default="inplace", help="refresh modes to measure at each size, comma-separated, "
                        "e.g. inplace,merged (merged serves W + BA as the base weights: no LoRA kernels in decode; "
                        "its pushes use --merged-bucket-mb)")
    parser.add_argument("--merged-bucket-mb", type=float, default=1024.0,
                        help="refresh.bucket_mb for merged rows (perf.json: 108 ms at 64 MB, 60 ms at 1024)")
    parser.add_argument("--fit-child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fit_child:
        model_dir, data, which, cap, ballast = args.fit_child.split(",")
        print("FIT " + json.dumps(fits_24gb_child(model_dir, Path(data), which, float(cap), float(ballast),
                                                  args.fit_overrides.split())), flush=True)
        return
    if not args.out:    # checked here: the fit child is started without --out
        parser.error("--out is required: the JSON file to write, e.g. --out results/step.json")
    import sglang
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="step-gpu-"))
    build_tiny_tokenizer(root / "tok")
    model_dir = str(random_qwen3_dir("0.6B", str(root / "tok"), Path(args.cache) / "qwen3-0.6b-random"))
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                            for p in synthetic_problems(4096, "step-bench")))
    tokenizer = load_tokenizer(model_dir)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sglang": sglang.__version__,
              "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M"),
              "setting": "Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections, refresh mode per row, "
                         "temperature 1.0, p50 of steps 2-4", "peak_bf16_tflops": PEAK_BF16_TFLOPS,
              "hbm_tbps": HBM_TBPS, "sizes": []}
    largest = max(p * g for p, g, _ in sizes)
    extra = [f"engine.sglang.extra_args={args.engine_extra}"] if args.engine_extra else []
    result["engine_extra_args"], result["overrides"] = args.engine_extra, args.overrides
    cfg = config(data, sizes[0], f"engine.sglang.mem_fraction_static={args.mem}",
                 f"engine.sglang.cuda_graph_max_bs={largest}",
                 *extra)
    if not args.fits_only:
        with start_engine(cfg, model_dir) as engine:
            for size in sizes:
                for mode in args.modes.split(","):
                    mode_args = [f"refresh.mode={mode}"] + ([f"refresh.bucket_mb={args.merged_bucket_mb}"]
                                                           if mode == "merged" else [])
                    row = measure_size(engine, model_dir, data, size, tokenizer, [*args.overrides, *mode_args])
                    result["sizes"].append(row)
                    print(json.dumps({k: row[k] for k in ("size", "refresh_mode", "step_wall_s_p50",
                                                          "rollout_vs_base_decode", "parts_s_p50")}), flush=True)
                    Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.skip_24gb:
        result["fits_24gb"] = []
        for which in args.fits_which.split(","):
            result["fits_24gb"].append(fits_24gb(model_dir, data, which, args.trainer_cap_gb,
                                                 args.fit_overrides.split()))
            print(json.dumps(result["fits_24gb"][-1]), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
