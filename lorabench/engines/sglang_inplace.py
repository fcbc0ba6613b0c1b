"""In-place adapter refresh for SGLang: a weight loader that runs inside the engine's scheduler
process (one per tensor-parallel rank) and writes a refreshed adapter straight into the engine's
GPU LoRA pool, the buffers its LoRA kernels read.

Why: SGLang's public path (`unload_lora_adapter` + `load_lora_adapter_from_tensors`) copies every
tensor to the host one by one (`.cpu()` in its LoRAAdapter), stacks q/k/v and gate/up there, and
copies the result back into the GPU pool when a batch first uses the new adapter id (with a fresh
pinned copy per tensor). For data that starts on the GPU that is two host round trips per step.

How: SGLang's `update_weights_from_tensor(named_tensors, load_format=<dotted path>)` calls a
custom loader `fn(model, named_tensors)` in each scheduler process, if the engine was started with
`custom_weight_loader=[<dotted path>]`. This loader
 1. finds the engine's LoRAManager (it holds the model; found once per process, then cached);
 2. groups the tensors per layer and normalises them with SGLang's own code (q/k/v and gate/up
    stacked exactly as a normal load would);
 3. refuses names, layouts or shapes that differ from the loaded adapter (nothing is written);
 4. if the adapter occupies a pool slot, copies into that slot with SGLang's own
    `load_lora_weight_to_buffer` (so tensor-parallel slicing is SGLang's too);
 5. updates the engine's host copy of the adapter (what the pool reloads from after an eviction),
    with non-blocking copies into pinned buffers, then synchronises the stream so the sender may
    reuse its buffer.
The adapter keeps its id, so prefix-cache entries computed with the old values would be reused:
the caller must flush the cache (SGLangEngine.update_adapter_in_place passes flush_cache=True).

Errors: SGLang calls custom loaders without a try/except, and an exception in a scheduler kills
the whole process tree (the user's notebook kernel included). So every check happens before
anything is written and raises InPlaceRefused, which the loader turns into a message written to
a small status tensor the caller sends along (a GPU buffer shared through CUDA IPC): b"OK" on
success, the reason otherwise. The caller raises EngineError with it.

Tied to SGLang internals verified on 0.5.17 (LoRAManager.loras / memory_pool / lora_modules,
LoRAAdapter._normalize_weights, LoRAMemoryPool.load_lora_weight_to_buffer). A version without them
fails here with a message, and refresh.mode=tensor is the public fallback.
"""
from __future__ import annotations

import gc
import json
import math
import time
import warnings
from types import SimpleNamespace

import torch

LOADER = "lorabench.engines.sglang_inplace.write_adapter_in_place"
PREFIX = "lorabench-inplace/"   # tensor names: PREFIX + <engine adapter id> + "/" + <PEFT name>
STATUS = PREFIX + "status"      # uint8 [STATUS_BYTES] on the GPU: the loader's reply
STATUS_BYTES = 2048


class InPlaceRefused(ValueError):
    """The update does not fit the loaded adapter (or this SGLang); nothing was written."""


def status_tensor(device="cuda") -> torch.Tensor:
    return torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=device)


