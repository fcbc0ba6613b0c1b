"""What a rollout asks of SGLang's sampler, and what each ask costs: decode with the adapter at the
rollout's batch sizes, plain, with each token's log-prob returned, with a per-request sampling seed,
and with both (what lorabench's rollout asks).

    python benchmarks/sampling_cost_gpu.py --out results/sampling_cost.json [--batches 128,512,2048]

Setting: a random-init model of Qwen3-0.6B's shape in bf16, a LoRA r=32 on the 7 projections served
by tensors, GSM8K-format prompts (generated), `batch` sequences x 128 new tokens, ignore_eos,
temperature 1.0, top_p 1.0, the engine arguments of the offline stack (synthetic.STACK) with
lorabench's defaults (triton LoRA kernels, CUDA graphs up to the largest batch). One engine; per
batch and variant one warm-up, then the p50 of 2. With a seed SGLang samples by a Gumbel trick over
the whole vocabulary in float64 (sampler.multinomial_with_seed), without one by torch.multinomial.
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

import watch  # noqa: E402  (this folder)
from sglang_calls import call_sglang  # noqa: E402
from synthetic import random_qwen3_dir  # noqa: E402

from lorabench.adapters import FlatAdapter  # noqa: E402
from lorabench.clock import synced_time  # noqa: E402
from lorabench.data import prompt_ids, synthetic_problems  # noqa: E402
from lorabench.engines.sglang import SGLangEngine, SGLangSettings  # noqa: E402
from lorabench.models import load_tokenizer  # noqa: E402
from lorabench.refresh_bench import adapter_model  # noqa: E402
from lorabench.tiny import build_tiny_tokenizer  # noqa: E402

STACK = dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none")
VARIANTS = {"plain": (False, False), "logprob": (True, False), "seed": (False, True), "seed+logprob": (True, True)}


def decode(engine, ids: list[list[int]], new_tokens: int, logprob: bool, seeded: bool) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    if seeded:
        params["sampling_seed"] = 1234
    t0 = synced_time()
    call_sglang(engine, lambda e: e.generate(input_ids=ids, sampling_params=params, lora_path=["a"] * len(ids),
                                             return_logprob=logprob))
    return synced_time() - t0


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
    import sglang
    root = Path(tempfile.mkdtemp(prefix="sampling-cost-"))
    build_tiny_tokenizer(root / "tok")
    q06 = str(random_qwen3_dir("0.6B", str(root / "tok"), Path(args.cache) / "qwen3-0.6b-random"))
    tok = load_tokenizer(q06)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [prompt_ids(tok, p.messages) for p in synthetic_problems(max(batches), "sampling-cost")]
    adapter = FlatAdapter.from_peft(adapter_model(q06, 32, dtype="bfloat16", device="cuda")).to("cuda", torch.bfloat16)
    torch.cuda.empty_cache()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sglang": sglang.__version__,
              "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M"),
              "setting": f"Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections (tensors), {args.new_tokens} "
                         f"new tokens, ignore_eos, T=1.0, top_p=1.0, p50 of 2 after 1 warm-up", "rows": []}
    settings = SGLangSettings(max_lora_rank=32, mem_fraction_static=args.mem_fraction, dtype="bfloat16",
                              cuda_graph_max_bs=max(batches), **STACK)
    with watch.phase("engine start", 150):
        engine = SGLangEngine(q06, settings)
    watch.engine = engine
    with engine:
        engine.load_adapter_tensors("a", adapter)
        for batch in batches:
            ids = prompts[:batch]
            row = {"batch": batch}
            for name, (logprob, seeded) in VARIANTS.items():
                with watch.phase(f"batch {batch} {name}", 120):
                    decode(engine, ids, args.new_tokens, logprob, seeded)
                    seconds = statistics.median(decode(engine, ids, args.new_tokens, logprob, seeded)
                                                for _ in range(2))
                row[f"{name}_tok_s"] = batch * args.new_tokens / seconds
                row[f"{name}_ms_per_decode_step"] = 1e3 * seconds / args.new_tokens
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
