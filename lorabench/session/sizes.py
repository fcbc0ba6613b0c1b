"""Is a run's size within what this machine can hold? An estimate before anything is built.

Each term is a lower bound on memory the run certainly allocates, so a refusal is never a false alarm:
sequences held at once (~1 KiB plus 64 bytes per new token each); the LoRA state (float32 x 8: weights,
gradients, two Adam moments, their rollback snapshot, the published adapter); the base weights; and
what the engine allocates in this process (`process_memory`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..engines import engine_class
from ..machine import machine_memory
from .config import Config, ConfigError, engine_needs

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, config) -> ModelShape:
        get = (config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d))
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        return cls(hidden, int(get("intermediate_size", 4 * hidden)), int(get("num_hidden_layers")), heads,
                   int(get("num_key_value_heads") or heads), int(get("head_dim") or hidden // heads),
                   int(get("vocab_size")), bool(get("tie_word_embeddings", False)))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def parameters(self) -> int:
        per_layer = sum(a * b for a, b in self.linear_shapes().values())
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


@dataclass(frozen=True)
class Need:
    what: str
    nbytes: int
    fix: str


def needs(cfg: Config, shape: ModelShape) -> list[Need]:
    g, d = cfg.grpo, cfg.data
    train, held_out = g.prompts_per_step * g.group_size, d.eval_size * d.eval_samples
    sequences = max(train, held_out)
    fix = (f"lower grpo.prompts_per_step x grpo.group_size (now {g.prompts_per_step} x {g.group_size})"
           if train >= held_out else f"lower data.eval_size x data.eval_samples (now {d.eval_size} x {d.eval_samples})")
    terms = [Need(f"{sequences:,} sequences of {g.max_new_tokens} new tokens held at once",
                  sequences * (1024 + 64 * g.max_new_tokens), fix)]
    targets = cfg.lora.target_modules
    linears = shape.linear_shapes()
    chosen = linears if targets == "all-linear" else {k: v for k, v in linears.items() if k in targets}
    lora_params = shape.layers * cfg.lora.r * sum(a + b for a, b in chosen.values())
    terms.append(Need(f"LoRA state ({lora_params:,} parameters at lora.r={cfg.lora.r}, float32 x 8)",
                      lora_params * 4 * 8, f"lower lora.r (now {cfg.lora.r})"))
    base_bytes = shape.parameters() * _DTYPE_BYTES[cfg.model.dtype]
    terms.append(Need(f"base weights ({shape.parameters():,} parameters in {cfg.model.dtype})", base_bytes,
                      "use a smaller model, or model.dtype=bfloat16"))
    engine = engine_class(cfg.engine.backend)
    terms += [Need(*term) for term in engine.process_memory(cfg.engine.chosen, engine_needs(cfg), shape.vocab,
                                                              base_bytes)]
    return sorted(terms, key=lambda n: -n.nbytes)


WARMSTART_TOKENS = 32   # fewer than any warm-start sequence has: the chat template and instruction alone are ~48


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def check_sizes(cfg: Config, shape: ModelShape, device: str, warm_start: bool = False) -> None:
    """Refuses a run whose needs() (or, `warm_start`, the tiny model's warm-start: one SFT batch's float32 logits,
    run while it is built) exceed the machine."""
    have, where = machine_memory(device)
    n = cfg.warmstart.batch_size
    if warm_start and (warm := n * WARMSTART_TOKENS * shape.vocab * 4) > have:
        raise ConfigError(f"the tiny model's warm-start: float32 logits of {n:,} sequences of at least "
                          f"{WARMSTART_TOKENS} tokens over {shape.vocab} tokens need at least {_gb(warm)} of memory, "
                          f"more than {where} ({_gb(have)}); lower warmstart.batch_size (now {n}; 32 is the default)")
    terms = needs(cfg, shape)
    total = sum(t.nbytes for t in terms)
    if total <= have:
        return
    listed = "; ".join(f"{t.what}: {_gb(t.nbytes)}" for t in terms if t.nbytes >= total / 100)
    raise ConfigError(f"this run needs at least {_gb(total)} of memory ({listed}), more than {where} "
                      f"({_gb(have)}); {terms[0].fix}")
