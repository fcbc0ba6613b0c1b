"""lorabench's headline GPU figures in one run (issue 5), on SGLang, next to the naive calls:

    bash .sglang/with-sglang.sh python benchmarks/gpu_perf.py --out $OUT/perf.json [--quick]

Sections (each writes its rows into the JSON as soon as it is done, so a time-out keeps the rest):
  refresh      end-to-end refresh (trainer tensors -> engine serving the new adapter, first request
               included) p50/p95 over >= 20 refreshes, for the naive calls (PEFT state dict +
               unload + load_lora_adapter_from_tensors; PEFT save_pretrained + unload + load by path)
               and lorabench's file / tensor / inplace modes, on Qwen3-0.6B's shape with r=32 on the
               7 projections; plus the steady-state request those include, and an in-place check
               (same values in place vs by a full load: log-prob difference)
  ranks        the same at r = 8 .. 128
  merged       full-weight push (update_weights_from_tensor) per bucket size, 1 .. 2048 MB
  sizes        tensor / inplace / file refresh on the tiny model, 0.6B and 1.7B shapes
  step         (first) rollout throughput with the adapter vs the base model (512 x 256 tokens), once
  step         GRPO steps at 64 prompts x 8 samples x 256 new tokens (inplace and tensor), and step
               time vs rollout size, with the step's parts
  tp           (--sections tp, two GPUs) refresh latency at engine.tp_size 1 and 2, same run
  floor        (--sections floor) a one-token request by engine setting, the floor under every
               end-to-end figure, and in-place refresh end to end where it is cheapest
  decode       (--sections decode) adapter vs base decode throughput, repeated, with default decode
               CUDA graphs and with graphs captured up to batch 512
Each figure is measured in this run; reference points (the naive calls) are measured here too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorabench.adapters import AdapterSnapshot  # noqa: E402
from lorabench.config import Config  # noqa: E402
from lorabench.data import synthetic_problems  # noqa: E402
from lorabench.engines.sglang import SGLangEngine  # noqa: E402
from lorabench.models import load_tokenizer, prompt_ids, random_qwen3_dir, tiny_model_dir  # noqa: E402
from lorabench.refresh import FileRefresh, InPlaceRefresh, MergedRefresh, TensorRefresh  # noqa: E402
from lorabench.refresh_bench import adapter_model, measure_bandwidth  # noqa: E402

STACK = ["engine.attention_backend=triton", "engine.sampling_backend=pytorch", "engine.grammar_backend=none",
         'engine.extra_args={"disable_prefill_cuda_graph": true}', "engine.dtype=bfloat16"]
CACHE = os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache")


def config(*overrides) -> Config:
    return Config.load(None, [*STACK, "engine.mem_fraction_static=0.3", *overrides])


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summary(ms: list[float]) -> dict:
    return {"p50_ms": statistics.median(ms), "p95_ms": pct(ms, 0.95), "min_ms": min(ms), "n": len(ms)}


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def nudge(model, seed: int) -> None:
    """A new adapter version, as an optimizer step makes one (untimed)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype), alpha=1e-3)


class Probe:
    """The first request after a refresh: one short prompt, one new token, with the adapter."""

    def __init__(self, engine, tokenizer_path):
        tok = load_tokenizer(tokenizer_path)
        self.engine = engine
        self.ids = prompt_ids(tok, synthetic_problems(1, "probe")[0].messages)

    def __call__(self, adapter):
        return self.engine.engine.generate(input_ids=[self.ids], sampling_params={"max_new_tokens": 1,
                                           "temperature": 0.0}, lora_path=[adapter])


# --- naive calls (what a user writes without lorabench) ----------------------------------------
def naive_tensor(engine, model, name):
    from peft import get_peft_model_state_dict
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    config_dict = model.peft_config["default"].to_dict()
    config_dict["target_modules"] = sorted(config_dict["target_modules"])
    config_dict["peft_type"] = "LORA"
    config_dict.pop("task_type", None)
    engine.engine.unload_lora_adapter(name)
    result = engine.engine.load_lora_adapter_from_tensors(name, tensors, json.loads(json.dumps(config_dict,
                                                          default=str)))
    assert result.success, result.error_message


def naive_file(engine, model, name, root: Path, step: int):
    path = root / f"naive-{step}"
    model.save_pretrained(path)
    engine.engine.unload_lora_adapter(name)
    result = engine.engine.load_lora_adapter(name, str(path))
    assert result.success, result.error_message


