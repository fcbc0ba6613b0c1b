"""Wall time of named parts, each read after the GPU's queued work, so GPU work counts in the part issuing it."""
from __future__ import annotations

import time

import torch


def synced_time() -> float:
    """perf_counter after the GPU's queued work, if this process uses CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


class Clock:
    """Adds the time since the last lap to `parts[part]` (a dict it may share with a record)."""

    def __init__(self, parts: dict[str, float] | None = None):
        self.parts = {} if parts is None else parts
        self.start = self.last = synced_time()

    def lap(self, part: str) -> float:
        now = synced_time()
        seconds, self.last = now - self.last, now
        self.parts[part] = self.parts.get(part, 0.0) + seconds
        return seconds

    def add(self, part: str, seconds: float) -> None:
        """A part timed elsewhere, before this clock started (a policy group's shared rollout): in the total."""
        self.parts[part] = self.parts.get(part, 0.0) + seconds
        self.start -= seconds

    @property
    def total(self) -> float:
        return self.last - self.start
