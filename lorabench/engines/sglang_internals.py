"""Every use of SGLang internals in lorabench, each named once below and verified on the releases in
VERIFIED; engines/sglang.py uses sglang.Engine's public methods only. On another release `check_version`
refuses the in-place writer (refresh.mode=tensor is the public fallback) and `release_notes` names the
life-cycle internals the engine lacks (each then skipped).

Every refresh mode:
- `shut_down`: Engine.shutdown without its kill_process_tree(os.getpid()) (it SIGKILLs a kernel's children
  too); reads `tokenizer_manager._subprocess_watchdog`, `Engine.send_to_rpc`, `Engine._weight_cache_daemon_procs`
  (each skipped if absent), stops what `get_all_child_pids` names, unregisters SGLang's atexit hook.
- `watch`: a failing SGLang process SIGQUITs this one; which exited is read from /proc/<pid>/stat.
- `event_loop`: `Engine.loop`; `abort_requests`: `tokenizer_manager.abort_request(abort_all=True)`.
- `release_leaked_lora_counts`: a request aborted in the scheduler's queue never gives back its adapter's in-use
  count (`lora_registry._counters`), and unloading that adapter waits for the count to be exactly 0; once no
  request is in flight (`rid_to_state` empty) and the releases that finished requests scheduled have run, every
  count must be 0, so what is left is given back.
- `check_reply`: replies carry no error code, so missing/already-loaded adapters are told by their text.
- `register_sampler` (`engine.sglang.sampling_backend=lorabench`): SGLang's plugin entry point (pyproject.toml,
  group `sglang.srt.plugins`, run in every SGLang process before it builds anything) registers SAMPLER through
  `sglang.srt.layers.sampler.register_sampler_backend`, in an engine that asked for it (SAMPLER_ENV). Its Sampler
  subclass samples plain temperature batches by `one_pass_sampler`, calling the Sampler's `_preprocess_logits` and
  `_sync_token_ids_across_tp`, reading SamplingBatchInfo's need_*/sampling_seed/return_sampling_masks and writing
  `LogprobResult`; every other batch goes to SGLang's own `forward`, and its `_sample_from_probs` draws one that
  needs top-p/k or min-p with the functions SGLang's default backend uses (`is_flashinfer_available`: FlashInfer's
  `top_k_top_p_sampling_from_probs`, `min_p_sampling_from_probs`, sgl_kernel's renorms; else
  `top_k_top_p_min_p_sampling_from_probs_torch`).
- `LORA_BACKENDS`: `--lora-backend`'s choices. `LoopbackStore`: SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE and
  torch's TORCHELASTIC_USE_AGENT_STORE point every scheduler rank at a store on loopback.

refresh.mode=inplace only: `lora_id` and `requests_in_flight` (tokenizer manager's lora_registry, rid_to_state)
and `PoolWriter` (made at the first in-place write). `handle` is registered as a custom weight loader
(unless engine.sglang.in_place=false); `update_weights_from_tensor(..., load_format=LOADER)` runs it in every
scheduler process. It reads LoRAManager (loras, lora_refs, num_pinned_loras, memory_pool, lora_modules,
fetch_new_loras), LoRAAdapter._normalize_weights, LoRAMemoryPool (A_buffer, B_buffer, uid_to_buffer_id,
load_lora_weight_to_buffer), lora.utils (get_target_module_name, get_stacked_multiply) and the layers'
slice_lora_{a,b}_weights. `map` (once per adapter) pins the adapter in a slot and runs SGLang's stacking and
slicing on tensors of source indices: the copy plan, refused unless it writes bit-identically to SGLang's own
loader. `apply` (every refresh) copies staging and the version through the plan in one batch. A moved slot:
refused, mapped again. Every check raises `Refused` (an exception would kill the scheduler), which `handle`
turns into a reply; nothing is written before every check passes.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import gc
import json
import math
import os
import signal
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

from ..adapters import AdapterLayout, FlatAdapter
from .base import AdapterAlreadyLoaded, AdapterNotLoaded, EngineError

VERIFIED = ("0.5.17",)             # the releases every internal here was checked against
LORA_BACKENDS = ("", "triton", "csgmv", "torch_native")   # --lora-backend's on VERIFIED; '' = SGLang's default
LOADER = "lorabench.engines.sglang_internals.handle"
PREFIX = "lorabench-pool/"         # tensor names: PREFIX + <command>/<lora id>/<what>[/<device>]
STATUS_BYTES = 4096
RELEASES_RUN_S = 0.05              # the engine's loop runs this long for scheduled adapter releases to finish
SAMPLER = "lorabench"              # engine.sglang.sampling_backend of the one-pass sampler
SAMPLER_ENTRY = "lorabench.engines.sglang_internals:register_sampler"   # pyproject.toml's SGLang plugin
SAMPLER_ENV = "LORABENCH_SGLANG_SAMPLER"   # set by an engine that asks for SAMPLER; its processes inherit it


class Refused(ValueError):
    """The command does not fit this engine, adapter or SGLang; nothing was written."""


def installed() -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_version() -> None:
    """Refuse the in-place writer on an unverified SGLang release (a wrong write serves a corrupt adapter)."""
    if not verified():
        raise EngineError(f"refresh.mode=inplace writes into SGLang's LoRA pool through internals verified on sglang "
                          f"{', '.join(VERIFIED)}; this Python has sglang {installed()}. Use refresh.mode=tensor "
                          f"(public API, any release), or install the tested release: pip install 'lorabench[sglang]'")


def lora_backend_known(name: str) -> bool:
    return name in LORA_BACKENDS or not verified()


def verified() -> bool:
    """No sglang here, or a release in VERIFIED (the sampler plugin and the in-place writer use its internals)."""
    return installed() in (None, *VERIFIED)


def sampler_plugin_found() -> bool:
    """Whether SGLang's processes will find `register_sampler`: lorabench installed (pip install -e .)."""
    from importlib.metadata import entry_points
    return any(ep.value == SAMPLER_ENTRY for ep in entry_points(group="sglang.srt.plugins"))


