"""Models and tokenizers: load by hub name or local path, or build the tiny offline default.

The tiny default is a real Qwen3-architecture causal LM (~2.5M params: hidden 256, 4 layers,
GQA 4/2 heads) with a byte-level BPE tokenizer trained here on generated GSM8K-style text and
Qwen's chat special tokens (<|im_start|>, <|im_end|>, <|endoftext|>). It is saved as an ordinary
Hugging Face model dir, so transformers, PEFT and SGLang all load it like Qwen/Qwen3-0.6B.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

TINY_ARCH = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY_VOCAB = 640  # a multiple of 64; byte-level BPE: 256 bytes + merges + 3 specials
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelError(ValueError):
    """A model path or name cannot be used; the message says which and how to fix it."""


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("LORABENCH_CACHE", Path.home() / ".cache" / "lorabench"))


def atomic_dir(final: Path):
    """Context manager yielding a temp dir next to `final` that is renamed onto it on success,
    so a crash never leaves a half-written model behind."""
    class _Atomic:
        def __enter__(self):
            final.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
            return self.tmp

        def __exit__(self, exc_type, exc, tb):
            if exc_type is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
                return False
            try:
                os.rename(self.tmp, final)
            except OSError:  # another process finished the same build first: keep theirs
                shutil.rmtree(self.tmp, ignore_errors=True)
                if not final.is_dir():
                    raise
            return False
    return _Atomic()


def build_tiny_tokenizer(out_dir: Path, seed: int = 0):
    """Train a byte-level BPE on generated problems and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from .data import INSTRUCTION, final_line_variants, synthetic_problems

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


def tiny_model_dir(cache_dir: str, warmstart, seed: int, log=print) -> Path:
    """Path of the warm-started tiny model, built on first use and cached by its recipe."""
    from . import __version__
    from .warmstart import warm_start
    recipe = {"arch": TINY_ARCH, "vocab": TINY_VOCAB, "template": CHAT_TEMPLATE, "seed": seed,
              "warmstart": vars(warmstart), "version": __version__}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    final = cache_root(cache_dir) / f"tiny-qwen3-{digest}"
    if (final / "config.json").is_file():
        return final
    with atomic_dir(final) as tmp:
        tokenizer = build_tiny_tokenizer(tmp, seed)
        model = build_tiny_model(tokenizer, seed)
        if warmstart.steps:
            warm_start(model, tokenizer, warmstart, seed, log=log)
        model.save_pretrained(tmp)
        (tmp / "lorabench_recipe.json").write_text(json.dumps(recipe, indent=1))
    return final


def resolve_model_path(cfg, log=print) -> str:
    """'tiny' -> the cached warm-started dir; a local dir as is; anything else is a hub name."""
    name = cfg.model.name_or_path
    if name == "tiny":
        return str(tiny_model_dir(cfg.model.cache_dir, cfg.warmstart, cfg.run.seed, log=log))
    if name.startswith((".", "/", "~")) and not Path(name).expanduser().is_dir():
        raise ModelError(f"model.name_or_path={name!r} does not exist; give an existing model dir, a hub "
                         f"name such as Qwen/Qwen3-0.6B, or 'tiny'")
    if Path(name).expanduser().is_dir() and not (Path(name).expanduser() / "config.json").is_file():
        raise ModelError(f"model dir {name} has no config.json; point model.name_or_path at a saved "
                         f"Hugging Face model dir")
    return str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device).eval()


def prompt_ids(tokenizer, messages: list[dict], enable_thinking: bool = False) -> list[int]:
    """Chat-formatted prompt tokens ending with the assistant header."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pick_device(requested: str = "") -> str:
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


# Qwen3 shapes (from the models' config.json), for random-init models of a real model's size: the
# GPU tests and benchmarks measure refresh and step costs without downloading weights
QWEN3_SHAPES = {
    "0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16),
    "1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    "4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
}


def random_qwen3_dir(shape: str, tokenizer_path: str, out_dir: str | Path, seed: int = 0) -> Path:
    """A random-init bf16 model of Qwen3-`shape`'s architecture (vocab 151936, tied embeddings,
    8 KV heads of 128) with the tiny tokenizer, saved in `out_dir` (reused if complete)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    if shape not in QWEN3_SHAPES:
        raise ModelError(f"shape={shape!r}: use one of {sorted(QWEN3_SHAPES)}")
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
