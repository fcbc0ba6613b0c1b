"""A rollout engine: a small core every engine implements, plus optional capabilities checked once
(`require`), never by the engine's name. Semantics are SGLang's:
- `adapter=None` runs the base model; a request is adapted only if it names an adapter;
- loading a loaded name raises `AdapterAlreadyLoaded`; unloading one not loaded raises `AdapterNotLoaded`
  (a refresh's first unload: callers catch it exactly);
- log-probs are of the sampling distribution (logits / temperature, before top-p);
- an adapter's version (its policy step) is written by the call that writes its weights, so a failed write
  cannot bump it; `served_version(None)` is the base weights' (a merged refresh overwrites them).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..adapters import FlatAdapter


SERVED = "how rollouts are served; the adapter is the same"


@dataclass(frozen=True)
class EngineNeeds:
    """What a run asks of its engine, derived by the session from the other sections."""
    lora_rank: int = 16
    target_modules: str | tuple[str, ...] = "all-linear"
    largest_batch: int = 0      # 0: not known (the engine's own default then)
    seed: int = 0
    model_dtype: str = "float32"
    adapters: int = 1           # adapters served side by side (a policy group: one per policy)
    max_new_tokens: int = 48    # the longest completion it will be asked for
    in_place: bool = True       # the adapter may be written in place (refresh.mode=inplace, or no run)
    samples_ahead: bool = False # the next step's rollouts are sampled while this one trains (grpo.max_staleness)


class EngineError(RuntimeError):
    """The engine refused a call; the message carries the engine's own error text."""


class AdapterNotLoaded(EngineError):
    """Unload (or generate) named an adapter the engine does not have."""


class AdapterAlreadyLoaded(EngineError):
    """Load named an adapter that is already loaded; unload it first."""


class StaleAdapter(EngineError):
    """A rollout was served by another adapter version than the trainer's."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 48
    temperature: float = 1.0   # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None    # per-call seed for reproducible sampling where the engine supports it


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]       # generated tokens, the stop token included if one was produced
    logprobs: list[float]      # one per generated token, under the sampling distribution
    finish_reason: str         # 'stop' | 'length'


@runtime_checkable
class RolloutEngine(Protocol):
    """The core: generate, score, load and unload adapters by name, report their versions."""
    name: str
    device: str
    max_lora_rank: int | None          # the largest rank the engine can hold (None: no limit)
    adapter_dtype: torch.dtype | None  # the dtype the engine keeps adapters in (None: as sent)

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, adapter: str | None) -> list[Completion]: ...
    def score(self, sequences: list[list[int]], prompt_lens: list[int], adapter: str | None,
              temperature: float = 1.0) -> list[torch.Tensor]:
        """Log-probs of sequences[i][prompt_lens[i]:] given the tokens before them."""

    def load_adapter(self, name: str, path: Path, version: int = 0) -> None: ...
    def load_adapter_tensors(self, name: str, adapter: FlatAdapter) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def loaded_adapters(self) -> list[str]: ...
    def served_version(self, adapter: str | None) -> int | None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class GenerateRequest:
    """One caller's part of a mixed batch: its prompts, its sampling, the adapter it names."""
    prompt_ids: list[list[int]]
    sampling: Sampling
    adapter: str | None


@runtime_checkable
class GeneratesMixed(Protocol):
    """Serve several requests, each with its own adapter and sampling, as one batch."""

    def generate_mixed(self, requests: list[GenerateRequest]) -> list[list[Completion]]:
        """The completions of each request, in order; as if each were generate(*request)."""


def generate_each(engine, requests: list[GenerateRequest]) -> list[list[Completion]]:
    """The requests as one batch where the engine can (GeneratesMixed), else one after the other."""
    if isinstance(engine, GeneratesMixed):
        return engine.generate_mixed(list(requests))
    return [engine.generate(r.prompt_ids, r.sampling, r.adapter) for r in requests]


def generate_served(engine, prompt_ids: list[list[int]], sampling: Sampling, adapter: str | None):
    """(completions, the version that served them): in one call where the engine has it (no write can
    come between), else generate then served_version (an engine nobody writes to meanwhile)."""
    if hasattr(engine, "generate_served"):
        return engine.generate_served(prompt_ids, sampling, adapter)
    return engine.generate(prompt_ids, sampling, adapter), engine.served_version(adapter)


@runtime_checkable
class UpdatesAdapterInPlace(Protocol):
    """Overwrite a loaded adapter's values where the engine keeps them: no unload, no reload."""

    def update_adapter_in_place(self, name: str, adapter: FlatAdapter) -> dict[str, float]:
        """Same names, shapes and LoRA config as loaded; returns the engine's own timings in ms."""


@runtime_checkable
class PushesWeights(Protocol):
    """Overwrite base weights by plain-model name (the merged-refresh baseline)."""

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True,
                       version: int | None = None) -> None: ...


@runtime_checkable
class ReleasesMemory(Protocol):
    """Give GPU memory back while the trainer runs; resume exactly what was released."""

    def release_memory(self, tags: list[str]) -> None: ...
    def resume_memory(self) -> None: ...


def require(engine, capability: type, who: str) -> None:
    """Refuse once, up front, an engine that lacks a capability `who` needs."""
    if not isinstance(engine, capability):
        raise EngineError(f"{who} needs an engine that {capability.__doc__.splitlines()[0].rstrip('.').lower()} "
                          f"({capability.__name__}); the {getattr(engine, 'name', type(engine).__name__)} engine "
                          f"cannot. Pick another refresh.mode or engine.backend")


def check_new(name: str, loaded) -> None:
    if name in loaded:
        raise AdapterAlreadyLoaded(f"adapter {name!r} is already loaded; unload it before loading again")


def check_loaded(name: str, loaded, why: str = "") -> None:
    if name not in loaded:
        raise AdapterNotLoaded(f"adapter {name!r} is not loaded (loaded: {sorted(loaded)}){why}")


IN_PLACE_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")


def check_same_lora_config(name: str, loaded: dict, new: dict) -> None:
    """An in-place update keeps the engine's scaling and layout: refuse a config that changes them."""
    changed = [k for k in IN_PLACE_KEYS if loaded.get(k) != new.get(k)]
    if changed:
        what = ", ".join(f"{k}: {loaded.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise EngineError(f"in-place update of adapter {name!r} changes {what}; an in-place update keeps the "
                          f"loaded config. Unload and load the adapter (refresh.mode=tensor) to change it")
