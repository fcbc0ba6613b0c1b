"""Training activation memory per token, by what autograd keeps: the bytes of every tensor saved for
backward in one `token_logprobs` forward of the policy (parameters excluded, shared storage counted
once), for each training setting (grpo.lora_compute x grpo.activation_checkpointing).

    python benchmarks/activation_memory.py [--device cpu|cuda] [--tokens 512] [--out FILE]

Setting: Qwen3-0.6B's layer shape (hidden 1024, MLP 3072, 16 x 128 query heads, 8 KV heads, vocab
151,936), random init in bf16, LoRA r=32 on the 7 projections, built with 1 and with 3 decoder
layers; the difference gives the cost per layer, scaled to the real model's 28. The figure counts
what backward keeps, which is what grows with the micro-batch; the caching allocator's peak adds
the weights, the head's [chunk, vocab] block and backward's transients on top. Runs on a CPU in
about a minute (the saved tensors are the same on a GPU, except the attention kernel's own).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meters import saved_activation_bytes  # noqa: E402  (this folder)
from synthetic import QWEN3_SHAPES  # noqa: E402

from lorabench.grpo import GRPOSettings  # noqa: E402
from lorabench.loss import token_logprobs  # noqa: E402
from lorabench.policy import LoraSettings, Policy  # noqa: E402

LAYERS_OF_THE_REAL_MODEL = 28
SETTINGS = [("float32", False), ("bfloat16", False), ("float32", True), ("bfloat16", True)]


def model_dir(root: Path, layers: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    out = root / f"layers-{layers}"
    shape = {**QWEN3_SHAPES["0.6B"], "num_hidden_layers": layers}
    config = Qwen3Config(vocab_size=151936, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, **shape)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


def saved_bytes(policy: Policy, tokens: int, device: str) -> int:
    """Bytes autograd keeps for backward in one training forward of `tokens` tokens (2 sequences)."""
    ids = torch.randint(0, 1000, (2, tokens // 2), device=device)
    policy.model.train()
    with policy.compute():
        kept, logp = saved_activation_bytes(
            policy.model, lambda: token_logprobs(policy.model, ids, torch.ones_like(ids), 1.0, chunk_size=256))
    logp.sum().backward()  # what was kept must serve a real backward
    policy.model.eval()
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # "Writing model shards" / "Loading weights" bars per policy
    lora = LoraSettings(r=32, alpha=64, target_modules="all-linear", dropout=0.0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {n: model_dir(Path(tmp), n) for n in (1, 3)}
        for compute, checkpointing in SETTINGS:
            grpo = GRPOSettings(lora_compute=compute, activation_checkpointing=checkpointing)
            per = {n: saved_bytes(Policy(str(d), lora, grpo, "bfloat16", args.device), args.tokens, args.device)
                   for n, d in dirs.items()}
            per_layer = (per[3] - per[1]) / 2 / args.tokens
            outside = per[1] / args.tokens - per_layer          # embedding, final norm, head chunks' inputs
            per_token = LAYERS_OF_THE_REAL_MODEL * per_layer + outside
            rows.append({"lora_compute": compute, "activation_checkpointing": checkpointing,
                         "kib_per_token_per_layer": per_layer / 1024, "kib_per_token_outside_layers": outside / 1024,
                         "mib_per_token_28_layers": per_token / 2**20,
                         "gib_at_8192_tokens": per_token * 8192 / 2**30,
                         "gib_at_4096_tokens": per_token * 4096 / 2**30})
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    if args.out:
        import peft
        import transformers
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        meta = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "device": args.device, "machine": platform.processor() or platform.machine(), "tokens": args.tokens,
                "commit": os.environ.get("LORABENCH_COMMIT", commit), "date": time.strftime("%Y-%m-%d %H:%M")}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
