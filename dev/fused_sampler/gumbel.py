"""A sampler that reads the logits once: next token by the Gumbel-max trick and its log-prob by an online
log-sum-exp (16 triton programs a row, then a combine of their partial results). Exact in distribution:
argmax(x/T + G) with G ~ Gumbel(0, 1) drawn per token is a draw from softmax(x/T); the log-prob is
x_id/T - logsumexp(x/T), what log(softmax) gives.

SGLang 0.5.17's sampler, for plain temperature sampling with log-probs, passes over the [rows, vocab] logits
about a dozen times (divide, softmax, copy back, multinomial's exponential draw, divide and argmax, log,
clamp). This is an experiment (dev/, not the package): `patch.py` puts it into SGLang's Sampler for the
cases it covers and leaves every other case to SGLang.
"""
from __future__ import annotations

import random

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_max_kernel(logits_ptr, row_stride, inv_t_ptr, seed, vocab, chunk, part_max_ptr, part_sum_ptr,
                       part_best_ptr, part_id_ptr, part_x_ptr, chunks, BLOCK: tl.constexpr):
    """One (row, chunk of the vocabulary): its max and sum of exp(x - max) of x = logits / T, and its best
    x + Gumbel noise with that token's id and x; `gumbel_sample` combines the chunks of a row."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    start_ptr = logits_ptr + row.to(tl.int64) * row_stride
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    best_x = tl.full([], 0.0, tl.float32)
    first = part * chunk
    for start in range(first, first + chunk, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < vocab
        x = tl.load(start_ptr + offs, mask=inside, other=float("-inf")).to(tl.float32) * inv_t
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
        u = tl.rand(seed, row * vocab + offs)                  # uniform [0, 1), one per token of the row
        z = tl.where(inside, x - tl.log(-tl.log(u)), float("-inf"))   # u = 0 gives -inf: never drawn
        block_best = tl.max(z, 0)
        block_id = tl.argmax(z, 0)
        block_x = tl.sum(tl.where(tl.arange(0, BLOCK) == block_id, x, 0.0), 0)
        better = block_best > best
        best_id = tl.where(better, start + block_id, best_id)
        best_x = tl.where(better, block_x, best_x)
        best = tl.maximum(best, block_best)
    out = row * chunks + part
    tl.store(part_max_ptr + out, running_max)
    tl.store(part_sum_ptr + out, running_sum)
    tl.store(part_best_ptr + out, best)
    tl.store(part_id_ptr + out, best_id)
    tl.store(part_x_ptr + out, best_x)


def fits(logits: torch.Tensor) -> bool:
    """Whether every token of `logits` gets its own random offset (tl.rand's offsets are int32)."""
    return logits.shape[0] * logits.shape[1] < 2**31


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | None = None,
                  block: int = 2048, chunks: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (any float dtype, rows contiguous), temperatures [rows] or [rows, 1] > 0 ->
    (token ids [rows] int32, their log-probs under softmax(logits / T) [rows] float32). Each row is read in
    `chunks` programs (a batch of a few hundred rows alone would leave most of the GPU idle)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    assert fits(logits), "tl.rand's offsets are int32"
    chunk = -(-vocab // (chunks * block)) * block
    chunks = -(-vocab // chunk)
    inv_t = (1.0 / temperatures.reshape(rows).float()).contiguous()
    floats = torch.empty(4, rows, chunks, dtype=torch.float32, device=logits.device)
    part_max, part_sum, part_best, part_x = floats
    part_id = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    seed = random.getrandbits(31) if seed is None else seed
    _gumbel_max_kernel[(rows, chunks)](logits, logits.stride(0), inv_t, seed, vocab, chunk, part_max, part_sum,
                                       part_best, part_id, part_x, chunks, BLOCK=block)
    top = part_max.max(1, keepdim=True).values                               # [rows, 1]
    log_z = top.squeeze(1) + torch.log((part_sum * torch.exp(part_max - top)).sum(1))
    winner = part_best.argmax(1, keepdim=True)                               # the chunk holding the draw
    ids = part_id.gather(1, winner).squeeze(1)
    return ids, part_x.gather(1, winner).squeeze(1) - log_z
