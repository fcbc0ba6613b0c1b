"""The training half of a GRPO step, alone: time, tokens/s, MFU and peak memory of `Policy.train`
on one fixed 64 x 8 x 256 batch, per training setting, plus a profile of where the time goes.

    python benchmarks/train_gpu.py --out results/train.json [--profile-out results/train_profile.txt]

Setting: a random-init model of Qwen3-0.6B's shape in bf16, LoRA r=32 on the 7 projections (B
non-zero), a synthetic batch shaped like the step benchmark's (512 sequences: 60-100 prompt tokens,
up to 256 completion tokens, right-padded), grpo.lr 1e-5. No engine: each setting gets a fresh
policy with the same seed, one warm-up call, then the p50 of --repeats calls. Memory is the
trainer's peak allocated (and reserved) bytes during a call, reset before it.
Besides speed it reports how far each setting's log-probs (of the first call, before any update)
are from the fp32-LoRA ones: bf16 LoRA matmuls must stay well inside the trainer-vs-engine gap.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from step_gpu import PEAK_BF16_TFLOPS  # noqa: E402  (the H200's vendor peak, one place)
from synthetic import random_qwen3_dir, random_tokens_like_rollouts  # noqa: E402

from lorabench.clock import synced_time  # noqa: E402
from lorabench.grpo import GRPOSettings  # noqa: E402
from lorabench.policy import LoraSettings, Policy, mismatch  # noqa: E402
from lorabench.rollout import RolloutBatch  # noqa: E402
from lorabench.tiny import build_tiny_tokenizer  # noqa: E402

# (lora_compute, activation_checkpointing, micro_batch_tokens, compile): PEFT's fp32 LoRA first (the
# reference of the log-prob gap), the default second (profiled). Training is bound by kernel launches
# per micro-batch, so the budget goes up to 65536 with checkpointing; the default's profile is mostly
# elementwise work and the head's log-sum-exp, which grpo.compile fuses (docs/results.md, "Step");
# under compile=all checkpointing runs inside the compiled layer (rows 6-9); row 11: one 16x8x128 batch
# (~27k tokens) in one micro-batch instead of two, fewer launches for a launch-bound update; row 12:
# compile "graphs", each layer compiled for CUDA graphs (mode reduce-overhead, static shapes): the same batch
# every call, so after the warm-up each micro-batch replays its graphs, the best case of the launch-free update;
# row 13: compile "cpp", inductor's C++ wrapper instead of its Python one (the launches' own CPU cost).
SETTINGS = [("float32", False, 8192, "off"), ("bfloat16", True, 32768, "off"), ("bfloat16", False, 4096, "off"),
            ("bfloat16", False, 16384, "off"), ("bfloat16", True, 16384, "off"), ("bfloat16", True, 65536, "off"),
            ("bfloat16", True, 32768, "all"), ("bfloat16", True, 16384, "all"), ("bfloat16", False, 8192, "all"),
            ("bfloat16", False, 16384, "all"), ("bfloat16", True, 32768, "head"), ("bfloat16", False, 32768, "all"),
            ("bfloat16", False, 16384, "graphs"), ("bfloat16", False, 16384, "cpp")]


def synthetic_batch(n: int, new_tokens: int, seed: int = 0) -> RolloutBatch:
    """[n, L] right-padded sequences shaped like GSM8K rollouts, with group-centred advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(60, 101, (n,), generator=g)
    completions = torch.randint(new_tokens // 2, new_tokens + 1, (n,), generator=g)
    ids, attn, cmask = random_tokens_like_rollouts(prompts.tolist(), completions.tolist(), (10, 1000), g)
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    advantages = (rewards - rewards.view(-1, 8).mean(1).repeat_interleave(8))
    return RolloutBatch(ids, attn, cmask, torch.zeros(cmask.shape), rewards, advantages)


DEVICE = "cuda"  # --device cpu runs the same code on a small model, as a smoke test


def make_policy(model_dir: str, compute: str, checkpointing: bool, budget: int,
                compiled: str) -> tuple[Policy, GRPOSettings]:
    torch.manual_seed(0)
    grpo = GRPOSettings(lr=1e-5, temperature=1.0, micro_batch_tokens=budget, lora_compute=compute,
                      activation_checkpointing=checkpointing,
                      compile="all" if compiled in ("graphs", "cpp") else compiled)
    policy = Policy(model_dir, LoraSettings(r=32, alpha=64, target_modules="all-linear", dropout=0.0), grpo,
                    "bfloat16", DEVICE)
    if compiled == "graphs":   # the layers compiled again, for CUDA graphs (cudagraph trees), at static shapes
        for layer in policy.model.get_base_model().get_decoder().layers:
            layer.compile(mode="reduce-overhead", dynamic=False)
    with torch.no_grad():  # a non-trivial adapter, the same for every setting
        g = torch.Generator().manual_seed(1)
        policy.lora_layers.buffer.add_(torch.randn(policy.lora_layers.buffer.shape, generator=g).to(DEVICE) * 1e-3)
    return policy, grpo


def inductor_config(compiled: str):
    """What the setting changes of inductor's config while its graphs compile (at the first call)."""
    return torch._inductor.config.patch(cpp_wrapper=True) if compiled == "cpp" else contextlib.nullcontext()


def measure(model_dir: str, batch: RolloutBatch, setting, repeats: int, reference) -> tuple[dict, torch.Tensor]:
    torch._dynamo.reset()   # each setting compiles afresh: dynamo reuses a layer's code across config patches
    with inductor_config(setting[3]):
        return _measure(model_dir, batch, setting, repeats, reference)


def _measure(model_dir: str, batch: RolloutBatch, setting, repeats: int, reference) -> tuple[dict, torch.Tensor]:
    compute, checkpointing, budget, compiled = setting
    policy, grpo = make_policy(model_dir, compute, checkpointing, budget, compiled)
    seconds, peaks, reserved = [], [], []
    first_logp = _trainer_logprobs(policy, batch, grpo)   # before any update
    for i in range(1 + repeats):
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = synced_time()
        stats = policy.train(batch)
        dt = synced_time() - t0
        if i == 0:
            first_call = dt          # the warm-up: with compile, the compile's time is here
        else:
            seconds.append(dt)
            peaks.append(torch.cuda.max_memory_allocated() / 1e9 if DEVICE == "cuda" else float("nan"))
            reserved.append(torch.cuda.max_memory_reserved() / 1e9 if DEVICE == "cuda" else float("nan"))
    tokens = stats["tokens"]
    mc = policy.model.get_base_model().config
    flops = trained_flops(mc, tokens, batch.size)
    row = {"lora_compute": compute, "activation_checkpointing": checkpointing, "micro_batch_tokens": budget,
           "compile": compiled, "first_call_s": first_call,
           "train_s_p50": statistics.median(seconds), "train_s": seconds, "tokens": tokens,
           "train_tok_s": tokens / statistics.median(seconds),
           "mfu": flops / statistics.median(seconds) / (PEAK_BF16_TFLOPS * 1e12),
           "peak_allocated_gb": max(peaks), "peak_reserved_gb": max(reserved)}
    if reference is not None:
        gap = mismatch(first_logp, dataclasses.replace(batch, engine_logprobs=reference))
        row["vs_fp32_lora_logprobs"] = {"mean": gap["mismatch_mean"], "p99": gap["mismatch_p99"],
                                        "max": gap["mismatch_max"]}
    del policy
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row, first_logp


@torch.no_grad()
def _trainer_logprobs(policy: Policy, batch: RolloutBatch, grpo) -> torch.Tensor:
    """The policy's log-probs on the batch under its training precision."""
    from lorabench.loss import token_logprobs
    out = torch.zeros(batch.engine_logprobs.shape)
    for start in range(0, batch.size, 32):
        part = batch.rows(list(range(start, min(start + 32, batch.size)))).to(DEVICE)
        with policy.compute():
            logp = token_logprobs(policy.model, part.input_ids, part.attention_mask, grpo.temperature)
        out[start:start + 32, :logp.shape[1]] = logp.float().cpu()
    return out


def profile(model_dir: str, batch: RolloutBatch, setting, out: Path) -> dict:
    """One train call under torch.profiler: the top CUDA kernels and how busy the GPU was."""
    from torch.profiler import ProfilerActivity
    torch._dynamo.reset()
    policy, grpo = make_policy(model_dir, *setting)
    with inductor_config(setting[3]):
        policy.train(batch)  # warm-up: the compile
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = synced_time()
        policy.train(batch)
        wall = synced_time() - t0
    averages = prof.key_averages()
    out.write_text(averages.table(sort_by="device_time_total", row_limit=40))
    kernel_us = sum(e.self_device_time_total for e in averages if e.device_type == torch.autograd.DeviceType.CUDA)
    del policy
    torch.cuda.empty_cache()
    return {"setting": list(setting), "wall_s": wall, "gpu_kernel_s": kernel_us / 1e6,
            "gpu_busy_fraction": kernel_us / 1e6 / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile-out", default="")
    parser.add_argument("--size", default="64x8x256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    parser.add_argument("--model", default="", help="a bf16 model dir instead of the random 0.6B shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile-setting", type=int, default=1, help="index into SETTINGS to profile "
                        "(default 1, the default setting)")
    parser.add_argument("--settings", default=",".join(str(i) for i in range(len(SETTINGS))),
                        help="indices into SETTINGS to measure, e.g. 0,1,5 (keep 0: the log-prob gap's reference)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    p, g, t = (int(x) for x in args.size.split("x"))
    root = Path(tempfile.mkdtemp(prefix="train-gpu-"))
    model_dir = args.model
    if not model_dir:
        build_tiny_tokenizer(root / "tok")
        model_dir = str(random_qwen3_dir("0.6B", str(root / "tok"), Path(args.cache) / "qwen3-0.6b-random"))
    batch = synthetic_batch(p * g, t)
    result = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
              "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M"),
              "setting": f"Qwen3-0.6B shape random init bf16, LoRA r=32 7 projections, synthetic {args.size} "
                         f"batch, Policy.train alone, p50 of {args.repeats} after 1 warm-up",
              "peak_bf16_tflops": PEAK_BF16_TFLOPS, "rows": []}
    reference = None   # the first setting's log-probs (fp32 LoRA, the old default): the others are compared
    chosen = [SETTINGS[int(i)] for i in args.settings.split(",")]
    for setting in chosen:
        try:
            row, logp = measure(model_dir, batch, setting, args.repeats, reference)
        except RuntimeError as err:   # out of memory, or a compile that fails: the row says so, the rest run
            row, logp = {"setting": list(setting), "error": f"{type(err).__name__}: {str(err)[:600]}"}, None
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        reference = logp if reference is None else reference
        result["rows"].append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "train_s"}),
              flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.profile_out:
        result["profile"] = profile(model_dir, batch, SETTINGS[args.profile_setting], Path(args.profile_out))
        print(json.dumps(result["profile"]), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
