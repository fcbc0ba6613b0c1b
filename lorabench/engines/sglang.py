"""The SGLang backend: an in-process `sglang.Engine` (no HTTP server, no open port) with LoRA enabled, token
ids in and out (skip_tokenizer_init=True), through its public methods only (internals: sglang_internals.py).

Invariants: every prompt names its adapter (`[None]*n` for the base model); a regex target is refused
before the engine starts; tensors are on the GPU before CUDA-IPC; only the memory tags released are resumed;
a failed call raises EngineError with the engine's message. Scripts that start an Engine need an
`if __name__ == "__main__":` guard (SGLang spawns processes).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..adapters import FlatAdapter, validate
from ..interrupts import sigint_handled_by
from ..settings import ALLOWED, Section, check, setting
from . import sglang_internals as internals
from .base import (
    SERVED,
    Completion,
    EngineError,
    EngineNeeds,
    GenerateRequest,
    Sampling,
    UpdatesAdapterInPlace,
    check_loaded,
    check_new,
    check_same_lora_config,
)
from .engine_thread import EngineThread

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
IDLE_AFTER_ABORT_S = 30.0   # how long a write waits for SGLang to finish the requests of an aborted call
AUTO = "auto"   # engine.sglang.sampling_backend: the one-pass sampler where it can run
DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
served = functools.partial(setting, resume=ALLOWED, why=SERVED)   # every engine.sglang setting: how rollouts run


def sglang_target_modules(target) -> list[str]:
    """User LoRA target modules -> SGLang's lora_target_modules ('all-linear': ['all']; a regex is refused)."""
    if isinstance(target, str):
        if target == "all-linear":
            return ["all"]
        if target.isidentifier():
            return [target]
        raise EngineError(f"lora.target_modules={target!r} is a regular expression; SGLang only accepts "
                          f"module names or 'all'. List the modules, e.g. {ALL_PROJECTIONS}")
    bad = [t for t in target if not t.isidentifier()]
    if bad:
        raise EngineError(f"lora.target_modules has entries that are not module names: {bad}; list plain "
                          f"names such as {ALL_PROJECTIONS}")
    return list(target)


