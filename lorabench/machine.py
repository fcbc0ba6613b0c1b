"""What this machine holds: its memory (a container's limit included), for size checks."""
from __future__ import annotations

import os
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
    """run.threads resolved: (torch CPU threads, how they were chosen); 0 = auto: torch's default less the
    busy CPUs, at least 1 (threads waiting on each other lose more to a busy core than one too few)."""
    import torch
    if not _TORCH_DEFAULT_THREADS:
        _TORCH_DEFAULT_THREADS.append(torch.get_num_threads())
    if setting > 0:
        return setting, f"{setting} (run.threads)"
    default = _TORCH_DEFAULT_THREADS[0]
    load = os.getloadavg()[0]
    threads = max(1, min(default, len(os.sched_getaffinity(0)) - round(load)))
    return threads, (f"{threads} (run.threads=0, auto: torch's default {default} less the CPUs busy by the "
                     f"1-minute load average, {load:.2f})")
