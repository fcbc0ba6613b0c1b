"""Warm-start (SFT) of the tiny model on generated problems, so GRPO starts from rewards that are
neither 0 nor 1: the model learns the arithmetic and mostly ends its answers with 'The answer is N.',
'= N' or the bare number; only `strict_format_fraction` of targets end with '#### N'."""
from __future__ import annotations

import math
import random
import time

import torch

from .data import synthetic_problems, warmstart_completion
from .models import prompt_ids


def sft_batch(tokenizer, problems, rng, strict_fraction):
    """Right-padded (input_ids, labels) with the loss only on completion tokens + <|im_end|>."""
    seqs, labels = [], []
    for p in problems:
        prompt = prompt_ids(tokenizer, p.messages)
        completion = tokenizer(warmstart_completion(p, rng, strict_fraction), add_special_tokens=False)["input_ids"]
        completion = completion + [tokenizer.eos_token_id]
        seqs.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, :len(s)] = torch.tensor(s)
        lab[i, :len(l)] = torch.tensor(l)
    return ids, lab, (lab != -100) | (torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None])


def warm_start(model, tokenizer, cfg, seed: int, log=print) -> list[float]:
    """Full-parameter SFT for cfg.steps steps (AdamW, linear warm-up, cosine decay). Returns the loss curve."""
    rng = random.Random(f"warmstart-{seed}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = max(1, cfg.steps // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    losses, t0 = [], time.perf_counter()
    for step in range(cfg.steps):
        problems = synthetic_problems(cfg.batch_size, f"warmstart-{seed}-{step}")
        ids, labels, attn = sft_batch(tokenizer, problems, rng, cfg.strict_format_fraction)
        loss = model(input_ids=ids.to(device), attention_mask=attn.long().to(device), labels=labels.to(device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0 or step == 0:
            log(f"warm-start step {step + 1}/{cfg.steps}  loss {loss.item():.3f}  "
                f"({time.perf_counter() - t0:.0f}s)")
    model.to("cpu").eval()
    return losses