def one_token_ms(probe, adapter, n: int = 20, warmup: int = 1) -> float:
    """Median of `n` one-token requests (after `warmup` untimed ones), nothing refreshed between."""
    for _ in range(warmup):
        probe(adapter)
    times = []
    for _ in range(n):
        t0 = sync_time()
        probe(adapter)
        times.append(1e3 * (sync_time() - t0))
    return statistics.median(times)


def time_refreshes(engine, model, probe, how: str, n: int, warmup: int, tmp: Path) -> dict:
    """`n` timed refreshes (after `warmup`) by `how`: end to end (first request included), the
    refresh alone, and lorabench's parts."""
    name = f"bench-{how}"
    refresher = None
    if how in ("tensor", "inplace", "file"):
        cls = {"tensor": TensorRefresh, "inplace": InPlaceRefresh, "file": FileRefresh}[how]
        kw = {"tmp_dir": str(tmp)} if how == "file" else {"device": "cuda"}
        refresher = cls(engine, name, transfer_dtype=torch.bfloat16, **kw)
    else:  # the naive calls unload first: load the name once
        first = AdapterSnapshot.from_peft(model)
        assert engine.engine.load_lora_adapter_from_tensors(name, first.tensors, first.config).success
    disk_tmp = Path(tempfile.mkdtemp(prefix="naive-peft-"))  # a plain disk dir, as a naive user writes
    e2e, alone, parts, loader = [], [], [], []
    for i in range(warmup + n):
        nudge(model, i)
        t0 = sync_time()
        if refresher is not None:
            rec = refresher.refresh(model, i)
        elif how == "naive_tensor":
            naive_tensor(engine, model, name)
        else:
            naive_file(engine, model, name, disk_tmp, i)
        t1 = sync_time()
        probe(name)
        t2 = sync_time()
        if i >= warmup:
            e2e.append(1e3 * (t2 - t0))
            alone.append(1e3 * (t1 - t0))
            if refresher is not None:
                parts.append({k: 1e3 * v for k, v in rec.parts.items()})
            if how == "inplace" and engine.last_write_ms:
                loader.append(dict(engine.last_write_ms))
    if refresher is not None:
        refresher.close()
        engine.unload_adapter(name)
    else:
        engine.engine.unload_lora_adapter(name)
    shutil.rmtree(disk_tmp, ignore_errors=True)
    # the same request with nothing refreshed (adapter unloaded: base)
    row = {"how": how, "end_to_end": summary(e2e), "refresh_only": summary(alone),
           "request_steady_ms": one_token_ms(probe, None, n=10, warmup=0)}
    if parts:
        row["parts_p50_ms"] = {k: statistics.median(p[k] for p in parts if k in p) for k in parts[-1]}
    if loader:  # the in-engine loader's own phases (TP rank 0), inside the 'write' part
        row["engine_loader_p50_ms"] = {k: statistics.median(p[k] for p in loader if k in p) for k in loader[-1]}
        row["engine_loader_p50_ms"]["total"] = statistics.median(sum(p.values()) for p in loader)
    return row


def in_place_check(engine, model, tokenizer_path) -> dict:
    """Log-probs after an in-place refresh vs after a full tensor load of the same values."""
    tok = load_tokenizer(tokenizer_path)
    seqs, plens = [], []
    for p in synthetic_problems(8, "inplace-check"):
        prompt = prompt_ids(tok, p.messages)
        seqs.append(prompt + tok(p.answer, add_special_tokens=False)["input_ids"])
        plens.append(len(prompt))
    inplace = InPlaceRefresh(engine, "check", device="cuda", transfer_dtype=torch.bfloat16)
    inplace.refresh(model, 0)
    nudge(model, 99)
    inplace.refresh(model, 1)  # in place
    got = engine.score(seqs, plens, "check")
    engine.unload_adapter("check")
    TensorRefresh(engine, "check", device="cuda", transfer_dtype=torch.bfloat16).refresh(model, 2)
    want = engine.score(seqs, plens, "check")
    engine.unload_adapter("check")
    d = torch.cat([(a - b).abs() for a, b in zip(got, want)])
    return {"max_abs_diff": d.max().item(), "mean_abs_diff": d.mean().item(), "tokens": d.numel()}


