"""Experiment: the one-pass sampler with four uniforms per Philox call (tl.rand4x) instead of one (tl.rand), timed
beside the package's kernel in one process, with the same chi-square and log-prob checks.
    python dev/fused_sampler/rand4x.py --out rand4x.json"""
from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from check import VOCAB, timed  # noqa: E402

from lorabench.engines.one_pass_sampler import gumbel_sample  # noqa: E402


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gumbel_max4(logits_ptr, row_stride, inv_t_ptr, seed, vocab, row_counters, chunk, part_max_ptr, part_sum_ptr,
                    part_best_ptr, part_id_ptr, part_x_ptr, chunks, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        inv_t = tl.load(inv_t_ptr + row)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        best = tl.full([], float("-inf"), tl.float32)
        best_id = tl.full([], 0, tl.int32)
        best_x = tl.full([], 0.0, tl.float32)
        for start in range(part * chunk, part * chunk + chunk, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            x = tl.load(row_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
            new_top = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
            u0, u1, u2, u3 = tl.rand4x(seed, row * row_counters + start // 4 + tl.arange(0, BLOCK // 4))
            u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [BLOCK])
            z = tl.where(inside, x - tl.log(-tl.log(u)), float("-inf"))
            block_best, block_id = tl.max(z, 0), tl.argmax(z, 0)
            block_x = tl.sum(tl.where(tl.arange(0, BLOCK) == block_id, x, 0.0), 0)
            better = block_best > best
            best_id = tl.where(better, start + block_id, best_id)
            best_x = tl.where(better, block_x, best_x)
            best = tl.maximum(best, block_best)
        out = row * chunks + part
        tl.store(part_max_ptr + out, top)
        tl.store(part_sum_ptr + out, total)
        tl.store(part_best_ptr + out, best)
        tl.store(part_id_ptr + out, best_id)
        tl.store(part_x_ptr + out, best_x)
    return gumbel_max4


def gumbel_sample4(logits, temperatures, block: int = 2048, chunks: int = 16):
    rows, vocab = logits.shape
    chunk = -(-vocab // (chunks * block)) * block
    chunks = -(-vocab // chunk)
    inv_t = (1.0 / temperatures.reshape(rows).float()).contiguous()
    part_max, part_sum, part_best, part_x = torch.empty(4, rows, chunks, dtype=torch.float32, device=logits.device)
    part_id = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _kernel()[(rows, chunks)](logits, logits.stride(0), inv_t, random.getrandbits(31), vocab, chunks * chunk // 4,
                              chunk, part_max, part_sum, part_best, part_id, part_x, chunks, BLOCK=block)
    top = part_max.max(1, keepdim=True).values
    log_z = top.squeeze(1) + torch.log((part_sum * torch.exp(part_max - top)).sum(1))
    winner = part_best.argmax(1, keepdim=True)
    return part_id.gather(1, winner).squeeze(1), part_x.gather(1, winner).squeeze(1) - log_z


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    t0 = time.time()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    torch.manual_seed(0)
    base = torch.randn(64, device="cuda") * 2
    draws = 2_000_000
    ids, _ = gumbel_sample4(base.expand(draws, 64), torch.full((draws,), 0.8, device="cuda"))
    p = torch.softmax(base / 0.8, -1)
    freq = torch.bincount(ids.long(), minlength=64).double() / draws
    keep = p * draws >= 5
    result["chi2"] = {"dof": int(keep.sum()) - 1, "value": float(((freq - p) ** 2 / p)[keep].sum() * draws)}
    print(f"[{time.time() - t0:6.1f} s] rand4x chi-square {result['chi2']}", flush=True)
    for block in (1024, 2048, 4096):
        for rows in (512, 2048):
            logits = torch.randn(rows, VOCAB, device="cuda") * 3
            temps = torch.ones(rows, 1, device="cuda")
            ids, lp = gumbel_sample4(logits, temps, block=block)
            ref = torch.log_softmax(logits, -1)[torch.arange(rows, device="cuda"), ids.long()]
            row = {"rows": rows, "block": block,
                   "rand_ms": timed(lambda x=logits, t=temps, b=block: gumbel_sample(x, t, block=b)),
                   "rand4x_ms": timed(lambda x=logits, t=temps, b=block: gumbel_sample4(x, t, block=b)),
                   "logprob_max_abs_gap": float((lp - ref).abs().max())}
            result["rows"].append(row)
            print(f"[{time.time() - t0:6.1f} s] {json.dumps(row)}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