@dataclass
class SGLangSettings(Section):
    """The `engine.sglang` section: what sglang.Engine is started with (the rest comes from EngineNeeds)."""
    mem_fraction_static: float = served(0.3, "Fraction of GPU memory for the engine's weights + KV cache: 0.3 leaves "
                                        "the trainer room on a 24 GB GPU; ~0.85 on GPUs of its own (base_gpu_id >= 1).")
    dtype: str = served("auto", "The engine's model dtype ('auto', 'bfloat16', 'float16').")
    max_lora_rank: int = served(0, "Largest LoRA rank the engine holds; 0 = the run's lora.r.")
    max_loras_per_batch: int = served(4, "Adapters per batch; the base model counts as one (>= 2).")
    lora_backend: str = served("triton", "The LoRA kernels: 'triton' (faster decode) or 'csgmv' (SGLang's default).")
    attention_backend: str = served("", "'' = SGLang's default.")
    sampling_backend: str = served("auto", "'auto' = 'lorabench' where SGLang can load it, else SGLang's default; "
                                   "'lorabench' = one read of the logits for plain temperature sampling (an SGLang "
                                   "plugin: lorabench pip-installed, a verified release); '' = SGLang's default.")
    grammar_backend: str = served("", "'' = SGLang's default.")
    disable_cuda_graph: bool = served(False, "Turn CUDA graphs off (slower decode, faster start).")
    cuda_graph_max_bs: int = served(0, "Largest decode batch run as a CUDA graph (a larger one decodes several "
                                    "times slower); 0 = the largest batch the run sends.")
    tp_size: int = served(1, "Tensor-parallel size: the GPUs the engine spans from base_gpu_id on (docs/multi_gpu.md).")
    base_gpu_id: int = served(0, "The engine's first GPU; the trainer is on cuda:0. 0 = shared; 1 = GPUs of its own, "
                              "so sampling ahead (grpo.max_staleness) overlaps training (docs/multi_gpu.md).")
    in_place: bool = served(True, "Register the in-place writer (a custom weight loader) at start, for "
                            "refresh.mode=inplace or an engine opened without a run; false: never, inplace refused.")
    extra_args: str = served("", 'A JSON object of further sglang.Engine arguments, e.g. \'{"enable_memory_saver": '
                             'true}\'.')
    log_file: str = served("", "A file (appended) for the engine processes' output; '' = this process's.",
                           writes="file")

    def sampler(self) -> str:
        """The sampling backend SGLang is started with ('' = its default): 'auto' is the one-pass sampler where
        SGLang's processes can load it (internals.sampler_problems), else SGLang's own."""
        if self.sampling_backend != AUTO:
            return self.sampling_backend
        return "" if internals.sampler_problems() else internals.SAMPLER

    def extra(self) -> dict:
        return json.loads(self.extra_args) if self.extra_args else {}

    def problems(self) -> list[str]:
        found = [
            *check(self.max_loras_per_batch >= 2, f"engine.sglang.max_loras_per_batch={self.max_loras_per_batch}: "
                   f"base-model requests take a slot too; use >= 2"),
            *check(0 < self.mem_fraction_static < 1, f"engine.sglang.mem_fraction_static={self.mem_fraction_static}: "
                   f"must be between 0 and 1 (e.g. 0.3 when the trainer shares the GPU)"),
            *check(self.dtype in DTYPES, f"engine.sglang.dtype={self.dtype!r}: use one of {sorted(DTYPES)}"),
            *(internals.sampler_problems() if self.sampling_backend == internals.SAMPLER else []),
            *check(internals.lora_backend_known(self.lora_backend),
                   f"engine.sglang.lora_backend={self.lora_backend!r}: use one of {sorted(internals.LORA_BACKENDS)} "
                   f"('' = SGLang's default)"),
            *[f"engine.sglang.{key}={getattr(self, key)}: must be >= {low} ({meaning})" for key, low, meaning in (
                ("max_lora_rank", 0, "0 = lora.r"), ("cuda_graph_max_bs", 0, "0 = the largest batch the run sends"),
                ("tp_size", 1, "the GPUs the engine spans"),
                ("base_gpu_id", 0, "a CUDA index; 0 = beside the trainer, 1 = a GPU of its own"),
            ) if getattr(self, key) < low],
        ]
        if found:
            return found
        try:
            extra = self.extra()
        except json.JSONDecodeError as err:
            return [f"engine.sglang.extra_args={self.extra_args!r} is not JSON ({err}); write a JSON object, e.g. "
                    f'\'{{"enable_memory_saver": true}}\'']
        if not isinstance(extra, dict):
            return [f'engine.sglang.extra_args={self.extra_args!r}: must be a JSON object {{"name": value, ...}}']
        placed = [key for key in ("tp_size", "base_gpu_id") if key in extra]
        return [*[f"engine.sglang.extra_args sets {key}={extra[key]!r}; use engine.sglang.{key} instead (one place "
                  f"for where the engine runs)" for key in placed],
                *check(extra.get("dp_size", 1) == 1, f"engine.sglang.extra_args sets dp_size={extra.get('dp_size')!r}: "
                       f"sglang {', '.join(internals.VERIFIED)} refuses adapter and weight updates with dp_size > 1; "
                       f"run one engine per data-parallel group, or use engine.sglang.tp_size (docs/multi_gpu.md)")]

    def engine_kwargs(self, model_path: str, needs: EngineNeeds) -> dict:
        kwargs = dict(model_path=model_path, tokenizer_path=model_path, skip_tokenizer_init=True, enable_lora=True,
                      max_lora_rank=self.max_lora_rank or needs.lora_rank, mem_fraction_static=self.mem_fraction_static,
                      lora_target_modules=sglang_target_modules(needs.target_modules), dtype=self.dtype,
                      max_loras_per_batch=max(self.max_loras_per_batch, needs.adapters + 1),   # + the base
                      random_seed=needs.seed, log_level="error")
        if self.in_place and needs.in_place:   # the in-place writer
            kwargs["custom_weight_loader"] = [internals.LOADER]
        # decode CUDA graphs up to the largest batch the run sends; above, a batch decodes eagerly
        if self.cuda_graph_max_bs or needs.largest_batch:
            kwargs["cuda_graph_max_bs_decode"] = self.cuda_graph_max_bs or needs.largest_batch
        chosen = {key: getattr(self, key) for key in ("attention_backend", "grammar_backend", "lora_backend",
                                                      "disable_cuda_graph", "base_gpu_id")}
        chosen["sampling_backend"] = self.sampler()
        kwargs.update({key: value for key, value in chosen.items() if value})   # '', False, 0: SGLang's default
        if self.tp_size > 1:
            kwargs["tp_size"] = self.tp_size
        return {**kwargs, **self.extra()}

    def gpu_problems(self, visible: int) -> list[str]:
        """Where the engine runs against the `visible` CUDA GPUs of this process."""
        last = self.base_gpu_id + self.tp_size - 1
        return check(last < visible, f"engine.sglang.base_gpu_id={self.base_gpu_id} with tp_size={self.tp_size} puts "
                     f"the engine on GPUs {self.base_gpu_id}..{last}, but this process sees {visible} (cuda:0.."
                     f"{visible - 1}; CUDA_VISIBLE_DEVICES chooses them); lower base_gpu_id or tp_size")


