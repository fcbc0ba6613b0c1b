"""Models and tokenizers: load by hub name or local path, or the tiny offline default (tiny.py)."""
from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .settings import ALLOWED, REFUSED, Section, check, setting

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFINES = "it defines the base model, its numerics or its prompts"


@dataclass
class ModelSettings(Section):
    """The `model` section: the base model and tokenizer the trainer and the engine load."""
    name_or_path: str = setting("tiny", "'tiny' builds a ~2.5M-param Qwen3-architecture model offline; "
                                "otherwise a hub name (Qwen/Qwen3-0.6B) or a local model dir.",
                                resume=REFUSED, why=_DEFINES)
    dtype: str = setting("float32", "Trainer weights dtype: float32 | bfloat16 | float16.",
                         resume=REFUSED, why=_DEFINES)
    enable_thinking: bool = setting(False, "Passed to Qwen3's chat template (ignored by the tiny tokenizer).",
                                    resume=REFUSED, why=_DEFINES)
    cache_dir: str = setting("", "Where the tiny model is cached; '' = ~/.cache/lorabench.",
                             resume=ALLOWED, why="where the tiny model is cached; its recipe names the model")

    def problems(self) -> list[str]:
        return check(self.dtype in DTYPES, f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")


class ModelError(ValueError):
    """A model path or name cannot be used; the message says which and how to fix it."""


# what the hub accepts as a repo id: 'name' or 'org/name'; anything else can only be a local path
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")
# where model configs keep their context length, most common first
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


@dataclass(frozen=True)
class ModelRef:
    """What model.name_or_path names, checked without loading weights."""
    kind: str   # 'tiny' | 'local' | 'hub'
    name: str   # the local dir or the hub repo id ('tiny' for the tiny model)


def model_ref(model: ModelSettings) -> ModelRef:
    """'tiny', an existing local model dir, or a hub id usable now; anything else is refused before a run dir exists."""
    name = model.name_or_path
    if name == "tiny":
        return ModelRef("tiny", name)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"model dir {name} has no config.json; point model.name_or_path at a saved "
                             f"Hugging Face model dir")
        return ModelRef("local", str(path))
    where = f"relative to {Path.cwd()}" if not path.is_absolute() else "absolute path"
    if path.exists() or name.startswith((".", "/", "~")) or not _HUB_ID.match(name):
        raise ModelError(f"model.name_or_path={name!r} does not exist ({where}) as a model dir; give an existing "
                         f"model dir, a hub name such as Qwen/Qwen3-0.6B, or 'tiny'")
    from .hub import model_unavailable
    if reason := model_unavailable(name):
        raise ModelError(f"model.name_or_path={name!r} is not a local dir ({where}) and cannot be used as a hub name: "
                         f"{reason}; or give an existing model dir or 'tiny'")
    return ModelRef("hub", name)


def resolve_model_path(model: ModelSettings, warmstart, seed: int, log=print, progress=None) -> str:
    """'tiny' -> the cached warm-started dir (built on first use, `progress` per step); else the dir or hub name."""
    ref = model_ref(model)
    if ref.kind == "tiny":
        from safetensors import SafetensorError

        from .tiny import cache_root, tiny_model_dir
        try:
            return str(tiny_model_dir(model.cache_dir, warmstart, seed, log=log, progress=progress))
        except (OSError, SafetensorError) as err:   # a full or failing disk: the partial build is removed
            where = cache_root(model.cache_dir)
            raise ModelError(f"model.cache_dir: the tiny model could not be written to {where} "
                             f"({type(err).__name__}: {str(err)[:160]}); nothing was left there. Free space on that "
                             f"filesystem, or point model.cache_dir at a writable dir with ~50 MB free") from err
    return ref.name


def model_config(ref: ModelRef):
    """The transformers config of a local or hub model (no weights are read)."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(ref.name)
    except (OSError, ValueError) as err:
        raise ModelError(f"model.name_or_path={ref.name!r}: its config.json cannot be read ({err}); point it at a "
                         f"saved Hugging Face model dir") from err


def model_context(ref: ModelRef) -> int:
    """The model's context length in tokens, from its config (no weights are read)."""
    if ref.kind == "tiny":
        from .tiny import TINY_ARCH
        return TINY_ARCH["max_position_embeddings"]
    config = model_config(ref)
    for key in _CONTEXT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ModelError(f"model.name_or_path={ref.name!r}: its config names no context length "
                     f"({', '.join(_CONTEXT_KEYS)}); set data.max_prompt_tokens to bound prompts yourself")


def model_tokenizer(ref: ModelRef, model: ModelSettings, warmstart, seed: int):
    """The run's tokenizer, without the model (the tiny one built in memory if its model is not cached)."""
    if ref.kind == "tiny":
        from .tiny import tiny_tokenizer
        return tiny_tokenizer(model.cache_dir, warmstart, seed)
    try:
        return load_tokenizer(ref.name)
    except (OSError, ValueError) as err:
        raise ModelError(f"model.name_or_path={ref.name!r}: its tokenizer cannot be loaded ({err}); a model dir "
                         f"needs its tokenizer files (save_pretrained of the tokenizer)") from err


def load_tokenizer(path: str):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str = "float32", device: str = "cpu"):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()


def pick_device(requested: str = "") -> str:
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def quiet_peft():
    """Hides PEFT's FutureWarning about `is_gradient_checkpointing` (PEFT's to fix) and its warning that an adapter
    name inside 'lora_' may load wrongly (lorabench never loads by PEFT's name matching)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="Adapter name .* should not be contained in the prefix",
                                category=UserWarning)
        yield


def with_lora(base, lora_config, adapter_name: str = "default"):
    """PEFT's get_peft_model, quietly (quiet_peft)."""
    from peft import get_peft_model
    with quiet_peft():
        return get_peft_model(base, lora_config, adapter_name=adapter_name)
