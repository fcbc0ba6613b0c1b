"""What this machine holds: its memory (a container's limit included), for size checks."""
from __future__ import annotations

import os
from pathlib import Path


def machine_memory(device: str) -> tuple[int, str]:
    """(bytes, what): the host's memory (or its cgroup limit), plus the GPU's for a CUDA device: the
    terms are not split by where they live, so the bound is the machine's whole memory."""
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
