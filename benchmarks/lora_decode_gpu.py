"""SGLang's decode with a LoRA adapter vs without, per LoRA kernel backend: where the rollout's gap
to base decode comes from, and which engine setting closes it.

    python benchmarks/lora_decode_gpu.py --out results/lora_decode.json [--batches 512] [--variants ...]

Setting: a random-init model of Qwen3-0.6B's shape in bf16, a LoRA r=32 on the 7 projections (B
non-zero), GSM8K-format prompts (generated), `batch` sequences x 256 new tokens, ignore_eos,
temperature 1.0, SGLang's own `Engine.generate` (no log-probs). One engine per variant (its
arguments go to sglang.Engine as engine.sglang.extra_args would pass them); per batch: one warm-up
generate, then the p50 of 3 for the base model and for the adapter.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_calls import gpu_header, timed_decode  # noqa: E402  (this folder)
from synthetic import STACK_ARGS, qwen3_06b_with_adapter  # noqa: E402

from lorabench.engines.sglang import SGLangEngine, SGLangSettings  # noqa: E402

VARIANTS = {  # name -> extra sglang.Engine arguments
    "default (csgmv, chunk 16)": {},
    "csgmv, chunk 64": {"max_lora_chunk_size": 64},
    "csgmv, chunk 128": {"max_lora_chunk_size": 128},
    "triton": {"lora_backend": "triton"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="512")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--variants", default=";".join(VARIANTS),
                        help="names from VARIANTS, separated by ; (the names hold commas)")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    q06, prompts, adapter = qwen3_06b_with_adapter(args.cache, max(batches), "lora-decode")
    result = {**gpu_header(), "rows": [],
              "setting": f"Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections, {args.new_tokens} new "
                         f"tokens, ignore_eos, T=1.0, p50 of 3 after 1 warm-up"}
    for name in args.variants.split(";"):
        settings = SGLangSettings(max_lora_rank=32, mem_fraction_static=0.5, dtype="bfloat16",
                                  cuda_graph_max_bs=max(batches), **STACK_ARGS, extra_args=json.dumps(VARIANTS[name]))
        with SGLangEngine(q06, settings) as engine:
            engine.load_adapter_tensors("a", adapter)
            for batch in batches:
                ids = prompts[:batch]
                times = {}
                for which, lora in (("base", None), ("adapter", "a")):
                    timed_decode(engine, ids, args.new_tokens, lora)
                    times[which] = statistics.median(timed_decode(engine, ids, args.new_tokens, lora) for _ in range(3))
                tokens = batch * args.new_tokens
                row = {"variant": name, "extra_args": VARIANTS[name], "batch": batch,
                       "base_tok_s": tokens / times["base"], "adapter_tok_s": tokens / times["adapter"],
                       "adapter_vs_base": times["base"] / times["adapter"]}
                result["rows"].append(row)
                print(json.dumps(row), flush=True)
                Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
