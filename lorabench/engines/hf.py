"""The reference engine: transformers + PEFT in this process (CPU or GPU), its own copy of the base weights,
SGLang's semantics (base.py). The offline default; it has every optional capability (memory release a no-op).
"""
from __future__ import annotations

import dataclasses
import functools
import re
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import LogitsProcessor, LogitsProcessorList, TopPLogitsWarper

from ..adapters import FlatAdapter, base_param_name, linear_shapes, validate
from ..interrupts import interrupts_deferred
from ..models import load_model, pick_device, quiet_peft, with_lora
from ..settings import ALLOWED, Section, check, setting
from .base import (
    SERVED,
    Completion,
    EngineError,
    Sampling,
    check_loaded,
    check_new,
    check_same_lora_config,
)


def _copy_checked(params: dict[str, torch.Tensor], named_tensors, what: str, naming_hint: str) -> None:
    """Copy each (name, tensor) into params[name], every name and shape checked first (a bad one writes nothing)."""
    named_tensors = list(named_tensors)
    for name, tensor in named_tensors:
        if name not in params:
            raise EngineError(f"{what}: the model has no parameter {name!r}; {naming_hint}")
        if params[name].shape != tensor.shape:
            raise EngineError(f"{what}: {name} has shape {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
    for name, tensor in named_tensors:
        params[name].copy_(tensor)


class DrawToken(LogitsProcessor):
    """Draws the next token from softmax(top_p(logits / temperature)) with the call's own generator and leaves it
    the only finite score, so greedy decoding takes it (transformers would sample from the global RNG)."""

    def __init__(self, sampling: Sampling, generator: torch.Generator | None):
        self.temperature, self.generator = sampling.temperature, generator
        self.top_p = TopPLogitsWarper(sampling.top_p) if sampling.top_p < 1 else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores / self.temperature
        if self.top_p is not None:
            scores = self.top_p(input_ids, scores)
        token = torch.multinomial(torch.softmax(scores, -1), 1, generator=self.generator)
        return torch.full_like(scores, -torch.inf).scatter_(1, token, 0.0)


_DEVICE = re.compile(r"^(cpu|cuda|cuda:\d+|mps)?$")


@dataclass
class HFSettings(Section):
    """The `engine.hf` section."""
    device: str = setting("", "Device of the hf engine (and of the trainer beside it); '' = cuda if available, "
                          "else cpu.", resume=ALLOWED, why=SERVED)

    def problems(self) -> list[str]:
        return check(bool(_DEVICE.match(self.device)),
                     f"engine.hf.device={self.device!r}: use '', cpu, cuda, cuda:N or mps")


def _serialized(method):
    """One call at a time, without autograd (sampling ahead runs beside the refresh that writes the adapter):
    each call sees the adapter whole, before or after a write."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock, torch.no_grad():
            return method(self, *args, **kwargs)
    return call


class HFEngine:
    Settings = HFSettings
    name = "hf"
    help = "transformers + PEFT in this process (CPU or GPU): the offline default and the reference"
    max_lora_rank = None     # PEFT holds any rank
    adapter_dtype = None     # keeps what it is sent: the trainer's dtype, so its weights equal the trainer's
    GENERATE_BATCH = 128     # sequences generated at once: the logits of all their positions are kept

    def __init__(self, model_path: str, device: str = "", dtype: str = "float32"):
        self.device, self.dtype, self.model_path = pick_device(device), dtype, model_path
        self._lock = threading.RLock()
        self._base = load_model(model_path, self.dtype, self.device).requires_grad_(False)
        self._peft = None                      # PeftModel once an adapter is installed
        self._adapters: dict[str, dict] = {}  # name -> config
        self._versions: dict[str | None, int] = {None: 0}  # adapter name (None: base weights) -> version
        self._shapes = linear_shapes(self._base)
        self._released = False
        gen = self._base.generation_config
        self.eos_ids = set(gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
        self.pad_id = gen.pad_token_id if gen.pad_token_id is not None else next(iter(self.eos_ids))

    @staticmethod
    def needs_problems(settings: HFSettings, needs) -> list[str]:
        return []   # PEFT holds any rank and target list

    @staticmethod
    def check_available(settings: HFSettings, capabilities=()) -> None:
        device = settings.device   # transformers and PEFT are lorabench's own dependencies
        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise EngineError(f"engine.hf.device={device!r}, but torch sees no CUDA GPU here (torch "
                                  f"{torch.__version__}); use engine.hf.device=cpu or '' (= cuda if available, "
                                  f"else cpu)")
            index, count = int(device.partition(":")[2] or 0), torch.cuda.device_count()
            if index >= count:
                raise EngineError(f"engine.hf.device={device!r}, but torch sees {count} CUDA GPU(s) here (cuda:0 to "
                                  f"cuda:{count - 1}); pick one of those")

    @staticmethod
    def device_of(settings: HFSettings) -> str:
        return pick_device(settings.device)

    @classmethod
    def process_memory(cls, settings: HFSettings, needs, vocab: int, base_weight_bytes: int) -> list[tuple]:
        """(what, bytes, fix) it allocates beside the trainer: the base weights and one generate chunk's logits."""
        chunk, tokens = min(cls.GENERATE_BATCH, needs.largest_batch or cls.GENERATE_BATCH), needs.max_new_tokens
        return [(f"the hf engine's logits ({chunk} sequences x {tokens} tokens x {vocab:,} vocab, float32)",
                 chunk * tokens * vocab * 4, f"lower grpo.max_new_tokens (now {tokens})"),
                ("the hf engine's copy of the base weights", base_weight_bytes,
                 "use a smaller model, or model.dtype=bfloat16")]

    @classmethod
    def from_settings(cls, model_path: str, settings: HFSettings, needs, **overrides) -> HFEngine:
        """Its base weights in the trainer's dtype, so its log-probs equal the trainer's."""
        return cls(model_path, **{"device": settings.device, "dtype": needs.model_dtype, **overrides})

    def loaded_adapters(self) -> list[str]:
        return sorted(self._adapters)

    @_serialized
    def served_version(self, adapter: str | None) -> int | None:
        return self._versions.get(adapter)

    def load_adapter(self, name: str, path: Path, version: int = 0) -> None:
        self.load_adapter_tensors(name, FlatAdapter.load_peft_dir(path, version))

    @_serialized
    def load_adapter_tensors(self, name: str, adapter: FlatAdapter) -> None:
        check_new(name, self._adapters)
        from peft import LoraConfig, set_peft_model_state_dict
        tensors, config = adapter.tensors, adapter.config
        validate(tensors, config, self._shapes)
        known = {f.name for f in dataclasses.fields(LoraConfig)}   # keys this PEFT version knows
        lora_config = LoraConfig(**{**{k: v for k, v in config.items() if k in known and k != "peft_type"},
                                    "inference_mode": True})
        with interrupts_deferred():   # PEFT's adapter and this engine's record of it change together
            if self._peft is None:
                self._peft = with_lora(self._base, lora_config, adapter_name=name)
            else:
                with quiet_peft():
                    self._peft.add_adapter(name, lora_config)
            result = set_peft_model_state_dict(self._peft, tensors, adapter_name=name)
            unexpected = [k for k in result.unexpected_keys if "lora_" in k]
            missing = [k for k in result.missing_keys if f".{name}." in k and "lora_" in k]
            if unexpected or missing:
                self._drop(name)
                raise EngineError(f"adapter {name!r}: tensors do not fit the model with its config "
                                  f"({len(unexpected)} unexpected, e.g. {unexpected[:3]}; {len(missing)} missing, "
                                  f"e.g. {missing[:3]}); the tensors and the config's target_modules / "
                                  f"layers_to_transform must name the same modules, with PEFT state-dict names "
                                  f"('base_model.model.<module>.lora_A.weight')")
            self._adapters[name] = config
            self._versions[name] = adapter.version
            self._peft.eval()

    @_serialized
    def update_adapter_in_place(self, name: str, adapter: FlatAdapter) -> dict[str, float]:
        """Copy new values into adapter `name`'s PEFT parameters (all checked before any is written)."""
        check_loaded(name, self._adapters, "; load it before updating it in place")
        check_same_lora_config(name, self._adapters[name], adapter.config)
        adapter.check_finite()  # a direct caller gets the load path's refusal of NaN/Inf too
        tensors, tag = adapter.tensors, f".{name}."
        params = {pname.replace(".lora_A" + tag, ".lora_A.").replace(".lora_B" + tag, ".lora_B."): param
                  for pname, param in self._peft.named_parameters()
                  if ".lora_A" + tag in pname or ".lora_B" + tag in pname}
        if len(tensors) != len(params):
            raise EngineError(f"in-place update of {name!r}: got {len(tensors)} tensors for {len(params)} LoRA "
                              f"parameters; send the whole adapter")
        with interrupts_deferred():   # never half the new values under the old version
            _copy_checked(params, tensors.items(), f"in-place update of {name!r}",
                          "send PEFT state-dict names ('base_model.model.<module>.lora_A.weight') of the loaded "
                          "adapter")
            self._versions[name] = adapter.version
        return {}

    @_serialized
    def unload_adapter(self, name: str) -> None:
        check_loaded(name, self._adapters)
        with interrupts_deferred():
            self._drop(name)

    def _drop(self, name: str) -> None:
        self._adapters.pop(name, None)
        self._versions.pop(name, None)
        if not self._adapters:
            # PEFT cannot run with zero adapters; strip the LoRA layers and serve the plain model
            self._base, self._peft = self._peft.unload(), None
        else:
            if name in self._peft.active_adapters:   # PEFT warns when the active one goes; any other will do
                self._peft.set_adapter(next(iter(self._adapters)))
            self._peft.delete_adapter(name)

    def _model_for(self, adapter: str | None):
        """(module, context) for a request: named adapter active, or the base model explicitly."""
        if adapter is None:
            return (self._base, nullcontext()) if self._peft is None else (self._peft, self._peft.disable_adapter())
        check_loaded(adapter, self._adapters, "; a request named it")
        self._peft.set_adapter(adapter)
        return self._peft, nullcontext()

    @_serialized
    def update_weights(self, named_tensors, flush_cache: bool = True, version: int | None = None) -> None:
        params = {base_param_name(n): p for n, p in self._base.named_parameters() if ".lora_" not in n}
        with interrupts_deferred():   # never half the new weights under the old version
            _copy_checked(params, named_tensors, "update_weights",
                          "send plain-model names such as 'model.layers.0.self_attn.q_proj.weight'")
            # flush_cache: this engine keeps no prefix cache between calls, nothing to flush
            if version is not None:
                self._versions[None] = version

    @_serialized
    def generate_served(self, prompt_ids, sampling: Sampling, adapter: str | None) -> tuple[list[Completion], int]:
        return self.generate(prompt_ids, sampling, adapter), self._versions.get(adapter)

    @_serialized
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, adapter: str | None) -> list[Completion]:
        model, ctx = self._model_for(adapter)
        out: list[Completion] = []
        # the call's own generator: its draws depend on its inputs only (training may run on another thread)
        generator = None if sampling.seed is None else torch.Generator(self.device).manual_seed(sampling.seed)
        with ctx:
            for start in range(0, len(prompt_ids), self.GENERATE_BATCH):
                out += self._generate_chunk(model, prompt_ids[start:start + self.GENERATE_BATCH], sampling, generator)
        return out

    def _padded(self, rows: list[list[int]], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention mask) [B, W] on the CPU; left padding: every row ends at the same column."""
        pad = functools.partial(pad_sequence, batch_first=True, padding_side="left" if left else "right")
        ids = pad([torch.tensor(row, dtype=torch.long) for row in rows], padding_value=self.pad_id)
        return ids, pad([torch.ones(len(row), dtype=torch.long) for row in rows])

    def _generate_chunk(self, model, prompts: list[list[int]], sampling: Sampling, generator) -> list[Completion]:
        ids, mask = self._padded(prompts, left=True)
        width = ids.shape[1]
        greedy = sampling.temperature == 0
        draws = [] if greedy else [DrawToken(sampling, generator)]   # then generate picks the drawn token
        gen = model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                             max_new_tokens=sampling.max_new_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, logits_processor=LogitsProcessorList(draws),
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids))
        new = gen.sequences[:, width:].cpu()                                   # [B, T]
        temp = 1.0 if greedy else sampling.temperature
        logits = torch.stack(gen.logits, dim=1).float().cpu() / temp           # [B, T, V]
        logprobs = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]  # [B, T]
        completions = []
        for i, p in enumerate(prompts):   # each up to its first stop token, included
            row = new[i].tolist()
            stop = next((t for t, token in enumerate(row) if token in self.eos_ids), None)
            end = len(row) if stop is None else stop + 1
            completions.append(Completion(list(p), row[:end], logprobs[i, :end].tolist(),
                                          "length" if stop is None else "stop"))
        return completions

    @_serialized
    def score(self, sequences, prompt_lens, adapter, temperature: float = 1.0) -> list[torch.Tensor]:
        model, ctx = self._model_for(adapter)
        ids, mask = self._padded(sequences, left=False)
        with ctx:
            logits = model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
        logprobs = torch.log_softmax(logits.float() / temperature, -1)[:, :-1]          # [B, W-1, V]
        token_lp = logprobs.gather(-1, ids[:, 1:, None].to(logprobs.device))[..., 0].cpu()  # [B, W-1]
        return [token_lp[i, prompt_lens[i] - 1: len(s) - 1] for i, s in enumerate(sequences)]

    def release_memory(self, tags: list[str]) -> None:
        if self._released:
            raise EngineError("release_memory called twice; resume_memory first")
        self._released = True  # weights stay resident: on a CPU there is nothing worth releasing

    def resume_memory(self) -> None:
        if not self._released:
            raise EngineError("resume_memory without release_memory; only what was released is resumed")
        self._released = False

    def close(self) -> None:
        self._peft = self._base = None
        self._adapters.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
