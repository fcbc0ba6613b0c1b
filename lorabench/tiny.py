"""The tiny offline model: a Qwen3-architecture causal LM (~2.5M params) with a byte-level BPE tokenizer
trained on generated GSM8K-style text, warm-started (SFT) so GRPO starts from rewards neither 0 nor 1.
An ordinary Hugging Face model dir, cached by its recipe and built once, atomically (`tiny_model_dir`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from .data import INSTRUCTION, final_line_variants, prompt_ids, synthetic_problems, warmstart_completion
from .safedir import atomic_dir, remove_dead_dir_temps
from .settings import REFUSED, Section, check, setting

_RECIPE = "it is part of the tiny base model's recipe: another value builds another model"


@dataclass
class WarmStartSettings(Section):
    """The `warmstart` section: the tiny model's SFT (part of its recipe; real models ignore it)."""
    steps: int = setting(400, "SFT steps for the tiny model before GRPO (0 = skip; ignored for real models).",
                         resume=REFUSED, why=_RECIPE)
    batch_size: int = setting(32, "SFT batch size.", resume=REFUSED, why=_RECIPE)
    lr: float = setting(6e-3, "SFT learning rate (AdamW, warm-up then cosine decay).", resume=REFUSED, why=_RECIPE)
    strict_format_fraction: float = setting(0.1, "Fraction of SFT answers that end with '#### N'; the rest end "
                                            "'The answer is N.', '= N' or the bare number. GRPO with the strict "
                                            "reward then has a format to discover.", resume=REFUSED, why=_RECIPE)

    def problems(self) -> list[str]:
        return [*check(self.steps >= 0, f"warmstart.steps={self.steps}: must be >= 0"),
                *check(self.batch_size >= 1, f"warmstart.batch_size={self.batch_size}: must be >= 1"),
                *check(self.lr > 0, f"warmstart.lr={self.lr}: must be > 0 (e.g. 6e-3)"),
                *check(0 <= self.strict_format_fraction <= 1,
                       f"warmstart.strict_format_fraction={self.strict_format_fraction}: must be in [0, 1]")]

TINY_ARCH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY_VOCAB = 640  # a multiple of 64; byte-level BPE: 256 bytes + merges + 3 specials
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("LORABENCH_CACHE", Path.home() / ".cache" / "lorabench"))


def build_tiny_tokenizer(out_dir: Path | None = None, seed: int = 0):
    """A byte-level BPE trained on generated problems (under a second), saved into `out_dir` if given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = []
    for p in synthetic_problems(4000, f"tokenizer-{seed}"):
        corpus += [p.question, INSTRUCTION, p.answer, *final_line_variants(p.ground_truth)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def build_tiny_model(tokenizer, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    vocab = -(-len(tokenizer) // 64) * 64
    config = Qwen3Config(vocab_size=vocab, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **TINY_ARCH)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def tiny_recipe(warmstart, seed: int) -> dict:
    from . import __version__
    return {"arch": TINY_ARCH, "vocab": TINY_VOCAB, "template": CHAT_TEMPLATE, "seed": seed,
            "warmstart": {f.name: getattr(warmstart, f.name) for f in dataclasses.fields(warmstart)},
            "version": __version__}


def tiny_cache_path(cache_dir: str, warmstart, seed: int) -> Path:
    """Where the tiny model of this recipe is (or will be) cached."""
    digest = hashlib.sha256(json.dumps(tiny_recipe(warmstart, seed), sort_keys=True).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / f"tiny-qwen3-{digest}"


def tiny_tokenizer(cache_dir: str, warmstart, seed: int):
    """The tiny model's tokenizer without the model: the cached one, else the same one built in memory."""
    final = tiny_cache_path(cache_dir, warmstart, seed)
    if (final / "config.json").is_file():
        from transformers import AutoTokenizer  # not models.load_tokenizer: models imports this module
        return AutoTokenizer.from_pretrained(str(final))
    return build_tiny_tokenizer(None, seed)


def tiny_model_dir(cache_dir: str, warmstart, seed: int, log=print, progress=None) -> Path:
    """The warm-started tiny model's dir, built on first use (`progress` at each warm-start step)."""
    recipe = tiny_recipe(warmstart, seed)
    final = tiny_cache_path(cache_dir, warmstart, seed)
    remove_dead_dir_temps(final.parent)
    if (final / "config.json").is_file():
        return final
    with atomic_dir(final) as tmp:
        tokenizer = build_tiny_tokenizer(tmp, seed)
        model = build_tiny_model(tokenizer, seed)
        if warmstart.steps:
            warm_start(model, tokenizer, warmstart, seed, log=log, progress=progress)
        model.save_pretrained(tmp)
        (tmp / "lorabench_recipe.json").write_text(json.dumps(recipe, indent=1))
    return final


# --- warm-start (SFT) ------------------------------------------------------------------------------
def sft_batch(tokenizer, problems, rng, strict_fraction):
    """Right-padded (input_ids, labels, attention) with the loss only on completion tokens + <|im_end|>."""
    seqs, labels = [], []
    for p in problems:
        prompt = prompt_ids(tokenizer, p.messages)
        completion = [*tokenizer(warmstart_completion(p, rng, strict_fraction), add_special_tokens=False)["input_ids"],
                      tokenizer.eos_token_id]
        seqs.append(prompt + completion)
        labels.append([-100] * len(prompt) + completion)

    def padded(rows, value):
        return pad_sequence([torch.tensor(row) for row in rows], batch_first=True, padding_value=value)
    return padded(seqs, tokenizer.pad_token_id), padded(labels, -100), padded([[True] * len(s) for s in seqs], False)


def warm_start(model, tokenizer, cfg, seed: int, log=print, progress=None) -> list[float]:
    """Full-parameter SFT for cfg.steps steps (AdamW, linear warm-up, cosine decay): the loss curve.
    `progress("warm-start", done, total)` after every step; a log line every 50."""
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
        if progress is not None:
            progress("warm-start", step + 1, cfg.steps)
        if (step + 1) % 50 == 0 or step == 0:
            log(f"warm-start step {step + 1}/{cfg.steps}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.0f}s)")
    model.to("cpu").eval()
    return losses