def kv_capacity_note(held: int | None, needs: EngineNeeds, fraction: float) -> str:
    """'' or why the largest batch will not fit the KV cache (`held` tokens), and the mem_fraction_static that would."""
    wanted = needs.largest_batch * needs.max_new_tokens   # prompts not counted: a lower bound
    if not held or wanted <= held:
        return ""
    enough = min(0.9, math.ceil(100 * fraction * wanted / held) / 100)   # the weights' share too: a little over
    return (f"the engine's KV cache holds {held:,} tokens, fewer than the {wanted:,} its largest batch needs at "
            f"once ({needs.largest_batch} sequences x {needs.max_new_tokens} new tokens, prompts not counted): "
            f"SGLang decodes that batch in waves, slower per token. engine.sglang.mem_fraction_static={enough:g} "
            f"(now {fraction:g}) would hold it, where the trainer's memory on the same GPU leaves room")


def overlap_note(needs: EngineNeeds, base_gpu_id: int) -> str:
    """'' or why sampling ahead overlaps little here: the engine shares the trainer's GPU without CUDA MPS."""
    pipes = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    if not needs.samples_ahead or base_gpu_id != 0 or (pipes / "control").exists():
        return ""
    return (f"grpo.max_staleness samples the next step while this one trains, but the engine shares the trainer's "
            f"GPU and no CUDA MPS daemon runs (no {pipes / 'control'}): the GPU runs the two processes' kernels in "
            f"turns, so a step costs about what an on-policy one does. Start MPS before the run "
            f"(nvidia-cuda-mps-control -d) or give the engine a GPU of its own (engine.sglang.base_gpu_id=1)")


def sampler_note(settings: SGLangSettings) -> str:
    """'' or why sampling_backend=auto left sampling to SGLang's own sampler here."""
    problems = internals.sampler_problems() if settings.sampling_backend == AUTO else []
    if not problems:
        return ""
    why = "; ".join(problem.split(": ", 1)[1] for problem in problems)
    return (f"engine.sglang.sampling_backend=auto: SGLang's own sampler, not lorabench's one-pass sampler (a 2,048-row "
            f"decode ~1.2x faster, docs/results.md section 2), because {why}")


