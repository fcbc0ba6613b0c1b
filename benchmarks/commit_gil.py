"""What a background commit takes from the stepping thread: the time one checkpoint write of `RunLog.commit`, on
another thread, costs a Python-bound thread (small torch ops, as an update's kernel launches are) that runs while it
is written (its time beside the write less its time alone). The state is a LoRA r=32 policy's on Qwen3-0.6B's
shape (AdamW's moments of 392 tensors: 1,177 tensors, 161 MB; the commit adds the adapter), in two layouts:

- "a host tensor per tensor": what the commit thread writes on a GPU (`commits.to_host` copies each tensor);
- "views of one host buffer": what a CPU run writes (`commits.cloned`'s views, which `to_host` leaves as they are).

    python benchmarks/commit_gil.py --out /tmp/commit_gil.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lorabench.adapters import PEFT_PREFIX, FlatAdapter  # noqa: E402
from lorabench.commits import cloned  # noqa: E402
from lorabench.runlog import RunLog  # noqa: E402

# (in, out) of the seven projections of a Qwen3-0.6B layer: q, k, v, o, gate, up, down
QWEN3_06B = [(1024, 2048), (1024, 1024), (1024, 1024), (2048, 1024), (1024, 3072), (1024, 3072), (3072, 1024)]


def policy_state(rank: int = 32, layers: int = 28) -> tuple[dict, FlatAdapter]:
    """(the trainer state a commit writes, the adapter) after one AdamW step."""
    names = [f"{PEFT_PREFIX}model.layers.{layer}.proj{j}.lora_{ab}.weight" for layer in range(layers)
             for j in range(len(QWEN3_06B)) for ab in "AB"]
    shapes = [shape for _ in range(layers) for fan_in, fan_out in QWEN3_06B for shape in ((rank, fan_in),
                                                                                         (fan_out, rank))]
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    adapter = FlatAdapter.from_tensors(dict(zip(names, params)), {"r": rank, "lora_alpha": 2 * rank})
    return {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, adapter


def python_bound_s(iterations: int) -> float:
    a = torch.ones(8)
    t0 = time.perf_counter()
    for _ in range(iterations):
        a = a * 1.0001 + 0.0
    return time.perf_counter() - t0


def seconds_taken(write, iterations: int, repeats: int) -> list[float]:
    """What one `write` on another thread costs a Python-bound thread that runs longer than it: its time beside
    the write less its time alone."""
    alone = statistics.median(python_bound_s(iterations) for _ in range(3))
    taken = []
    for _ in range(repeats):
        writer = threading.Thread(target=write)
        writer.start()
        taken.append(python_bound_s(iterations) - alone)
        writer.join()
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    state, adapter = policy_state()
    log = RunLog.create(tempfile.mkdtemp(prefix="commit-gil-"), "gil", log=lambda *_: None)
    result = {"torch": torch.__version__, "tensors": 1 + sum(len(s) for s in state["optimizer"]["state"].values()),
              "mb": sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values()
                        for t in s.values()) / 1e6, "layouts": {}}
    for name, value in (("a host tensor per tensor", state), ("views of one host buffer", cloned(state))):
        def write(value=value):   # the commit's own checkpoint write (no adapter dir, no rows)
            log.commit(1, value, adapter, {}, save_adapter=False)
        writes = []
        for _ in range(3):
            t0 = time.perf_counter()
            write()
            writes.append(time.perf_counter() - t0)
        iterations = int(60000 * 3 * max(writes) / python_bound_s(60000))   # the thread outlasts a write
        taken = seconds_taken(write, iterations, args.repeats)
        result["layouts"][name] = {"write_s": writes, "taken_s": taken, "taken_s_p50": statistics.median(taken)}
        print(f"{name}: a write {statistics.median(writes):.2f} s; it takes {statistics.median(taken):.2f} s "
              f"(p50; {min(taken):.2f}-{max(taken):.2f}) from a Python-bound thread beside it")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