def read_status(status: torch.Tensor) -> str:
    """'OK', the loader's refusal, or '' if the loader never ran."""
    return bytes(status.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")


def _write_status(status: torch.Tensor, message: str) -> None:
    data = message.encode()[: STATUS_BYTES - 1]
    status.zero_()
    status[: len(data)].copy_(torch.tensor(list(data), dtype=torch.uint8))

_managers: dict[int, object] = {}  # id(model) -> its LoRAManager, per scheduler process


FLAT = "flat:"                  # ... + <id> + "/flat:" + JSON [[PEFT name, shape], ...]: one buffer


def tensor_name(lora_id: str, peft_name: str) -> str:
    return f"{PREFIX}{lora_id}/{peft_name}"


def flat_name(lora_id: str, layout: list) -> str:
    """The name of one flat tensor holding every adapter tensor back to back, in `layout` order."""
    return f"{PREFIX}{lora_id}/{FLAT}{json.dumps(layout, separators=(',', ':'))}"


def _unflatten(layout_json: str, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    try:
        layout = json.loads(layout_json)
    except json.JSONDecodeError as err:
        raise InPlaceRefused(f"flat tensor layout is not JSON ({err})") from err
    total = sum(math.prod(shape) for _, shape in layout)
    if flat.dim() != 1 or flat.numel() != total:
        raise InPlaceRefused(f"flat tensor has shape {tuple(flat.shape)}, its layout {total} elements")
    views, offset = {}, 0
    for name, shape in layout:
        n = math.prod(shape)
        views[name] = flat[offset:offset + n].view(shape)
        offset += n
    return views


def _lora_manager(model):
    manager = _managers.get(id(model))
    if manager is not None and manager.base_model is model:
        return manager
    from sglang.srt.lora.lora_manager import LoRAManager
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated torch aliases
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():  # once per process: the model holds no reference to its manager
            if isinstance(obj, LoRAManager) and obj.base_model is model:
                _managers[id(model)] = obj
                return obj
    raise InPlaceRefused("this engine has no LoRAManager for its model; start it with enable_lora=True")


class _AdapterView:
    """A loaded LoRAAdapter seen with other per-layer weights: SGLang's normalisation and pool copy
    read `.layers[i].weights` (and `.pinned_weights`) and the adapter's config and scaling."""

    def __init__(self, adapter, layer_weights: list[dict]):
        self._adapter = adapter
        self.layers = [SimpleNamespace(weights=w, pinned_weights={}) for w in layer_weights]
        self.embedding_layers, self.pinned_embedding_layers = {}, {}
        self.added_tokens_embeddings, self.pinned_added_tokens_embeddings = {}, {}

    def __getattr__(self, name):
        return getattr(self._adapter, name)


class _Phases:
    """Wall time of the loader's phases in ms, each ended by a stream sync so GPU work is counted
    where it is issued: where the engine-side part of an in-place write goes (issue 5)."""

    def __init__(self):
        self.ms: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        torch.cuda.current_stream().synchronize()
        now = time.perf_counter()
        self.ms[name] = self.ms.get(name, 0.0) + 1e3 * (now - self._t)
        self._t = now

    def reply(self) -> str:
        """'OK' + the phases, e.g. 'OK {"check": 1.2, ...}' (parsed by parse_reply)."""
        return "OK " + json.dumps({k: round(v, 3) for k, v in self.ms.items()})


def parse_reply(reply: str) -> tuple[bool, dict[str, float]]:
    """(accepted, loader phase timings in ms) from a status reply."""
    if reply == "OK":
        return True, {}
    if reply.startswith("OK {"):
        return True, json.loads(reply[3:])
    return False, {}


@torch.no_grad()
def write_adapter_in_place(model, named_tensors) -> None:
    """The loader SGLang calls (see the module docstring); never raises for a refused update.
    With tensor parallelism every rank runs it; SGLang hands ranks other than the status buffer's
    device a copy (`tensor.to(device)` before custom loaders), so the reply is TP rank 0's. The
    ranks run the same checks on the same tensors, so they accept or refuse together."""
    phases = _Phases()
    named_tensors = list(named_tensors)
    status = next((t for n, t in named_tensors if n == STATUS), None)
    try:
        _write(model, [(n, t) for n, t in named_tensors if n != STATUS], phases)
    except InPlaceRefused as err:
        if status is None:
            raise  # nobody to tell: fail loudly rather than silently keep the old adapter
        _write_status(status, f"refused: {err}")
        torch.cuda.current_stream().synchronize()
        return
    if status is not None:
        _write_status(status, phases.reply())
    torch.cuda.current_stream().synchronize()  # the sender's buffers are free once this returns


def _write(model, named_tensors, phases: _Phases) -> None:
    from sglang.srt.layers.utils import get_layer_id
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.mem_pool import LoRAMemoryPool
    missing = [f for f, owner in (("_normalize_weights", LoRAAdapter), ("load_lora_weight_to_buffer", LoRAMemoryPool))
               if not hasattr(owner, f)]
    if missing:
        raise InPlaceRefused(f"this SGLang lacks {missing} (verified on 0.5.17); use refresh.mode=tensor")

    manager = _lora_manager(model)
    by_id: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if not name.startswith(PREFIX):
            raise InPlaceRefused(f"tensor {name!r} is not named {PREFIX}<id>/<PEFT name>")
        lora_id, peft_name = name[len(PREFIX):].split("/", 1)
        if peft_name.startswith(FLAT):
            by_id.setdefault(lora_id, {}).update(_unflatten(peft_name[len(FLAT):], tensor))
        else:
            by_id.setdefault(lora_id, {})[peft_name] = tensor
    if len(by_id) != 1:
        raise InPlaceRefused(f"one adapter per call, got ids {sorted(by_id)}")
    (lora_id, tensors), = by_id.items()
    adapter = manager.loras.get(lora_id)
    if adapter is None:
        raise InPlaceRefused(f"adapter id {lora_id} is not loaded in this engine; load "
                         f"it first (load_lora_adapter_from_tensors)")

    layers: list[dict[str, torch.Tensor]] = [{} for _ in adapter.layers]
    for name, tensor in tensors.items():
        layer_id = get_layer_id(name)
        if layer_id is None or layer_id >= len(layers):
            raise InPlaceRefused(f"{name} is not in a decoder layer; embed_tokens and "
                             f"lm_head adapters need the full load path (refresh.mode=tensor)")
        layers[layer_id][name] = tensor
    rank = adapter.config.r
    for name, tensor in tensors.items():  # stacking needs these; checked before anything runs
        half_ok = tensor.shape[0] == rank if ".lora_A." in name else tensor.shape[-1] == rank
        if tensor.dim() != 2 or not half_ok or not tensor.is_cuda:
            raise InPlaceRefused(f"{name} has shape {tuple(tensor.shape)} on {tensor.device}; the loaded adapter "
                                 f"has rank {rank} (lora_A [r, in], lora_B [out, r], on the GPU)")
    phases.lap("check")
    view = _AdapterView(adapter, layers)
    try:
        LoRAAdapter._normalize_weights(view)  # SGLang's own stacking (q/k/v, gate/up), on the GPU
    except RuntimeError as err:  # torch.cat of mismatched shapes: our input, refused before any write
        raise InPlaceRefused(f"the tensors do not stack like the loaded adapter's ({err})") from err
    for layer_id, (loaded, new) in enumerate(zip(adapter.layers, layers)):
        if set(new) != set(loaded.weights):
            raise InPlaceRefused(f"layer {layer_id} has weights {sorted(new)[:4]}..., the "
                             f"loaded adapter {sorted(loaded.weights)[:4]}...; send the same modules")
        for key, tensor in new.items():
            if tuple(tensor.shape) != tuple(loaded.weights[key].shape):
                raise InPlaceRefused(f"{key} has shape {tuple(tensor.shape)}, the loaded "
                                 f"adapter {tuple(loaded.weights[key].shape)}")

    phases.lap("normalize")
    pool = manager.memory_pool
    slot = pool.uid_to_buffer_id.get(lora_id)
    if slot is not None:  # resident: overwrite its slot, sliced per TP rank by SGLang's own code
        pool.load_lora_weight_to_buffer(lora_id, slot, view, manager.lora_modules,
                                        manager.embed_tokens_module, manager.lm_head_module)
    phases.lap("pool")
    for loaded, new in zip(adapter.layers, layers):  # the host copy the pool reloads from
        for key, tensor in new.items():
            host = loaded.weights[key]
            if host.dtype != tensor.dtype or not host.is_pinned():
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                loaded.weights[key] = host
            host.copy_(tensor, non_blocking=True)
        if getattr(loaded, "pinned_weights", None):
            loaded.pinned_weights.clear()  # pinned copies of the old values (overlap loading)
    phases.lap("host_copy")
