"""The adapter as it travels: one flat buffer (`FlatAdapter`), its layout and its plain-JSON config.

Names are PEFT's state-dict names, which PEFT's loader and SGLang's load_lora_adapter_from_tensors accept:
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight      # [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight      # [out, r]
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import itertools
import json
import math
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from .safedir import atomic_dir, write_new_file

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# a trained adapter's dtype whatever model.dtype (PEFT keeps LoRA weights in float32; rundir.checkpoint_problem)
LORA_DTYPE = torch.float32


class AdapterError(ValueError):
    """An adapter (dir, tensors or config) is invalid; the message names the culprit and the fix."""


class AdapterWriteError(OSError):
    """Writing an adapter dir failed (`errno`: the cause's); nothing was replaced. The message names dir and fix."""

    def __str__(self) -> str:   # the message alone: it names the cause itself
        return str(self.strerror)


def split_lora_key(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' -> ('model.layers.0.mlp.up_proj', 'lora_A')."""
    parts = key.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise AdapterError(f"tensor name {key!r} is not a LoRA weight; expected '<module>.lora_A.weight' "
                           f"or '<module>.lora_B.weight' (PEFT state-dict names)")
    return ".".join(parts[:-2]).removeprefix(PEFT_PREFIX), parts[-2]


def base_param_name(peft_param: str) -> str:
    """'base_model.model.model.layers.0.mlp.up_proj.base_layer.weight' -> 'model.layers.0.mlp.up_proj.weight'."""
    return peft_param.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Path):
        return str(value)
    return value


def plain_config(lora_config, modules: list[str] | None = None) -> dict:
    """A PEFT LoraConfig as plain JSON (enums as strings, sets as sorted lists, `peft_type` present). `modules`:
    the leaf names the adapter covers, replacing target modules PEFT resolved to full paths (engines match leaves)."""
    raw = lora_config.to_dict() if hasattr(lora_config, "to_dict") else dict(lora_config)
    target = raw.get("target_modules")
    config = {k: _plain(v) for k, v in raw.items() if k != "target_modules"}
    if isinstance(target, str):
        config["target_modules"] = target
    elif modules is not None:
        config["target_modules"] = sorted(set(modules))
    else:
        config["target_modules"] = sorted({t.split(".")[-1] for t in target})
    config["peft_type"] = str(config.get("peft_type") or "LORA")
    if config.get("task_type") is None:
        config.pop("task_type", None)
    json.dumps(config)  # fails here, not in the engine, if anything is still not JSON
    return config


@dataclass(frozen=True)
class AdapterLayout:
    """Names and shapes of an adapter's tensors, in buffer order (sorted by name)."""
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> AdapterLayout:
        names = tuple(sorted(tensors))
        return cls(names, tuple(tuple(tensors[n].shape) for n in names))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each tensor in the buffer, plus the total at the end."""
        return tuple(itertools.accumulate((math.prod(shape) for shape in self.shapes), initial=0))

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @cached_property
    def modules(self) -> list[str]:
        """The adapted modules' plain names, sorted: the order of every per-module vector (delta_squares)."""
        return sorted({split_lora_key(name)[0] for name in self.names})

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Name -> view of `buffer` (1-D, `numel` elements)."""
        if buffer.dim() != 1 or buffer.numel() != self.numel:
            raise AdapterError(f"flat adapter buffer has shape {tuple(buffer.shape)}; its layout needs "
                               f"{self.numel} elements in one dimension")
        return {name: buffer[start:end].view(shape)
                for name, shape, start, end in zip(self.names, self.shapes, self.offsets, self.offsets[1:])}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(-1) for n in self.names])

    def to_json(self) -> str:
        return json.dumps([[n, list(s)] for n, s in zip(self.names, self.shapes)], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> AdapterLayout:
        try:
            pairs = json.loads(text)
            return cls(tuple(str(n) for n, _ in pairs), tuple(tuple(int(d) for d in s) for _, s in pairs))
        except (json.JSONDecodeError, TypeError, ValueError) as err:
            raise AdapterError(f"adapter layout is not a JSON list of [name, shape] pairs ({err})") from err


@dataclass(frozen=True, eq=False)
class FlatAdapter:
    buffer: torch.Tensor     # [numel] every LoRA tensor back to back, in layout order
    layout: AdapterLayout
    config: dict             # plain-JSON adapter_config.json content
    version: int = 0         # the policy step whose weights these are

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], config: dict, version: int = 0) -> FlatAdapter:
        """Copy separate tensors (PEFT names, one dtype) into a new flat adapter."""
        if not tensors:
            raise AdapterError(_NO_TENSORS)
        dtypes = {t.dtype for t in tensors.values()}
        if len(dtypes) != 1:
            raise AdapterError(f"adapter tensors mix dtypes {sorted(map(str, dtypes))}; cast them to one dtype")
        layout = AdapterLayout.of(tensors)
        return cls(layout.flatten({k: v.detach() for k, v in tensors.items()}), layout, dict(config), version)

    @cached_property
    def tensors(self) -> dict[str, torch.Tensor]:
        """PEFT name -> view of the buffer (lora_A [r, in], lora_B [out, r])."""
        return self.layout.views(self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scaling(self) -> float:
        return float(self.config["lora_alpha"]) / self.rank

    @property
    def modules(self) -> list[str]:
        return self.layout.modules

    def to(self, device=None, dtype=None) -> FlatAdapter:
        return dataclasses.replace(self, buffer=self.buffer.to(device=device, dtype=dtype))

    @cached_property
    def delta_squares(self) -> torch.Tensor:
        """[modules] ‖B·A‖²_F per adapted module in float64, without (α/r)²: Σ (BᵀB) ⊙ (AAᵀ), batched per shape."""
        modules = self.modules
        by_shape: dict[tuple, list[int]] = {}
        halves = [(self.tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"], self.tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"])
                  for m in modules]
        for i, (a, b) in enumerate(halves):
            by_shape.setdefault((a.shape, b.shape), []).append(i)
        out = torch.empty(len(modules), dtype=torch.float64, device=self.buffer.device)
        for index in by_shape.values():
            a = torch.stack([halves[i][0] for i in index]).double()   # [n, r, in]
            b = torch.stack([halves[i][1] for i in index]).double()   # [n, out, r]
            out[index] = ((b.mT @ b) * (a @ a.mT)).sum((1, 2))
        return out.clamp_min(0)

    def delta_norm(self) -> float:
        """‖ΔW‖ over all adapted modules: sqrt(Σ ‖(α/r)·B·A‖²_F); 0 for a fresh adapter (B = 0)."""
        return self.scaling * float(self.delta_squares.sum().sqrt())

    def check_finite(self) -> None:
        """One isfinite over the buffer (one device sync); the slow path names the culprit."""
        if bool(torch.isfinite(self.buffer).all()):
            return
        for name, t in self.tensors.items():
            _check_finite(name, t)

    def save_peft_dir(self, path: str | Path) -> Path:
        """Write adapter_config.json + adapter_model.safetensors into `path` atomically (safedir.atomic_dir);
        a failed write raises AdapterWriteError and leaves the previous dir intact."""
        path = Path(path)
        try:
            with atomic_dir(path, replace=True) as tmp:
                self._write_files(str(tmp / WEIGHTS_NAME), str(tmp / CONFIG_NAME))
        except OSError as err:
            raise _write_error(path, err, self.nbytes) from err
        return path

    def save_into(self, parent, name: str) -> Path:
        """save_peft_dir inside a run dir: `parent` is a safedir.SafeDir, so no link on the way is followed."""
        try:
            with parent.atomic_subdir(name) as tmp:
                self._write_files(WEIGHTS_NAME, CONFIG_NAME, dir_fd=tmp.fd)
        except OSError as err:
            raise _write_error(parent.path / name, err, self.nbytes) from err
        return parent.path / name

    def _write_files(self, weights: str, config: str, dir_fd: int | None = None) -> None:
        _write_flat_safetensors(weights, self.layout, self.buffer, dir_fd)
        write_new_file(config, json.dumps(self.config, indent=1).encode(), dir_fd=dir_fd)

    @classmethod
    def load_peft_dir(cls, path: str | Path, version: int = 0) -> FlatAdapter:
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        path = Path(path)
        if not path.is_dir():
            raise AdapterError(f"adapter dir {path} does not exist; pass a dir written by save_peft_dir or PEFT's "
                               f"save_pretrained")
        for name, fix in ((CONFIG_NAME, "save with save_pretrained"),
                          (WEIGHTS_NAME, "re-save with safe_serialization")):
            if not (path / name).is_file():
                raise AdapterError(f"adapter dir {path} has no {name}; a PEFT adapter dir needs {CONFIG_NAME} "
                                   f"and {WEIGHTS_NAME} ({fix})")
        try:
            config = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise AdapterError(f"{path / CONFIG_NAME} is not valid JSON ({err}); re-save the adapter") from err
        if not isinstance(config, dict):
            raise AdapterError(f"{path / CONFIG_NAME} holds {type(config).__name__}, not a JSON object; re-save "
                               f"the adapter")
        try:
            validate_config(config)
        except AdapterError as err:
            raise AdapterError(f"{path / CONFIG_NAME}: {err}") from err
        try:
            tensors = load_file(str(path / WEIGHTS_NAME))
        except (SafetensorError, OSError) as err:
            raise AdapterError(f"{path / WEIGHTS_NAME} is truncated or corrupt ({err}); re-save the adapter") from err
        return cls.from_tensors(tensors, config, version)


# our own writer: safetensors.torch.save_file refuses tensors sharing one storage (needs a clone of each)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_flat_safetensors(path: Path | str, layout: AdapterLayout, buffer: torch.Tensor, dir_fd=None) -> None:
    """A .safetensors file whose data section is `buffer` as it is."""
    dtype = _SAFETENSORS_DTYPES.get(buffer.dtype)
    if dtype is None:
        raise AdapterError(f"cannot write adapter dtype {buffer.dtype}; use float32, bfloat16 or float16")
    size = buffer.element_size()
    header = {"__metadata__": {"format": "pt"}}
    for name, shape, start, end in zip(layout.names, layout.shapes, layout.offsets, layout.offsets[1:]):
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [start * size, end * size]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    data = buffer.detach().cpu().contiguous().view(torch.uint8).numpy()
    write_new_file(path, len(blob).to_bytes(8, "little"), blob, memoryview(data), dir_fd=dir_fd)


def _write_error(path: Path, err: OSError, nbytes: int = 0) -> AdapterWriteError:
    if err.errno == errno.ENOSPC:
        try:
            free = f"{shutil.disk_usage(path.parent).free} bytes free"
        except OSError:
            free = "free space unknown"
        return AdapterWriteError(errno.ENOSPC, f"no space left to write adapter dir {path} (needs ~{nbytes} "
                                 f"bytes, {free}); the previous adapter is untouched. Free space on that "
                                 f"filesystem, or {_ELSEWHERE}. Cause: {err}")
    return AdapterWriteError(err.errno or errno.EIO, f"writing adapter dir {path} failed ({err}); the previous "
                             f"adapter is untouched. Check that {path.parent} is writable and has space, or "
                             f"{_ELSEWHERE}")


# a run dir stays where it is on resume (run.out_dir cannot be an override there): it moves by a copy
_ELSEWHERE = ("point refresh.file.tmp_dir at a larger one (file refresh), or copy the run dir to one and resume the "
              "copy (a run dir's adapters/)")


def linear_shapes(model) -> dict[str, tuple[int, int]]:
    """Plain-model module name -> (out_features, in_features) for every Linear (PEFT wrappers unwrapped)."""
    shapes = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        linear = isinstance(module, torch.nn.Linear) and weight is not None and weight.dim() == 2
        if linear and ".lora_" not in f".{name}":   # PEFT's own lora_A/lora_B Linears are not the model's layers
            plain = base_param_name(name + ".weight")[: -len(".weight")]
            shapes[plain] = (module.out_features, module.in_features)
    return shapes


def validate_config(cfg: dict, max_rank: int | None = None) -> int:
    """Check an adapter config before its tensors are read; returns the rank."""
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"adapter config peft_type={cfg.get('peft_type')!r}; only LORA adapters are supported "
                           f"(set peft_type='LORA')")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter config r={rank!r}; the rank must be a positive integer")
    alpha = cfg.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"adapter config lora_alpha={alpha!r}; it must be a positive number (PEFT would "
                           f"silently use its default, changing the scaling alpha/r): write the alpha it was "
                           f"trained with")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"adapter rank r={rank} exceeds the engine's max_lora_rank={max_rank}; start the "
                           f"engine with engine.sglang.max_lora_rank>={rank} or train with lora.r<={max_rank}")
    target = cfg.get("target_modules")
    if isinstance(target, list) and any(len(t) == 1 for t in target):
        raise AdapterError(f"adapter config target_modules={target!r} looks like a string split into characters; "
                           f"keep 'all-linear' a string or list module names")
    return rank


def validate(tensors: dict[str, torch.Tensor], config: dict, shapes: dict[str, tuple[int, int]] | None = None,
             max_rank: int | None = None) -> None:
    """Refuse an adapter before it reaches an engine: bad config, missing halves, rank or shape mismatches,
    modules the model lacks, NaN/Inf values."""
    rank = validate_config(config, max_rank)
    if not tensors:
        raise AdapterError(_NO_TENSORS)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, half = split_lora_key(key)
        halves.setdefault(module, {})[half] = tensor
        _check_finite(key, tensor)
    for module, pair in halves.items():
        _check_module(module, pair, rank, config.get("target_modules"), shapes)


_NO_TENSORS = "adapter has no tensors; snapshot a PEFT model that has a LoRA adapter"


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"adapter tensor {name} has NaN/Inf values; the update diverged (lower grpo.lr or check "
                           f"the loss) and it was not sent to the engine")


def _check_module(module: str, pair: dict, rank: int, target, shapes) -> None:
    if set(pair) != {"lora_A", "lora_B"}:
        raise AdapterError(f"module {module} has only {sorted(pair)}; each module needs lora_A and lora_B")
    a, b = pair["lora_A"], pair["lora_B"]
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterError(f"module {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match rank "
                           f"r={rank}; the config and the tensors disagree")
    leaf = module.split(".")[-1]
    if isinstance(target, list) and leaf not in target:
        raise AdapterError(f"module {module} is not in target_modules={target}; add '{leaf}' to target_modules or "
                           f"drop its tensors")
    if shapes is None:
        return
    if module not in shapes:
        raise AdapterError(f"adapter targets {module}, which the base model does not have; train the adapter on "
                           f"this base model")
    out_f, in_f = shapes[module]
    if a.shape[1] != in_f or b.shape[0] != out_f:
        raise AdapterError(f"module {module}: adapter maps {a.shape[1]}->{b.shape[0]} but the base layer is "
                           f"{in_f}->{out_f}; the adapter was trained on another model")


@torch.no_grad()
def merge_weights(base: dict[str, torch.Tensor], adapter: FlatAdapter, adapted_only: bool = False) -> dict:
    """Plain-model state dict with W + (α/r)·B·A for every adapted layer, out of place (PEFT's merge/unmerge
    would drift bf16 base weights). `adapted_only`: only the adapted layers' weights."""
    merged = {} if adapted_only else dict(base)
    for module in adapter.modules:
        name = f"{module}.weight"
        if name not in base:
            raise AdapterError(f"adapter targets {module}, which the base weights do not have")
        w = base[name]
        a = adapter.tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"].to(w.device).float()
        b = adapter.tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"].to(w.device).float()
        merged[name] = torch.addmm(w.float(), b, a, alpha=adapter.scaling).to(w.dtype)  # one fp32 rounding
    return merged


def base_weights(peft_model) -> dict[str, torch.Tensor]:
    """The trainer's frozen base weights by plain-model name (views, no copy)."""
    return {base_param_name(n): p.detach() for n, p in peft_model.named_parameters() if ".lora_" not in n}
