"""Refresh at the floor, on SGLang: every refresh mode next to the naive calls, in one run.

    python benchmarks/refresh_gpu.py --out results/refresh_tp1.json [--tp 2] [--prefill-graphs on,off]

Setting: a random-init model of Qwen3-0.6B's shape in bf16, LoRA r=32 on the 7 projections (392
tensors, 38 MB in bf16), SGLang's own defaults for CUDA graphs unless --prefill-graphs says off.
Before every refresh the adapter changes (as an optimizer step changes it); p50/p95 of --n
refreshes after 3 warm-up ones.
  refresh call  trainer LoRA weights -> the engine holds the new adapter (lorabench: the policy's
                snapshot + refresher.refresh; naive: PEFT's state dict or save_pretrained + unload + load)
  end to end    the call + the first request after it (one prompt, one new token, with the adapter)
After each refresh (untimed) the engine's log-probs on 8 probe sequences are compared with the
trainer's current weights (transformers + PEFT, bf16) and with the previous version's.
The section `request` times the one-token request itself in several states, to find out what the
steady request costs and why. Everything lands in one JSON (machine, versions, commit, date).
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

from sglang_calls import call_sglang  # noqa: E402  (this folder)
from synthetic import peft_adapter, random_qwen3_dir  # noqa: E402  (this folder)

from lorabench.clock import synced_time  # noqa: E402
from lorabench.data import prompt_ids, synthetic_problems  # noqa: E402
from lorabench.engines.sglang import SGLangEngine, SGLangSettings  # noqa: E402
from lorabench.engines.sglang_internals import check_reply  # noqa: E402
from lorabench.loss import plain_token_logprobs  # noqa: E402
from lorabench.models import load_tokenizer  # noqa: E402
from lorabench.policy import LoraLayers  # noqa: E402
from lorabench.refresh import make_refresher, refresh_settings  # noqa: E402
from lorabench.refresh_bench import adapter_model  # noqa: E402
from lorabench.tiny import build_tiny_tokenizer  # noqa: E402

MODES = ("inplace", "tensor", "file", "naive_tensor", "naive_file")
STACK = dict(attention_backend="triton", grammar_backend="none")  # the offline stack


def stats(values: list[float]) -> dict:
    v = sorted(values)
    return {"p50": statistics.median(v), "p95": v[min(len(v) - 1, round(0.95 * (len(v) - 1)))], "min": v[0],
            "n": len(v)}


def meta(args) -> dict:
    import peft
    import sglang
    import transformers
    return {"gpu": torch.cuda.get_device_name(), "gpus": torch.cuda.device_count(), "torch": torch.__version__,
            "sglang": sglang.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "commit": os.environ.get("LORABENCH_COMMIT", ""), "date": time.strftime("%Y-%m-%d %H:%M"),
            "setting": {"model": "Qwen3-0.6B shape, random init, bf16", "lora": "r=32, alpha=64, 7 projections",
                        "tp_size": args.tp, "n": args.n, "warmup": 3}}


NUDGE = 0.5  # relative size of each version's change; see nudge()
_origin: dict[str, torch.Tensor] = {}


def nudge(model, seed: int) -> None:
    """A new adapter version (untimed): every LoRA weight = its first value + NUDGE x its own scale
    x fresh N(0, 1) noise. Fresh, not cumulative, so the adapter keeps its size over 100+ versions;
    large enough that the previous version sits far outside the bf16 parity noise (a cumulative 2e-3
    walk moved the log-probs only ~4x that noise, too close to tell versions apart)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_A" in name:
                first = _origin.setdefault(name, p.detach().clone())
                noise = torch.randn(p.shape, generator=g, device=p.device, dtype=p.dtype)
                p.copy_(first + noise * (NUDGE * first.float().std().item()))