def sampler_problems() -> list[str]:
    """Why sampling_backend=SAMPLER cannot run here: the plugin not installed, or an unverified release."""
    asked = f"engine.sglang.sampling_backend={SAMPLER}"
    return [*([f"{asked}: SGLang finds lorabench's sampler through its installed entry point, and this Python has "
               f"none; run `pip install -e .` in the checkout"] if not sampler_plugin_found() else []),
            *([f"{asked}: lorabench's sampler subclasses SGLang's through internals verified on sglang "
               f"{', '.join(VERIFIED)}, and this Python has sglang {installed()}; use '' (SGLang's sampler) or "
               f"pip install 'lorabench[sglang]'"] if not verified() else [])]


def register_sampler() -> None:
    """SGLang's plugin hook, in each of its processes: sampling_backend=SAMPLER makes a `_one_pass_sampler`.
    Only in an engine that asked for it (SAMPLER_ENV): SGLang runs every installed plugin, whoever starts it."""
    if os.environ.get(SAMPLER_ENV) != "1":
        return
    from sglang.srt.layers.sampler import register_sampler_backend
    register_sampler_backend(SAMPLER, _one_pass_sampler)


def _one_pass_sampler():
    from sglang.srt.layers import sampler as sgl
    from sglang.srt.layers.logprob_processor import LogprobResult
    from sglang.srt.utils.common import is_flashinfer_available

    from .one_pass_sampler import fits, gumbel_sample

    class OnePassSampler(sgl.Sampler):
        def _plain(self, info, logits, top_logprobs_nums, token_ids_logprobs) -> bool:
            return (fits(logits) and not info.is_all_greedy and info.sampling_seed is None
                    and not (info.need_top_p_sampling or info.need_top_k_sampling or info.need_min_p_sampling)
                    and self.rl_on_policy_target is None and not self.enable_deterministic
                    and not self.use_ascend_backend and not sgl.SGLANG_RETURN_ORIGINAL_LOGPROB
                    and not any(info.return_sampling_masks or []) and not any(n > 0 for n in top_logprobs_nums)
                    and all(ids is None for ids in token_ids_logprobs or [])
                    and sgl.get_tp_group().world_size == 1)   # ranks would each draw their own token

        def forward(self, logits_output, info, return_logprob, top_logprobs_nums, token_ids_logprobs, positions):
            if not self._plain(info, logits_output.next_token_logits, top_logprobs_nums or [], token_ids_logprobs):
                return super().forward(logits_output, info, return_logprob, top_logprobs_nums, token_ids_logprobs,
                                       positions)
            logits = self._preprocess_logits(logits_output.next_token_logits, info)
            ids, logprobs = gumbel_sample(logits, info.temperatures)
            if return_logprob:
                LogprobResult(token_logprobs=logprobs).write_output_to(logits_output)
            self._sync_token_ids_across_tp(ids, info)
            return ids

        def _sample_from_probs(self, probs, info, positions, simple_sampling_case):
            # a batch it leaves to SGLang (top-p, greedy rows beside sampled ones) is drawn as under SGLang's default
            # backend: FlashInfer's fused kernels where they import, else torch's (a sort of the vocabulary). SGLang's
            # own dispatch knows only its backends' names and raised on SAMPLER, which killed the scheduler.
            if simple_sampling_case:
                return super()._sample_from_probs(probs, info, positions, simple_sampling_case)
            if info.sampling_seed is None and is_flashinfer_available():
                if info.need_min_p_sampling:
                    probs = sgl.top_p_renorm_prob(sgl.top_k_renorm_prob(probs, info.top_ks), info.top_ps)
                    return sgl.min_p_sampling_from_probs(probs, info.min_ps)
                return sgl.top_k_top_p_sampling_from_probs(probs.contiguous(), info.top_ks, info.top_ps,
                                                           filter_apply_order="joint")
            return sgl.top_k_top_p_min_p_sampling_from_probs_torch(
                probs, info.top_ks, info.top_ps, info.min_ps, info.need_min_p_sampling, info.sampling_seed, positions)
    return OnePassSampler()