# --- sections ------------------------------------------------------------------------------------
def section_refresh(res, q06, tiny, args, tmp):
    n, warm = (6, 2) if args.quick else (20, 3)
    cfg = config("lora.r=128", "engine.max_lora_rank=128")
    with SGLangEngine(str(q06), cfg) as engine:
        probe = Probe(engine, str(q06))
        model = adapter_model(str(q06), 32, dtype="bfloat16", device="cuda")
        res["adapter_mb_bf16"] = sum(p.numel() * 2 for n_, p in model.named_parameters() if "lora_" in n_) / 2**20
        res["refresh"] = [time_refreshes(engine, model, probe, how, n, warm, tmp)
                          for how in ("naive_tensor", "naive_file", "tensor", "file", "inplace")]
        res["in_place_check"] = in_place_check(engine, model, str(q06))
        save(res, args.out)
        rows = []
        for rank in ((8, 128) if args.quick else (8, 16, 32, 64, 128)):
            model = adapter_model(str(q06), rank, dtype="bfloat16", device="cuda")
            for how in ("naive_tensor", "tensor", "file", "inplace"):
                row = time_refreshes(engine, model, probe, how, max(4, n // 3), 2, tmp)
                rows.append({"rank": rank, **row})
                log(f"rank {rank:>3} {how:>12}: e2e p50 {row['end_to_end']['p50_ms']:.1f} ms")
            del model
        res["ranks"] = rows
        save(res, args.out)
        # merged full-weight push per bucket size (last: it overwrites the engine's weights)
        model = adapter_model(str(q06), 32, dtype="bfloat16", device="cuda")
        merged = []
        for mb in ((1, 64, 2048) if args.quick else (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)):
            refresher = MergedRefresh(engine, "policy", bucket_mb=mb)
            times = []
            for i in range(2 if args.quick else 4):
                rec = refresher.refresh(model, i)
                if i:
                    times.append(1e3 * rec.total_s)
            merged.append({"bucket_mb": mb, "buckets": len(rec.buckets), "bytes": rec.nbytes,
                           "parts_ms": {k: 1e3 * v for k, v in rec.parts.items()}, **summary(times)})
            log(f"merged bucket {mb:>5} MB: {statistics.median(times):.0f} ms in {len(rec.buckets)} pushes")
        res["merged"] = merged
        save(res, args.out)


def section_sizes(res, q06, tiny, args, tmp):
    rows = []
    shapes = [("tiny", tiny), ("0.6B", q06)]
    if not args.quick:
        shapes.append(("1.7B", random_qwen3_dir("1.7B", str(tiny), Path(CACHE) / "qwen3-1.7b-random")))
    for label, path in shapes:
        with SGLangEngine(str(path), config("lora.r=32")) as engine:
            probe = Probe(engine, str(path))
            model = adapter_model(str(path), 32, dtype="bfloat16", device="cuda")
            params = sum(p.numel() for n_, p in model.named_parameters() if "lora_" not in n_)
            for how in ("naive_tensor", "tensor", "inplace", "file"):
                row = time_refreshes(engine, model, probe, how, 6 if args.quick else 10, 2, tmp)
                rows.append({"model": label, "params": params, **row})
                log(f"{label:>5} {how:>12}: e2e p50 {row['end_to_end']['p50_ms']:.1f} ms")
            del model
        res["sizes"] = rows
        save(res, args.out)


def section_decode_and_step(res, q06, tiny, args, tmp):
    from lorabench.grpo import GRPOTrainer
    from lorabench.runlog import RunLog
    data = tmp / "gsm8k_train.jsonl"
    data.write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                            for p in synthetic_problems(2048, "perf")))
    common = ["lora.r=32", "model.dtype=bfloat16", f"data.source={data}", "engine.mem_fraction_static=0.35"]
    cfg = config(*common)
    with SGLangEngine(str(q06), cfg) as engine:
        # decode throughput: 512 sequences x 256 new tokens, adapter vs base
        tok = load_tokenizer(str(q06))
        prompts = [prompt_ids(tok, p.messages) for p in synthetic_problems(64, "decode")] * 8
        model = adapter_model(str(q06), 32, dtype="bfloat16", device="cuda")
        TensorRefresh(engine, "policy", device="cuda", transfer_dtype=torch.bfloat16).refresh(model, 0)
        params = {"max_new_tokens": 256, "temperature": 1.0, "ignore_eos": True}
        decode = {}
        for label, adapter in (("base", None), ("adapter", "policy"), ("base_again", None), ("adapter_again", "policy")):
            t0 = sync_time()
            outs = engine.engine.generate(input_ids=prompts, sampling_params=params, lora_path=[adapter] * len(prompts))
            dt = sync_time() - t0
            tokens = sum(len(o["output_ids"]) for o in outs)
            decode[label] = {"seconds": dt, "tokens": tokens, "tokens_per_s": tokens / dt}
            log(f"decode {label}: {tokens / dt:.0f} tok/s")
        decode["adapter_vs_base"] = (decode["adapter_again"]["tokens_per_s"] / decode["base_again"]["tokens_per_s"])
        res["decode"] = decode
        engine.unload_adapter("policy")
        del model
        save(res, args.out)
        # GRPO steps: parts of a step at 64 x 8 x 256, and step time vs rollout size
        steps = []
        sizes = [(64, 8, 256, "inplace"), (64, 8, 256, "tensor")]
        if not args.quick:
            sizes += [(16, 8, 128, "inplace"), (32, 8, 256, "inplace")]
        for prompts_per_step, group, new_tokens, mode in sizes:
            run_cfg = config(*common, f"refresh.mode={mode}", f"grpo.prompts_per_step={prompts_per_step}",
                             f"grpo.group_size={group}", f"grpo.max_new_tokens={new_tokens}", "grpo.micro_batch=32",
                             f"run.out_dir={tmp / 'runs'}", f"run.name=step-{prompts_per_step}-{mode}",
                             "run.save_adapter_every=1000")
            trainer = GRPOTrainer(run_cfg, str(q06), engine, RunLog(tmp / "runs" / f"s-{prompts_per_step}-{mode}"))
            rows = [trainer.step().metrics for _ in range(3 if prompts_per_step == 64 else 2)]
            trainer.close()
            last = rows[1:]  # the first step compiles and warms up
            keys = ("time/rollout_s", "time/reward_s", "time/train_s", "time/refresh_s", "time/step_s")
            row = {"prompts": prompts_per_step, "group": group, "max_new_tokens": new_tokens, "mode": mode,
                   **{k: statistics.median(r[k] for r in last if k in r) for k in keys if k in last[0]},
                   "refresh_total_ms": statistics.median(1e3 * r["refresh/total_s"] for r in last)}
            row["refresh_share"] = row["refresh_total_ms"] / 1e3 / row["time/step_s"]
            steps.append(row)
            log(f"step {prompts_per_step}x{group}x{new_tokens} {mode}: step {row['time/step_s']:.2f} s, "
                f"refresh {row['refresh_total_ms']:.1f} ms ({100 * row['refresh_share']:.2f}%)")
            res["step"] = steps
            save(res, args.out)


