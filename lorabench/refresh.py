"""Refresh modes: move the step's flat adapter into the engine after an optimizer step, timing each part.

    file      write a PEFT dir (atomic, 0600, tmpfs when available) -> unload -> load by path
    tensor    stage the buffer on the engine's device in buckets -> unload -> load from tensors
    inplace   load once like `tensor`, then overwrite the engine's resident copy (no unload or reload)
    merged    push W + (a/r)BA of every adapted layer in buckets; the engine then serves the base name
    none      the stale-adapter control: the first adapter is loaded once and never updated

A mode is a Refresher subclass plus its line in REFRESH_MODES (`needs`: engine capabilities it uses;
`Settings`: its `refresh.<mode>` section, whose fields reach __init__ as keywords; `takes_base_weights`).
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from .adapters import FlatAdapter, merge_weights
from .clock import Clock
from .engines.base import AdapterNotLoaded, PushesWeights, UpdatesAdapterInPlace, require
from .safedir import remove_stale_temps
from .settings import ALLOWED, Section, check, setting

_HOW = "how the adapter reaches the engine; what it serves is the same"


@dataclass
class RefreshSettings(Section):
    """The `refresh` section; one sub-section per mode with settings of its own (`refresh.file`)."""
    mode: str = setting("tensor", "How the adapter reaches the engine after each step: one of "
                        "lorabench.refresh.REFRESH_MODES, each listed with its help in --help-config "
                        "(docs/results.md compares them).", resume=ALLOWED,
                        why=f"{_HOW} (not to or from 'none', whose engine serves a stale adapter)")
    bucket_mb: float = setting(64.0, "Bucket size in MB: the adapter is staged in buckets of this size, and a merged "
                               "push sends one engine call per bucket (larger buckets: fewer calls, more peak "
                               "memory; docs/results.md).", resume=ALLOWED, why=_HOW)

    @classmethod
    def parts(cls) -> dict[str, type]:
        return {mode: c.Settings for mode, c in REFRESH_MODES.items() if c.Settings is not None}

    def problems(self) -> list[str]:
        return [*check(self.mode in REFRESH_MODES, f"refresh.mode={self.mode!r}: use one of {sorted(REFRESH_MODES)}"),
                *check(0 < self.bucket_mb <= 2**20, f"refresh.bucket_mb={self.bucket_mb}: must be in (0, 1048576] "
                       f"(e.g. 64; 1048576 MB = 1 TiB, more than any model's weights, is one bucket for everything)")]


@dataclass
class FileSettings(Section):
    tmp_dir: str = setting("", "Where file refresh writes adapter dirs; '' = /dev/shm if writable, else the "
                           "system temp dir.", resume=ALLOWED, why="where file refresh writes", writes="dir")


@dataclass
class RefreshRecord:
    mode: str
    version: int                                            # the adapter version sent
    nbytes: int = 0
    parts: dict[str, float] = field(default_factory=dict)   # part -> seconds
    buckets: list[dict] = field(default_factory=list)       # one row per bucket
    engine_ms: dict[str, float] = field(default_factory=dict)  # the engine's own timings, where it reports them

    @property
    def total_s(self) -> float:
        return sum(self.parts.values())

    def rows(self, step: int) -> list[dict]:
        """sync.jsonl rows: each bucket, then the refresh total."""
        total = {"step": step, "mode": self.mode, "row": "refresh", "version": self.version, "bytes": self.nbytes,
                 "buckets": len(self.buckets), "total_s": self.total_s, **{f"{k}_s": v for k, v in self.parts.items()}}
        return [{"step": step, "mode": self.mode, "row": "bucket", **b} for b in self.buckets] + [total]


def pack_buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Sort by name and pack greedily into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
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


def adapter_tmp_root(configured: str = "") -> Path:
    """A private (0700) dir for adapter files: /dev/shm when writable, else the temp dir; roots left by killed
    processes (`lorabench-adapters-<pid>-*`) are removed first."""
    parent = configured or ("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    remove_stale_temps(Path(parent), ("lorabench-adapters-",))
    return Path(tempfile.mkdtemp(prefix=f"lorabench-adapters-{os.getpid()}-", dir=parent))


class Refresher:
    mode: ClassVar[str] = ""
    help: ClassVar[str] = ""
    needs: ClassVar[tuple[type, ...]] = ()                 # optional engine capabilities it uses
    release_tags: ClassVar[tuple[str, ...]] = ("kv_cache",)  # engine memory it can spare during training
    keeps_engine_fresh: ClassVar[bool] = True              # False only for the stale control
    Settings: ClassVar[type | None] = None                 # its own section, refresh.<mode>
    takes_base_weights: ClassVar[bool] = False             # writes the engine's base weights from the trainer's

    def __init__(self, engine, adapter_name: str, bucket_mb: float = 64.0):
        for capability in self.needs:
            require(engine, capability, f"refresh.mode={self.mode}")
        self.engine, self.adapter_name = engine, adapter_name
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.refreshes = 0

    @classmethod
    def from_settings(cls, engine, adapter_name: str, settings: RefreshSettings, own=None, base_weights=None):
        """From the refresh section, the mode's own sub-section (each field an __init__ keyword), base weights."""
        kwargs = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)} if own is not None else {}
        if cls.takes_base_weights:
            kwargs["base_weights"] = base_weights
        return cls(engine, adapter_name, settings.bucket_mb, **kwargs)

    @property
    def serving_adapter(self) -> str | None:
        """The adapter name rollouts must pass: the refreshed adapter (None for merged weights)."""
        return self.adapter_name

    def refresh(self, adapter: FlatAdapter) -> RefreshRecord:
        """Move `adapter` into the engine; it was checked finite and validated by the policy."""
        record = RefreshRecord(self.mode, adapter.version)
        self._refresh(adapter, record)
        self.refreshes += 1
        return record

    def _refresh(self, adapter: FlatAdapter, record: RefreshRecord) -> None:
        raise NotImplementedError

    def engine_memory_resumed(self, tags: list[str]) -> None:
        """The engine released `tags` for the update and took them back: lost state is re-sent next refresh."""

    def _stage(self, adapter: FlatAdapter, device, record: RefreshRecord, clock: Clock) -> FlatAdapter:
        """The adapter in the engine's dtype on `device`, copied bucket by bucket (one record row each)."""
        src = adapter.buffer
        to_host = torch.device(device).type == "cpu" and src.is_cuda
        out = torch.empty(src.numel(), dtype=self.engine.adapter_dtype or src.dtype, device=device, pin_memory=to_host)
        start = 0
        for i, bucket in enumerate(pack_buckets(list(adapter.tensors.items()), self.bucket_bytes)):
            n = sum(t.numel() for _, t in bucket)
            out[start:start + n].copy_(src[start:start + n], non_blocking=True)
            record.buckets.append({"bucket": i, "tensors": len(bucket), "bytes": n * out.element_size(),
                                   "seconds": clock.lap("stage")})
            start += n
        record.nbytes = out.numel() * out.element_size()
        return FlatAdapter(out, adapter.layout, adapter.config, adapter.version)

    def close(self) -> None:
        pass