def missing(engine) -> list[str]:
    """The life-cycle internals this started engine lacks (each then skipped)."""
    manager = engine.tokenizer_manager
    found = {"tokenizer_manager._subprocess_watchdog": hasattr(manager, "_subprocess_watchdog"),
             "tokenizer_manager.abort_request": callable(getattr(manager, "abort_request", None)),
             "Engine.send_to_rpc": hasattr(engine, "send_to_rpc"),
             "Engine._weight_cache_daemon_procs": hasattr(engine, "_weight_cache_daemon_procs"),
             "tokenizer_manager.lora_registry._counters": hasattr(getattr(manager, "lora_registry", None),
                                                                 "_counters"),
             "tokenizer_manager.rid_to_state": hasattr(manager, "rid_to_state")}
    return [name for name, ok in found.items() if not ok]


def release_notes(engine) -> list[str]:
    """For every mode: [] on a verified release, else what the session tells the user about this one."""
    release = installed()
    if release is None or release in VERIFIED:
        return []
    gone = missing(engine)
    found = f"it lacks {', '.join(gone)} (skipped)" if gone else "each is present"
    return [f"sglang {release}: lorabench uses a few SGLang internals, verified on {', '.join(VERIFIED)} "
            f"(engines/sglang_internals.py); {found}; refresh.mode=inplace and "
            f"engine.sglang.sampling_backend={SAMPLER} are refused on this release"]


def _outcome(result) -> tuple[bool, str]:
    """Engine replies carry .success/.error_message (LoRA calls) or (success, message, ...) tuples."""
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        return result[0], result[1]
    return getattr(result, "success", True), getattr(result, "error_message", "") or ""


def check_reply(result, what: str):
    ok, message = _outcome(result)
    if ok:
        return result
    if "does not exist" in message or "not loaded" in message:
        raise AdapterNotLoaded(f"{what}: {message}")
    if "already loaded" in message or "already exists" in message:
        raise AdapterAlreadyLoaded(f"{what}: {message}")
    raise EngineError(f"{what} failed; engine says: {message}")


def lora_id(engine, name: str) -> str:
    """The engine's internal id of adapter `name` (each load gets a new one)."""
    ref = engine.tokenizer_manager.lora_registry.get_all_adapters().get(name)
    if ref is None:
        raise AdapterNotLoaded(f"adapter {name!r} is not in the engine's LoRA registry")
    return ref.lora_id


def requests_in_flight(engine) -> bool:   # anyone's
    return bool(engine.tokenizer_manager.rid_to_state)


def event_loop(engine):
    return engine.loop


def release_leaked_lora_counts(engine, deadline: float) -> None:
    """On the engine's thread once SGLang's scheduler is idle after an abort: set every adapter's in-use count back
    to 0 (see the module docstring). First the engine's loop runs until no request is in flight: the aborted
    requests' last outputs come through the detokenizer, after the scheduler's own reply, and the releases they
    schedule are tasks yet to run; a count taken before either would be given back twice (below 0, on which an
    unload waits forever too). EngineError past `deadline` (time.monotonic). Skipped where the counts are absent."""
    manager = engine.tokenizer_manager
    counters = getattr(getattr(manager, "lora_registry", None), "_counters", None)
    if counters is None:
        return
    while getattr(manager, "rid_to_state", None):
        if time.monotonic() > deadline:
            raise EngineError(f"SGLang still tracks {len(manager.rid_to_state)} request(s) after an interrupted call "
                              f"although its scheduler is idle; an adapter unload now could wait forever. Close the "
                              f"session and open it again (lorabench resume continues from the last checkpoint)")
        engine.loop.run_until_complete(asyncio.sleep(RELEASES_RUN_S))   # outputs in transit are handled
    engine.loop.run_until_complete(asyncio.sleep(RELEASES_RUN_S))   # the releases their handling scheduled run
    for counter in counters.values():
        if (count := counter.value()) > 0:
            engine.loop.run_until_complete(counter.decrement(count))


def abort_requests(engine) -> None:
    """End every request in flight early (on the engine's loop), where abort_request is callable."""
    abort = getattr(engine.tokenizer_manager, "abort_request", None)
    if callable(abort):
        abort(abort_all=True)


