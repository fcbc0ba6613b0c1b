"""Refresh latency per method, bucket size and LoRA rank on a real engine, beside the physical floor:
the bytes moved once at the measured copy bandwidth (notebook 02, benchmarks/refresh_sweep.py).

A row (`measure_refresh`) summarises `repeats` refreshes after `warmup` untimed ones, with one torch thread
unless told otherwise: {"engine", "device", "mode", "rank", "bucket_mb", "repeats", "threads", "bytes",
"buckets", "parts": {part: s}, "total_s", "min_s", "first_request_s", "end_to_end_s", "samples": every
repeat's "total_s", "first_request_s", "end_to_end_s" and "parts"}. `bytes`, `buckets`, `parts` and
`total_s` are the lower median call's; `first_request_s` is the median request after a refresh (one
greedy token), `end_to_end_s` of call + request. Parts: the policy's `snapshot`, then the refresher's.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import statistics
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from .adapters import base_weights
from .clock import Clock
from .engines.base import AdapterNotLoaded, Sampling
from .refresh import REFRESH_MODES, make_refresher, pack_buckets, refresh_settings

MODES = tuple(m for m, cls in REFRESH_MODES.items() if cls.keeps_engine_fresh)   # every mode but the stale control
FIRST_REQUEST = list(range(10, 42))   # 32 prompt token ids every model's vocabulary has


def measure_bandwidth(device: str = "cpu", megabytes: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s: bytes of one tensor / best time of `dst.copy_(src)` (each byte moved once)."""
    n = megabytes * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)

    def copy() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        return time.perf_counter() - t0
    copy()  # first touch: page faults are not bandwidth
    return n * 4 / min(copy() for _ in range(repeats)) / 1e9


def floor_seconds(nbytes: int, bandwidth_gbps: float) -> float:
    """The physical floor of a refresh: its bytes moved once at the measured bandwidth."""
    return nbytes / (bandwidth_gbps * 1e9)


def adapter_model(model_path: str, rank: int, seed: int = 0, target_modules="all-linear",
                  dtype: str = "float32", device: str = "cpu"):
    """A trainer-side PEFT model with a rank-`rank` LoRA and a seeded non-zero lora_B: a trained adapter's size."""
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


@contextmanager
def torch_threads(threads: int | None):
    """torch's CPU thread count set to `threads` inside the block (None: as it is); one thread keeps CPU
    timings steady on a shared machine (torch waits for the last of its threads)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def measure_refresh(engine, peft_model, mode: str, bucket_mb: float, repeats: int = 3, warmup: int = 1,
                    adapter_name: str = "bench", threads: int | None = 1) -> dict:
    """Refreshes of `peft_model`'s adapter into `engine` by `mode` at `bucket_mb` as one row; it re-binds the
    LoRA weights as views of one flat buffer, so pass a scratch model (`adapter_model`), not a trainer's."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: use one of {MODES}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one timed refresh")
    with scratch_refresher(engine, peft_model, mode, bucket_mb, adapter_name) as (layers, refresher), \
            torch_threads(threads) as used:
        records, first_requests = _timed_refreshes(engine, layers, refresher, warmup, repeats)
    return _row(engine, peft_model, mode, bucket_mb, used, records, first_requests)


@contextmanager
def scratch_refresher(engine, peft_model, mode: str, bucket_mb: float, adapter_name: str):
    """(layers, refresher) for `peft_model`'s adapter, its LoRA weights views of one flat buffer as the
    policy keeps them; after the block the refresher is closed and the adapter unloaded."""
    from .policy import LoraLayers
    layers = LoraLayers(peft_model, flatten=True)
    merged = REFRESH_MODES[mode].takes_base_weights   # the adapter is merged into the engine's weights
    refresher = make_refresher(refresh_settings(mode, bucket_mb), engine, adapter_name,
                               base_weights=base_weights(peft_model) if merged else None)
    try:
        yield layers, refresher
    finally:
        refresher.close()
        with suppress(AdapterNotLoaded):
            if not merged:
                engine.unload_adapter(adapter_name)


def _timed_refreshes(engine, layers, refresher, warmup: int, repeats: int, first_version: int = 0):
    """`warmup` untimed then `repeats` timed refreshes (versions from `first_version`), each followed by
    one request (one prompt, one greedy token): (records, first request seconds)."""
    records, first_requests = [], []
    for i in range(warmup + repeats):
        clock = Clock()
        adapter = layers.snapshot(first_version + i)   # the trainer side of a refresh: part of its time
        snapshot_s = clock.lap("snapshot")
        record = refresher.refresh(adapter)
        record.parts = {"snapshot": snapshot_s, **record.parts}
        clock.lap("refresh")
        engine.generate([FIRST_REQUEST], Sampling(max_new_tokens=1, temperature=0.0), refresher.serving_adapter)
        if i >= warmup:
            records.append(record)
            first_requests.append(clock.lap("first_request"))
    return records, first_requests


