"""The engine protocol, with SGLang's semantics, that every rollout engine implements.

- A request is adapted only if it names an adapter; `adapter=None` runs the base model.
- Loading a name that is already loaded is an error (`AdapterAlreadyLoaded`): refresh is
  unload, then load.
- Unloading a name that is not loaded raises `AdapterNotLoaded`, the one benign case during a
  refresh (the first refresh has nothing to unload); callers catch exactly that.
- Log-probs are of the sampling distribution (logits / temperature, before top-p), as SGLang
  returns them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


class EngineError(RuntimeError):
    """The engine refused a call; the message carries the engine's own error text."""


class AdapterNotLoaded(EngineError):
    """Unload (or generate) named an adapter the engine does not have."""


class AdapterAlreadyLoaded(EngineError):
    """Load named an adapter that is already loaded; unload it first."""


IN_PLACE_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora")


def check_same_lora_config(name: str, loaded: dict, new: dict) -> None:
    """An in-place update keeps the engine's scaling and layout: refuse a config that changes them."""
    changed = [k for k in IN_PLACE_KEYS if loaded.get(k) != new.get(k)]
    if changed:
        what = ", ".join(f"{k}: {loaded.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise EngineError(f"in-place update of adapter {name!r} changes {what}; an in-place update keeps the "
                          f"loaded config. Unload and load the adapter (refresh.mode=tensor) to change it")


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


class RolloutEngine(Protocol):
    name: str

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, adapter: str | None) -> list[Completion]: ...

    def score(self, sequences: list[list[int]], prompt_lens: list[int], adapter: str | None,
              temperature: float = 1.0) -> list[torch.Tensor]:
        """Log-probs of sequences[i][prompt_lens[i]:] given the tokens before them."""
        ...

    def load_adapter(self, name: str, path: Path) -> None: ...

    def load_adapter_tensors(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def update_adapter_in_place(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Overwrite the values of loaded adapter `name` (same names, shapes and LoRA config)."""
        ...

    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], flush_cache: bool = True) -> None:
        """Overwrite base weights by plain-model name (the merged-refresh baseline)."""
        ...

    def loaded_adapters(self) -> list[str]: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def close(self) -> None: ...