class Probe:
    """Probe sequences for parity, and the one-token request that follows a refresh."""

    def __init__(self, engine, tokenizer_path: str):
        tok = load_tokenizer(tokenizer_path)
        self.engine = engine
        problems = synthetic_problems(9, "refresh-probe")
        self.request_ids = prompt_ids(tok, problems[0].messages)
        self.seqs, self.plens = [], []
        for p in problems[1:]:
            prompt = prompt_ids(tok, p.messages)
            self.seqs.append(prompt + tok(p.answer, add_special_tokens=False)["input_ids"])
            self.plens.append(len(prompt))

    def request(self, adapter, ids=None):
        return call_sglang(self.engine, lambda e: e.generate(input_ids=[ids or self.request_ids], lora_path=[adapter],
                                                            sampling_params={"max_new_tokens": 1, "temperature": 0.0}))

    def engine_logprobs(self, adapter) -> torch.Tensor:
        return torch.cat(self.engine.score(self.seqs, self.plens, adapter))

    @torch.no_grad()
    def trainer_logprobs(self, model) -> torch.Tensor:
        out = []
        for seq, plen in zip(self.seqs, self.plens):
            ids = torch.tensor([seq], device="cuda")
            out.append(plain_token_logprobs(model, ids, torch.ones_like(ids), 1.0)[0, plen - 1:].float().cpu())
        return torch.cat(out)


def naive_refresh(engine, model, name: str, how: str, root: Path, i: int) -> None:
    """What a user writes without lorabench: PEFT's own calls, then SGLang's public API."""
    from peft import get_peft_model_state_dict
    config = model.peft_config["default"].to_dict()
    config.update(target_modules=sorted(config["target_modules"]), peft_type="LORA")
    config.pop("task_type", None)
    config = json.loads(json.dumps(config, default=str))
    if how == "naive_tensor":
        tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
        check_reply(call_sglang(engine, lambda e: e.unload_lora_adapter(name)), "unload")
        check_reply(call_sglang(engine, lambda e: e.load_lora_adapter_from_tensors(name, tensors, config)),
                    "load from tensors")
    else:
        path = root / f"naive-{i}"
        model.save_pretrained(path)
        check_reply(call_sglang(engine, lambda e: e.unload_lora_adapter(name)), "unload")
        check_reply(call_sglang(engine, lambda e: e.load_lora_adapter(name, str(path))), "load")


def time_mode(engine, model, probe: Probe, how: str, n: int, root: Path) -> dict:
    # flatten=True as the trainer's Policy does: the LoRA weights are views of one buffer, and the
    # snapshot is one clone (without it the snapshot gathers 392 tensors, ~2 ms of the call)
    name, layers, warmup = f"bench-{how}", LoraLayers(model, flatten=True), 3
    refresher = None if how.startswith("naive") else make_refresher(
        refresh_settings(how, **({"tmp_dir": str(root)} if how == "file" else {})), engine, name)
    if refresher is None:
        engine.load_adapter_tensors(name, peft_adapter(model).to("cuda", torch.bfloat16))
    calls, e2e, parts, engine_ms, parity, previous, snapshots = [], [], [], [], [], [], []
    last = probe.trainer_logprobs(model)
    for i in range(warmup + n):
        nudge(model, 1000 * len(how) + i)
        t0 = synced_time()
        if refresher is not None:
            adapter = layers.snapshot(i + 1)
            t_snapshot = synced_time()
            record = refresher.refresh(adapter)
        else:
            naive_refresh(engine, model, name, how, root, i)
        t1 = synced_time()
        probe.request(name)
        t2 = synced_time()
        current, got = probe.trainer_logprobs(model), probe.engine_logprobs(name)
        if i >= warmup:
            calls.append(1e3 * (t1 - t0))
            e2e.append(1e3 * (t2 - t0))
            parity.append([(got - current).abs().max().item(), (got - current).abs().mean().item()])
            previous.append((got - last).abs().mean().item())
            if refresher is not None:
                snapshots.append(1e3 * (t_snapshot - t0))
                parts.append({k: 1e3 * v for k, v in record.parts.items()})
                engine_ms.append(record.engine_ms)
        last = current
    if refresher is not None:
        refresher.close()
    engine.unload_adapter(name)  # every mode, the naive ones too, loaded `name` through the wrapper first
    row = {"mode": how, "call_ms": stats(calls), "end_to_end_ms": stats(e2e), "first_request_ms":
           stats([b - a for a, b in zip(calls, e2e)]), "parity_max": max(p[0] for p in parity),
           "parity_mean_worst": max(p[1] for p in parity), "previous_mean_min": min(previous),
           "previous_vs_parity": min(previous) / max(p[1] for p in parity)}  # the goal: >= 10x
    if snapshots:
        row["snapshot_ms"] = stats(snapshots)   # the policy's part of the call: clone + finite check
    if parts:
        row["parts_p50_ms"] = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[-1]}
    if engine_ms and engine_ms[-1]:
        row["engine_p50_ms"] = {k: statistics.median(p.get(k, 0.0) for p in engine_ms) for k in engine_ms[-1]}
    return row


