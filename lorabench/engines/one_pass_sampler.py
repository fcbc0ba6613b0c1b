"""Plain temperature sampling that reads the logits once: each row's token by the Gumbel-max trick and its
log-prob by an online log-sum-exp, in one triton kernel (16 programs a row, then a combine of their partial
results). Exact in distribution: argmax(x/T + G), G ~ Gumbel(0, 1) drawn per token, is a draw from softmax(x/T);
the log-prob is x_id/T - logsumexp(x/T), what log(softmax) gives. SGLang's own sampler passes over the
[rows, vocab] logits about a dozen times for the same draw (docs/results.md section 2, "SGLang's sampler in a
group's decode"). Served to SGLang as `engine.sglang.sampling_backend=lorabench` (sglang_internals).
"""
from __future__ import annotations

import functools
import random

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gumbel_max(logits_ptr, row_stride, inv_t_ptr, seed, vocab, row_counters, chunk, part_max_ptr, part_sum_ptr,
                   part_best_ptr, part_id_ptr, part_x_ptr, chunks, BLOCK: tl.constexpr):
        """One (row, chunk): max and sum of exp(x - max) of x = logits / T; the best x + Gumbel noise, its id
        and x."""
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
            # a uniform [0, 1) per token, four from each Philox counter (one each costs 1.4x the kernel's time)
            u0, u1, u2, u3 = tl.rand4x(seed, row * row_counters + start // 4 + tl.arange(0, BLOCK // 4))
            u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [BLOCK])
            z = tl.where(inside, x - tl.log(-tl.log(u)), float("-inf"))   # u = 0: -inf, never drawn
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
    return gumbel_max


def _chunking(vocab: int, block: int, chunks: int) -> tuple[int, int]:
    """(tokens a program reads, programs a row): at most `chunks` programs of whole blocks cover the vocabulary."""
    chunk = -(-vocab // (chunks * block)) * block
    return chunk, -(-vocab // chunk)


def fits(logits: torch.Tensor, block: int = 2048, chunks: int = 16) -> bool:
    """Whether every token of `logits` [rows, vocab] gets its own random: a row takes a quarter of its padded
    length in int32 Philox counters (a small vocabulary is padded to a whole block)."""
    chunk, chunks = _chunking(logits.shape[1], block, chunks)
    return logits.shape[0] * (chunks * chunk // 4) < 2**31 and logits.stride(1) == 1


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int | None = None,
                  block: int = 2048, chunks: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] on a GPU (`fits`), temperatures [rows] or [rows, 1] > 0 -> (token ids [rows] int32,
    their log-probs under softmax(logits / T) [rows] float32)."""
    rows, vocab = logits.shape
    assert fits(logits, block, chunks), "more tokens than int32 random counters, or a strided vocabulary"
    chunk, chunks = _chunking(vocab, block, chunks)
    inv_t = (1.0 / temperatures.reshape(rows).float()).contiguous()
    part_max, part_sum, part_best, part_x = torch.empty(4, rows, chunks, dtype=torch.float32, device=logits.device)
    part_id = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    seed = random.getrandbits(31) if seed is None else seed
    _kernel()[(rows, chunks)](logits, logits.stride(0), inv_t, seed, vocab, chunks * chunk // 4, chunk, part_max,
                              part_sum, part_best, part_id, part_x, chunks, BLOCK=block)
    top = part_max.max(1, keepdim=True).values                               # [rows, 1]
    log_z = top.squeeze(1) + torch.log((part_sum * torch.exp(part_max - top)).sum(1))
    winner = part_best.argmax(1, keepdim=True)                               # the chunk that holds the draw
    return part_id.gather(1, winner).squeeze(1), part_x.gather(1, winner).squeeze(1) - log_z
