"""Inputs of real shapes without downloads or an engine, for the benchmarks, the GPU tests and
dev/run_notebooks_gpu.py (imported with the checkout and this folder on sys.path):

- `random_qwen3_dir`: a random-init model of Qwen3's published shapes (vocab 151936, tied
  embeddings, 8 KV heads of 128, bf16) with any tokenizer (the tiny one). Refresh and step costs
  depend on the shapes, not on the values, so it measures them at that size on a machine that
  cannot reach the hub.
- `random_tokens_like_rollouts`: random token ids laid out as `lorabench.rollout.collate` lays out
  rollouts, to time or test the training path without sampling.
- `peft_adapter`: a PEFT model's adapter as a FlatAdapter, copied through PEFT's own state dict (the
  tests' reference for the policy's faster path, policy.LoraLayers).
"""
from __future__ import annotations

from pathlib import Path

import torch

from lorabench.models import load_tokenizer
from lorabench.safedir import atomic_dir

# the engine arguments of our offline GPU stack (no FlashInfer, FA3 or xgrammar; a full install needs none)
STACK_ARGS = dict(attention_backend="triton", grammar_backend="none")  # SGLangSettings
STACK = ["engine.backend=sglang", "engine.sglang.attention_backend=triton", "engine.sglang.grammar_backend=none",
         "engine.sglang.dtype=bfloat16", "model.dtype=bfloat16"]

QWEN3_SHAPES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
}


def peft_adapter(model, adapter_name: str = "default", version: int = 0):
    """The adapter `adapter_name` of a PEFT model as a new FlatAdapter (PEFT names, its config as plain JSON)."""
    from peft import get_peft_model_state_dict

    from lorabench.adapters import FlatAdapter, plain_config, split_lora_key
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    modules = sorted({split_lora_key(k)[0].split(".")[-1] for k in state})
    return FlatAdapter.from_tensors(state, plain_config(model.peft_config[adapter_name], modules), version)


def random_qwen3_dir(shape: str, tokenizer_path: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A random-init bf16 model of Qwen3-`shape`'s architecture with the tokenizer at
    `tokenizer_path`, saved in `out_dir` (reused if complete)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    if shape not in QWEN3_SHAPES:
        raise ValueError(f"shape={shape!r}: use one of {sorted(QWEN3_SHAPES)}")
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file() and (out_dir / "n_params.txt").is_file():
        return out_dir
    tok = load_tokenizer(tokenizer_path)
    config = Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         torch_dtype="bfloat16", **QWEN3_SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "n_params.txt").write_text(str(sum(p.numel() for p in model.parameters())))
    return out_dir


def random_tokens_like_rollouts(prompt_lens: list[int], completion_lens: list[int], token_range: tuple[int, int],
                                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random token ids laid out as `collate` lays out rollouts: ids [n, L] (0 at padding),
    attention mask [n, L], completion mask [n, L-1] after each prompt."""
    n, width = len(prompt_lens), max(p + c for p, c in zip(prompt_lens, completion_lens))
    ids = torch.randint(*token_range, (n, width), generator=generator)
    attn = torch.zeros(n, width, dtype=torch.long)
    cmask = torch.zeros(n, width - 1)
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        attn[i, :p + c] = 1
        cmask[i, p - 1:p - 1 + c] = 1   # log-prob row t predicts token t+1
    return ids * attn, attn, cmask


def qwen3_06b_run(root: Path, cache: str | Path, data_name: str) -> list[str]:
    """The config overrides of a GPU benchmark run at Qwen3-0.6B's shape: a random-init model of that
    shape with the tiny tokenizer (cached under `cache`), and 4096 synthetic GSM8K-style problems as
    a local data file in `root`."""
    import json

    from lorabench.data import synthetic_problems
    from lorabench.tiny import build_tiny_tokenizer
    build_tiny_tokenizer(root / "tok")
    model_dir = random_qwen3_dir("0.6B", str(root / "tok"), Path(cache) / "qwen3-0.6b-random")
    data = root / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": p.question, "answer": p.answer}) + "\n"
                            for p in synthetic_problems(4096, data_name)))
    return [f"model.name_or_path={model_dir}", f"data.source={data}", "data.eval_size=4"]


def size_overrides(size: str) -> list[str]:
    """'PxGxT' (prompts x completions x new tokens per step) as config overrides."""
    p, g, t = (int(x) for x in size.split("x"))
    return [f"grpo.prompts_per_step={p}", f"grpo.group_size={g}", f"grpo.max_new_tokens={t}"]


def qwen3_06b_with_adapter(cache: str | Path, prompts: int, tag: str) -> tuple[str, list[list[int]], object]:
    """For decode benchmarks: the random Qwen3-0.6B-shape dir (cached under `cache`), `prompts` GSM8K-format
    prompts as token ids, and a bf16 LoRA r=32 on the 7 projections (B non-zero) on the GPU, as a FlatAdapter."""
    import tempfile

    from lorabench.data import prompt_ids, synthetic_problems
    from lorabench.refresh_bench import adapter_model
    from lorabench.tiny import build_tiny_tokenizer
    tok_dir = Path(tempfile.mkdtemp(prefix=f"{tag}-")) / "tok"
    build_tiny_tokenizer(tok_dir)
    q06 = str(random_qwen3_dir("0.6B", str(tok_dir), Path(cache) / "qwen3-0.6b-random"))
    tok = load_tokenizer(q06)
    ids = [prompt_ids(tok, p.messages) for p in synthetic_problems(prompts, tag)]
    adapter = peft_adapter(adapter_model(q06, 32, dtype="bfloat16", device="cuda")).to("cuda", torch.bfloat16)
    torch.cuda.empty_cache()
    return q06, ids, adapter
