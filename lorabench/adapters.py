"""Adapter snapshots: the LoRA weights of a PEFT model, detached from training, with engine-facing
names and a plain-JSON config, ready to be written as a PEFT dir or handed to an engine as tensors.

Names are PEFT's state-dict names (`get_peft_model_state_dict`), the contract both PEFT's loader
and SGLang's `load_lora_adapter_from_tensors` accept:
    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight      # [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight      # [out, r]
Trainer parameter names differ (`...q_proj.lora_A.default.weight`, `...q_proj.base_layer.weight`);
the functions below map between them explicitly rather than by string accident.
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter (dir, tensors or config) is invalid; the message names the culprit and the fix."""


class AdapterWriteError(OSError):
    """Writing an adapter dir failed (disk full, read-only or missing filesystem); `errno` is the
    cause's (ENOSPC for a full disk) and the message names the dir and the fix. Nothing was
    replaced: the previous dir at that path, if any, is intact."""


# --- names -------------------------------------------------------------------------------------
def split_lora_key(key: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' -> ('model.layers.0.mlp.up_proj', 'lora_A')."""
    parts = key.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise AdapterError(f"tensor name {key!r} is not a LoRA weight; expected '<module>.lora_A.weight' "
                           f"or '<module>.lora_B.weight' (PEFT state-dict names)")
    module = ".".join(parts[:-2])
    if module.startswith(PEFT_PREFIX):
        module = module[len(PEFT_PREFIX):]
    return module, parts[-2]


def base_param_name(peft_param: str) -> str:
    """Trainer (PEFT-wrapped) parameter name -> the plain model's name:
    'base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight' -> 'model.layers.0.self_attn.q_proj.weight'."""
    name = peft_param[len(PEFT_PREFIX):] if peft_param.startswith(PEFT_PREFIX) else peft_param
    return name.replace(".base_layer.", ".")


# --- config ------------------------------------------------------------------------------------
def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(_plain(v) for v in value) if isinstance(value, (set, frozenset)) else [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Path):
        return str(value)
    return value


def plain_config(lora_config, modules: list[str] | None = None) -> dict:
    """A PEFT LoraConfig as plain JSON: enums as strings, `peft_type` present, sets as sorted lists,
    and a string `target_modules` ('all-linear') kept a string (never list('all-linear')).
    When PEFT has resolved 'all-linear' to full module paths, `modules` (the leaf names the adapter
    really covers) replaces them, since engines match target modules by leaf name."""
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


# --- the snapshot ------------------------------------------------------------------------------
@dataclass
class AdapterSnapshot:
    tensors: dict[str, torch.Tensor]  # PEFT state-dict name -> tensor (lora_A [r, in], lora_B [out, r])
    config: dict                      # plain-JSON adapter_config.json content
    step: int = 0
    flat: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)
    # ^ set when `tensors` are consecutive views of one 1-D buffer (FlatSnapshotter)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scaling(self) -> float:
        return float(self.config["lora_alpha"]) / self.rank

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def modules(self) -> list[str]:
        return sorted({split_lora_key(k)[0] for k in self.tensors})

    def to(self, device=None, dtype=None) -> "AdapterSnapshot":
        return AdapterSnapshot({k: v.to(device=device, dtype=dtype) for k, v in self.tensors.items()},
                               dict(self.config), self.step)

    def delta_norm(self) -> float:
        """‖ΔW‖ over all adapted modules: sqrt(Σ ‖(α/r)·B·A‖²_F); 0 for a fresh adapter (B = 0)."""
        total = 0.0
        for module in self.modules:
            a = self.tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"].float()
            b = self.tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"].float()
            total += float((self.scaling * (b @ a)).pow(2).sum())
        return total ** 0.5

    @classmethod
    def from_peft(cls, model, adapter_name: str = "default", step: int = 0) -> "AdapterSnapshot":
        from peft import get_peft_model_state_dict
        state = get_peft_model_state_dict(model, adapter_name=adapter_name)
        tensors = {k: v.detach().clone() for k, v in state.items()}
        modules = sorted({split_lora_key(k)[0].split(".")[-1] for k in tensors})
        return cls(tensors, plain_config(model.peft_config[adapter_name], modules), step)

    def save_peft_dir(self, path: str | Path) -> Path:
        """Write adapter_config.json + adapter_model.safetensors into `path` atomically: a temp dir
        (0700, files 0600, fsynced) in the same parent is renamed onto `path`; an existing `path`
        is swapped out first. A crash leaves either the old dir, the new dir or nothing, never a
        torn one. What a killed writer leaves are hidden siblings named `.<name>.tmp-<pid>-*` /
        `.<name>.old-<pid>-*` (never loadable candidates); the next write to `path` removes those
        whose writer process is gone. A failed write (disk full) raises AdapterWriteError."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent, (f".{path.name}.tmp-", f".{path.name}.old-"))
        pid = os.getpid()
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{pid}-", dir=path.parent))  # mkdtemp: 0700
        except OSError as err:
            raise _write_error(path, err) from err
        try:
            if self.flat is not None:  # one buffer: one device->host copy and one write
                _write_flat_safetensors(tmp / WEIGHTS_NAME, self.tensors, self.flat)
            else:
                weights = {k: v.detach().contiguous().cpu() for k, v in self.tensors.items()}
                save_file(weights, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            _write_private(tmp / CONFIG_NAME, json.dumps(self.config, indent=1).encode())
            os.chmod(tmp / WEIGHTS_NAME, 0o600)
            _fsync(tmp / WEIGHTS_NAME)
            _fsync_dir(tmp)
            if path.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-{pid}-", dir=path.parent))
                os.rename(path, old / "dir")
                try:
                    os.rename(tmp, path)
                except OSError:
                    os.rename(old / "dir", path)  # put the previous dir back
                    shutil.rmtree(old, ignore_errors=True)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, path)
            _fsync_dir(path.parent)
        except (SafetensorError, OSError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _write_error(path, err, self.nbytes) from err
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    @classmethod
    def load_peft_dir(cls, path: str | Path) -> "AdapterSnapshot":
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        path = Path(path)
        if not path.is_dir():
            raise AdapterError(f"adapter dir {path} does not exist; pass a dir written by save_peft_dir "
                               f"or PEFT's save_pretrained")
        if not (path / CONFIG_NAME).is_file():
            raise AdapterError(f"adapter dir {path} has no {CONFIG_NAME}; a PEFT adapter dir needs "
                               f"{CONFIG_NAME} and {WEIGHTS_NAME} (save with save_pretrained)")
        if not (path / WEIGHTS_NAME).is_file():
            raise AdapterError(f"adapter dir {path} has no {WEIGHTS_NAME}; re-save the adapter with "
                               f"safe_serialization (the default)")
        try:
            config = json.loads((path / CONFIG_NAME).read_text())
        except json.JSONDecodeError as err:
            raise AdapterError(f"{path / CONFIG_NAME} is not valid JSON ({err}); re-save the adapter") from err
        try:
            tensors = load_file(str(path / WEIGHTS_NAME))
        except (SafetensorError, OSError) as err:
            raise AdapterError(f"{path / WEIGHTS_NAME} is truncated or corrupt ({err}); re-save the "
                               f"adapter") from err
        return cls(tensors, config)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _write_flat_safetensors(path: Path, tensors: dict[str, torch.Tensor], flat: torch.Tensor) -> None:
    """A .safetensors file whose data section is `flat` as it is: `tensors` must be consecutive views
    of `flat` in key order (FlatSnapshotter builds them so). safetensors' own writer refuses tensors
    that share storage and copies each one; the format itself is just a JSON header and the bytes."""
    dtype = _SAFETENSORS_DTYPES.get(flat.dtype)
    if dtype is None:
        raise AdapterError(f"cannot write adapter dtype {flat.dtype}; use float32, bfloat16 or float16")
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if offset != flat.numel() * flat.element_size():
        raise AdapterError("adapter tensors are not the whole flat buffer; snapshot with FlatSnapshotter")
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    data = flat.detach().cpu().contiguous().view(torch.uint8).numpy()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        fh.write(memoryview(data))


def _write_error(path: Path, err: BaseException, nbytes: int = 0) -> AdapterWriteError:
    """A clear AdapterWriteError for a failed adapter write (safetensors reports ENOSPC as text)."""
    code = getattr(err, "errno", None)
    if code is None and ("No space left" in str(err) or "os error 28" in str(err)):
        code = errno.ENOSPC
    if code == errno.ENOSPC:
        try:
            free = f"{shutil.disk_usage(path.parent).free} bytes free"
        except OSError:
            free = "free space unknown"
        return AdapterWriteError(errno.ENOSPC, f"no space left to write adapter dir {path} (needs ~{nbytes} "
                                 f"bytes, {free}); the previous adapter is untouched. Free space on that "
                                 f"filesystem or point refresh.tmp_dir (file refresh) / run.out_dir (run "
                                 f"dirs) at a larger one. Cause: {err}")
    return AdapterWriteError(code or errno.EIO, f"writing adapter dir {path} failed ({err}); the previous "
                             f"adapter is untouched. Check that {path.parent} is writable and has space, or "
                             f"set refresh.tmp_dir / run.out_dir elsewhere")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temps(parent: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """Remove entries of `parent` named `<prefix><pid>-...` (or `<prefix><pid>.`) whose writer
    process `pid` is dead: the garbage a killed atomic write leaves. A live writer's temps (this
    process's included) are never touched. Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        prefix = next((p for p in prefixes if entry.name.startswith(p)), None)
        if prefix is None:
            continue
        head = entry.name[len(prefix):].replace(".", "-").split("-", 1)[0]
        if not head.isdigit() or int(head) == os.getpid() or _pid_alive(int(head)):
            continue
        target = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
        removed.append(target)
    return removed


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- validation --------------------------------------------------------------------------------
def linear_shapes(model) -> dict[str, tuple[int, int]]:
    """Plain-model module name -> (out_features, in_features) for every Linear (PEFT wrappers unwrapped)."""
    shapes = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if ".lora_" in f".{name}":  # PEFT's own lora_A/lora_B Linears are not layers of the model
            continue
        if isinstance(module, torch.nn.Linear) and weight is not None and weight.dim() == 2:
            plain = base_param_name(name + ".weight")[: -len(".weight")]
            shapes[plain] = (module.out_features, module.in_features)
    return shapes


