"""What the benchmarks count, beside the clock (imported with the checkout and this folder on
sys.path; the CPU tests use `saved_activation_bytes` to check what the training path keeps):

- `saved_activation_bytes`: the bytes autograd saves for backward, what grows with the tokens of a
  micro-batch (activation_memory.py);
- `matmul_params`, `model_flops_per_token`, `trained_flops`: the FLOPs of a trained token and of a
  batch, for model FLOPs utilisation (step_gpu.py, train_gpu.py, step_user_path.py);
- `GpuBusy`: the share of time each GPU was running a kernel while a block ran (step_user_path.py);
- `trainer_context`: under CUDA MPS, the trainer's share of the SMs and its client priority, before the engine starts.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading

import torch


def saved_activation_bytes(model, fn) -> tuple[int, object]:
    """Bytes of distinct tensor storages autograd saves for backward while fn() runs, parameters
    excluded (they are resident anyway); returns (bytes, fn's result)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            saved[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return sum(saved.values()), result


def _config_value(config, name: str, default=None):
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    value = default if value is None else value   # e.g. Llama configs may say head_dim=None
    if value is None:
        raise ValueError(f"model config has no {name}")
    return value


def matmul_params(model_config) -> int:
    """Weights that take part in a matmul for every token, from a Qwen3/Llama-style config (an
    object or a dict): attention q/k/v/o and the gated MLP in each layer, plus the output head.
    The input embedding is a lookup (no FLOPs) and is left out, tied or not; norms and biases are
    negligible and left out too."""
    hidden = _config_value(model_config, "hidden_size")
    heads = _config_value(model_config, "num_attention_heads")
    kv_heads = _config_value(model_config, "num_key_value_heads", heads)
    head_dim = _config_value(model_config, "head_dim", hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)                 # q, o: heads; k, v: kv_heads
    mlp = 3 * hidden * _config_value(model_config, "intermediate_size")        # gate, up, down
    layers = _config_value(model_config, "num_hidden_layers")
    return layers * (attention + mlp) + hidden * _config_value(model_config, "vocab_size")


def model_flops_per_token(model_config, seq_len: int = 0) -> float:
    """Forward + backward FLOPs per trained token (PaLM, Chowdhery et al. 2022, appendix B):
    6 * matmul_params (2 per weight forward, 4 backward) + 12 * layers * heads * head_dim * seq_len
    for the attention scores and weighted sum (counted over the full, not causal-halved, context).
    Activation recomputation (checkpointing) is deliberately not counted, as MFU convention has it."""
    heads = _config_value(model_config, "num_attention_heads")
    head_dim = _config_value(model_config, "head_dim", _config_value(model_config, "hidden_size") // heads)
    layers = _config_value(model_config, "num_hidden_layers")
    return 6.0 * matmul_params(model_config) + 12.0 * layers * heads * head_dim * seq_len



def trained_flops(model_config, tokens: float, sequences: int) -> float:
    """Forward + backward FLOPs of training `tokens` tokens in `sequences` sequences of equal length
    (model_flops_per_token at their mean length)."""
    return model_flops_per_token(model_config, int(tokens / sequences)) * tokens

class GpuBusy:
    """`with GpuBusy() as busy: ...`, then `busy.percent` = {gpu index: mean utilization.gpu}: nvidia-smi's
    share of each sample period (every `period_ms`) in which a kernel ran on that GPU, averaged over the
    block. Empty where nvidia-smi is missing (a CPU machine)."""

    def __init__(self, period_ms: int = 100):
        self.period_ms, self.samples, self.percent = period_ms, {}, {}
        self._proc = self._reader = None

    def __enter__(self) -> GpuBusy:
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu",
                                           "--format=csv,noheader,nounits", f"-lms={self.period_ms}"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            index, _, busy = line.partition(",")
            if busy.strip().isdigit():
                self.samples.setdefault(int(index), []).append(int(busy))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=10)
            self._reader.join(timeout=10)
        self.percent = {gpu: sum(v) / len(v) for gpu, v in sorted(self.samples.items())}


def trainer_context(sm_percent: int = 0, below_normal: bool = False) -> None:
    """Under CUDA MPS: make this process's CUDA context now with the trainer's share of the SMs
    (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and client priority (CUDA_MPS_CLIENT_PRIORITY=1, BELOW_NORMAL), both read
    once when a context is made, then take them out of the environment: the engine's processes, started
    later from it, keep every SM and the NORMAL priority. Nothing to do when neither is asked for."""
    asked = {**({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(sm_percent)} if sm_percent else {}),
             **({"CUDA_MPS_CLIENT_PRIORITY": "1"} if below_normal else {})}
    if not asked:
        return
    os.environ.update(asked)
    torch.zeros(1, device="cuda")
    for key in asked:
        del os.environ[key]
