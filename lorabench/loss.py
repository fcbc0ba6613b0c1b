"""The GRPO math as pure functions: advantages, the clipped loss, per-token log-probs, micro-batching.

`token_logprobs` is memory-lean: instead of the full forward's fp32 log_softmax (several [N, L-1, V]
tensors kept for backward) it runs the transformer body and applies the output head `chunk_size`
positions at a time, each chunk recomputed in backward: the extra peak is one [chunk_size, V] fp32
block. That equals the model's forward only when its logits are just the output head; models that
soft-cap or rescale logits after it (Gemma 2/3, Cohere, Granite) are refused, naming the setting.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

# config settings that change logits after lm_head, with the value at which they do nothing
LOGIT_TRANSFORM_SETTINGS = {
    "final_logit_softcapping": None,   # Gemma 2/3: cap * tanh(logits / cap)
    "logit_softcapping": None,
    "logit_scale": None,               # Cohere: logits * scale (only neutral when absent)
    "logits_scaling": 1.0,             # Granite: logits / scaling
    "unpadded_vocab_size": None,       # head wider than the vocabulary, trimmed after the head
}


def sent_ahead(t: torch.Tensor, device) -> torch.Tensor:
    """`t` on `device` without the host waiting: a host tensor bound for a GPU goes through pinned memory."""
    device = torch.device(device)
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (group std + eps), rewards laid out group by group: [P*G] -> [P*G]."""
    r = rewards.view(-1, group_size)                    # [P, G]
    std = r.std(dim=1, keepdim=True, unbiased=False)    # population std: a group of equal rewards -> 0
    return ((r - r.mean(dim=1, keepdim=True)) / (std + eps)).view(-1)


def grpo_loss(logp, old_logp, advantages, mask, clip_eps: float, ref_logp=None, kl_beta: float = 0.0,
              is_weight=None):
    """Returns (loss, metrics as floats). logp, old_logp, ref_logp, mask, is_weight: [n, L-1]; advantages: [n].
    is_weight (no gradient): min(π_old / π_sample, C) per token, multiplying its surrogate (max_staleness)."""
    loss, metrics = grpo_loss_terms(logp, old_logp, advantages, mask, clip_eps, ref_logp, kl_beta, is_weight)
    return loss, {name: value.item() for name, value in metrics.items()}


def grpo_loss_terms(logp, old_logp, advantages, mask, clip_eps: float, ref_logp=None, kl_beta: float = 0.0,
                    is_weight=None):
    """`grpo_loss` with its metrics as 0-dim tensors on the loss's device: the trainer sums them without a sync."""
    ratio = torch.exp(logp - old_logp)                                          # [n, L-1]
    adv = advantages[:, None]                                                   # [n, 1]
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if is_weight is not None:
        per_token = per_token * is_weight.detach()
    on = mask.float()                                                           # [n, L-1]; NaN below without tokens
    metrics = {"clip_fraction": (((ratio - 1).abs() > clip_eps).float() * on).sum() / on.sum()}
    if ref_logp is not None and kl_beta > 0:
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1                                         # k3, >= 0
        per_token = per_token + kl_beta * kl
        metrics["kl"] = (kl * mask).sum().double() / mask.sum().clamp(min=1).double()
    per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)              # [n] token mean
    return per_seq.mean(), metrics


