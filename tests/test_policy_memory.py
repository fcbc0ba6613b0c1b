"""Training memory settings of the policy: grpo.lora_compute (bf16 LoRA matmuls on the fp32 adapter)
and grpo.activation_checkpointing. Each must keep what autograd saves smaller and the numbers
the same (checkpointing: exactly; bf16: within bf16 rounding)."""
import pytest
import torch
from conftest import perturb_lora_B
from meters import saved_activation_bytes  # benchmarks/

from lorabench.loss import token_logprobs
from lorabench.policy import Policy, lora_compute_dtype
from lorabench.session.config import Config, ConfigError

LORA = ["lora.r=4", "lora.alpha=8"]


def _policy(model_dir, dtype: str, *overrides) -> Policy:
    cfg = Config.load(None, [*LORA, f"model.dtype={dtype}", *overrides])
    torch.manual_seed(0)
    policy = Policy(str(model_dir), cfg.lora, cfg.grpo, dtype, "cpu")
    perturb_lora_B(policy.model, seed=1)
    return policy


def _batch(tokenizer):
    texts = ["Tom has 3 apples and buys 4 more. How many? #### 7", "What is 12 minus 5? It is 7. #### 7"]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _forward_backward(policy: Policy, ids, mask) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """Log-probs, the LoRA gradients and the bytes autograd kept (parameters excluded) for one pass."""
    policy.model.train()
    policy.optimizer.zero_grad(set_to_none=True)
    with policy.compute():
        kept, logp = saved_activation_bytes(policy.model, lambda: token_logprobs(policy.model, ids, mask, 1.0))
    (logp * mask[:, 1:]).sum().backward()
    policy.model.eval()
    return logp.detach().float(), [p.grad.clone() for p in policy.params], kept


def test_auto_follows_the_model_dtype():
    assert lora_compute_dtype("auto", "bfloat16") == "bfloat16"
    assert lora_compute_dtype("auto", "float32") == "float32"
    assert lora_compute_dtype("float32", "bfloat16") == "float32"


def test_bf16_lora_compute_keeps_less_and_stays_close(tiny_model_dir, tokenizer):
    ids, mask = _batch(tokenizer)
    keep = "grpo.activation_checkpointing=false"       # what autograd keeps is what this test compares
    fp32_lp, fp32_grads, fp32_kept = _forward_backward(
        _policy(tiny_model_dir, "bfloat16", "grpo.lora_compute=float32", keep), ids, mask)
    bf16_policy = _policy(tiny_model_dir, "bfloat16", keep)                 # auto -> bfloat16
    assert bf16_policy.bf16_lora
    assert all(p.dtype == torch.float32 for p in bf16_policy.params)        # the adapter stays fp32
    bf16_lp, bf16_grads, bf16_kept = _forward_backward(bf16_policy, ids, mask)
    # no fp32 copy of each LoRA layer's input is kept (the 0.6B shape: 91 -> 63 KiB per token per layer)
    assert bf16_kept < 0.85 * fp32_kept, (bf16_kept, fp32_kept)
    gap = (bf16_lp - fp32_lp)[mask[:, 1:].bool()].abs()
    assert gap.mean() < 0.02 and gap.max() < 0.1, gap                      # bf16 rounding, not another model
    cos = torch.nn.functional.cosine_similarity(torch.cat([g.flatten() for g in bf16_grads]),
                                                torch.cat([g.flatten() for g in fp32_grads]), dim=0)
    assert cos > 0.99, cos


def test_activation_checkpointing_same_gradients_far_less_kept(tiny_model_dir, tokenizer):
    ids, mask = _batch(tokenizer)
    plain = _policy(tiny_model_dir, "float32", "grpo.activation_checkpointing=false")
    plain_lp, plain_grads, plain_kept = _forward_backward(plain, ids, mask)
    ckpt = _policy(tiny_model_dir, "float32")                               # the default: checkpointing on
    ckpt_lp, ckpt_grads, ckpt_kept = _forward_backward(ckpt, ids, mask)
    assert torch.allclose(ckpt_lp, plain_lp, atol=1e-6, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(ckpt_grads, plain_grads))
    assert ckpt_kept < plain_kept / 3, (ckpt_kept, plain_kept)
    # evaluation and rollouts (eval mode, no grad) never recompute: the same numbers as before
    with torch.no_grad():
        assert torch.equal(token_logprobs(ckpt.model, ids, mask, 1.0), token_logprobs(ckpt.model, ids, mask, 1.0))


def test_bad_lora_compute_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"grpo.lora_compute='bf16'.*'bfloat16'"):
        Config.load(None, ["grpo.lora_compute=bf16"])
    with pytest.raises(ConfigError, match=r"model.dtype=float32.*set model.dtype=bfloat16"):
        Config.load(None, ["grpo.lora_compute=bfloat16"])
    assert Config.load(None, ["grpo.lora_compute=bfloat16", "model.dtype=bfloat16"]).grpo.lora_compute == "bfloat16"