def validate(snapshot: AdapterSnapshot, shapes: dict[str, tuple[int, int]] | None = None,
             max_rank: int | None = None) -> None:
    """Refuse an adapter before anything is sent to an engine: wrong config, missing halves,
    rank or shape mismatches, modules the model lacks, NaN/Inf values."""
    cfg = snapshot.config
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"adapter config peft_type={cfg.get('peft_type')!r}; only LORA adapters are "
                           f"supported (set peft_type='LORA')")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter config r={rank!r}; the rank must be a positive integer")
    if max_rank is not None and rank > max_rank:
        raise AdapterError(f"adapter rank r={rank} exceeds the engine's max_lora_rank={max_rank}; start the "
                           f"engine with engine.max_lora_rank>={rank} or train with lora.r<={max_rank}")
    target = cfg.get("target_modules")
    if isinstance(target, list) and any(len(t) == 1 for t in target):
        raise AdapterError(f"adapter config target_modules={target!r} looks like a string split into "
                           f"characters; keep 'all-linear' a string or list module names")
    if not snapshot.tensors:
        raise AdapterError("adapter has no tensors; snapshot a PEFT model that has a LoRA adapter")
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in snapshot.tensors.items():
        module, half = split_lora_key(key)
        halves.setdefault(module, {})[half] = tensor
        if not torch.isfinite(tensor).all():
            raise AdapterError(f"adapter tensor {key} has NaN/Inf values; the update diverged (lower "
                               f"grpo.lr or check the loss) and it was not sent to the engine")
    for module, pair in halves.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"module {module} has only {sorted(pair)}; each module needs lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(f"module {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                               f"match rank r={rank}; the config and the tensors disagree")
        leaf = module.split(".")[-1]
        if isinstance(target, list) and leaf not in target:
            raise AdapterError(f"module {module} is not in target_modules={target}; add '{leaf}' to "
                               f"target_modules or drop its tensors")
        if shapes is not None:
            if module not in shapes:
                raise AdapterError(f"adapter targets {module}, which the base model does not have; "
                                   f"train the adapter on this base model")
            out_f, in_f = shapes[module]
            if a.shape[1] != in_f or b.shape[0] != out_f:
                raise AdapterError(f"module {module}: adapter maps {a.shape[1]}->{b.shape[0]} but the base "
                                   f"layer is {in_f}->{out_f}; the adapter was trained on another model")


