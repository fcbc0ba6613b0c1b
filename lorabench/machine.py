"""What this machine holds: its memory (a container's limit included), for size checks, and its free CPUs."""
from __future__ import annotations

import os
import time
from pathlib import Path


def machine_memory(device: str) -> tuple[int, str]:
    """(bytes, what): the host's memory (or its cgroup limit), plus the GPU's for a CUDA device."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    where = "the memory of this machine"
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = Path(limit_file).read_text().strip() if Path(limit_file).is_file() else ""
        if text.isdigit() and int(text) < host:
            host, where = int(text), "the memory limit of this container (cgroup)"
    if device.startswith("cuda"):
        import torch
        gpu = torch.cuda.get_device_properties(int(device.partition(":")[2] or 0)).total_memory
        return host + gpu, f"{where} plus the GPU memory of {device}"
    return host, where


_TORCH_DEFAULT_THREADS: list[int] = []   # torch's own thread count, read before anything here sets it


def cpu_threads(setting: int) -> tuple[int, str]:
    """run.threads resolved: (torch CPU threads, how they were chosen); 0 = auto: torch's default less the busy
    CPUs (the 1-minute load average, or fewer if /proc/stat shows fewer busy now), at least 1."""
    import torch
    if not _TORCH_DEFAULT_THREADS:
        _TORCH_DEFAULT_THREADS.append(torch.get_num_threads())
    if setting > 0:
        return setting, f"{setting} (run.threads)"
    default, cpus = _TORCH_DEFAULT_THREADS[0], os.sched_getaffinity(0)
    load, now = os.getloadavg()[0], busy_now(cpus)
    busy = load if now is None else min(load, now)
    threads = max(1, min(default, len(cpus) - round(busy)))
    seen = f"the 1-minute load average {load:.2f}" + ("" if now is None else f", {now:.2f} busy in /proc/stat now")
    return threads, f"{threads} (run.threads=0, auto: torch's default {default} less the CPUs busy: {seen})"


def busy_now(cpus: set[int], seconds: float = 0.3) -> float | None:
    """How many of `cpus` other processes keep busy over `seconds` (/proc/stat less this process); None without it."""
    def sample() -> dict[int, list[int]]:
        with open("/proc/stat") as fh:   # "cpuN user nice system idle iowait irq softirq steal ..."
            rows = [line.split() for line in fh if line.startswith("cpu") and line[3].isdigit()]
        return {int(row[0][3:]): [int(x) for x in row[1:9]] for row in rows}
    try:
        before, own = sample(), time.process_time()
        time.sleep(seconds)
        after, own = sample(), time.process_time() - own
    except (OSError, ValueError):
        return None
    busy = 0.0
    for cpu in cpus & before.keys() & after.keys():
        delta = [b - a for a, b in zip(before[cpu], after[cpu])]
        if sum(delta) > 0:
            busy += 1 - (delta[3] + delta[4]) / sum(delta)   # idle and iowait are free
    return max(0.0, busy - own / seconds)