def _row(engine, peft_model, mode: str, bucket_mb: float, threads: int, records, first_requests: list[float]) -> dict:
    """One row: the settings, the (lower) median refresh's bytes, buckets and parts, every repeat's times."""
    median = sorted(records, key=lambda r: r.total_s)[(len(records) - 1) // 2]
    calls = [r.total_s for r in records]
    ends = [c + f for c, f in zip(calls, first_requests)]
    names = list(dict.fromkeys(p for r in records for p in r.parts))
    return {"engine": getattr(engine, "name", type(engine).__name__), "device": str(getattr(engine, "device", "")),
            "mode": mode, "rank": int(peft_model.peft_config["default"].r), "bucket_mb": bucket_mb,
            "repeats": len(records), "threads": threads, "bytes": median.nbytes, "buckets": len(median.buckets),
            "parts": dict(median.parts), "total_s": median.total_s, "min_s": min(calls),
            "first_request_s": statistics.median(first_requests), "end_to_end_s": statistics.median(ends),
            "samples": {"total_s": calls, "first_request_s": list(first_requests), "end_to_end_s": ends,
                        "parts": {p: [r.parts.get(p, 0.0) for r in records] for p in names}}}


# --- the sweeps of notebook 02 -------------------------------------------------------------------------
def merged_push_tensors(peft_model) -> list[tuple[str, torch.Tensor]]:
    """What a merged refresh pushes after its first: the adapted layers' base weights (views)."""
    from .policy import LoraLayers
    base = base_weights(peft_model)
    return [(f"{m}.weight", base[f"{m}.weight"]) for m in LoraLayers(peft_model).layout.modules]


def push_count(named: list[tuple[str, torch.Tensor]], bucket_mb: float) -> int:
    """The number of engine calls a merged push of `named` takes at `bucket_mb` (the refresher's packing)."""
    return len(pack_buckets(named, int(bucket_mb * 2**20)))


def _smallest_bucket(named, most: int) -> int:
    """The smallest bucket (bytes, >= the smallest tensor) that packs `named` in at most `most` pushes;
    the count never grows with the bucket size, so a bisection finds it."""
    sizes = [t.numel() * t.element_size() for _, t in named]
    fits = range(min(sizes), sum(sizes) + 1)
    return fits[bisect.bisect_left(fits, True, key=lambda size: len(pack_buckets(named, size)) <= most)]


def _round_up(mb: float) -> float:
    """Two significant digits, rounded up (so the bucket still holds what it held)."""
    scale = 10 ** (math.floor(math.log10(mb)) - 1)
    return float(f"{math.ceil(mb / scale - 1e-9) * scale:.2g}")   # the format drops the float's noise


def push_curve(named: list[tuple[str, torch.Tensor]], points: int = 160) -> list[tuple[float, int]]:
    """(bucket MB, pushes of `named`) on a log grid from half the smallest tensor to twice all of them."""
    sizes = [t.numel() * t.element_size() / 2**20 for _, t in named]
    low, high = min(sizes) / 2, 2 * sum(sizes)
    grid = [low * (high / low) ** (i / (points - 1)) for i in range(points)]
    return [(mb, push_count(named, mb)) for mb in grid]


def _reachable_counts(named, points: int) -> dict[int, float]:
    """Push count -> the smallest bucket (MB) reaching it, for at least `points` counts where possible:
    targets spread evenly on a log scale, more of them until enough differ."""
    most, reach, tried = len(named), {}, set()
    for n in range(max(points, 2), 2 * most + 2):
        for i in range(n):
            target = round(most ** (1 - i / (n - 1)))
            if target not in tried:
                tried.add(target)
                exact = _smallest_bucket(named, target) / 2**20
                reach.setdefault(push_count(named, exact), exact)
        if len(reach) >= points:
            break
    return reach


def distinct_push_buckets(named: list[tuple[str, torch.Tensor]], points: int) -> list[float]:
    """Up to `points` bucket sizes (MB, ascending), each giving a different push count of `named`, from
    one tensor per push to one push, even on a log scale; each the smallest reaching its count, rounded
    up to two digits where that keeps the count."""
    reach = _reachable_counts(named, points)
    most, picked = len(named), []
    for i in range(min(points, len(reach))):
        goal = most ** (1 - i / max(points - 1, 1))
        picked.append(min((c for c in reach if c not in picked), key=lambda c: abs(math.log(c / goal))))
    rounded = {count: _round_up(reach[count]) for count in picked}
    return sorted(size if push_count(named, size) == count else reach[count] for count, size in rounded.items())


def measure_many(engine, points: list[tuple], repeats: int, progress=None, threads: int | None = 1) -> list[dict]:
    """measure_refresh for each (peft_model, mode, bucket_mb) in `points`; `progress(done, total)` after each."""
    rows = []
    for model, mode, bucket_mb in points:
        rows.append(measure_refresh(engine, model, mode, bucket_mb, repeats, threads=threads))
        if progress is not None:
            progress(len(rows), len(points))
    return rows


def rank_sweep(engine, model_path: str, ranks, bucket_mb: float, repeats: int, dtype: str = "float32",
               modes=MODES, progress=None, threads: int | None = 1) -> list[dict]:
    """Every mode at every LoRA rank, one scratch model per rank; merged last at each rank (it overwrites
    the engine's base weights: timings stay valid, generations do not). `progress(done, total)` after each."""
    order = sorted(modes, key=lambda m: m == "merged")
    rows = []
    for rank in ranks:
        model = adapter_model(model_path, rank, dtype=dtype, device=str(getattr(engine, "device", "cpu")))
        for mode in order:
            rows.append(measure_refresh(engine, model, mode, bucket_mb, repeats, threads=threads))
            if progress is not None:
                progress(len(rows), len(ranks) * len(order))
        del model
    return rows


def thread_probe(engine, peft_model, thread_counts, repeats: int = 10, progress=None) -> list[dict]:
    """In-place refreshes at each torch thread count, one row per count (as measure_refresh's). The counts
    take turns, one timed refresh per round, so a changing load favours none. `progress` after each round."""
    timed = {n: ([], []) for n in thread_counts}
    with scratch_refresher(engine, peft_model, "inplace", 64.0, "threads") as (layers, refresher):
        with torch_threads(thread_counts[0]):   # untimed: the first refresh loads the adapter
            _timed_refreshes(engine, layers, refresher, warmup=1, repeats=0)
        for round_ in range(repeats):
            for i, n in enumerate(thread_counts):
                with torch_threads(n):
                    new = _timed_refreshes(engine, layers, refresher, 0, 1, 1 + round_ * len(thread_counts) + i)
                for kept, more in zip(timed[n], new):
                    kept.extend(more)
            if progress is not None:
                progress(round_ + 1, repeats)
    return [_row(engine, peft_model, "inplace", 64.0, n, *timed[n]) for n in thread_counts]


def steadiest_threads(rows, tolerance: float = 0.1) -> int:
    """The fewest threads (thread_probe's rows) whose upper quartile end to end is within `tolerance` of the lowest."""
    from .viz import end_to_end_ms, quartiles
    upper = {r["threads"]: quartiles(end_to_end_ms(r))[2] for r in rows}
    best = min(upper.values())
    return min(n for n, q in upper.items() if q <= (1 + tolerance) * best)


def save_results(path: str | Path, rows: list[dict], bandwidth_gbps: float, **meta) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"kind": "refresh_sweep", "bandwidth_gbps": bandwidth_gbps, "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "cpus": os.cpu_count(),
               **meta, "rows": rows}
    path.write_text(json.dumps(payload, indent=1))
    return path


def engine_label(engine) -> str:
    """Which engine and device produced a measurement, for figure titles."""
    device, name = str(getattr(engine, "device", "cpu")), getattr(engine, "name", type(engine).__name__)
    where = "CPU" if device == "cpu" else (torch.cuda.get_device_name() if torch.cuda.is_available() else device)
    return f"hf engine, {where} (not SGLang)" if name == "hf" else f"{name} engine, {where}"


def load_label() -> str:
    """The 1-minute load average and the CPUs this process may use, for a figure's title."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"load average {os.getloadavg()[0]:.1f} on {cpus} CPUs"


def fastest_copy_bandwidth(device: str = "cpu", sizes_mb=(1, 16, 256)) -> tuple[float, int]:
    """(GB/s, MB): the fastest measure_bandwidth over `sizes_mb` with one and the current torch threads (a floor
    must bound every size moved: a copy within the CPU caches runs several times faster)."""
    def bandwidth(mb: int, threads: int) -> float:
        with torch_threads(threads):
            return measure_bandwidth(device, megabytes=mb, repeats=20 if mb <= 16 else 5)
    return max((bandwidth(mb, n), mb) for mb in sizes_mb for n in sorted({1, torch.get_num_threads()}))
