"""Shared fixtures for the CPU suite: a tiny random-init Qwen3 model built offline once per session,
PEFT trainer models with a non-trivial adapter, and real HFEngine instances (no mocks)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

# Two CPU threads, and threads that sleep instead of spin while waiting: another process (a demo)
# may share the two cores, and spinning OpenMP threads then slow every matmul down several times.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # works without `pip install -e .` too
    sys.path.insert(0, str(ROOT))
# the benchmarks' own modules (meters, synthetic inputs), which some tests use too; appended, so that
# nothing there shadows an installed package
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.append(str(ROOT / "benchmarks"))

torch.set_num_threads(int(os.environ.get("LORABENCH_TEST_THREADS", "2")))

# a small rank keeps the suite fast; 'all-linear' exercises PEFT's resolution of target modules
LORA_R, LORA_ALPHA = 4, 8


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3 model + its BPE tokenizer, saved as an ordinary HF model dir."""
    from lorabench.tiny import build_tiny_model, build_tiny_tokenizer
    out = tmp_path_factory.mktemp("tiny-model")
    tokenizer = build_tiny_tokenizer(out)
    model = build_tiny_model(tokenizer)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from lorabench.models import load_tokenizer
    return load_tokenizer(str(tiny_model_dir))


def perturb_lora_B(model, seed: int = 0, scale: float = 0.2) -> None:
    """Make the adapter non-trivial: PEFT initialises lora_B to zero (adapter == base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=gen).to(param.device) * scale)


@pytest.fixture
def make_peft_model(tiny_model_dir):
    """Factory: a fresh PEFT-wrapped trainer model (LoRA on all linear layers), lora_B perturbed."""
    from peft import LoraConfig, get_peft_model

    from lorabench.models import load_model

    def make(seed: int = 0, perturb: bool = True, target_modules="all-linear", r: int = LORA_R):
        torch.manual_seed(seed)
        base = load_model(str(tiny_model_dir), "float32", "cpu")
        config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=target_modules, lora_dropout=0.0,
                            bias="none")
        model = get_peft_model(base, config)
        if perturb:
            perturb_lora_B(model, seed)
        model.eval()
        return model
    return make


@pytest.fixture
def engine(tiny_model_dir):
    """A real HFEngine on CPU serving the tiny model's base weights."""
    from lorabench.engines.hf import HFEngine
    eng = HFEngine(str(tiny_model_dir), device="cpu", dtype="float32")
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def sample_sequences(tokenizer):
    """Two chat prompts of different lengths followed by their reference answers: (seqs, prompt_lens)."""
    from lorabench.data import prompt_ids, synthetic_problems
    seqs, lens = [], []
    for p in synthetic_problems(2, "test-seqs"):
        prompt = prompt_ids(tokenizer, p.messages)
        seqs.append(prompt + tokenizer(p.answer, add_special_tokens=False)["input_ids"])
        lens.append(len(prompt))
    assert lens[0] != lens[1]  # different prompt lengths: padding is exercised
    return seqs, lens


@torch.no_grad()
def model_logprobs(model, sequences, prompt_lens, temperature: float = 1.0) -> list[torch.Tensor]:
    """The trainer side: log-probs of sequences[i][prompt_lens[i]:] from an unpadded forward pass."""
    out = []
    for seq, plen in zip(sequences, prompt_lens):
        ids = torch.tensor([seq])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
        lp = torch.log_softmax(logits / temperature, -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(lp[plen - 1:])
    return out


def merged_state_dict(peft_model, adapted_only: bool = False) -> dict[str, torch.Tensor]:
    """W + (α/r)·B·A for every layer of a PEFT model, out of place: the package's merge
    (adapters.merge_weights) of the model's own adapter."""
    from synthetic import peft_adapter

    from lorabench.adapters import base_weights, merge_weights
    return merge_weights(base_weights(peft_model), peft_adapter(peft_model), adapted_only)


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape, (x.shape, y.shape)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


class CoreOnlyEngine:
    """A real engine with only the core RolloutEngine protocol (generate, score, load/unload by name,
    versions): it serves through an HFEngine it owns but has none of the optional capabilities (no
    in-place update, no weight push, no memory release), as a minimal third-party backend would."""
    name = "core-only"
    help = "the core protocol and nothing else (tests)"
    max_lora_rank = None
    adapter_dtype = None

    def __init__(self, model_path: str):
        from lorabench.engines.hf import HFEngine
        self._inner = HFEngine(model_path, device="cpu", dtype="float32")
        self.device = self._inner.device

    def generate(self, prompt_ids, sampling, adapter):
        return self._inner.generate(prompt_ids, sampling, adapter)

    def score(self, sequences, prompt_lens, adapter, temperature: float = 1.0):
        return self._inner.score(sequences, prompt_lens, adapter, temperature)

    def load_adapter(self, name, path, version: int = 0):
        self._inner.load_adapter(name, path, version)

    def load_adapter_tensors(self, name, adapter):
        self._inner.load_adapter_tensors(name, adapter)

    def unload_adapter(self, name):
        self._inner.unload_adapter(name)

    def loaded_adapters(self):
        return self._inner.loaded_adapters()

    def served_version(self, adapter):
        return self._inner.served_version(adapter)

    def close(self):
        self._inner.close()


@pytest.fixture
def core_engine(tiny_model_dir):
    eng = CoreOnlyEngine(str(tiny_model_dir))
    yield eng
    eng.close()


@pytest.fixture
def default_sigint():
    """For tests that interrupt themselves: SIGINT raises KeyboardInterrupt (Python's own handler),
    also when pytest was started with SIGINT ignored, as a shell's background job is (Python then
    keeps it ignored, and no interrupt would arrive); not blocked in the main thread either."""
    import signal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def load_checkpoint(runlog):
    """What a resume does with a run log: its last checkpoint and adapter (None, None before the first), the
    files made to agree with it (RunLog.check_checkpoint, then RunLog.repair)."""
    state, adapter, found = runlog.check_checkpoint()
    runlog.repair(found)
    return state, adapter