def plain_token_logprobs(model, input_ids, attention_mask, temperature: float) -> torch.Tensor:
    """Reference: full forward, fp32 log_softmax over the vocabulary, gather. [N, L] -> [N, L-1].
    Keeps several [N, L-1, V] fp32 tensors for backward; use `token_logprobs` for training."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()  # [N, L-1, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, input_ids[:, 1:, None])[..., 0]


def body_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformer body returning last_hidden_state, output head) of a causal LM, PEFT-wrapped or not (the
    active LoRA adapter applies; prompt/prefix tuning, which changes the inputs, is refused)."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and getattr(peft_config, "is_prompt_learning", False):
        raise NotImplementedError(f"token_logprobs: PEFT {peft_config.peft_type} changes the inputs in "
                                  f"PeftModel.forward, which the lean path skips; use plain_token_logprobs")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    head = base.get_output_embeddings()
    if decoder is None or decoder is base or head is None:
        raise NotImplementedError(f"token_logprobs: cannot split {type(base).__name__} into a decoder and an "
                                  f"output head; use plain_token_logprobs")
    _refuse_logit_transforms(base)
    return decoder, head


def _refuse_logit_transforms(base) -> None:
    configs = [base.config]
    if hasattr(base.config, "get_text_config"):  # multimodal configs keep the LM settings in a sub-config
        configs.append(base.config.get_text_config())
    for config in configs:
        for name, neutral in LOGIT_TRANSFORM_SETTINGS.items():
            value = getattr(config, name, neutral)
            if value != neutral:
                raise NotImplementedError(f"token_logprobs: {type(base).__name__} has {name}={value!r}, so its "
                                          f"forward changes logits after the output head and the lean path "
                                          f"would differ from it; use plain_token_logprobs")
    if hasattr(base, "final_logits_bias"):
        raise NotImplementedError(f"token_logprobs: {type(base).__name__} adds final_logits_bias after the "
                                  f"head; use plain_token_logprobs")


def _chunk_logprobs(head, hidden_rows, target_rows, temperature: float) -> torch.Tensor:
    """log softmax(head(h) / T)[target] through autograd, [c, H], [c] -> [c]: heads HeadLogprobs does not cover."""
    logits = head(hidden_rows).float()                                          # [c, V] fp32
    if temperature != 1.0:  # skip a second [c, V] fp32 block where it changes nothing
        logits = logits / temperature
    # logit[target] - logsumexp(logits) == log_softmax(logits)[target], without a second [c, V] tensor
    return logits.gather(-1, target_rows[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def _log_normaliser(logits, temperature: float):
    """logsumexp(logits / T) over the vocabulary in fp32: [c, V] -> [c]."""
    return torch.logsumexp(logits.float() / temperature, dim=-1)


def _entropy(logits, log_normaliser, temperature: float):
    """Entropy of softmax(logits / T) per row in fp32: [c, V] -> [c], H = log Z - sum_v p_v * logit_v / T,
    clamped at 0 (rounding takes a peaked row a hair below)."""
    scaled = logits.float() / temperature
    probs = torch.exp(scaled - log_normaliser[:, None])                                  # [c, V]
    return (log_normaliser - (probs * scaled).sum(-1)).clamp_min(0.0)


@torch.no_grad()
def _chunk_entropy(head, hidden_rows, temperature: float) -> torch.Tensor:
    """`_entropy` for heads HeadLogprobs does not cover (one more head call, without gradients)."""
    logits = head(hidden_rows).float()                                                   # [c, V]
    return _entropy(logits, _log_normaliser(logits, temperature), temperature)


def _logits_grad(logits, log_normaliser, targets, grad_out, temperature: float):
    """grad_out * d logp[target] / d logits = grad_out * (onehot(target) - softmax(logits / T)) / T: [c, V]."""
    probs = torch.exp(logits.float() / temperature - log_normaliser[:, None])             # [c, V]
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    return ((onehot.float() - probs) * (grad_out / temperature)[:, None]).to(logits.dtype)


@functools.cache
def _compiled(fn):
    """fn through torch.compile, once per process (dynamic: chunks vary): one fused pass over the logits."""
    return torch.compile(fn, dynamic=True)


class HeadLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] for a chunk of rows, [c, H] -> [c], with a hand-written backward
    that keeps only the rows and one fp32 normaliser per row. `fused`: the logits passes compiled."""

    @staticmethod
    def forward(ctx, rows, weight, targets, temperature: float, fused: bool, with_entropy: bool):
        device = rows.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
        with torch.autocast(device, enabled=False):
            logits = rows.to(dtype) @ weight.to(dtype).T                                  # [c, V]
            normaliser = (_compiled(_log_normaliser) if fused else _log_normaliser)(logits, temperature)
            picked = logits.gather(-1, targets[:, None])[:, 0].float() / temperature     # [c]
            # a metric from the logits already here (one more pass over them, nothing kept for backward)
            entropy = ((_compiled(_entropy) if fused else _entropy)(logits, normaliser, temperature)
                       if with_entropy else normaliser.new_zeros(0))                     # [c] or [0]
        ctx.save_for_backward(rows, weight, targets, normaliser)
        ctx.temperature, ctx.fused, ctx.dtype = temperature, fused, dtype
        ctx.mark_non_differentiable(entropy)
        return picked - normaliser, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        rows, weight, targets, normaliser = ctx.saved_tensors
        w = weight.to(ctx.dtype)
        logits = rows.to(ctx.dtype) @ w.T                                                 # [c, V] again
        grad_fn = _compiled(_logits_grad) if ctx.fused else _logits_grad
        grad_logits = grad_fn(logits, normaliser, targets, grad_out.float(), ctx.temperature)
        grad_rows = (grad_logits @ w).to(rows.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad_logits.T @ rows.to(ctx.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_rows, grad_weight, None, None, None, None


def token_logprobs(model, input_ids, attention_mask, temperature: float, chunk_size: int = 512,
                   positions: torch.Tensor | None = None, compiled_head: bool = False) -> torch.Tensor:
    """Log-prob of each next token under logits / temperature, [N, L] -> [N, L-1], equal to
    `plain_token_logprobs` without full-vocabulary logits for the batch. chunk_size: positions per
    head call (extra peak ~chunk_size * V * 4 bytes). positions: optional [N, L-1] bool, the only rows
    put through the head (0 elsewhere). compiled_head: the logits passes compiled (HeadLogprobs)."""
    return token_logprobs_and_entropy(model, input_ids, attention_mask, temperature, chunk_size, positions,
                                      compiled_head, with_entropy=False)[0]


def token_logprobs_and_entropy(model, input_ids, attention_mask, temperature: float, chunk_size: int = 512,
                               positions: torch.Tensor | None = None, compiled_head: bool = False,
                               with_entropy: bool = True):
    """`token_logprobs` and, from the same logits, the entropy of softmax(logits / T) per position in
    nats, without gradients (0 where `positions` is False; None without with_entropy)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: log-probs of logits / temperature need temperature > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    decoder, head = body_and_head(model)
    # use_cache=False: a KV cache is useless for one full-sequence pass and costs memory
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    n, length, width = hidden.shape                                             # [N, L, H]
    if positions is not None and tuple(positions.shape) != (n, length - 1):
        raise ValueError(f"positions has shape {tuple(positions.shape)}; it must be [N, L-1] = {(n, length - 1)}")
    # position t predicts token t+1: drop the last position, flatten to rows
    hidden_rows = hidden[:, :-1].reshape(-1, width)                             # [N*(L-1), H]
    target_rows = input_ids[:, 1:].reshape(-1)                                  # [N*(L-1)]
    picked = None
    if positions is not None:
        # [R] rows wanted; `positions` on the host (the trainer's) picks them without waiting for the device
        picked = sent_ahead(positions.reshape(-1).nonzero()[:, 0], hidden.device)
        hidden_rows, target_rows = hidden_rows.index_select(0, picked), target_rows[picked]
    plain_head = isinstance(head, torch.nn.Linear) and head.bias is None   # else autograd, chunks checkpointed
    pieces, entropies = [], []
    for start in range(0, hidden_rows.shape[0], chunk_size):
        rows, targets = hidden_rows[start:start + chunk_size], target_rows[start:start + chunk_size]
        if plain_head:
            logp, entropy = HeadLogprobs.apply(rows, head.weight, targets, temperature, compiled_head, with_entropy)
            pieces.append(logp)
            entropies.append(entropy)
        else:
            pieces.append(checkpoint(_chunk_logprobs, head, rows, targets, temperature, use_reentrant=False)
                          if torch.is_grad_enabled() else _chunk_logprobs(head, rows, targets, temperature))
            if with_entropy:
                entropies.append(_chunk_entropy(head, rows.detach(), temperature))

    def to_positions(values):  # [R] or [N*(L-1)] -> [N, L-1], 0 where no position was wanted
        if not values:  # L == 1 (no next token anywhere) or no position wanted
            return hidden.new_zeros((n, length - 1), dtype=torch.float32)
        values = torch.cat(values)
        if picked is not None:  # back to every position (differentiable)
            values = values.new_zeros(n * (length - 1)).index_put((picked,), values)
        return values.view(n, length - 1)
    return to_positions(pieces), (to_positions(entropies) if with_entropy else None)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[N, L] 1 on real tokens -> [N, 1, L, L] bool, True where query t may attend a real key s <= t."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def token_budget_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Sequence indices in micro-batches of padded size (len * longest) <= token_budget, longest first
    (ties by index: little padding, and an out-of-memory shows at once); a longer sequence gets a batch
    of its own. A last batch of one takes one from a batch of three or more before it: compiled layers
    compile again for a batch of one.

    >>> token_budget_batches([3, 10, 4, 10, 2], token_budget=20)
    [[1, 3], [2, 0, 4]]
    >>> token_budget_batches([5, 5, 5, 5], token_budget=15)
    [[0, 1], [2, 3]]
    """
    if token_budget < 1:
        raise ValueError(f"token_budget={token_budget}: must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # lengths only decrease along `order`, so a batch's first index is its longest sequence
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= token_budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    if len(batches) > 1 and len(batches[-1]) == 1 and len(batches[-2]) >= 3:
        # the moved sequence fit a batch of three at its length, so a batch of two holds it
        batches[-1].insert(0, batches[-2].pop())
    return batches