_LIVE: weakref.WeakSet = weakref.WeakSet()   # our engines whose failed processes we watch for
_previous_sigquit = None
_last_shutdown = -math.inf   # time.monotonic() when an engine of ours last stopped its processes
SHUTDOWN_GRACE_S = 30.0      # a SIGQUIT this soon after is from those processes going


def note_shutdown() -> None:
    global _last_shutdown
    _last_shutdown = time.monotonic()


def watch(owner) -> None:
    """Handle SIGQUIT for `owner` (`.engine`, `.serving`, `.children_failed(reason)`), if on the main thread."""
    global _previous_sigquit
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGQUIT) is not _on_sigquit:
        _previous_sigquit = signal.signal(signal.SIGQUIT, _on_sigquit)
    _LIVE.add(owner)


def unwatch(owner) -> None:
    _LIVE.discard(owner)


def _on_sigquit(signum, frame) -> None:
    owners = [o for o in list(_LIVE) if o.serving]
    if not owners and time.monotonic() - _last_shutdown < SHUTDOWN_GRACE_S:
        return   # an engine of ours stopping its processes: not a failure
    if not owners:   # not from an engine of ours: what SIGQUIT did before
        signal.signal(signal.SIGQUIT, _previous_sigquit or signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGQUIT)
        return
    dead = {o: _exited(o.engine) for o in owners}
    # a process that failed signals before it exits: if none has exited yet, it is one of these
    for owner in [o for o, d in dead.items() if d] or owners:
        owner.children_failed(", ".join(dead[owner]) or "a scheduler or detokenizer process signalled a failure")


def _exited(engine) -> list[str]:
    """Those of the engine's processes that have exited, as 'process N exited (...)'."""
    exited = []
    for pid in engine.get_all_child_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            exited.append(f"process {pid} exited")
            continue
        if fields[0] == "Z":   # field 52 of stat: the exit status, as waitpid reports it
            status = int(fields[49]) if len(fields) > 49 else 0
            how = f"killed by signal {status & 0x7F}" if status & 0x7F else f"exit code {status >> 8}"
            exited.append(f"process {pid} exited ({how})")
    return exited


def shut_down(engine) -> None:
    """Stop the engine's own processes and wait for them (their GPU memory is back on return)."""
    import psutil
    atexit.unregister(engine.shutdown)   # at exit it would kill every child, and it keeps the engine alive
    watchdog = getattr(engine.tokenizer_manager, "_subprocess_watchdog", None)
    if watchdog is not None:
        watchdog.stop()     # first: a watchdog that sees its processes go signals a failure
    rpc = getattr(engine, "send_to_rpc", None)
    if rpc is not None:
        rpc.close(linger=0)
        engine.send_to_rpc = None
    daemons = getattr(engine, "_weight_cache_daemon_procs", None)
    if daemons:
        engine._terminate_weight_cache_daemons(daemons)
        engine._weight_cache_daemon_procs = []
    psutil.wait_procs(stop_processes(engine), timeout=60)


def stop_processes(engine) -> list:
    """SIGKILL what is left of the engine's scheduler and detokenizer processes and theirs; returns them."""
    import psutil  # SGLang requires it
    processes = []
    for pid in engine.get_all_child_pids():
        try:
            proc = psutil.Process(pid)
            processes += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for proc in processes:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    return processes


