"""Refresh strategies: move the trainer's current adapter into the engine after an optimizer step,
timing each part. One small class per mode:

    FileRefresh     write a PEFT dir (atomic, 0600, tmpfs when available) -> unload -> load by path
    TensorRefresh   stage tensors on the engine's device in buckets -> unload -> load from tensors
    InPlaceRefresh  the first refresh loads like TensorRefresh; later ones write the new values into
                    the engine's resident copy of that adapter (SGLang: its GPU LoRA pool, through a
                    loader running inside the engine; hf: the PEFT parameters), no unload or reload
    MergedRefresh   W + (a/r)BA for every layer -> push full weights in buckets (no cache flush
                    until the last bucket) -> the engine then serves the base name, adapter-free
    NoRefresh       the stale-adapter control: the first adapter is loaded once and never updated

Snapshots are taken by adapters.FlatSnapshotter: every LoRA tensor copied into one flat buffer with a
single NaN/Inf check (one device sync), and cast once to the engine's dtype (`transfer_dtype`) for
what the engine receives; the trainer-dtype snapshot is what the step record keeps.

Every refresh returns a RefreshRecord (one row for the run's sync.jsonl per bucket and a total).
Only `AdapterNotLoaded` is caught on unload (the first refresh has nothing to unload); any other
engine error propagates with the engine's message.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .adapters import AdapterSnapshot, FlatSnapshotter, merged_state_dict, remove_stale_temps
from .engines.base import AdapterNotLoaded
from .models import DTYPES


@dataclass
class RefreshRecord:
    mode: str
    step: int
    nbytes: int = 0
    parts: dict[str, float] = field(default_factory=dict)   # part -> seconds
    buckets: list[dict] = field(default_factory=list)       # one row per bucket
    snapshot: AdapterSnapshot | None = field(default=None, repr=False)  # what was sent (trainer reuses it)

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())

    def rows(self) -> list[dict]:
        """sync.jsonl rows: each bucket, then the refresh total."""
        total = {"step": self.step, "mode": self.mode, "row": "refresh", "bytes": self.nbytes,
                 "buckets": len(self.buckets), "total_s": self.total_s, **{f"{k}_s": v for k, v in self.parts.items()}}
        return [{"step": self.step, "mode": self.mode, "row": "bucket", **b} for b in self.buckets] + [total]


def pack_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Sort by name and pack greedily into buckets of at most `bucket_bytes`; a tensor larger than
    a bucket travels alone. Every tensor lands in exactly one bucket."""
    buckets, current, size = [], [], 0
    for name, tensor in sorted(named, key=lambda kv: kv[0]):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


class _Clock:
    """Wall-clock parts; synchronises CUDA before each reading so GPU work is counted."""

    def __init__(self, record: RefreshRecord):
        self.record = record
        self.cuda = torch.cuda.is_available()
        self.t = self.now()

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, part: str) -> float:
        t = self.now()
        dt, self.t = t - self.t, t
        self.record.parts[part] = self.record.parts.get(part, 0.0) + dt
        return dt


def _unload_if_loaded(engine, name: str) -> None:
    try:
        engine.unload_adapter(name)
    except AdapterNotLoaded:  # the first refresh: nothing loaded yet, the one benign case
        pass


def adapter_tmp_root(configured: str = "") -> Path:
    """A private (0700) dir for adapter files: tmpfs (/dev/shm) when writable, else the temp dir.
    Named `lorabench-adapters-<pid>-*`: roots left by killed processes (on tmpfs they hold RAM)
    are removed here, when the next refresher starts."""
    parent = configured or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    remove_stale_temps(Path(parent), ("lorabench-adapters-",))
    return Path(tempfile.mkdtemp(prefix=f"lorabench-adapters-{os.getpid()}-", dir=parent))


class Refresher:
    mode = "base"

    def __init__(self, engine, adapter_name: str, bucket_mb: float = 64.0, max_rank: int | None = None,
                 transfer_dtype: torch.dtype | None = None):
        self.engine, self.adapter_name = engine, adapter_name
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.max_rank = max_rank
        self.transfer_dtype = transfer_dtype  # what the engine receives; None = the trainer's dtype
        self.refreshes = 0
        self._snapshotter: FlatSnapshotter | None = None

    @property
    def serving_adapter(self) -> str | None:
        """The adapter name rollouts must pass: the refreshed adapter (None for merged weights)."""
        return self.adapter_name

    def refresh(self, peft_model, step: int) -> RefreshRecord:
        record = RefreshRecord(self.mode, step)
        self._refresh(peft_model, record)
        self.refreshes += 1
        return record

    def _snapshot(self, peft_model, record: RefreshRecord) -> AdapterSnapshot:
        """Validated (structure once, values every time) before the engine sees anything."""
        if self._snapshotter is None or self._snapshotter.model is not peft_model:
            self._snapshotter = FlatSnapshotter(peft_model, max_rank=self.max_rank)
        snapshot = self._snapshotter.snapshot(record.step)
        record.snapshot = snapshot
        return snapshot

    def _stage(self, snapshot: AdapterSnapshot, device, record: RefreshRecord, clock: "_Clock"):
        """(views, buffer): the snapshot in the transfer dtype on `device`, as views of one new flat buffer filled
        bucket by bucket (a bucket is a run of whole tensors, packed by pack_buckets; the names are
        sorted, so each bucket is one contiguous range); one record row per bucket."""
        src = snapshot.flat if snapshot.flat is not None else torch.cat(
            [snapshot.tensors[n].reshape(-1) for n in sorted(snapshot.tensors)])
        to_host = torch.device(device).type == "cpu" and src.is_cuda  # pinned: ~20x faster device->host
        out = torch.empty(src.numel(), dtype=self.transfer_dtype or src.dtype, device=device, pin_memory=to_host)
        views = self._snapshotter.views(out)
        start = 0
        for i, bucket in enumerate(pack_buckets(list(views.items()), self.bucket_bytes)):
            n = sum(t.numel() for _, t in bucket)
            out[start:start + n].copy_(src[start:start + n], non_blocking=True)
            record.buckets.append({"bucket": i, "tensors": len(bucket), "bytes": n * out.element_size(),
                                   "seconds": clock.lap("stage")})
            start += n
        record.nbytes = out.numel() * out.element_size()
        return views, out

    def close(self) -> None:
        pass


