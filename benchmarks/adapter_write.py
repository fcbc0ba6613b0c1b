"""Why lorabench writes adapter safetensors itself: its writer against `safetensors.torch.save_file`
on the adapter of the 0.6B shape (r=32 on the 7 projections: 392 tensors, 38 MB in bf16).

    python benchmarks/adapter_write.py [--repeats 5] [--dir /dev/shm]

lorabench's adapter is one flat buffer whose tensors are views of it; save_file refuses tensors
that share storage, so it needs a clone of each first. Both files must load to the same tensors.
Writes benchmarks/results/adapter_write.json (median and min of each, machine, versions).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lorabench.adapters import AdapterLayout, _write_flat_safetensors  # noqa: E402

PROJECTIONS = {"q_proj": (2048, 1024), "k_proj": (1024, 1024), "v_proj": (1024, 1024), "o_proj": (1024, 2048),
               "gate_proj": (3072, 1024), "up_proj": (3072, 1024), "down_proj": (1024, 3072)}


def adapter_layout(rank: int = 32, layers: int = 28) -> AdapterLayout:
    shapes = {}
    for layer in range(layers):
        for name, (out_f, in_f) in PROJECTIONS.items():
            module = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            shapes[f"{module}.lora_A.weight"] = torch.empty(rank, in_f)
            shapes[f"{module}.lora_B.weight"] = torch.empty(out_f, rank)
    return AdapterLayout.of(shapes)


def main() -> None:
    from safetensors import __version__ as st_version
    from safetensors.torch import load_file, save_file
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adapter_write.json"))
    args = parser.parse_args()
    layout = adapter_layout()
    buffer = torch.randn(layout.numel).to(torch.bfloat16)
    views = layout.views(buffer)
    times = {"lorabench": [], "save_file": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for i in range(args.repeats):
            t0 = time.perf_counter()
            _write_flat_safetensors(Path(tmp) / f"ours-{i}.safetensors", layout, buffer)
            t1 = time.perf_counter()
            save_file({k: v.clone() for k, v in views.items()}, str(Path(tmp) / f"theirs-{i}.safetensors"),
                      metadata={"format": "pt"})
            t2 = time.perf_counter()
            times["lorabench"].append(1e3 * (t1 - t0))
            times["save_file"].append(1e3 * (t2 - t1))
        ours = load_file(str(Path(tmp) / "ours-0.safetensors"))
        theirs = load_file(str(Path(tmp) / "theirs-0.safetensors"))
        identical = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                          "safetensors": st_version}, "date": time.strftime("%Y-%m-%d %H:%M"), "dir": args.dir,
              "tensors": len(layout.names), "megabytes": buffer.numel() * 2 / 2**20, "identical_files": identical,
              **{k: {"median_ms": statistics.median(v), "min_ms": min(v), "all_ms": v} for k, v in times.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"lorabench {result['lorabench']['median_ms']:.0f} ms, save_file {result['save_file']['median_ms']:.0f} ms "
          f"(median of {args.repeats}, {result['megabytes']:.1f} MB, identical: {identical})")


if __name__ == "__main__":
    main()
