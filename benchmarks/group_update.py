"""Would one update for K policies beat K updates? The training half of a group step, alone: K policies on one
shared model (as a policy group holds them, `Policy(beside=...)`), each with its own batch, updated

- one after another, `Policy.train` per policy (what `PolicyGroup.step` does now), and
- in one pass ("fused", built here only): the K batches' rows in one forward and backward through the frozen
  base, each row's LoRA term from its own policy's adapter (a batched matmul over the K adapters), each
  policy's GRPO loss on its own rows, then each policy's clip and optimizer step.

Measured (docs/results.md, section 2): exact, and slower than the K updates on an H100 (1.06x at 16x8x128,
1.17x at 64x8x256), so the group keeps updating policy by policy. It checks that it computes the same: the
fused log-probs of each policy's rows against that policy's own, and (`--check`, CPU, fp32) each policy's
gradient in one fused update against that in its own `Policy.train`.

    python benchmarks/group_update.py --out results/group_update.json --sizes 16x8x128 64x8x256 --k 4
    python benchmarks/group_update.py --out /tmp/g.json --device cpu --check     # the tiny model, exactness
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
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meters import trained_flops  # noqa: E402  (this folder)
from step_gpu import PEAK_BF16_TFLOPS  # noqa: E402
from synthetic import random_qwen3_dir  # noqa: E402
from train_gpu import synthetic_batch  # noqa: E402

from lorabench.clock import synced_time  # noqa: E402
from lorabench.grpo import GRPOSettings  # noqa: E402
from lorabench.loss import grpo_loss_terms  # noqa: E402
from lorabench.policy import COMPILED_WIDTH_MULTIPLE, LoraSettings, Policy  # noqa: E402
from lorabench.rollout import RolloutBatch, round_up  # noqa: E402
from lorabench.session import Config  # noqa: E402
from lorabench.tiny import build_tiny_tokenizer  # noqa: E402

T0 = time.perf_counter()


def say(text: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {text}", flush=True)


def make_group(model_dir: str, k: int, grpo: GRPOSettings, dtype: str, device: str) -> list[Policy]:
    """K policies on one model, adapters p0..p{K-1} drawn apart (each B non-zero, its own seed)."""
    lora = LoraSettings(r=32, alpha=64, target_modules="all-linear", dropout=0.0)
    policies: list[Policy] = []
    for i in range(k):
        policies.append(Policy(model_dir, lora, grpo, dtype, device, adapter_name=f"p{i}", init_seed=i,
                               beside=policies[0] if policies else None))
        with torch.no_grad():
            g = torch.Generator().manual_seed(100 + i)
            buffer = policies[-1].lora_layers.buffer
            buffer.add_(torch.randn(buffer.shape, generator=g).to(buffer.device) * 1e-3)
    return policies


def _grouped_lora_forward(names: list[str]):
    """A PEFT LoRA Linear's forward for rows grouped by policy: x [K*n, L, in] (policy i's rows at
    [i*n, (i+1)*n)) -> base(x) + policy i's (alpha/r)·B·A·x on its rows, by two batched matmuls."""
    def forward(self, x, *args, **kwargs):
        result = self.base_layer(x, *args, **kwargs)                               # [K*n, L, out]
        k = len(names)
        a = torch.stack([self.lora_A[name].weight for name in names])               # [K, r, in]
        b = torch.stack([self.lora_B[name].weight for name in names])               # [K, out, r]
        scale = torch.tensor([self.scaling[name] for name in names], device=x.device)[:, None, None]
        xs = x.reshape(k, -1, x.shape[-1]).to(a.dtype)                              # [K, n*L, in]
        lora = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))       # [K, n*L, out]
        return result + (lora * scale.to(lora.dtype)).reshape(result.shape).to(result.dtype)
    return forward


@contextlib.contextmanager
def grouped(policies: list[Policy]):
    """Every LoRA layer of the shared model serves rows grouped by policy; every policy's weights train."""
    from peft.tuners.lora import Linear
    names = [p.adapter_name for p in policies]
    layers = [m for m in policies[0].model.modules() if isinstance(m, Linear)]
    forward = _grouped_lora_forward(names)
    for layer in layers:
        layer.forward = types.MethodType(forward, layer)
    for p in policies:
        for param in p.params:
            param.requires_grad_(True)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward   # back to the class's


def _padded(parts: list[RolloutBatch]) -> list[RolloutBatch]:
    """The parts right-padded to the widest width W (padding to a multiple of W reaches W from any width <= W)."""
    width = max(p.input_ids.shape[1] for p in parts)
    return [p.padded_to_multiple(width) for p in parts]