# --- fast snapshots ----------------------------------------------------------------------------
class FlatSnapshotter:
    """Snapshots of one PEFT model's adapter as views of a single flat buffer: one `cat` copies every
    LoRA tensor, one `isfinite` checks them all and one device sync reads the answer, instead of a
    clone and a sync per tensor (the 0.6B-shape adapter has 392). The structure (names, rank, shapes,
    target modules) is validated once, on the first snapshot; later snapshots only check values.

    `snapshot()` returns the trainer-dtype snapshot (checkpoints and metrics use it); `views(buffer)`
    lays the same names and shapes over another flat buffer (e.g. one cast to the engine's dtype)."""

    def __init__(self, peft_model, adapter_name: str = "default", max_rank: int | None = None):
        self.model, self.adapter_name = peft_model, adapter_name
        first = AdapterSnapshot.from_peft(peft_model, adapter_name)
        validate(first, linear_shapes(peft_model), max_rank)
        self.config = first.config
        self.names = sorted(first.tensors)
        self.shapes = {k: tuple(first.tensors[k].shape) for k in self.names}
        self._owners = self._lora_linears()

    def _lora_linears(self) -> list:
        """The nn.Linear holding each tensor (PEFT's lora_A[adapter] / lora_B[adapter]), in `names`
        order. Reading `.weight` from them each time sees a replaced Parameter, and costs ~0.5 ms
        for 392 tensors where walking named_parameters() of a 0.6B model costs several ms."""
        owners = {}
        for module_name, module in self.model.named_modules():
            for half in ("lora_A", "lora_B"):
                table = getattr(module, half, None)
                if isinstance(table, torch.nn.ModuleDict) and self.adapter_name in table:
                    owners[f"{module_name}.{half}.weight"] = table[self.adapter_name]
        missing = [n for n in self.names if n not in owners]
        if missing:
            raise AdapterError(f"cannot map adapter tensors to the trainer's LoRA layers, e.g. {missing[:2]}; "
                               f"the model's LoRA layers changed after the refresher was created")
        return [owners[n] for n in self.names]

    @torch.no_grad()
    def snapshot(self, step: int = 0) -> AdapterSnapshot:
        tensors = [owner.weight.detach() for owner in self._owners]
        for name, t in zip(self.names, tensors):
            if tuple(t.shape) != self.shapes[name]:
                raise AdapterError(f"adapter tensor {name} changed shape {self.shapes[name]} -> {tuple(t.shape)} "
                                   f"since the first refresh; start a new refresher for a new adapter")
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if not bool(torch.isfinite(flat).all()):
            for name, t in zip(self.names, tensors):  # the slow path names the culprit
                if not torch.isfinite(t).all():
                    raise AdapterError(f"adapter tensor {name} has NaN/Inf values; the update diverged (lower "
                                       f"grpo.lr or check the loss) and it was not sent to the engine")
        return AdapterSnapshot(self.views(flat), dict(self.config), step, flat=flat)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, offset = {}, 0
        for name in self.names:
            shape = self.shapes[name]
            n = shape[0] * shape[1]
            views[name] = flat[offset:offset + n].view(shape)
            offset += n
        if offset != flat.numel():
            raise AdapterError(f"flat buffer has {flat.numel()} elements, the adapter {offset}")
        return views


# --- merged weights (the full-weight baseline) ---------------------------------------------------
@torch.no_grad()
def merged_state_dict(peft_model, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """Plain-model state dict with W + (α/r)·B·A for every LoRA layer, computed out of place.
    Equivalent to merge_adapter() / read / unmerge_adapter() but leaves the trainer's base weights
    bit-identical (merge + unmerge in bf16 drifts them a little every step)."""
    merged = {}
    lora_modules = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and adapter_name in getattr(module, "lora_A", {}):
            lora_modules[name] = module
    for name, param in peft_model.named_parameters():
        if ".lora_" in name:
            continue
        plain = base_param_name(name)
        owner = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if owner in lora_modules:
            layer = lora_modules[owner]
            a = layer.lora_A[adapter_name].weight.float()
            b = layer.lora_B[adapter_name].weight.float()
            scale = layer.scaling[adapter_name]
            merged[plain] = (param.float() + scale * (b @ a)).to(param.dtype)
        else:
            merged[plain] = param.detach()
    return merged