class LoopbackStore:
    """The rendezvous store of SGLang's scheduler ranks, bound to 127.0.0.1 (torch's own, started by rank 0,
    listens unauthenticated on every interface); every rank joins as a client. Its variables are set only
    while the engine starts, and not at all if the user set the override."""

    def __init__(self, world_size: int | None):
        self.server = None
        self.variables: dict[str, str] = {}
        if world_size is None:
            return
        import socket
        from datetime import timedelta

        from torch.distributed import TCPStore
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            port = sock.getsockname()[1]
            self.server = TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=600),
                                   wait_for_workers=False, master_listen_fd=sock.fileno())
            sock.detach()  # the store owns the descriptor now and closes it when it stops
        self.variables = {"SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE": f"tcp://127.0.0.1:{port}",
                          "TORCHELASTIC_USE_AGENT_STORE": "True",
                          # older torch reads it in the agent-store branch
                          "TORCHELASTIC_RESTART_COUNT": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")}

    @classmethod
    def for_engine(cls, tp_size: int) -> LoopbackStore:
        user_set = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE" in os.environ
        return cls(None if user_set else tp_size)

    @contextlib.contextmanager
    def environment(self):
        saved = {k: os.environ.get(k) for k in self.variables}
        os.environ.update(self.variables)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def close(self) -> None:
        self.server = None  # the last reference: torch stops the server and closes its socket


# === the trainer's side ==========================================================================
@dataclass
class _Mapping:
    lora_id: str
    layout: AdapterLayout
    staging: dict[int, torch.Tensor]     # device -> [numel] in the pool's dtype, lent to the engine
    version: dict[int, torch.Tensor]     # device -> [1] int64, the version the next apply writes
    status: dict[int, torch.Tensor]      # device -> [STATUS_BYTES] uint8, where each rank replies


class PoolWriter:
    """One per SGLangEngine, made at its first in-place write: maps adapters into its pool, applies values."""

    def __init__(self, engine):
        self.engine = engine
        self.mapped: dict[str, _Mapping] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}   # device -> where status buffers are zeroed and read
        args = engine.engine.server_args
        self.devices = [args.base_gpu_id + i * args.gpu_id_step for i in range(args.tp_size)]
        self.dtype = engine.adapter_dtype or torch.bfloat16

    def write(self, name: str, adapter: FlatAdapter) -> dict[str, float]:
        """New values for adapter `name`; ms timings: the engine's (`apply`/`map`), ours (`stage`/`request`/`reply`)."""
        mapping = self.mapped.get(name)
        if mapping is not None and mapping.layout != adapter.layout:
            self.forget(name)
            mapping = None
        if mapping is None:
            return self._map(name, adapter)
        t0 = time.perf_counter()
        self._stage(mapping, adapter)
        ours = {"stage": time.perf_counter() - t0}
        reply = self._send("apply", mapping, [], flush_cache=True, timings=ours)
        if reply.get("refused", "").startswith("remap:"):  # the slot moved or the engine lost the plan
            self.mapped.pop(name, None)
            return {**self._map(name, adapter), "remapped": 1.0}
        return {**{k: 1e3 * v for k, v in ours.items()}, **self._accept(reply, name, adapter.version)}

    def version(self, name: str) -> int:
        """The version the engine holds beside its copy of adapter `name` (asked, not remembered)."""
        reply = self._send("version", self.mapped[name], [], flush_cache=False)
        if "refused" in reply:
            raise EngineError(f"asking the engine for adapter {name!r}'s version failed: {reply['refused']}")
        return int(reply["version"])

    def forget(self, name: str) -> None:
        """Drop the mapping (before an unload): the engine releases the staging buffers it holds."""
        mapping = self.mapped.pop(name, None)
        if mapping is not None and self.engine.engine is not None:
            self._send("forget", mapping, [], flush_cache=False)

    def forget_all(self) -> None:
        for name in list(self.mapped):
            self.forget(name)

    def _map(self, name: str, adapter: FlatAdapter) -> dict[str, float]:
        mapping = _Mapping(lora_id(self.engine.engine, name), adapter.layout,
                           {d: torch.empty(adapter.layout.numel, dtype=self.dtype, device=d) for d in self.devices},
                           {d: torch.zeros(1, dtype=torch.int64, device=d) for d in self.devices},
                           {d: torch.zeros(STATUS_BYTES, dtype=torch.uint8, device=d) for d in self.devices})
        self._stage(mapping, adapter)
        # on a GPU: CUDA tensors cross to the engine as IPC handles (CPU tensors would need fd passing)
        layout = torch.frombuffer(bytearray(adapter.layout.to_json().encode()), dtype=torch.uint8).to(self.devices[0])
        extra = [(f"layout/{mapping.lora_id}", layout)]
        extra += [(f"staging/{mapping.lora_id}/{d}", t) for d, t in mapping.staging.items()]
        extra += [(f"version/{mapping.lora_id}/{d}", t) for d, t in mapping.version.items()]
        reply = self._send("map", mapping, extra, flush_cache=True)
        timings = self._accept(reply, name, adapter.version)
        self.mapped[name] = mapping
        return timings

    def _stage(self, mapping: _Mapping, adapter: FlatAdapter) -> None:
        for device in self.devices:
            mapping.staging[device].copy_(adapter.buffer, non_blocking=True)   # cast to the pool's dtype
            mapping.version[device].fill_(adapter.version)
        # another process reads these: wait for the copies' streams (engine's GPUs and the trainer's), not the
        # whole device (a background commit's host copies run on a stream of their own)
        for device in {*self.devices, adapter.buffer.device.index or 0}:
            torch.cuda.current_stream(device).synchronize()

    def _on_status_stream(self, mapping: _Mapping, fn) -> list:
        """fn(status) for each rank's status buffer on a stream of the pool's own, waited for: on the default
        stream a zero_() could queue behind the trainer's update and wipe the engine's reply."""
        done = []
        for device, status in mapping.status.items():
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
            with torch.cuda.stream(stream):
                done.append(fn(status))
            stream.synchronize()
        return done

    def _send(self, command: str, mapping: _Mapping, extra: list, flush_cache: bool,
              timings: dict | None = None) -> dict:
        self._on_status_stream(mapping, torch.Tensor.zero_)
        named = [(f"{PREFIX}{command}/{mapping.lora_id}/status/{d}", s) for d, s in mapping.status.items()]
        named += [(f"{PREFIX}{name}", t) for name, t in extra]
        t0 = time.perf_counter()
        result = self.engine.engine.update_weights_from_tensor(named, load_format=LOADER, flush_cache=flush_cache)
        t1 = time.perf_counter()
        ok, message = _outcome(result)
        if not ok:
            raise EngineError(f"in-place {command} of adapter id {mapping.lora_id} failed; engine says: {message}")
        replies = self._on_status_stream(mapping, read_status)
        if timings is not None:
            timings.update(request=t1 - t0, reply=time.perf_counter() - t1)
        refused = [r["refused"] for r in replies if "refused" in r]
        if refused:
            return {"refused": refused[0]}
        missing = [d for d, r in zip(self.devices, replies) if not r]
        if missing:
            return {"refused": f"no reply from the engine's loader on GPU(s) {missing}"}
        return replies[0]  # tensor-parallel ranks run the same checks and copies: rank 0 speaks for all

    def _accept(self, reply: dict, name: str, version: int) -> dict[str, float]:
        if "refused" in reply:
            raise EngineError(f"in-place update of adapter {name!r} refused by the engine: {reply['refused']}. "
                              f"The engine still serves the previous values; refresh.mode=tensor is the public "
                              f"fallback")
        if int(reply["version"]) != version:
            raise EngineError(f"in-place update of adapter {name!r}: the engine reports version {reply['version']}, "
                              f"{version} was written; the adapter in the engine is not the trainer's")
        return reply.get("ms", {})


