"""What a rollout asks of SGLang's decode, and what it costs: decode with the adapter at the rollout's
batch sizes, plain and with each token's log-prob returned (what lorabench's rollout asks), per decode
step: whether a batch of K policies' rollouts costs K batches (per-sequence work: the KV cache read,
the sampler over the vocabulary, the scheduler's per-request bookkeeping) or less. Variants: the adapter
plain and with log-probs, the base model with log-probs, the batch split over four adapters (a group's
batch), and that batch through lorabench's own call (`generate_mixed`, what a group's step sends). Beside
each timed decode, the GPU's busy share (nvidia-smi's utilization, every 100 ms): well under 100% means
the decode waits on the CPU (the scheduler's per-request work), not on the GPU.

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
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import watch  # noqa: E402  (this folder)
from meters import GpuBusy  # noqa: E402
from sglang_calls import gpu_header, timed_decode  # noqa: E402
from synthetic import STACK_ARGS, qwen3_06b_with_adapter  # noqa: E402

from lorabench.clock import synced_time  # noqa: E402
from lorabench.engines.base import GenerateRequest, Sampling  # noqa: E402
from lorabench.engines.sglang import SGLangEngine, SGLangSettings  # noqa: E402

ADAPTERS = ["a", "b", "c", "d"]
VARIANTS = {"plain": (False, 1), "logprob": (True, 1), "base_logprob": (True, 0), "logprob_k4": (True, 4),
            "lorabench_k4": (True, 4)}   # name -> (return_logprob, adapters; 0 = the base model)


def busy_share(run) -> tuple[float, float]:
    """(seconds of run(), GPU 0's mean utilization % meanwhile (meters.GpuBusy); nan without nvidia-smi)."""
    with GpuBusy() as busy:
        seconds = run()
    return seconds, busy.percent.get(0, float("nan"))


def decode(engine, ids, new_tokens: int, variant: str) -> float:
    """Seconds of one decode of `ids` as `variant` asks (the lorabench variant: per generated token)."""
    logprob, adapters = VARIANTS[variant]
    if variant == "lorabench_k4":   # the group's own call: one GenerateRequest per policy, EOS allowed
        requests = [GenerateRequest(ids[i::4], Sampling(max_new_tokens=new_tokens), name)
                    for i, name in enumerate(ADAPTERS)]
        t0 = synced_time()
        done = engine.generate_mixed(requests)
        made = sum(len(c.token_ids) for part in done for c in part)
        return (synced_time() - t0) * len(ids) * new_tokens / made
    names = [None] if adapters == 0 else ADAPTERS[:adapters]
    return timed_decode(engine, ids, new_tokens, [names[i % len(names)] for i in range(len(ids))], logprob)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="128,512,2048")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--mem-fraction", type=float, default=0.6)
    parser.add_argument("--limit", type=float, default=400, help="the run stops itself after this many seconds")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    parser.add_argument("--attention", default=STACK_ARGS["attention_backend"], help="engine.sglang.attention_backend")
    parser.add_argument("--sampling-backend", default="auto",
                        help="engine.sglang.sampling_backend ('lorabench': the one-pass sampler)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--profile-dir", default="", help="also trace 8 decode steps of the largest batch (logprob_k4) "
                        "with SGLang's profiler, CPU and GPU, into this folder")
    args = parser.parse_args()
    watch.limit(args.limit)
    batches = [int(b) for b in args.batches.split(",")]
    q06, prompts, adapter = qwen3_06b_with_adapter(args.cache, max(batches), "sampling-cost")
    result = {**gpu_header(), "rows": [],
              "setting": f"Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections (tensors), {args.new_tokens} "
                         f"new tokens, ignore_eos, T=1.0, top_p=1.0, p50 of 2 after 1 warm-up"}
    settings = SGLangSettings(max_lora_rank=32, mem_fraction_static=args.mem_fraction, dtype="bfloat16",
                              cuda_graph_max_bs=max(batches), max_loras_per_batch=len(ADAPTERS) + 1,
                              **{**STACK_ARGS, "attention_backend": args.attention,
                                 "sampling_backend": args.sampling_backend})
    with watch.phase("engine start", 300):   # FlashInfer compiles its kernels in the first start (~3 min)
        engine = SGLangEngine(q06, settings)
    watch.engine = engine
    with engine:
        for name in ADAPTERS:   # the same weights under four names: four slots, four segments in a batch
            engine.load_adapter_tensors(name, adapter)
        for batch in batches:
            ids = prompts[:batch]
            row = {"batch": batch}
            for name in args.variants.split(","):
                with watch.phase(f"batch {batch} {name}", 120):
                    decode(engine, ids, args.new_tokens, name)
                    timed = [busy_share(lambda ids=ids, name=name: decode(engine, ids, args.new_tokens, name))
                             for _ in range(2)]
                seconds, busy = (statistics.median(part) for part in zip(*timed))
                row[f"{name}_tok_s"] = batch * args.new_tokens / seconds
                row[f"{name}_ms_per_decode_step"] = 1e3 * seconds / args.new_tokens
                row[f"{name}_gpu_busy_pct"] = busy
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
        if args.profile_dir:
            with watch.phase("profile", 120):
                profile_mid_decode(engine, prompts[:max(batches)], args.new_tokens, args.profile_dir)


def profile_mid_decode(engine, ids, new_tokens: int, out_dir: str, after_s: float = 3.0) -> None:
    """SGLang's profiler over 8 forward passes, started `after_s` into a decode of `ids` (past the prefills):
    the scheduler writes a chrome trace into `out_dir`. The start is sent on the engine's running loop."""
    import asyncio
    import time

    from sglang.srt.managers.io_struct import ProfileReq
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    decoding = threading.Thread(target=decode, args=(engine, ids, new_tokens, "logprob_k4"))
    decoding.start()
    time.sleep(after_s)
    req = ProfileReq(output_dir=out_dir, num_steps=8, activities=["CPU", "GPU"], with_stack=False, record_shapes=False)
    sgl = engine.engine
    asyncio.run_coroutine_threadsafe(sgl.tokenizer_manager.start_profile(req), sgl.loop).result(timeout=60)
    decoding.join()
    print(f"profile: {sorted(p.name for p in Path(out_dir).iterdir())}", flush=True)


if __name__ == "__main__":
    main()
