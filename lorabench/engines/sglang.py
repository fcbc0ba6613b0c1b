"""The SGLang backend: an in-process `sglang.Engine` (no HTTP server, no open port) with LoRA
enabled, serving the base weights once and adapters refreshed live by name.

Only public Engine methods are used: generate, load_lora_adapter, load_lora_adapter_from_tensors,
unload_lora_adapter, update_weights_from_tensor, release/resume_memory_occupation, flush_cache,
shutdown. Token ids in, token ids and log-probs out (skip_tokenizer_init=True). The one exception is
the in-place refresh (refresh.mode=inplace): a custom weight loader, registered at start and run
inside the engine through update_weights_from_tensor, that writes into SGLang's LoRA pool
(sglang_inplace.py); it reads the adapter's engine id from the tokenizer manager's LoRA registry.

What each item of the integration defect chain (docs/background.md) maps to here:
 1. every request passes `lora_path=[name]*n`, or `[None]*n` for an explicit base request;
 2. 'all-linear' -> SGLang's 'all'; a regex target is refused at start (ConfigError);
 3. adapter configs are plain JSON (adapters.plain_config);
 4. sglang >= 0.5.17 (one serialised payload per TP rank, done by Engine itself);
 5. tensors are moved to the GPU before CUDA-IPC serialisation (refresh.TensorRefresh);
 6. PEFT state-dict names are sent, never trainer parameter names (adapters.AdapterSnapshot);
 7. release/resume are symmetric: only the tags released are resumed;
 8. a failed call raises EngineError with the engine's own error_message;
 9. multi-bucket merged pushes flush once, after the last bucket.

Scripts that start an Engine need an `if __name__ == "__main__":` guard (SGLang spawns its
scheduler process). In Jupyter the kernel's event loop is already running: nest_asyncio is applied.
If the scheduler dies, SGLang kills its whole process tree, the parent included.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
from pathlib import Path

import torch

from ..config import ConfigError
from .base import (AdapterAlreadyLoaded, AdapterNotLoaded, Completion, EngineError, Sampling,
                   check_same_lora_config)
from . import sglang_inplace

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sglang_target_modules(target) -> list[str]:
    """User LoRA target modules -> SGLang's lora_target_modules. 'all-linear' becomes ['all']; a
    string that is not a plain module name (a regex) cannot be expressed and is refused."""
    if isinstance(target, str):
        if target == "all-linear":
            return ["all"]
        if target.isidentifier():
            return [target]
        raise ConfigError(f"lora.target_modules={target!r} is a regular expression; SGLang only accepts "
                          f"module names or 'all'. List the modules, e.g. {ALL_PROJECTIONS}")
    bad = [t for t in target if not t.isidentifier()]
    if bad:
        raise ConfigError(f"lora.target_modules has entries that are not module names: {bad}; list plain "
                          f"names such as {ALL_PROJECTIONS}")
    return list(target)


def _in_running_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _check(result, what: str):
    """Engine replies carry .success/.error_message (LoRA calls) or (success, message) tuples."""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        ok, message = result
    else:
        ok, message = getattr(result, "success", True), getattr(result, "error_message", "") or ""
    if ok:
        return result
    if "does not exist" in message or "not loaded" in message:
        raise AdapterNotLoaded(f"{what}: {message}")
    if "already loaded" in message or "already exists" in message:
        raise AdapterAlreadyLoaded(f"{what}: {message}")
    raise EngineError(f"{what} failed; engine says: {message}")


def _one_buffer(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D span `tensors` cover if they are contiguous, back-to-back views of one buffer in this
    order (as refresh.Refresher._stage makes them), else None."""
    first = tensors[0]
    # adjacent addresses are not enough: separate allocations can sit back to back. Back-to-back
    # tensors whose first and last share a storage all lie inside it (storages do not overlap).
    if tensors[-1].untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return None
    expected = first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device or t.data_ptr() != expected:
            return None
        expected += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    return first.as_strided((total,), (1,), first.storage_offset())


class _LoopbackStore:
    """The torch.distributed rendezvous store of SGLang's scheduler ranks, hosted here on 127.0.0.1.

    Why: SGLang's ranks rendezvous through tcp://127.0.0.1:<port>, but torch's TCPStore server
    (started by rank 0) listens on every interface ('::') whatever host it is given: an
    unauthenticated key-value store open to the network for the engine's lifetime (seen on the
    H200 machines; tests/test_sglang_gpu.py::test_engine_opens_no_door). Here the server is
    started on a socket bound to loopback (TCPStore's master_listen_fd) and every rank joins it as
    a client: SGLang's SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE points the ranks at it, and
    torch's TORCHELASTIC_USE_AGENT_STORE makes rank 0 a client too. Both variables are set only
    while the engine starts (its processes inherit them) and only if the user has not set
    SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE: then the user's rendezvous is used as is."""

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
    def for_engine(cls, tp_size: int) -> "_LoopbackStore":
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


