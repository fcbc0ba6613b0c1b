"""SGLang's decode with a LoRA adapter vs without, per LoRA kernel backend and per decode setting (the
triton attention's KV splits, decode steps per schedule): where the rollout's gap to base decode comes
from, and which engine setting closes it or makes both faster.

    python benchmarks/lora_decode_gpu.py --out results/lora_decode.json [--batches 512] [--variants ...]

Setting: a random-init model of Qwen3-0.6B's shape in bf16, a LoRA r=32 on the 7 projections (B
non-zero), GSM8K-format prompts (generated), `batch` sequences x 256 new tokens, ignore_eos,
temperature 1.0, SGLang's own `Engine.generate` (no log-probs). One engine per variant (its
arguments go to sglang.Engine as engine.sglang.extra_args would pass them); per batch: one warm-up
generate, then the p50 of 3 for the base model and for the adapter.

--profile-steps N: then, per variant and batch, SGLang's own profiler over N scheduler steps of one more
generate (base, adapter, adapter with log-probs): the GPU kernels by total time, from its trace files, so the
decode step's time can be split into attention, the LoRA kernels, the matmuls and the sampling.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_calls import call_sglang, gpu_header, timed_decode  # noqa: E402  (this folder)
from synthetic import STACK_ARGS, qwen3_06b_with_adapter  # noqa: E402

from lorabench.engines.sglang import SGLangEngine, SGLangSettings  # noqa: E402

VARIANTS = {  # name -> extra sglang.Engine arguments
    "default (csgmv, chunk 16)": {},
    "csgmv, chunk 64": {"max_lora_chunk_size": 64},
    "csgmv, chunk 128": {"max_lora_chunk_size": 128},
    "triton": {"lora_backend": "triton"},
    # the decode attention's KV splits (8 by default, for long contexts; ours are 80-350 tokens at 512 sequences)
    "triton, kv splits 2": {"lora_backend": "triton", "triton_attention_num_kv_splits": 2},
    "triton, kv splits 4": {"lora_backend": "triton", "triton_attention_num_kv_splits": 4},
    # the scheduler's CPU work once per 4 decode steps instead of each
    "triton, 4 decode steps a schedule": {"lora_backend": "triton", "num_continuous_decode_steps": 4},
    # SGLang's own default attention: needs FlashInfer's JIT sources and nvcc (run under dev/flashinfer_jit)
    "flashinfer attention": {"lora_backend": "triton", "attention_backend": "flashinfer"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="512")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--variants", default=";".join(VARIANTS),
                        help="names from VARIANTS, separated by ; (the names hold commas)")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    parser.add_argument("--profile-steps", type=int, default=0, help="profile this many scheduler steps (0: none)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    q06, prompts, adapter = qwen3_06b_with_adapter(args.cache, max(batches), "lora-decode")
    result = {**gpu_header(), "rows": [],
              "setting": f"Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections, {args.new_tokens} new "
                         f"tokens, ignore_eos, T=1.0, p50 of 3 after 1 warm-up"}
    t0 = time.monotonic()
    for name in args.variants.split(";"):
        print(f"[decode {time.monotonic() - t0:.0f} s] {name}: engine opening", flush=True)
        settings = SGLangSettings(max_lora_rank=32, mem_fraction_static=0.5, dtype="bfloat16",
                                  cuda_graph_max_bs=max(batches), **STACK_ARGS, extra_args=json.dumps(VARIANTS[name]))
        with SGLangEngine(q06, settings) as engine:
            engine.load_adapter_tensors("a", adapter)
            print(f"[decode {time.monotonic() - t0:.0f} s] {name}: engine open, adapter loaded", flush=True)
            for batch in batches:
                ids = prompts[:batch]
                times = {}
                for which, lora in (("base", None), ("adapter", "a")):
                    timed_decode(engine, ids, args.new_tokens, lora)
                    times[which] = statistics.median(timed_decode(engine, ids, args.new_tokens, lora) for _ in range(3))
                    print(f"[decode {time.monotonic() - t0:.0f} s] {name}, batch {batch}, {which}: "
                          f"{times[which]:.2f} s", flush=True)
                tokens = batch * args.new_tokens
                row = {"variant": name, "extra_args": VARIANTS[name], "batch": batch,
                       "base_tok_s": tokens / times["base"], "adapter_tok_s": tokens / times["adapter"],
                       "adapter_vs_base": times["base"] / times["adapter"]}
                if args.profile_steps:
                    row["profiles"] = {which: kernel_profile(engine, ids, args.new_tokens, lora, logprob,
                                                             args.profile_steps, Path(args.out).parent / "traces")
                                       for which, lora, logprob in (("base", None, False), ("adapter", "a", False),
                                                                    ("adapter_logprobs", "a", True))}
                result["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profiles"}), flush=True)
                Path(args.out).write_text(json.dumps(result, indent=1))


def kernel_profile(engine, ids, new_tokens: int, lora, logprob: bool, steps: int, root: Path) -> dict:
    """SGLang's profiler over `steps` scheduler steps from the start of one generate (the prefill and the first
    decode steps; ignore_eos keeps every sequence running): GPU kernel time by kernel name, largest first."""
    out = root / f"{lora or 'base'}-{'logprobs' if logprob else 'plain'}-{len(ids)}-{time.time_ns()}"
    out.mkdir(parents=True)
    call_sglang(engine, lambda e: e.start_profile(output_dir=str(out), num_steps=steps, activities=["GPU"]))
    timed_decode(engine, ids, new_tokens, lora, logprob)
    deadline = time.time() + 60   # the scheduler writes its trace after its last profiled step
    while not list(out.rglob("*.trace.json*")) and time.time() < deadline:
        time.sleep(1)
    by_name, total = collections.Counter(), 0.0
    for trace in out.rglob("*.trace.json*"):
        opener = gzip.open if trace.suffix == ".gz" else open
        with opener(trace, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            if ev.get("cat") == "kernel" and "dur" in ev:
                by_name[ev["name"][:120]] += ev["dur"] / 1e3
                total += ev["dur"] / 1e3
    return {"steps": steps, "gpu_kernel_ms": total, "traces": len(list(out.rglob("*.trace.json*"))),
            "top_ms": [[name, ms] for name, ms in by_name.most_common(25)]}


if __name__ == "__main__":
    main()
