"""What a rollout asks of SGLang's decode, and what it costs: decode with the adapter at the rollout's
batch sizes, plain and with each token's log-prob returned (what lorabench's rollout asks), per decode
step: whether a batch of K policies' rollouts costs K batches (per-sequence work: the KV cache read,
the sampler over the vocabulary, the scheduler's per-request bookkeeping) or less.

    python benchmarks/sampling_cost_gpu.py --out results/sampling_cost.json [--batches 128,512,2048]

Setting: a random-init model of Qwen3-0.6B's shape in bf16, a LoRA r=32 on the 7 projections served
by tensors, GSM8K-format prompts (generated), `batch` sequences x 128 new tokens, ignore_eos,
temperature 1.0, top_p 1.0, the engine arguments of the offline stack (synthetic.STACK) with
lorabench's defaults (triton LoRA kernels, CUDA graphs up to the largest batch). One engine; per
batch and variant one warm-up, then the p50 of 2. (A request's sampling_seed reaches SGLang 0.5.17's
sampler only with enable_deterministic_inference; otherwise it samples by torch.multinomial.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import watch  # noqa: E402  (this folder)
from sglang_calls import gpu_header, timed_decode  # noqa: E402
from synthetic import STACK_ARGS, qwen3_06b_with_adapter  # noqa: E402

from lorabench.engines.sglang import SGLangEngine, SGLangSettings  # noqa: E402

VARIANTS = {"plain": False, "logprob": True}   # name -> return_logprob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="128,512,2048")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mem-fraction", type=float, default=0.6)
    parser.add_argument("--limit", type=float, default=400, help="the run stops itself after this many seconds")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    args = parser.parse_args()
    watch.limit(args.limit)
    batches = [int(b) for b in args.batches.split(",")]
    q06, prompts, adapter = qwen3_06b_with_adapter(args.cache, max(batches), "sampling-cost")
    result = {**gpu_header(), "rows": [],
              "setting": f"Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections (tensors), {args.new_tokens} "
                         f"new tokens, ignore_eos, T=1.0, top_p=1.0, p50 of 2 after 1 warm-up"}
    settings = SGLangSettings(max_lora_rank=32, mem_fraction_static=args.mem_fraction, dtype="bfloat16",
                              cuda_graph_max_bs=max(batches), **STACK_ARGS)
    with watch.phase("engine start", 150):
        engine = SGLangEngine(q06, settings)
    watch.engine = engine
    with engine:
        engine.load_adapter_tensors("a", adapter)
        for batch in batches:
            ids = prompts[:batch]
            row = {"batch": batch}
            for name, logprob in VARIANTS.items():
                with watch.phase(f"batch {batch} {name}", 120):
                    timed_decode(engine, ids, args.new_tokens, "a", logprob)
                    seconds = statistics.median(timed_decode(engine, ids, args.new_tokens, "a", logprob)
                                                for _ in range(2))
                row[f"{name}_tok_s"] = batch * args.new_tokens / seconds
                row[f"{name}_ms_per_decode_step"] = 1e3 * seconds / args.new_tokens
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