class SGLangEngine:
    name = "sglang"

    def __init__(self, model_path: str, cfg, **engine_overrides):
        e, lora = cfg.engine, cfg.lora
        self.target_modules = sglang_target_modules(lora.target_modules)
        self.max_lora_rank = e.max_lora_rank or lora.r
        if lora.r > self.max_lora_rank:
            raise ConfigError(f"lora.r={lora.r} exceeds engine.max_lora_rank={self.max_lora_rank}; raise "
                              f"engine.max_lora_rank")
        if _in_running_loop():  # Jupyter: the engine's sync methods need to re-enter the kernel's loop
            import nest_asyncio
            nest_asyncio.apply()
        import sglang
        kwargs = dict(model_path=model_path, tokenizer_path=model_path, skip_tokenizer_init=True,
                      enable_lora=True, max_lora_rank=self.max_lora_rank, lora_target_modules=self.target_modules,
                      max_loras_per_batch=e.max_loras_per_batch, mem_fraction_static=e.mem_fraction_static,
                      dtype=e.dtype, random_seed=cfg.run.seed, log_level="error",
                      custom_weight_loader=[sglang_inplace.LOADER])
        for key in ("attention_backend", "sampling_backend", "grammar_backend"):
            if getattr(e, key):
                kwargs[key] = getattr(e, key)
        if e.disable_cuda_graph:
            kwargs["disable_cuda_graph"] = True
        if e.tp_size > 1:
            kwargs["tp_size"] = e.tp_size
        if e.cuda_graph_max_bs:
            kwargs["cuda_graph_max_bs_decode"] = e.cuda_graph_max_bs
        if e.extra_args:
            kwargs.update(json.loads(e.extra_args))
        kwargs.update(engine_overrides)
        # No open doors (docs/reliability.md). With tp_size > 1 the scheduler ranks talk through
        # NCCL and gloo, which bind their bootstrap sockets to the host's first non-loopback
        # interface by default; one host needs loopback only (tensors go over NVLink/PCIe). Set the
        # variables yourself to override.
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            os.environ.setdefault(var, "lo")
        tp_size = kwargs.get("tp_size", 1)
        if tp_size > 1 and torch.cuda.is_initialized():
            # SGLang refuses to start when its GPUs' free memory differs by > 10%: give back this
            # process's cached blocks on the GPU it shares with rank 0 first
            torch.cuda.empty_cache()
        self._store = _LoopbackStore.for_engine(tp_size)
        try:
            with self._store.environment():
                self.engine = sglang.Engine(**kwargs)
        except (ValueError, RuntimeError, AssertionError) as err:
            self._store.close()
            hint = ""
            if tp_size > 1:
                held = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_initialized() else 0.0
                hint = (f"; with engine.tp_size={tp_size} SGLang also refuses GPUs whose free memory differs by "
                        f"more than 10% (this process holds {held:.1f} GB on its current GPU, which rank 0 "
                        f"shares): start the engine before the trainer, or see docs/multi_gpu.md")
            raise EngineError(f"sglang.Engine failed to start ({type(err).__name__}: {err}); check "
                              f"engine.mem_fraction_static (now {e.mem_fraction_static}) and the model path "
                              f"{model_path}{hint}") from err
        self.device = "cuda"
        self._adapters: set[str] = set()
        self._configs: dict[str, dict] = {}  # name -> config it was loaded with (tensor loads)
        self._released: list[str] = []
        self.last_write_ms: dict[str, float] = {}  # the in-engine loader's phases, last in-place write
        from transformers import GenerationConfig
        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:  # no generation_config.json: the model config's eos is what SGLang uses too
            from transformers import AutoConfig
            eos = AutoConfig.from_pretrained(model_path).eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    # -- adapters ---------------------------------------------------------------------------
    def loaded_adapters(self) -> list[str]:
        return sorted(self._adapters)

    def load_adapter(self, name: str, path: Path) -> None:
        if name in self._adapters:
            raise AdapterAlreadyLoaded(f"adapter {name!r} is already loaded; unload it before loading again")
        _check(self.engine.load_lora_adapter(name, str(path)), f"load_lora_adapter({name!r}, {path})")
        self._adapters.add(name)
        self._configs.pop(name, None)

    def load_adapter_tensors(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        if name in self._adapters:
            raise AdapterAlreadyLoaded(f"adapter {name!r} is already loaded; unload it before loading again")
        off_gpu = [k for k, v in tensors.items() if not v.is_cuda]
        if off_gpu:  # CUDA-IPC carries GPU tensors only
            raise EngineError(f"load_adapter_tensors: {len(off_gpu)} tensors are not on the GPU (e.g. "
                              f"{off_gpu[0]}); move them with .cuda() first")
        _check(self.engine.load_lora_adapter_from_tensors(name, tensors, config),
               f"load_lora_adapter_from_tensors({name!r})")
        self._adapters.add(name)
        self._configs[name] = dict(config)

    def update_adapter_in_place(self, name: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
        """Overwrite loaded adapter `name` inside the engine's GPU LoRA pool (and its host copy) with
        `tensors` (PEFT names, GPU, same shapes and config). The prefix cache is flushed: entries
        computed with the old values carry the same adapter id and would otherwise be reused."""
        if name not in self._adapters:
            raise AdapterNotLoaded(f"adapter {name!r} is not loaded (loaded: {self.loaded_adapters()}); load it "
                                   f"before updating it in place")
        if name not in self._configs:
            raise EngineError(f"adapter {name!r} was loaded from a dir; in-place updates need one tensor load "
                              f"first (load_adapter_tensors), so its config is known")
        check_same_lora_config(name, self._configs[name], config)
        off_gpu = [k for k, v in tensors.items() if not v.is_cuda]
        if off_gpu:
            raise EngineError(f"update_adapter_in_place: {len(off_gpu)} tensors are not on the GPU (e.g. "
                              f"{off_gpu[0]}); move them with .cuda() first")
        ref = self.engine.tokenizer_manager.lora_registry.get_all_adapters().get(name)
        if ref is None:
            raise AdapterNotLoaded(f"adapter {name!r} is not in the engine's LoRA registry")
        flat = _one_buffer(list(tensors.values()))
        if flat is not None:  # one CUDA-IPC handle instead of one per tensor (392 for the 0.6B shape)
            layout = [(k, list(v.shape)) for k, v in tensors.items()]
            named = [(sglang_inplace.flat_name(ref.lora_id, layout), flat)]
        else:
            named = [(sglang_inplace.tensor_name(ref.lora_id, k), v) for k, v in tensors.items()]
        # the loader's reply travels back in a GPU buffer on TP rank 0's device (see sglang_inplace)
        status = sglang_inplace.status_tensor(torch.device("cuda", self.engine.server_args.base_gpu_id))
        named.append((sglang_inplace.STATUS, status))
        _check(self.engine.update_weights_from_tensor(named, load_format=sglang_inplace.LOADER, flush_cache=True),
               f"in-place update of adapter {name!r}")
        reply = sglang_inplace.read_status(status)
        accepted, self.last_write_ms = sglang_inplace.parse_reply(reply)
        if not accepted:
            reply = reply or "no reply from the in-engine loader"
            raise EngineError(f"in-place update of adapter {name!r} failed; engine says: {reply}. The engine "
                              f"still serves the previous values")

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise AdapterNotLoaded(f"adapter {name!r} is not loaded (loaded: {self.loaded_adapters()})")
        _check(self.engine.unload_lora_adapter(name), f"unload_lora_adapter({name!r})")
        self._adapters.discard(name)
        self._configs.pop(name, None)

    def update_weights(self, named_tensors, flush_cache: bool = True) -> None:
        _check(self.engine.update_weights_from_tensor(list(named_tensors), flush_cache=flush_cache),
               "update_weights_from_tensor")

    # -- generation and scoring -------------------------------------------------------------
    def _lora(self, adapter: str | None, n: int) -> list[str | None]:
        if adapter is not None and adapter not in self._adapters:
            raise AdapterNotLoaded(f"request names adapter {adapter!r}, which is not loaded "
                                   f"(loaded: {self.loaded_adapters()})")
        return [adapter] * n  # explicit, also for the base model: [None] * n

    def generate(self, prompt_ids, sampling: Sampling, adapter: str | None) -> list[Completion]:
        params = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                  "top_p": sampling.top_p if sampling.temperature > 0 else 1.0}
        if sampling.temperature == 0:
            params["top_k"] = 1
        if sampling.seed is not None and sampling.temperature > 0:
            params["sampling_seed"] = sampling.seed
        outs = self.engine.generate(input_ids=[list(p) for p in prompt_ids], sampling_params=params,
                                    return_logprob=True, lora_path=self._lora(adapter, len(prompt_ids)))
        completions = []
        for p, out in zip(prompt_ids, outs):
            meta = out["meta_info"]
            tokens = list(out["output_ids"])
            logprobs = [float(lp) for lp, _tok, *_ in meta["output_token_logprobs"]]
            reason = (meta.get("finish_reason") or {}).get("type", "length")
            completions.append(Completion(list(p), tokens, logprobs, "stop" if reason == "stop" else "length"))
        return completions

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

    # -- memory -------------------------------------------------------------------------------
    def release_memory(self, tags: list[str] | None = None) -> None:
        """Release GPU memory for training. Tags: 'kv_cache' (default), 'weights' (SGLang's). Released
        weights come back with undefined contents unless the engine keeps a CPU backup, so only
        release them when every weight is pushed again after resume (merged refresh). Needs the
        engine started with enable_memory_saver (engine.extra_args) to free anything. Only what was
        released is resumed, so the pair stays symmetric."""
        if self._released:
            raise EngineError(f"memory already released ({self._released}); resume_memory first")
        tags = tags or ["kv_cache"]
        self.engine.release_memory_occupation(tags=tags)
        self._released = list(tags)

    def resume_memory(self) -> None:
        if not self._released:
            raise EngineError("resume_memory without release_memory; only what was released is resumed")
        self.engine.resume_memory_occupation(tags=self._released)
        self._released = []

    def close(self) -> None:
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
            self.engine = None
        if getattr(self, "_store", None) is not None:
            self._store.close()
            self._store = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
