"""benchmarks/meters.py, what the benchmarks count: the FLOPs of a trained token (for MFU), by hand
for Qwen3-0.6B and against the linear layers of a real model, and the bytes autograd saves."""
import pytest
import torch
from meters import matmul_params, model_flops_per_token, saved_activation_bytes  # benchmarks/

QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936}


def test_flops_per_token_qwen3_06b_by_hand():
    # weight shapes of one Qwen3-0.6B layer (in, out): q/o use 16 heads of 128, k/v 8 KV heads of 128
    layer = {"q_proj": (1024, 16 * 128), "k_proj": (1024, 8 * 128), "v_proj": (1024, 8 * 128),
             "o_proj": (16 * 128, 1024), "gate_proj": (1024, 3072), "up_proj": (1024, 3072),
             "down_proj": (3072, 1024)}
    per_layer = sum(a * b for a, b in layer.values())
    non_embedding = 28 * per_layer
    assert non_embedding == 440_401_920                    # Qwen3-0.6B's model card: 0.44B non-embedding
    lm_head = 151936 * 1024
    assert matmul_params(QWEN3_06B) == non_embedding + lm_head
    assert model_flops_per_token(QWEN3_06B) == pytest.approx(6 * (non_embedding + lm_head))
    attention = 12 * 28 * (16 * 128) * 330                 # scores + weighted sum, 330-token context
    assert model_flops_per_token(QWEN3_06B, seq_len=330) == pytest.approx(6 * (non_embedding + lm_head) + attention)


def test_matmul_params_match_an_instantiated_model():
    """Counted from the config = the weights of every nn.Linear in a real (small) Qwen3 model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    config = Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(model.config) == linear
    assert matmul_params(model.config.to_dict()) == linear  # a plain dict works too


def test_saved_bytes_count_what_backward_keeps_but_the_weights():
    """A linear layer keeps its input for backward (its weight is resident anyway: not counted) and
    tanh keeps its output: 2 x [4, 10] float32 = 320 bytes; under no_grad nothing is kept."""
    layer = torch.nn.Linear(10, 10, bias=False)
    x = torch.randn(4, 10)
    saved, out = saved_activation_bytes(layer, lambda: layer(x).tanh())
    assert saved == 2 * 4 * 10 * 4 and out.requires_grad
    with torch.no_grad():
        assert saved_activation_bytes(layer, lambda: layer(x).tanh())[0] == 0