def section_tp(res, q06, tiny, args, tmp):
    """Refresh latency with the engine on one GPU and tensor-parallel over two (issue 7), in the
    same run: 0.6B shape, r=32, naive calls and lorabench's modes, plus the in-place parity check."""
    n, warm = (6, 2) if args.quick else (20, 3)
    rows = []
    for tp in (2, 1):
        torch.cuda.empty_cache()
        if tp > torch.cuda.device_count():
            rows.append({"tp": tp, "skipped": f"needs {tp} GPUs, this machine has {torch.cuda.device_count()}"})
            continue
        with SGLangEngine(str(q06), config("lora.r=32", "engine.backend=sglang", f"engine.tp_size={tp}")) as engine:
            probe = Probe(engine, str(q06))
            model = adapter_model(str(q06), 32, dtype="bfloat16", device="cuda")
            for how in ("naive_tensor", "naive_file", "tensor", "file", "inplace"):
                row = time_refreshes(engine, model, probe, how, n, warm, tmp)
                rows.append({"tp": tp, **row})
                log(f"tp={tp} {how:>12}: refresh p50 {row['refresh_only']['p50_ms']:.1f} ms, e2e p50 "
                    f"{row['end_to_end']['p50_ms']:.1f} ms")
            rows.append({"tp": tp, "in_place_check": in_place_check(engine, model, str(q06))})
            del model
        res["tp"] = rows
        save(res, args.out)