@contextlib.contextmanager
def child_output_to(path: str):
    """File descriptors 1 and 2 point at `path` during the block, so the processes started in it write there
    for life (not into a notebook's output); '' changes nothing."""
    if not path:
        yield
        return
    try:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as err:
        raise EngineError(f"engine.sglang.log_file={path!r}: cannot open it for writing ({err.strerror}); name a "
                          f"file in an existing, writable directory, or set engine.sglang.log_file='' to keep the "
                          f"engine's output here") from err
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def _on_engine_thread(abort_on_interrupt: bool = False):
    """The method runs on the engine's thread; abort_on_interrupt: an interrupted caller's request is aborted."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if self._thread is None:
                raise EngineError(f"SGLangEngine.{method.__name__}: the engine is closed; open a new one")
            return self._thread.call(method, self, *args, on_interrupt=self._abort if abort_on_interrupt else None,
                                     **kwargs)
        return call
    return wrap


class SGLangEngine:
    """An in-process sglang.Engine, created and driven on a thread of its own (engine_thread.py), every
    method run there, in order. Its processes ignore SIGINT (an interrupt stops the caller, never the
    engine); if one dies, the engine is marked failed (every call raises EngineError) instead of SGLang
    killing this process. Both need the engine created on the main thread."""
    Settings = SGLangSettings
    name = "sglang"
    help = "an in-process sglang.Engine on the GPU(s), no HTTP server"

    @staticmethod
    def check_available(settings: SGLangSettings, capabilities=()) -> None:
        """The sglang package (in-place refresh: a verified release, engine.sglang.in_place) and a CUDA GPU."""
        import importlib.util
        if importlib.util.find_spec("sglang") is None:
            raise EngineError("engine.backend='sglang' needs the sglang package, which is not installed for this "
                              "Python; install it on a GPU machine (pip install 'lorabench[sglang]') or use "
                              "engine.backend=hf")
        if UpdatesAdapterInPlace in capabilities:
            internals.check_version()
            if not settings.in_place:
                raise EngineError("refresh.mode=inplace with engine.sglang.in_place=false: the engine would start "
                                  "without the in-place writer; set engine.sglang.in_place=true, or use "
                                  "refresh.mode=tensor")
        if not torch.cuda.is_available():
            raise EngineError(f"engine.backend='sglang' needs a CUDA GPU; torch {torch.__version__} sees none here. "
                              f"Use engine.backend=hf on this machine")
        placement = settings.gpu_problems(torch.cuda.device_count())
        if placement:
            raise EngineError(placement[0])

    @staticmethod
    def needs_problems(settings: SGLangSettings, needs: EngineNeeds) -> list[str]:
        """What of the run's needs SGLang cannot serve, each with the fix."""
        found = check(not settings.max_lora_rank or settings.max_lora_rank >= needs.lora_rank,
                      f"engine.sglang.max_lora_rank={settings.max_lora_rank} is below lora.r={needs.lora_rank}; raise "
                      f"it or set 0 (= lora.r)")
        try:
            sglang_target_modules(needs.target_modules)
        except EngineError as err:
            found.append(str(err))
        return found

    def __init__(self, model_path: str, settings: SGLangSettings | None = None, needs: EngineNeeds | None = None,
                 **engine_overrides):
        self.settings = settings = settings or SGLangSettings()
        needs = needs or EngineNeeds()
        self.max_lora_rank = settings.max_lora_rank or needs.lora_rank
        self.has_writer = settings.in_place and needs.in_place   # as engine_kwargs registers it
        self.adapter_dtype = DTYPES.get(settings.dtype)  # None for 'auto': the model's own dtype
        self.device = "cuda"
        self.engine = self._store = None
        self._aborted = False   # a call's requests were aborted: SGLang's scheduler may still hold them
        self._thread = EngineThread("lorabench-sglang")
        try:
            # SGLang's processes inherit 'ignore' (a handler would not survive exec): Jupyter interrupts the
            # kernel's whole process group. The start itself cannot be interrupted.
            with sigint_handled_by(signal.SIG_IGN):
                self._thread.call(self._start, model_path, settings.engine_kwargs(model_path, needs), engine_overrides)
            self.notes = self._thread.call(self._notes, needs)
        except BaseException:
            self._thread.close("the engine did not start")
            self._thread = None
            raise
        internals.watch(self)

    def _start(self, model_path: str, kwargs: dict, overrides: dict) -> None:
        """sglang.Engine(**kwargs, **overrides), its rendezvous store on loopback, or an EngineError saying why not."""
        try:
            import sglang
        except ImportError as err:
            raise EngineError(f"engine.backend='sglang' needs the sglang package ({err}); install it with "
                              f"pip install 'lorabench[sglang]' on a GPU machine, or use engine.backend=hf") from err
        kwargs, settings = {**kwargs, **overrides}, self.settings
        # NCCL and gloo bind their bootstrap sockets to a non-loopback interface by default; one host needs lo
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            os.environ.setdefault(var, "lo")
        tp_size = kwargs.get("tp_size", 1)
        if tp_size > 1 and torch.cuda.is_initialized():
            # SGLang refuses GPUs whose free memory differs by > 10%: give back our cached blocks first
            torch.cuda.empty_cache()
        if kwargs.get("sampling_backend") == internals.SAMPLER:   # the plugin registers it only where asked for
            os.environ[internals.SAMPLER_ENV] = "1"
        store = internals.LoopbackStore.for_engine(tp_size)
        try:
            with store.environment(), child_output_to(settings.log_file):
                self.engine, self._store = sglang.Engine(**kwargs), store
        except (ValueError, RuntimeError, AssertionError) as err:
            store.close()
            hint = ""
            if tp_size > 1:
                held = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_initialized() else 0.0
                hint = (f"; with engine.sglang.tp_size={tp_size} SGLang also refuses GPUs whose free memory differs "
                        f"by more than 10% (this process holds {held:.1f} GB on its current GPU, which rank 0 "
                        f"shares): start the engine before the trainer, or see docs/multi_gpu.md")
            if settings.log_file:
                hint += f"; the engine's own output is in {settings.log_file}"
            raise EngineError(f"sglang.Engine failed to start ({type(err).__name__}: {err}); check "
                              f"engine.sglang.mem_fraction_static (now {settings.mem_fraction_static}) and the model "
                              f"path {model_path}{hint}") from err
        self._thread.use_loop(internals.event_loop(self.engine))   # made on this thread: its own
        self._adapters: set[str] = set()
        self._configs: dict[str, dict] = {}   # name -> config it was loaded with (tensor loads)
        self._versions: dict[str | None, int] = {None: 0}
        self._released: list[str] = []
        self.pool: internals.PoolWriter | None = None   # made at the first in-place write

    def _notes(self, needs: EngineNeeds) -> list[str]:
        """What the session tells the user: KV room, sampling-ahead overlap, an unverified release's gaps."""
        notes = [kv_capacity_note(self.engine.get_server_info().get("max_total_num_tokens"), needs,
                                  self.settings.mem_fraction_static), overlap_note(needs, self.settings.base_gpu_id),
                 sampler_note(self.settings)]
        return [*filter(None, notes), *internals.release_notes(self.engine)]

    @staticmethod
    def device_of(settings: SGLangSettings) -> str:
        return "cuda"   # the trainer's: cuda:0, rank 0's GPU unless base_gpu_id moves the engine

    @staticmethod
    def process_memory(settings: SGLangSettings, needs, vocab: int, base_weight_bytes: int) -> list[tuple]:
        return []   # nothing in the trainer's process: the engine's memory is its processes' own

    @classmethod
    def from_settings(cls, model_path: str, settings: SGLangSettings, needs: EngineNeeds,
                      **engine_overrides) -> SGLangEngine:
        return cls(model_path, settings, needs, **engine_overrides)

    @_on_engine_thread()
    def loaded_adapters(self) -> list[str]:
        return sorted(self._adapters)

    @_on_engine_thread()
    def served_version(self, adapter: str | None) -> int | None:
        return self._served_now(adapter)

    def _served_now(self, adapter: str | None) -> int | None:   # on the engine's thread
        if adapter is not None and self.pool is not None and adapter in self.pool.mapped:
            return self.pool.version(adapter)  # kept in the engine, beside its copy of the adapter
        return self._versions.get(adapter)

    @_on_engine_thread()
    def load_adapter(self, name: str, path: Path, version: int = 0) -> None:
        check_new(name, self._adapters)
        internals.check_reply(self.engine.load_lora_adapter(name, str(path)), f"load_lora_adapter({name!r}, {path})")
        self._adapters.add(name)
        self._configs.pop(name, None)
        self._versions[name] = version

    @_on_engine_thread()
    def load_adapter_tensors(self, name: str, adapter: FlatAdapter) -> None:
        check_new(name, self._adapters)
        if not adapter.buffer.is_cuda:  # CUDA-IPC carries GPU tensors only
            raise EngineError(f"load_adapter_tensors: the adapter is on {adapter.buffer.device}; move it to the "
                              f"GPU first (FlatAdapter.to('cuda'))")
        validate(adapter.tensors, adapter.config, max_rank=self.max_lora_rank)  # refused here, not in the scheduler
        internals.check_reply(self.engine.load_lora_adapter_from_tensors(name, adapter.tensors, adapter.config),
                              f"load_lora_adapter_from_tensors({name!r})")
        self._adapters.add(name)
        self._configs[name] = dict(adapter.config)
        self._versions[name] = adapter.version

    @_on_engine_thread()
    def update_adapter_in_place(self, name: str, adapter: FlatAdapter) -> dict[str, float]:
        """Overwrite adapter `name` in the engine's GPU LoRA pool (PoolWriter); refused while requests are in flight."""
        check_loaded(name, self._adapters, "; load it before updating it in place")
        if name not in self._configs:
            raise EngineError(f"adapter {name!r} was loaded from a dir; in-place updates need one tensor load "
                              f"first (load_adapter_tensors), so its config is known")
        check_same_lora_config(name, self._configs[name], adapter.config)
        if not self.has_writer:
            raise EngineError("this engine was started without the in-place writer (engine.sglang.in_place=false, "
                              "or for a run whose refresh.mode is not inplace); start one for a run with "
                              "refresh.mode=inplace, or use refresh.mode=tensor")
        if self.pool is None:
            internals.check_version()
            self.pool = internals.PoolWriter(self)
        if internals.requests_in_flight(self.engine):
            raise EngineError(f"in-place update of adapter {name!r} refused: requests are in flight, and they "
                              f"would read a half-written adapter; update between generate calls")
        self._idle_after_abort()
        return self.pool.write(name, adapter)

    @_on_engine_thread()
    def unload_adapter(self, name: str) -> None:
        check_loaded(name, self._adapters)
        self._idle_after_abort()
        if self.pool is not None:
            self.pool.forget(name)
        internals.check_reply(self.engine.unload_lora_adapter(name), f"unload_lora_adapter({name!r})")
        self._adapters.discard(name)
        self._configs.pop(name, None)
        self._versions.pop(name, None)

    @_on_engine_thread()
    def update_weights(self, named_tensors, flush_cache: bool = True, version: int | None = None) -> None:
        if flush_cache:
            self._idle_after_abort()
        internals.check_reply(self.engine.update_weights_from_tensor(list(named_tensors), flush_cache=flush_cache),
                              "update_weights_from_tensor")
        if version is not None:
            self._versions[None] = version

    def _lora(self, adapter: str | None, n: int) -> list[str | None]:
        if adapter is not None:
            check_loaded(adapter, self._adapters, "; a request named it")
        return [adapter] * n  # explicit, also for the base model: [None] * n

    @_on_engine_thread(abort_on_interrupt=True)
    def generate(self, prompt_ids, sampling: Sampling, adapter: str | None) -> list[Completion]:
        return self._mixed([GenerateRequest(prompt_ids, sampling, adapter)])[0]

    @_on_engine_thread(abort_on_interrupt=True)
    def generate_served(self, prompt_ids, sampling: Sampling, adapter: str | None) -> tuple[list[Completion], int]:
        """generate and the version that served it, in one call (a write sent meanwhile runs after it)."""
        return self._mixed([GenerateRequest(prompt_ids, sampling, adapter)])[0], self._served_now(adapter)

    @_on_engine_thread(abort_on_interrupt=True)
    def generate_mixed(self, requests: list[GenerateRequest]) -> list[list[Completion]]:
        """One sglang generate call: each prompt names its request's adapter and sampling parameters."""
        return self._mixed(requests)

    def _mixed(self, requests: list[GenerateRequest]) -> list[list[Completion]]:   # on the engine's thread
        prompts = [list(p) for r in requests for p in r.prompt_ids]
        params = [_params(r.sampling) for r in requests for _ in r.prompt_ids]
        lora = [name for r in requests for name in self._lora(r.adapter, len(r.prompt_ids))]
        outs = iter(self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                         lora_path=lora))   # one per prompt, in order
        return [[_completion(p, next(outs)) for p in r.prompt_ids] for r in requests]

    @_on_engine_thread(abort_on_interrupt=True)
    def score(self, sequences, prompt_lens, adapter, temperature: float = 1.0) -> list[torch.Tensor]:
        if temperature != 1.0:
            raise EngineError("SGLangEngine.score returns log-probs at temperature 1 only")
        outs = self.engine.generate(input_ids=[list(s) for s in sequences], sampling_params={"max_new_tokens": 0},
                                    return_logprob=True, logprob_start_len=[max(0, p - 1) for p in prompt_lens],
                                    lora_path=self._lora(adapter, len(sequences)))
        result = []
        for seq, plen, out in zip(sequences, prompt_lens, outs):
            lps = [lp for lp, *_ in out["meta_info"]["input_token_logprobs"] if lp is not None]
            result.append(torch.tensor(lps[len(lps) - (len(seq) - plen):], dtype=torch.float32))
        return result

    def _abort(self, call_id: int) -> None:
        """A caller stopped waiting for call `call_id`: end it early if still running (never a later call)."""
        engine, thread = self.engine, self._thread
        if engine is None or thread is None or thread.loop is None or thread.loop.is_closed():
            return

        def abort_if_still_running():
            if thread.running_call == call_id:
                self._aborted = True
                internals.abort_requests(engine)
        thread.loop.call_soon_threadsafe(abort_if_still_running)

    def _idle_after_abort(self) -> None:   # on the engine's thread, before a call that needs SGLang idle
        """After an aborted call, wait until SGLang's scheduler has let go of its requests: the cache flush that
        ends a weight write, and a memory release, assert that the scheduler is idle, and a failed assert stops
        the scheduler. An aborted request can stay in its running batch a step after its call has returned. Then
        give back the adapter uses SGLang leaked for aborted requests, on which an unload would wait."""
        if not self._aborted:
            return
        deadline = time.monotonic() + IDLE_AFTER_ABORT_S
        while not self.engine.flush_cache().success:   # public: refuses, never asserts
            if time.monotonic() > deadline:
                raise EngineError(f"SGLang's scheduler still holds requests {IDLE_AFTER_ABORT_S:.0f} s after an "
                                  f"interrupted call; a weight write or memory release now would stop it, so "
                                  f"neither ran. Close the session and open it again (lorabench resume continues "
                                  f"from the last checkpoint)")
            time.sleep(0.05)
        internals.release_leaked_lora_counts(self.engine, deadline)   # else an unload of their adapter waits forever
        self._aborted = False

    @_on_engine_thread()
    def release_memory(self, tags: list[str]) -> None:
        """Release GPU memory for training; tags 'kv_cache', 'weights' (weights come back undefined: only for a
        merged refresh, which pushes them all). Frees nothing without enable_memory_saver (extra_args)."""
        if self._released:
            raise EngineError(f"memory already released ({self._released}); resume_memory first")
        self._idle_after_abort()
        self.engine.release_memory_occupation(tags=list(tags))
        self._released = list(tags)

    @_on_engine_thread()
    def resume_memory(self) -> None:
        if not self._released:
            raise EngineError("resume_memory without release_memory; only what was released is resumed")
        self.engine.resume_memory_occupation(tags=self._released)
        if "weights" in self._released and self.pool is not None:
            self.pool.forget_all()  # the LoRA pool may come back elsewhere or empty: map again
        self._released = []

    def close(self) -> None:
        """Stop the engine's processes and its thread, after the call in progress (a failed engine's at once)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        internals.unwatch(self)
        internals.note_shutdown()
        try:
            if not thread.failure:
                thread.call(self._shutdown)
            elif self.engine is not None:
                internals.shut_down(self.engine)   # its processes died or were stopped: what is left goes now
        finally:
            thread.close()
            self.engine = None
            if self._store is not None:
                self._store.close()
                self._store = None
            internals.note_shutdown()

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.forget_all()
        internals.shut_down(self.engine)

    @property
    def serving(self) -> bool:
        return self._thread is not None and not self._thread.failure

    def children_failed(self, reason: str) -> None:
        """One of the engine's processes failed (SIGQUIT, main thread): stop the others, fail the calls."""
        log = f"; its output is in {self.settings.log_file}" if self.settings.log_file else ""
        self._thread.fail(f"the SGLang engine failed: {reason}{log}. Its processes were stopped; close the "
                          f"session and open a new one (a run dir continues from its last checkpoint: "
                          f"lorabench resume)")
        internals.stop_processes(self.engine)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _params(sampling: Sampling) -> dict:
    """SGLang's sampling parameters (greedy: top_k 1; a seed, read only with enable_deterministic_inference)."""
    params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
              "top_p": sampling.top_p if sampling.temperature > 0 else 1.0}
    if sampling.temperature == 0:
        params["top_k"] = 1
    if sampling.seed is not None and sampling.temperature > 0:
        params["sampling_seed"] = sampling.seed
    return params


def _completion(prompt: list[int], out: dict) -> Completion:
    meta = out["meta_info"]
    logprobs = [float(lp) for lp, _tok, *_ in meta["output_token_logprobs"]]
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    return Completion(list(prompt), list(out["output_ids"]), logprobs, "stop" if reason == "stop" else "length")