class FileRefresh(Refresher):
    mode = "file"
    help = "write a PEFT dir (tmpfs when available), unload, load by path"
    Settings = FileSettings

    def __init__(self, engine, adapter_name: str, bucket_mb: float = 64.0, tmp_dir: str = ""):
        super().__init__(engine, adapter_name, bucket_mb)
        self.root = adapter_tmp_root(tmp_dir)
        self._previous: Path | None = None

    def _refresh(self, adapter, record):
        clock = Clock(record.parts)
        host = self._stage(adapter, "cpu", record, clock)  # one device->host copy, engine dtype
        path = host.save_peft_dir(self.root / f"{self.adapter_name}-{record.version:06d}")
        clock.lap("write")
        with suppress(AdapterNotLoaded):   # the first refresh: nothing loaded yet
            self.engine.unload_adapter(self.adapter_name)
        clock.lap("unload")
        try:
            self.engine.load_adapter(self.adapter_name, path, version=adapter.version)
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
    help = "stage tensors on the engine's device in buckets, unload, load_lora_adapter_from_tensors"

    def _refresh(self, adapter, record):
        clock = Clock(record.parts)
        # CUDA-IPC needs GPU tensors: a CPU tensor would fail (or be copied) inside the engine
        staged = self._stage(adapter, self.engine.device, record, clock)
        with suppress(AdapterNotLoaded):
            self.engine.unload_adapter(self.adapter_name)
        clock.lap("unload")
        self.engine.load_adapter_tensors(self.adapter_name, staged)
        clock.lap("load")


