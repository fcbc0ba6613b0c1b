"""The step a user gets: `RunSession.open` as `lorabench run` does (the defaults plus the setting's
overrides, a real run dir, a checkpoint every step), each step timed from outside, with the commit
written in the background (the default) and in line, beside SGLang's own decode of the same batch.

    python benchmarks/step_user_path.py --out results/step_user_path.json            # the H200 setting
    python benchmarks/step_user_path.py --tiny --out /tmp/step_user_path_cpu.json    # the CPU reference engine

GPU setting: a random-init model of Qwen3-0.6B's shape in bf16, LoRA r=32 alpha=64 on the default
targets, refresh.mode=inplace, 64 prompts x 8 x 256 new tokens, temperature 1, the engine arguments
of the SGLang stack (step_gpu.STACK). --tiny: the tiny model on the hf engine at the demo's size.
Reported per run (a commit mode, and with --staleness a grpo.max_staleness each): the first step (the
compile, when grpo.compile compiles), p50 of steps 2..n of the whole step and of each part, the
background commit's write time, each GPU's busy share over the steps (meters.GpuBusy) and the
training part's model FLOPs utilisation against the H200's bf16 peak (GPU setting only).
The engine on a GPU of its own (two GPUs):
    python benchmarks/step_user_path.py --out results/step_own_gpu.json --modes background --staleness 0 1 \
        --overrides engine.sglang.base_gpu_id=1 engine.sglang.mem_fraction_static=0.85 torch keeps its
compiled graphs in its on-disk caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): the first run on a
machine pays the compile; a later process (`--modes background` again) shows the first step with a warm cache.
Under CUDA MPS (dev/gpu_session.sh, LORABENCH_MPS=1), --trainer-sm-percent caps this process's share of the SMs
and leaves the engine's processes all of them: with one step stale the rollout, not training, is the longer.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meters import GpuBusy, trained_flops, trainer_context  # noqa: E402  (this folder)
from synthetic import qwen3_06b_run, size_overrides  # noqa: E402  (this folder)

from lorabench.data import prompt_ids  # noqa: E402
from lorabench.session import Config, RunSession  # noqa: E402

GPU_SETTING = ["lora.r=32", "lora.alpha=64", "refresh.mode=inplace", "grpo.prompts_per_step=64", "grpo.group_size=8",
               "grpo.max_new_tokens=256", "grpo.temperature=1.0"]


def timed_steps(session, steps: int) -> dict:
    """Each step timed from outside (the commit's wait for the previous one included)."""
    walls, rows, writes = [], [], []
    commits = session.trainer._commits
    if commits._pool is not None:   # run.commit_in_background: time each write on the commit thread
        write = commits._write

        def timed_write(*args) -> None:
            t0 = time.perf_counter()
            write(*args)
            writes.append(time.perf_counter() - t0)
        commits._write = timed_write

    def one_step() -> None:
        t0 = time.perf_counter()
        rows.append(session.trainer.step().metrics)
        walls.append(time.perf_counter() - t0)
        print(f"step {len(walls)}: {walls[-1]:.2f} s (lag {rows[-1].get('adapter/lag', 0)})", flush=True)

    one_step()
    with GpuBusy() as busy:   # steps 2..n, as the p50s
        for _ in range(steps - 1):
            one_step()
    t0 = time.perf_counter()
    session.trainer.wait_committed()
    drain = time.perf_counter() - t0
    later = rows[1:]
    parts = {k[5:-2]: statistics.median(r[k] for r in later) for k in later[0] if k.startswith("time/")}
    return {"first_step_s": walls[0], "step_wall_s_p50": statistics.median(walls[1:]), "step_wall_s": walls,
            "parts_s_p50": parts, "last_commit_drain_s": drain,
            "background_write_s_last": writes[-1] if writes else (0.0 if commits._pool is not None else None),
            "completion_tokens_p50": statistics.median(r["completions/mean_length"] for r in later),
            "served_versions": [r["adapter/served_version"] for r in rows],
            "lags": [r.get("adapter/lag", 0) for r in rows], "gpu_busy_percent": busy.percent,
            "train_tokens_p50": statistics.median(r["train/tokens"] for r in later),
            "memory_peak_gb_p50": {k[7:-8]: statistics.median(r[k] for r in later)
                                   for k in later[0] if k.startswith("memory/")}}


class _Bypasses(logging.Handler):
    """Why inductor compiled a graph without its on-disk cache: the reasons it logs (codecache, INFO)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Bypassing" in record.getMessage():
            self.reasons.append(record.getMessage())


BYPASSES = _Bypasses()


def watch_cache_bypasses() -> None:
    codecache = logging.getLogger("torch._inductor.codecache")
    codecache.addHandler(BYPASSES)
    codecache.setLevel(min(codecache.getEffectiveLevel(), logging.INFO))


def compile_cache_counters() -> dict:
    """torch's counts of compiled graphs and of on-disk cache hits and misses so far in this process, and why
    a graph bypassed inductor's cache (watch_cache_bypasses)."""
    from torch._dynamo.utils import counters
    return {**{group: dict(counters[group]) for group in ("stats", "aot_autograd", "inductor") if group in counters},
            "fxgraph_cache_bypass_reasons": sorted(set(BYPASSES.reasons))}


def sglang_decode(session, t: int) -> dict:
    """SGLang's own decode of a step's batch, base, with the adapter, and with the adapter and each token's
    log-prob returned, as a rollout asks (step_gpu.decode_reference)."""
    from step_gpu import decode_reference
    trainer = session.trainer
    g = trainer.settings
    problems = trainer.source.train_batch(99, g.prompts_per_step)
    ids = [prompt_ids(trainer.tokenizer, p.messages) for p in problems for _ in range(g.group_size)]
    served = trainer.refresher.serving_adapter
    kinds = {"base": (None, False), "adapter": (served, False), "adapter_logprob": (served, True)}
    rounds = [{kind: decode_reference(session.engine, ids, t, adapter, logprobs)["tok_s"]
               for kind, (adapter, logprobs) in kinds.items()} for _ in range(3)]
    return {f"{kind}_tok_s": statistics.median(r[kind] for r in rounds) for kind in kinds}


def train_mfu(session, row: dict) -> float:
    """Model FLOPs (meters.trained_flops) of the training part's tokens per second, over the H200's
    bf16 peak (step_gpu.PEAK_BF16_TFLOPS)."""
    from step_gpu import PEAK_BF16_TFLOPS
    g = session.trainer.settings
    flops = trained_flops(session.trainer.policy.model.get_base_model().config, row["train_tokens_p50"],
                          g.prompts_per_step * g.group_size)
    return flops / row["parts_s_p50"]["train"] / (PEAK_BF16_TFLOPS * 1e12)


def save_attention_in_checkpoints() -> None:
    """An experiment, not the package's behaviour: each compiled layer's checkpoint keeps the fused attention's
    outputs instead of recomputing them in backward (selective activation checkpointing). The seeded attention
    ops then are not recomputed, so torch need not wrap them to replay their seed (the wrapper that makes two
    graphs bypass inductor's cache), and backward skips one attention forward per layer, for more memory."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    import lorabench.policy as policy
    aten = torch.ops.aten
    kept = {getattr(aten, name).default for name in (
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, name)}

    def choose(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE
    # the package's own checkpointed forward (policy._checkpointed), each call given this policy
    policy.checkpoint = functools.partial(checkpoint, context_fn=functools.partial(
        create_selective_checkpoint_contexts, choose))


def measure(overrides: list[str], out_dir: Path, name: str, steps: int, decode: bool) -> dict:
    cfg = Config.load(None, [*overrides, f"run.out_dir={out_dir}", f"run.name={name}"])
    t0 = time.perf_counter()
    session = RunSession.open(cfg, log=lambda *a: None)
    print(f"{name}: opened in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        row = {"name": name, "open_s": time.perf_counter() - t0, **timed_steps(session, steps),
               "compile_caches": compile_cache_counters()}
        if decode:
            row["train_mfu"] = train_mfu(session, row)
            row["sglang_decode"] = sglang_decode(session, cfg.grpo.max_new_tokens)
            if not cfg.grpo.max_staleness:   # a stale step's rollout ran beside training, off the step's path
                p, g = cfg.grpo.prompts_per_step, cfg.grpo.group_size
                rollout_tok_s = p * g * row["completion_tokens_p50"] / row["parts_s_p50"]["rollout"]
                for reference in ("base", "adapter", "adapter_logprob"):
                    row[f"rollout_vs_{reference}_decode"] = rollout_tok_s / row["sglang_decode"][f"{reference}_tok_s"]
    finally:
        session.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the hf engine (CPU)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    parser.add_argument("--overrides", nargs="*", default=[], help="more config overrides for both runs")
    parser.add_argument("--modes", nargs="+", choices=["background", "in_line"], default=["background", "in_line"],
                        help="the commit modes to run, one run each, in this order")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0],
                        help="grpo.max_staleness of the runs: each commit mode runs once per value")
    parser.add_argument("--sizes", nargs="+", default=["64x8x256"],
                        help="PxGxT: prompts x completions x new tokens per step, one run per size (GPU setting only)")
    parser.add_argument("--no-decode", action="store_true", help="skip SGLang's own decode of the batch (~20 s a run)")
    parser.add_argument("--save-attention", action="store_true",
                        help="an experiment: checkpoints keep the attention's outputs (save_attention_in_checkpoints)")
    parser.add_argument("--trainer-sm-percent", type=int, default=0,
                        help="under CUDA MPS: the share of the GPU's SMs this process (the trainer) may use; the "
                             "engine's processes keep all of them (0: no limit)")
    parser.add_argument("--trainer-below-normal", action="store_true",
                        help="under CUDA MPS: this process (the trainer) is a BELOW_NORMAL client "
                             "(CUDA_MPS_CLIENT_PRIORITY=1): where both have kernels ready, the engine's run first")
    args = parser.parse_args()
    watch_cache_bypasses()
    root = Path(tempfile.mkdtemp(prefix="step-user-"))
    trainer_context(args.trainer_sm_percent, args.trainer_below_normal)
    if args.save_attention:
        save_attention_in_checkpoints()
    if args.tiny:
        base = ["model.name_or_path=tiny"]
    else:
        from synthetic import STACK
        base = [*STACK, *GPU_SETTING, *qwen3_06b_run(root, args.cache, "step-bench")]
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "commit": os.environ.get("LORABENCH_COMMIT", ""),
              "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(),
              "overrides": [*base, *args.overrides], "trainer_sm_percent": args.trainer_sm_percent or 100,
              "trainer_below_normal": args.trainer_below_normal,
              "save_attention": args.save_attention,
              "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "runs": []}
    sizes = [None] if args.tiny else args.sizes
    for size, mode, staleness in ((s, m, k) for s in sizes for m in args.modes for k in args.staleness):
        name = mode + (f"-stale{staleness}" if staleness else "") + (f"-{size}" if len(sizes) > 1 else "")
        shape = [] if size is None else size_overrides(size)
        row = measure([*base, *shape, *args.overrides, f"run.commit_in_background={str(mode == 'background').lower()}",
                       f"grpo.max_staleness={staleness}"], root / "runs", name, args.steps,
                      decode=not (args.tiny or args.no_decode))
        result["runs"].append(row)
        print(json.dumps({k: row[k] for k in ("name", "first_step_s", "step_wall_s_p50", "parts_s_p50",
                                              "gpu_busy_percent")}), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