def _stacked(parts: list[RolloutBatch]) -> RolloutBatch:
    """The K parts' rows one after another, right-padded to the widest."""
    parts = _padded(parts)
    return RolloutBatch(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(RolloutBatch)))


def fused_micro_batches(batches: list[RolloutBatch], budget: int, multiple: int) -> list[RolloutBatch]:
    """Micro-batches of K equal slices, one per policy (the i-th longest rows of each together), each within
    `budget` padded tokens in all, as `Policy.train` keeps one policy's (activations grow with a micro-batch's
    tokens: K slices of `budget` each ran out of the H100's 80 GB at 16x8x128, K=8). Longest first, so a
    slice holds more rows as they get shorter."""
    n, k = batches[0].size, len(batches)
    order = [sorted(range(n), key=lambda i, b=b: -b.lengths[i]) for b in batches]
    parts, start = [], 0
    while start < n:
        width = max(round_up(b.lengths[o[start]], multiple) for b, o in zip(batches, order))
        per = max(1, budget // (k * width))
        parts.append(_stacked([b.rows(o[start:start + per], multiple) for b, o in zip(batches, order)]))
        start += per
    return parts


def fused_train(policies: list[Policy], batches: list[RolloutBatch]) -> list[dict]:
    """One epoch of every policy's GRPO update in one pass per micro-batch (grpo.epochs=1, on-policy)."""
    first, k = policies[0], len(policies)
    multiple = COMPILED_WIDTH_MULTIPLE if first.compile == "all" else 1
    micro = fused_micro_batches([b.to("cpu") for b in batches], first.grpo.micro_batch_tokens, multiple)
    sums = torch.zeros(k, 2, dtype=torch.float64, device=first.device)   # loss, clip_fraction per policy
    first.model.train()
    for p in policies:
        p.optimizer.zero_grad(set_to_none=True)
    with grouped(policies):
        for host in micro:
            part = host.to(first.device)
            logp, _ = first._logprobs(part, host.completion_mask.bool(), first._layer_mask(part), with_entropy=True)
            n = part.size // k
            total = 0
            for i, p in enumerate(policies):
                rows = slice(i * n, (i + 1) * n)
                loss, m = grpo_loss_terms(logp[rows], logp[rows].detach(), part.advantages[rows],
                                          part.completion_mask[rows], p.grpo.clip_eps)
                share = n / batches[i].size
                total = total + loss * share
                sums[i] += torch.stack([loss.detach().double(), m["clip_fraction"].double()]) * share
            total.backward()
    norms = []
    for p in policies:   # no wait for the GPU until every policy has stepped
        norms.append(torch.nn.utils.clip_grad_norm_(p.params, p.grpo.max_grad_norm))
        p.optimizer.step()
        p.version += 1
    first.model.eval()
    return [{"loss": float(sums[i, 0]), "grad_norm": float(norm)} for i, norm in enumerate(norms)]


@torch.no_grad()
def logprob_gap(policies: list[Policy], batches: list[RolloutBatch]) -> dict:
    """Max |fused - own| log-prob over each policy's completion tokens, and to the next policy's adapter (a
    wrong adapter must show: the fused rows must be far closer to their own)."""
    first, k = policies[0], len(policies)
    parts = _padded([b.rows(list(range(min(8, b.size)))) for b in batches])
    own = []
    for p, part in zip(policies, parts):
        p._activate()
        dev = part.to(first.device)
        own.append(p._logprobs(dev, part.completion_mask.bool(), first._layer_mask(dev), with_entropy=False)[0])
    stacked = _stacked(parts)
    fused_in = stacked.to(first.device)
    with grouped(policies):
        fused = first._logprobs(fused_in, stacked.completion_mask.bool(), first._layer_mask(fused_in),
                                with_entropy=False)[0]
    n = parts[0].size
    gaps, wrong = [], []
    for i in range(k):
        on = parts[i].completion_mask.bool().to(first.device)
        mine = fused[i * n:(i + 1) * n]
        gaps.append(float((mine - own[i]).abs()[on].max()))
        wrong.append(float((mine - own[(i + 1) % k]).abs()[on].max()) if k > 1 else float("nan"))
    return {"max_gap_own": max(gaps), "min_gap_other": min(wrong)}


def measure(policies: list[Policy], batches: list[RolloutBatch], repeats: int) -> dict:
    """p50 of `repeats` calls each way after a warm-up call each (the compile's), one after the other."""
    times: dict[str, list[float]] = {"sequential": [], "fused": []}
    for i in range(1 + repeats):
        for way in times:
            t0 = synced_time()
            if way == "sequential":
                for p, b in zip(policies, batches):
                    stats = p.train(b)
            else:
                fused_train(policies, batches)
            dt = synced_time() - t0
            say(f"{way} call {i}: {dt:.3f} s" + (" (warm-up)" if i == 0 else ""))
            if i:
                times[way].append(dt)
    tokens = stats["tokens"] * len(policies)
    flops = trained_flops(policies[0].model.get_base_model().config, tokens, batches[0].size * len(policies))
    row = {"tokens": tokens}
    for way, seconds in times.items():
        p50 = statistics.median(seconds)
        row[way] = {"p50_s": p50, "s": seconds, "mfu": flops / p50 / (PEAK_BF16_TFLOPS * 1e12)}
    row["fused_over_sequential"] = row["fused"]["p50_s"] / row["sequential"]["p50_s"]
    return row


def check_exact(model_dir: str, k: int, size: str) -> dict:
    """CPU, fp32, no compile: each policy's (clipped) gradient in one fused update vs in its own Policy.train."""
    p, g, t = (int(x) for x in size.split("x"))
    grpo = GRPOSettings(lr=1e-2, temperature=1.0, compile="off", activation_checkpointing=False, kl_beta=0.0,
                        epochs=1, max_staleness=0, max_delta_ratio=0.0)
    batches = [synthetic_batch(p * g, t, seed=i) for i in range(k)]
    for b in batches:
        b.input_ids.remainder_(200)   # within the tiny vocabulary
    after = []
    for way in ("own", "fused"):
        policies = make_group(model_dir, k, grpo, "float32", "cpu")
        gap = logprob_gap(policies, batches) if way == "fused" else None
        if way == "own":
            for pol, b in zip(policies, batches):
                pol.train(b)
        else:
            fused_train(policies, batches)
        after.append([torch.cat([q.grad.flatten() for q in pol.params]) for pol in policies])   # clipped
    diff = max(float((g - g0).abs().max() / g0.abs().max()) for g, g0 in zip(after[0], after[1]))
    return {"max_gradient_diff_over_max_gradient": diff, **gap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", nargs="+", default=["16x8x128", "64x8x256"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--check", action="store_true", help="CPU exactness check on the tiny model, then stop")
    parser.add_argument("--limit", type=float, default=540, help="seconds: no new size starts after this")
    parser.add_argument("--overrides", nargs="*", default=["grpo.activation_checkpointing=false"],
                        help="grpo.* settings as on lorabench's command line, e.g. grpo.micro_batch_tokens=32768")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="group-update-"))
    result = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch": torch.__version__, "commit": os.environ.get("LORABENCH_COMMIT", ""),
              "date": time.strftime("%Y-%m-%d %H:%M"), "k": args.k, "overrides": args.overrides, "rows": []}
    if args.check:
        from lorabench.tiny import build_tiny_model
        tokenizer = build_tiny_tokenizer(root / "tiny")
        build_tiny_model(tokenizer).save_pretrained(root / "tiny")
        model_dir = str(root / "tiny")
        result["check"] = check_exact(model_dir, args.k, "2x4x12")
        say(json.dumps(result["check"]))
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    build_tiny_tokenizer(root / "tok")
    model_dir = str(random_qwen3_dir("0.6B", str(root / "tok"), Path(args.cache) / "qwen3-0.6b-random"))
    grpo = Config.load(None, ["grpo.lr=1e-5", "grpo.temperature=1.0", "grpo.kl_beta=0", "grpo.epochs=1",
                              *args.overrides]).grpo   # the CLI's parsing and checks
    policies = make_group(model_dir, args.k, grpo, "bfloat16", args.device)
    say(f"{args.k} policies built")
    for size in args.sizes:
        if time.perf_counter() - T0 > args.limit:
            say(f"{size}: not started, past --limit {args.limit:g} s")
            break
        p, g, t = (int(x) for x in size.split("x"))
        batches = [synthetic_batch(p * g, t, seed=i) for i in range(args.k)]
        row = {"size": size, **measure(policies, batches, args.repeats), **logprob_gap(policies, batches)}
        say(json.dumps({key: row[key] for key in ("size", "fused_over_sequential", "max_gap_own", "min_gap_other")}))
        result["rows"].append(row)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