class FileRefresh(Refresher):
    mode = "file"

    def __init__(self, *args, tmp_dir: str = "", **kw):
        super().__init__(*args, **kw)
        self.root = adapter_tmp_root(tmp_dir)
        self._previous: Path | None = None

    def _refresh(self, peft_model, record):
        clock = _Clock(record)
        snapshot = self._snapshot(peft_model, record)
        clock.lap("snapshot")
        host, flat = self._stage(snapshot, "cpu", record, clock)  # one device->host copy, engine dtype
        out = AdapterSnapshot(host, snapshot.config, record.step, flat=flat)
        path = out.save_peft_dir(self.root / f"{self.adapter_name}-{record.step:06d}")
        clock.lap("write")
        _unload_if_loaded(self.engine, self.adapter_name)
        clock.lap("unload")
        try:
            self.engine.load_adapter(self.adapter_name, path)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)  # the engine refused it: nothing references it
            raise
        clock.lap("load")
        if self._previous not in (None, path):  # the engine has read the new dir; the old one can go
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


class TensorRefresh(Refresher):
    mode = "tensor"

    def __init__(self, *args, device: str | None = None, **kw):
        super().__init__(*args, **kw)
        # CUDA-IPC needs GPU tensors: a CPU tensor would fail (or be copied) inside the engine
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")

    def _refresh(self, peft_model, record):
        clock = _Clock(record)
        snapshot = self._snapshot(peft_model, record)
        clock.lap("snapshot")
        staged, _ = self._stage(snapshot, self.device, record, clock)
        _unload_if_loaded(self.engine, self.adapter_name)
        clock.lap("unload")
        self.engine.load_adapter_tensors(self.adapter_name, staged, snapshot.config)
        clock.lap("load")


class InPlaceRefresh(TensorRefresh):
    """Load once, then overwrite the engine's resident copy of the adapter in place: no unload, no
    reload, no host round trip. The engine keeps the adapter's name, slot and scaling, so the LoRA
    config (rank, alpha, target modules) must stay the same; a changed config is refused by the
    engine and a full TensorRefresh is the way to change it."""
    mode = "inplace"

    def _refresh(self, peft_model, record):
        if self.adapter_name not in self.engine.loaded_adapters():
            return super()._refresh(peft_model, record)  # the first load (or after an engine restart)
        clock = _Clock(record)
        snapshot = self._snapshot(peft_model, record)
        clock.lap("snapshot")
        staged, _ = self._stage(snapshot, self.device, record, clock)
        self.engine.update_adapter_in_place(self.adapter_name, staged, snapshot.config)
        clock.lap("write")


class MergedRefresh(Refresher):
    mode = "merged"

    @property
    def serving_adapter(self) -> str | None:
        return None  # the engine's base weights *are* the policy now

    def _refresh(self, peft_model, record):
        clock = _Clock(record)
        self._snapshot(peft_model, record)  # validate (NaN/Inf, shapes) before any weight is pushed
        merged = merged_state_dict(peft_model)
        clock.lap("merge")
        buckets = pack_buckets(list(merged.items()), self.bucket_bytes)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            self.engine.update_weights(bucket, flush_cache=last)  # flush once, after the last bucket
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            record.nbytes += nbytes
            record.buckets.append({"bucket": i, "tensors": len(bucket), "bytes": nbytes,
                                   "seconds": clock.lap("push")})


class NoRefresh(TensorRefresh):
    """Stale-adapter control: load the first adapter, then never update the engine again."""
    mode = "none"

    def refresh(self, peft_model, step):
        if self.refreshes == 0:
            record = super().refresh(peft_model, step)
            record.mode = self.mode
            return record
        return RefreshRecord(self.mode, step)


def make_refresher(cfg, engine) -> Refresher:
    r = cfg.refresh
    # SGLang's LoRA pool has a fixed max rank (engine.max_lora_rank, 0 = lora.r); the hf engine has none
    sglang = cfg.engine.backend == "sglang"
    max_rank = (cfg.engine.max_lora_rank or cfg.lora.r) if sglang else None
    # SGLang keeps adapters in its own dtype: send that (half the bytes of fp32); the hf engine gets
    # the trainer's dtype, so its weights equal the trainer's exactly
    dtype = DTYPES.get(cfg.engine.dtype) if sglang else None  # None for 'auto'
    common = dict(bucket_mb=r.bucket_mb, max_rank=max_rank, transfer_dtype=dtype)
    name = cfg.engine.adapter_name
    if r.mode == "file":
        return FileRefresh(engine, name, tmp_dir=r.tmp_dir, **common)
    if r.mode == "merged":
        return MergedRefresh(engine, name, **common)
    cls = {"tensor": TensorRefresh, "inplace": InPlaceRefresh, "none": NoRefresh}[r.mode]
    return cls(engine, name, device=getattr(engine, "device", None), **common)