def request_study(engine, model, probe: Probe, n: int = 20) -> dict:
    """The one-token request in several states: what does a steady request cost, and why?"""
    engine.load_adapter_tensors("study", peft_adapter(model).to("cuda", torch.bfloat16))
    tok_ids = probe.request_ids
    out = {}

    def timed(fn, before=None) -> dict:
        ms = []
        for i in range(n + 2):
            if before:
                before(i)
            t0 = synced_time()
            fn(i)
            if i >= 2:
                ms.append(1e3 * (synced_time() - t0))
        return stats(ms)

    def flush(i) -> None:
        check_reply(call_sglang(engine, lambda e: e.flush_cache()), "flush_cache")

    out["steady_adapter"] = timed(lambda i: probe.request("study"))
    out["steady_base"] = timed(lambda i: probe.request(None))
    out["after_flush_adapter"] = timed(lambda i: probe.request("study"), before=flush)
    out["fresh_prompt_adapter"] = timed(lambda i: probe.request("study", [7 + i % 50] + tok_ids[1:]))
    out["flush_cache"] = timed(flush)
    out["idle_100ms_then_request"] = timed(lambda i: probe.request("study"), before=lambda i: time.sleep(0.1))
    engine.unload_adapter("study")
    return out


def run(args) -> dict:
    root = Path(tempfile.mkdtemp(prefix="refresh-gpu-"))
    tok_dir = root / "tok"
    build_tiny_tokenizer(tok_dir)
    q06 = str(random_qwen3_dir("0.6B", str(tok_dir), Path(args.cache) / "qwen3-0.6b-random"))
    model = adapter_model(q06, 32, dtype="bfloat16", device="cuda")
    result = {**meta(args), "settings": {}}
    for graphs in args.prefill_graphs.split(","):
        overrides = {} if graphs == "on" else {"disable_prefill_cuda_graph": True}
        settings = SGLangSettings(max_lora_rank=32, mem_fraction_static=args.mem, dtype="bfloat16",
                                  tp_size=args.tp, **STACK)
        rows = []
        with SGLangEngine(q06, settings, **overrides) as engine:
            probe = Probe(engine, q06)
            for how in args.modes.split(","):
                rows.append(time_mode(engine, model, probe, how, args.n, root))
                print(json.dumps({k: rows[-1][k] for k in ("mode", "call_ms", "end_to_end_ms", "parity_mean_worst")}),
                      flush=True)
            study = request_study(engine, model, probe)
        result["settings"][f"prefill_graphs_{graphs}"] = {"rows": rows, "request": study}
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--mem", type=float, default=0.3, help="engine mem_fraction_static")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--prefill-graphs", default="on", help="on, off or on,off")
    parser.add_argument("--cache", default=os.environ.get("LORABENCH_CACHE", "/tmp/lorabench-cache"))
    run(parser.parse_args())


if __name__ == "__main__":
    main()
