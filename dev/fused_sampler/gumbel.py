"""A sampler that reads the logits once: next token by the Gumbel-max trick and its log-prob by an online
log-sum-exp, in one triton pass per row. Exact in distribution: argmax(x/T + G) with G ~ Gumbel(0, 1) drawn
per token is a draw from softmax(x/T); the log-prob is x_id/T - logsumexp(x/T), what log(softmax) gives.

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
def _gumbel_max_kernel(logits_ptr, row_stride, inv_t_ptr, seed, ids_ptr, logprob_ptr, vocab,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    inv_t = tl.load(inv_t_ptr + row)
    start_ptr = logits_ptr + row.to(tl.int64) * row_stride
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_id = tl.full([], 0, tl.int32)
    best_x = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
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
    tl.store(ids_ptr + row, best_id)
    tl.store(logprob_ptr + row, best_x - (running_max + tl.log(running_sum)))


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | None = None,
                  block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (any float dtype, rows contiguous), temperatures [rows] or [rows, 1] > 0 ->
    (token ids [rows] int32, their log-probs under softmax(logits / T) [rows] float32)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    assert rows * vocab < 2**31, "tl.rand's offsets are int32"
    inv_t = (1.0 / temperatures.reshape(rows).float()).contiguous()
    ids = torch.empty(rows, dtype=torch.int32, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    seed = random.getrandbits(31) if seed is None else seed
    _gumbel_max_kernel[(rows,)](logits, logits.stride(0), inv_t, seed, ids, logprobs, vocab, BLOCK=block)
    return ids, logprobs
