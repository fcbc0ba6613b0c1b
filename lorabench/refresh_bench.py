"""Refresh latency per method (file / tensor / inplace / merged) and bucket size, on a real engine,
next to the physical floor: the bytes moved divided by the measured copy bandwidth (notebook 02;
benchmarks/refresh_sweep.py sweeps ranks and bucket sizes with it).

    engine = start_engine(cfg, model_path)              # a scratch engine: merged overwrites its weights
    model = adapter_model(model_path, rank=16)          # a scratch trainer-side adapter of that size
    rows = [measure_refresh(engine, model, mode, bucket_mb=64) for mode in MODES]
    bandwidth = measure_bandwidth()                     # GB/s, host memcpy (or on-device on a GPU)
    save_results("refresh.json", rows, bandwidth)       # load_results reads it back

Each row is the median of `repeats` refreshes of the same adapter after `warmup` untimed ones:
    {"engine", "device", "mode", "rank", "bucket_mb", "bytes", "buckets", "parts": {part: s},
     "total_s", "min_s", "first_request_s", "repeats"}
`first_request_s` is the median of the request right after each refresh (one prompt, one greedy
token, with the refreshed adapter): with the call, the refresh end to end as a rollout sees it.
Parts are the refresher's own (refresh.py), after the policy's snapshot (timed here as `snapshot`):
file = stage (per bucket, to the host) + write + unload + load; tensor = stage (per bucket) + unload +
load; inplace = write (after its first, loading refresh); merged = merge + push (per bucket).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from .adapters import base_weights
from .clock import Clock
from .engines.base import AdapterNotLoaded, Sampling
from .refresh import REFRESH_MODES, make_refresher, refresh_settings

MODES = tuple(m for m, cls in REFRESH_MODES.items() if cls.keeps_engine_fresh)   # every mode but the stale control
FIRST_REQUEST = list(range(10, 42))   # 32 prompt token ids every model's vocabulary has


def measure_bandwidth(device: str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s (1e9 bytes/s): bytes of one tensor / best time of `dst.copy_(src)`.
    One copy reads and writes each byte once, so bytes / bandwidth is the time to move them once."""
    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return n * 4 / best / 1e9


def floor_seconds(nbytes: int, bandwidth_gbps: float) -> float:
    """The physical floor of a refresh: its bytes moved once at the measured bandwidth."""
    return nbytes / (bandwidth_gbps * 1e9)


def adapter_model(model_path: str, rank: int, seed: int = 0, target_modules="all-linear",
                  dtype: str = "float32", device: str = "cpu"):
    """A trainer-side PEFT model with a rank-`rank` LoRA on `target_modules` and a non-zero lora_B
    (seeded noise), i.e. an adapter of the size a trained one has."""
    from peft import LoraConfig

    from .models import load_model, with_lora
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules, lora_dropout=0.0, bias="none")
    model = with_lora(load_model(model_path, dtype, device), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.01)
    return model.eval()


def _drop_adapter(engine, name: str) -> None:
    try:
        engine.unload_adapter(name)
    except AdapterNotLoaded:
        pass


def measure_refresh(engine, peft_model, mode: str, bucket_mb: float, repeats: int = 3, warmup: int = 1,
                    adapter_name: str = "bench") -> dict:
    """Median refresh of `peft_model`'s adapter into `engine` by `mode` at `bucket_mb` (one row),
    the policy's snapshot (LoRA layers -> one flat adapter) included as the part `snapshot`.

    Like the policy, it makes the model's LoRA weights views of one flat buffer (LoraLayers with
    flatten=True), which re-binds them: pass a scratch model (`adapter_model`), not a live trainer's,
    whose optimizer would lose its parameters."""
    from .policy import LoraLayers
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one timed refresh")
    layers = LoraLayers(peft_model, flatten=True)  # as the policy keeps them
    refresher = make_refresher(refresh_settings(mode, bucket_mb), engine, adapter_name,
                               base_weights=base_weights(peft_model) if mode == "merged" else None)
    records, first_requests = [], []
    try:
        for version in range(warmup + repeats):
            clock = Clock()
            adapter = layers.snapshot(version)   # the trainer side of a refresh: part of its time
            snapshot_s = clock.lap("snapshot")
            record = refresher.refresh(adapter)
            record.parts = {"snapshot": snapshot_s, **record.parts}
            clock.lap("refresh")
            engine.generate([FIRST_REQUEST], Sampling(max_new_tokens=1, temperature=0.0), refresher.serving_adapter)
            if version >= warmup:
                records.append(record)
                first_requests.append(clock.lap("first_request"))
    finally:
        refresher.close()
        if mode != "merged":
            _drop_adapter(engine, adapter_name)
    median = sorted(records, key=lambda r: r.total_s)[(len(records) - 1) // 2]  # the lower median
    return {"engine": getattr(engine, "name", type(engine).__name__), "device": str(getattr(engine, "device", "")),
            "mode": mode, "rank": int(peft_model.peft_config["default"].r), "bucket_mb": bucket_mb,
            "bytes": median.nbytes, "buckets": len(median.buckets), "parts": dict(median.parts),
            "total_s": median.total_s, "min_s": min(r.total_s for r in records),
            "first_request_s": statistics.median(first_requests), "repeats": repeats}


def save_results(path: str | Path, rows: list[dict], bandwidth_gbps: float, **meta) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"kind": "refresh_sweep", "bandwidth_gbps": bandwidth_gbps, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M"), **meta, "rows": rows}
    path.write_text(json.dumps(payload, indent=1))
    return path


def load_results(path: str | Path) -> dict | None:
    """A refresh-sweep file (as `save_results` writes it), or None if the file is something else."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("kind") != "refresh_sweep":
        return None
    return data


def engine_label(engine) -> str:
    """Which engine and device produced a measurement, for figure titles."""
    device = str(getattr(engine, "device", "cpu"))
    where = "CPU" if device == "cpu" else (torch.cuda.get_device_name() if torch.cuda.is_available() else device)
    if getattr(engine, "name", "") == "hf":
        return f"hf engine, {where} (not SGLang)"
    return f"{getattr(engine, 'name', type(engine).__name__)} engine, {where}"