def read_status(status: torch.Tensor) -> dict:
    """A rank's reply: {} (no reply), {'refused': reason} or {'version': v, 'ms': {...}}."""
    text = status.cpu().numpy().tobytes().rstrip(b"\0").decode("utf-8", "replace")
    return json.loads(text) if text else {}


# === the engine's side (runs inside each scheduler process) ======================================
@dataclass
class _Plan:
    slot: int
    buffers: list[int]                 # data_ptr of each pool buffer the plan writes (moved = remap)
    dsts: list[torch.Tensor]           # pool views
    srcs: list[torch.Tensor]           # strided views of the staging buffer
    version: torch.Tensor              # [1] int64, engine-owned
    version_src: torch.Tensor          # [1] int64, the trainer's (lent)
    staging: torch.Tensor              # kept so the mapping stays open
    notify: list = field(default_factory=list)  # modules caching derived operands per slot
    status: torch.Tensor | None = None  # kept too: while it lives, torch reuses its open IPC handle


_plans: dict[str, _Plan] = {}          # lora id -> plan, per scheduler process
_managers: dict[int, object] = {}      # id(model) -> its LoRAManager


@torch.no_grad()
def handle(model, named_tensors) -> None:
    """The loader SGLang calls; never raises for a refused command (see the module docstring)."""
    device = torch.cuda.current_device()
    parts = {}
    for name, tensor in named_tensors:
        if not name.startswith(PREFIX):
            raise ValueError(f"lorabench's pool loader got tensor {name!r}; it only takes {PREFIX}* names")
        parts[name[len(PREFIX):]] = tensor
    command, lora_id = next(iter(parts)).split("/")[:2]
    status = parts.get(f"{command}/{lora_id}/status/{device}")
    t0 = time.perf_counter()
    try:
        version = _COMMANDS[command](model, lora_id, parts, device)
        reply = {"version": version, "ms": {command: 1e3 * (time.perf_counter() - t0)}}
    except Refused as err:
        reply = {"refused": str(err)}
    if status is None:
        if "refused" in reply:
            raise RuntimeError(f"lorabench pool loader: {reply['refused']}")  # nobody to tell: fail loudly
        return
    data = json.dumps(reply).encode()
    if len(data) >= STATUS_BYTES:  # cut the reason, keep the reply valid JSON
        data = json.dumps({"refused": reply.get("refused", "reply too long")[: STATUS_BYTES // 8]}).encode()
    status.zero_()
    status[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    torch.cuda.current_stream().synchronize()  # the sender reads the reply once the call returns


def _apply(model, lora_id: str, parts: dict, device: int) -> int:
    plan = _plans.get(lora_id)
    if plan is None:
        raise Refused(f"remap: adapter id {lora_id} is not mapped in this engine (restarted, or never mapped)")
    manager = _lora_manager(model)
    pool = manager.memory_pool
    if pool.uid_to_buffer_id.get(lora_id) != plan.slot or _buffer_ptrs(pool) != plan.buffers:
        _plans.pop(lora_id, None)
        raise Refused(f"remap: adapter id {lora_id} left pool slot {plan.slot} or the pool moved")
    torch._foreach_copy_(plan.dsts, plan.srcs)
    plan.version.copy_(plan.version_src)
    for notify in plan.notify:
        notify({plan.slot})
    return int(plan.version.item())   # .item() waits for the copies


def _version(model, lora_id: str, parts: dict, device: int) -> int:
    plan = _plans.get(lora_id)
    if plan is None:
        raise Refused(f"adapter id {lora_id} is not mapped in this engine")
    return int(plan.version.item())


def _forget(model, lora_id: str, parts: dict, device: int) -> int:
    plan = _plans.pop(lora_id, None)
    return -1 if plan is None else int(plan.version.item())


def _map(model, lora_id: str, parts: dict, device: int) -> int:
    from sglang.srt.lora.lora import LoRAAdapter
    manager = _lora_manager(model)
    adapter = manager.loras.get(lora_id)
    if adapter is None:
        raise Refused(f"adapter id {lora_id} is not loaded in this engine; load it first")
    layout = AdapterLayout.from_json(parts[f"layout/{lora_id}"].cpu().numpy().tobytes().decode())
    staging, version_src = parts[f"staging/{lora_id}/{device}"], parts[f"version/{lora_id}/{device}"]
    if staging.dtype != manager.memory_pool.dtype or staging.numel() != layout.numel:
        raise Refused(f"staging buffer is {staging.dtype} x {staging.numel()}, the pool keeps "
                      f"{manager.memory_pool.dtype} and the layout has {layout.numel} elements")
    _pin_and_load(manager, lora_id)
    plan = _build_plan(manager, adapter, layout, staging, version_src)
    # SGLang's own write, then ours: refuse the plan unless they agree bit for bit
    view = _AdapterView(adapter, _by_layer(layout.views(staging), len(adapter.layers)))
    LoRAAdapter._normalize_weights(view)
    sglang_write = functools.partial(manager.memory_pool.load_lora_weight_to_buffer, lora_id, plan.slot, view,
                                     manager.lora_modules, manager.embed_tokens_module, manager.lm_head_module)
    sglang_write()
    reference = [d.clone() for d in plan.dsts]
    torch._foreach_zero_(plan.dsts)
    torch._foreach_copy_(plan.dsts, plan.srcs)
    bad = [i for i, (d, r) in enumerate(zip(plan.dsts, reference)) if not torch.equal(d, r)]
    if bad:
        sglang_write()
        raise Refused(f"the copy plan disagrees with SGLang's own loader on {len(bad)} of {len(plan.dsts)} "
                      f"blocks (first: {tuple(plan.dsts[bad[0]].shape)}); this SGLang lays out its pool "
                      f"differently (verified on {', '.join(VERIFIED)}): use refresh.mode=tensor")
    _keep_host_copy(adapter, view)
    # held, so torch reuses the open IPC mapping of the status buffer sent with every command
    plan.status = parts.get(f"map/{lora_id}/status/{device}")
    plan.version.copy_(version_src)
    _plans[lora_id] = plan
    return int(plan.version.item())


_COMMANDS = {"map": _map, "apply": _apply, "version": _version, "forget": _forget}


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
    raise Refused("this engine has no LoRAManager for its model; start it with enable_lora=True")


def _pin_and_load(manager, lora_id: str) -> None:
    """Pin the adapter (never evicted, so never reloaded over our writes) and make it resident in a slot."""
    ref = manager.lora_refs.get(lora_id)
    if ref is None:
        raise Refused(f"adapter id {lora_id} has no LoRA ref in this engine")
    if not ref.pinned:
        import msgspec
        if manager.num_pinned_loras >= manager.max_loras_per_batch - 1:
            raise Refused(f"cannot pin another adapter: {manager.num_pinned_loras} of max_loras_per_batch="
                          f"{manager.max_loras_per_batch} slots are pinned and one must stay free; raise "
                          f"engine.sglang.max_loras_per_batch")
        manager.lora_refs[lora_id] = msgspec.structs.replace(ref, pinned=True)  # LoRARef is frozen
        manager.num_pinned_loras += 1
    if lora_id not in manager.memory_pool.uid_to_buffer_id:
        manager.fetch_new_loras({lora_id})


def _by_layer(tensors: dict[str, torch.Tensor], n_layers: int) -> list[dict[str, torch.Tensor]]:
    from sglang.srt.layers.utils import get_layer_id
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(n_layers)]
    for name, tensor in tensors.items():
        layer_id = get_layer_id(name)
        if layer_id is None or layer_id >= n_layers:
            raise Refused(f"{name} is not in a decoder layer; embed_tokens and lm_head adapters need the full "
                          f"load path (refresh.mode=tensor)")
        layers[layer_id][name] = tensor
    return layers


class _AdapterView:
    """A loaded LoRAAdapter with other per-layer weights (what SGLang's normalisation and pool copy read)."""

    def __init__(self, adapter, layer_weights: list[dict]):
        self._adapter = adapter
        self.layers = [SimpleNamespace(weights=w, pinned_weights={}) for w in layer_weights]
        self.embedding_layers, self.pinned_embedding_layers = {}, {}
        self.added_tokens_embeddings, self.pinned_added_tokens_embeddings = {}, {}

    def __getattr__(self, name):
        return getattr(self._adapter, name)


def _build_plan(manager, adapter, layout: AdapterLayout, staging: torch.Tensor, version_src) -> _Plan:
    """Where each pool element of the adapter's slot comes from, as strided blocks of `staging`."""
    from sglang.srt.lora.layers import FusedMoEWithLoRA
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.utils import get_stacked_multiply, get_target_module_name
    pool, rank = manager.memory_pool, adapter.config.r
    slot = pool.uid_to_buffer_id.get(adapter.uid)
    if slot is None:
        raise Refused("the adapter has no pool slot after loading it")
    index = torch.arange(layout.numel, dtype=torch.int64)
    view = _AdapterView(adapter, _by_layer(layout.views(index), len(adapter.layers)))
    LoRAAdapter._normalize_weights(view)
    dsts, srcs, notify = [], [], []
    for layer_id, (layer, modules) in enumerate(zip(view.layers, manager.lora_modules)):
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, idx in layer.weights.items():
            target = get_target_module_name(name, pool.target_modules)
            halves.setdefault(target, {})["A" if ".lora_A." in name else "B"] = idx
        for module_name, module in modules.items():
            if isinstance(module, FusedMoEWithLoRA):
                raise Refused("mixture-of-experts LoRA layers are not covered by the copy plan; use "
                              "refresh.mode=tensor")
            if callable(getattr(module, "on_lora_slots_updated", None)):
                notify.append(module.on_lora_slots_updated)
            target = get_target_module_name(module_name, pool.target_modules)
            pair = halves.pop(target, None)
            if pair is None:
                continue  # not adapted: SGLang's own write zeroed its rows, and they stay zero
            c = get_stacked_multiply(target, manager.base_model)
            a_dst = pool.A_buffer[target][layer_id][slot, :rank * c, :]   # SGLang's standard layout
            b_dst = pool.B_buffer[target][layer_id][slot, :, :rank]
            for idx, dst in ((module.slice_lora_a_weights(pair["A"]), a_dst),
                             (module.slice_lora_b_weights(pair["B"]), b_dst)):
                _add_blocks(idx, dst, staging, dsts, srcs)
        if halves:
            raise Refused(f"layer {layer_id}: adapter modules {sorted(halves)} have no LoRA layer in this engine")
    version = torch.zeros(1, dtype=torch.int64, device=staging.device)
    return _Plan(slot, _buffer_ptrs(pool), dsts, srcs, version, version_src, staging, notify)


def _add_blocks(idx: torch.Tensor, dst: torch.Tensor, staging: torch.Tensor, dsts: list, srcs: list) -> None:
    """Split an index map [R, C] into row runs that are one strided view of `staging` each."""
    if tuple(idx.shape) != tuple(dst.shape):
        raise Refused(f"pool block {tuple(dst.shape)} does not match the adapter's {tuple(idx.shape)}; the engine "
                      f"was started with another max_lora_rank or target modules")
    rows, cols = idx.shape
    if cols > 1 and not bool((idx[:, 1:] - idx[:, :-1] == 1).all()):
        raise Refused("a pool row gathers non-adjacent adapter elements; this SGLang's layout is not covered")
    starts = idx[:, 0].tolist()
    begin = 0
    while begin < rows:
        end = begin + 1
        stride = starts[begin + 1] - starts[begin] if begin + 1 < rows else cols
        if stride < cols:  # rows that overlap or run backwards cannot share one view: a row alone
            stride = cols
        else:
            while end < rows and starts[end] - starts[end - 1] == stride:
                end += 1
        dsts.append(dst[begin:end])
        srcs.append(staging.as_strided((end - begin, cols), (stride, 1), starts[begin]))
        begin = end


def _buffer_ptrs(pool) -> list[int]:
    return [t.data_ptr() for buffers in (pool.A_buffer, pool.B_buffer) for name in sorted(buffers)
            for t in buffers[name]]


def _keep_host_copy(adapter, view) -> None:
    """SGLang's host copy of the (pinned) adapter gets the mapped values, truthful at map time."""
    for loaded, new in zip(adapter.layers, view.layers):
        for key, tensor in new.weights.items():
            host = loaded.weights.get(key)
            if host is None or host.shape != tensor.shape:
                raise Refused(f"{key}: the loaded adapter has {None if host is None else tuple(host.shape)}, the "
                              f"update {tuple(tensor.shape)}; send the modules and rank the adapter was loaded with")
            host.copy_(tensor.to(host.dtype), non_blocking=False)
        if getattr(loaded, "pinned_weights", None):
            loaded.pinned_weights.clear()  # pinned copies of the old values (overlap loading)