class InPlaceRefresh(TensorRefresh):
    """Load once, then overwrite the engine's resident copy in place (the LoRA config must stay the same)."""
    mode = "inplace"
    help = "load once, then write new values into the engine's resident adapter (SGLang: its GPU LoRA pool)"
    needs = (UpdatesAdapterInPlace,)

    def _refresh(self, adapter, record):
        if self.adapter_name not in self.engine.loaded_adapters():
            return super()._refresh(adapter, record)  # the first load (or after an engine restart)
        clock = Clock(record.parts)
        record.nbytes = adapter.nbytes
        record.engine_ms = self.engine.update_adapter_in_place(self.adapter_name, adapter)
        clock.lap("write")


class MergedRefresh(Refresher):
    mode = "merged"
    help = "merge W + (alpha/r)BA and push full weights in buckets (the full-weight baseline)"
    needs = (PushesWeights,)
    release_tags = ("kv_cache", "weights")  # every weight is pushed again after resume
    takes_base_weights = True

    def __init__(self, engine, adapter_name: str, bucket_mb: float = 64.0, base_weights=None):
        super().__init__(engine, adapter_name, bucket_mb)
        if base_weights is None:
            raise ValueError("refresh.mode=merged needs the trainer's base weights (base_weights=...)")
        self.base_weights = base_weights
        self._push_every_weight = True   # on the first push (an earlier run may have merged others), after a release

    @property
    def serving_adapter(self) -> str | None:
        return None  # the engine's base weights *are* the policy now

    def engine_memory_resumed(self, tags):
        if "weights" in tags:
            self._push_every_weight = True   # released weights come back with undefined contents

    def _refresh(self, adapter, record):
        clock = Clock(record.parts)
        merged = merge_weights(self.base_weights, adapter, adapted_only=not self._push_every_weight)
        clock.lap("merge")
        buckets = pack_buckets(list(merged.items()), self.bucket_bytes)
        for i, bucket in enumerate(buckets):
            last = i == len(buckets) - 1
            # flush once, after the last bucket; the version moves with the last weights written
            self.engine.update_weights(bucket, flush_cache=last, version=adapter.version if last else None)
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            record.nbytes += nbytes
            record.buckets.append({"bucket": i, "tensors": len(bucket), "bytes": nbytes, "seconds": clock.lap("push")})
        self._push_every_weight = False   # only after every bucket arrived


class NoRefresh(TensorRefresh):
    mode = "none"
    help = "the stale-adapter control: load the first adapter once, never update it"
    keeps_engine_fresh = False

    def refresh(self, adapter):
        if self.refreshes == 0:
            return super().refresh(adapter)
        return RefreshRecord(self.mode, adapter.version)


REFRESH_MODES: dict[str, type[Refresher]] = {cls.mode: cls for cls in
                                             (FileRefresh, TensorRefresh, InPlaceRefresh, MergedRefresh, NoRefresh)}


def refresh_settings(mode: str, bucket_mb: float = 64.0, **own) -> RefreshSettings:
    """The refresh section for `mode` with its own settings (`own`, e.g. tmp_dir), without a run config."""
    if mode not in REFRESH_MODES:
        raise ValueError(f"refresh.mode={mode!r}: use one of {sorted(REFRESH_MODES)}")
    settings = RefreshSettings(mode=mode, bucket_mb=bucket_mb)
    part = REFRESH_MODES[mode].Settings
    if own:
        if part is None:
            raise ValueError(f"refresh.mode={mode!r} has no settings of its own; got {sorted(own)}")
        settings.subsections[mode] = part(**own)
    return settings


def make_refresher(settings: RefreshSettings | str, engine, adapter_name: str, base_weights=None) -> Refresher:
    """The refresher `settings` (the refresh section, or a mode's name) chooses, built from its own settings."""
    if isinstance(settings, str):
        settings = refresh_settings(settings)
    return REFRESH_MODES[settings.mode].from_settings(engine, adapter_name, settings,
                                                      settings.subsections.get(settings.mode), base_weights)