def section_floor(res, q06, tiny, args, tmp):
    """The floor under every end-to-end figure: a one-token request with nothing refreshed, by
    engine setting (LoRA on, with and without the adapter; LoRA off; prefill CUDA graphs on), and
    the in-place refresh end to end where the request is cheapest. 0.6B shape, r=32."""
    variants = {"lora_prefill_eager": {}, "lora_prefill_graph": {"disable_prefill_cuda_graph": False},
                "no_lora_prefill_eager": {"enable_lora": False}}
    rows = []
    for label, overrides in variants.items():
        t0 = time.perf_counter()
        try:
            with SGLangEngine(str(q06), config("lora.r=32"), **overrides) as engine:
                row = {"variant": label, "start_s": time.perf_counter() - t0}
                probe = Probe(engine, str(q06))
                row["request_base_ms"] = one_token_ms(probe, None)
                if overrides.get("enable_lora", True):
                    model = adapter_model(str(q06), 32, dtype="bfloat16", device="cuda")
                    TensorRefresh(engine, "floor", device="cuda", transfer_dtype=torch.bfloat16).refresh(model, 0)
                    row["request_adapter_ms"] = one_token_ms(probe, "floor")
                    engine.unload_adapter("floor")
                    row["inplace"] = time_refreshes(engine, model, probe, "inplace", 20, 3, tmp)
                    del model
        except Exception:  # a setting this SGLang refuses: record it, measure the others
            row = {"variant": label, "error": traceback.format_exc()[-2000:]}
        rows.append(row)
        log(f"floor {label}: {json.dumps({k: v for k, v in row.items() if k.startswith('request')})}")
        res["floor"] = rows
        save(res, args.out)


def section_decode(res, q06, tiny, args, tmp):
    """Rollout throughput with the adapter vs the base model, 512 sequences x 256 new tokens (the
    64 x 8 x 256 step's rollout), base and adapter alternated 3 times, with SGLang's default decode
    CUDA graphs (captured up to batch 256 on an H200) and with graphs captured up to 512."""
    tok = load_tokenizer(str(q06))
    prompts = [prompt_ids(tok, p.messages) for p in synthetic_problems(64, "decode")] * 8
    params = {"max_new_tokens": 256, "temperature": 1.0, "ignore_eos": True}
    out = {}
    for label, overrides in (("graphs_default", {}), ("graphs_to_512", {"cuda_graph_max_bs_decode": 512})):
        with SGLangEngine(str(q06), config("lora.r=32", "engine.mem_fraction_static=0.35"), **overrides) as engine:
            model = adapter_model(str(q06), 32, dtype="bfloat16", device="cuda")
            TensorRefresh(engine, "policy", device="cuda", transfer_dtype=torch.bfloat16).refresh(model, 0)
            del model
            runs = []
            for rep in range(1 if args.quick else 3):
                for adapter in (None, "policy"):
                    t0 = sync_time()
                    outs = engine.engine.generate(input_ids=prompts, sampling_params=params,
                                                  lora_path=[adapter] * len(prompts))
                    dt = sync_time() - t0
                    tokens = sum(len(o["output_ids"]) for o in outs)
                    runs.append({"rep": rep, "adapter": adapter is not None, "seconds": dt, "tokens_per_s": tokens / dt})
                    log(f"decode {label} rep {rep} {'adapter' if adapter else 'base'}: {tokens / dt:.0f} tok/s")
        base = statistics.median(r["tokens_per_s"] for r in runs if not r["adapter"])
        lora = statistics.median(r["tokens_per_s"] for r in runs if r["adapter"])
        out[label] = {"runs": runs, "base_tokens_per_s": base, "adapter_tokens_per_s": lora, "adapter_vs_base": lora / base}
        res["decode_repeat"] = out
        save(res, args.out)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save(res: dict, path: str) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, path)


SECTIONS = {"refresh": section_refresh, "sizes": section_sizes, "step": section_decode_and_step,
            "tp": section_tp, "floor": section_floor, "decode": section_decode}
DEFAULT_SECTIONS = "refresh,sizes,step"  # tp needs two GPUs; floor and decode are the issue-5 profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_perf.json")
    parser.add_argument("--quick", action="store_true", help="few repeats: a smoke run of every section")
    parser.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma-separated, of {list(SECTIONS)}")
    args = parser.parse_args()
    import peft
    import sglang
    import transformers
    res = {"kind": "gpu_perf", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "sglang": sglang.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
           "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M"),
           "quick": args.quick, "errors": {}}
    res["device_copy_gbps"] = measure_bandwidth("cuda", 1024)
    from lorabench.config import WarmStartConfig
    tiny = tiny_model_dir(CACHE, WarmStartConfig(steps=0), 0, log=log)
    q06 = random_qwen3_dir("0.6B", str(tiny), Path(CACHE) / "qwen3-0.6b-random")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as tmp:
        for name in args.sections.split(","):
            t0 = time.perf_counter()
            log(f"section {name}")
            try:
                SECTIONS[name](res, q06, tiny, args, Path(tmp))
            except Exception:  # a benchmark driver: record the failure, run the other sections
                res["errors"][name] = traceback.format_exc()
                log(res["errors"][name])
            res[f"{name}_section_s"] = time.perf_counter() - t0
            save(res, args.out)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
