"""HFEngine with SGLang's semantics: base unless a request names an adapter, strict load/unload,
generate log-probs that agree with score(), seeded sampling, base-weight updates, memory symmetry,
adapter versions that only a successful write moves, and the engine registry and capabilities."""
import warnings

import pytest
import torch
from conftest import max_abs_diff, model_logprobs, perturb_lora_B
from synthetic import peft_adapter  # benchmarks/, on sys.path by conftest

from lorabench.adapters import AdapterError, FlatAdapter
from lorabench.data import prompt_ids, synthetic_problems
from lorabench.engines import (
    ENGINES,
    AdapterAlreadyLoaded,
    AdapterNotLoaded,
    EngineError,
    PushesWeights,
    ReleasesMemory,
    RolloutEngine,
    Sampling,
    StaleAdapter,
    UpdatesAdapterInPlace,
    engine_class,
)
from lorabench.engines.hf import HFEngine
from lorabench.models import load_model
from lorabench.session import start_engine
from lorabench.session.config import Config, ConfigError


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return load_model(str(tiny_model_dir))


@pytest.fixture
def adapter(make_peft_model):
    """(trainer model, its adapter) with a non-zero lora_B."""
    model = make_peft_model(seed=0)
    return model, peft_adapter(model)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    out = [prompt_ids(tokenizer, p.messages) for p in synthetic_problems(3, "engine-prompts")]
    assert len(set(map(len, out))) > 1  # left padding is exercised
    return out


def test_exceptions_hierarchy():
    for err in (AdapterNotLoaded, AdapterAlreadyLoaded, StaleAdapter):
        assert issubclass(err, EngineError)


# --- registry and capabilities ------------------------------------------------------------------
def test_registry_builds_the_configured_engine(tiny_model_dir):
    assert engine_class("hf") is HFEngine and "hf" in ENGINES and "sglang" in ENGINES
    with pytest.raises(EngineError, match="carrier-pigeon"):
        engine_class("carrier-pigeon")
    cfg = Config.load(overrides=["engine.hf.device=cpu", "model.dtype=bfloat16"])
    engine = start_engine(cfg, str(tiny_model_dir))
    try:
        assert type(engine) is HFEngine and engine.device == "cpu" and engine.dtype == "bfloat16"
        assert engine.model_path == str(tiny_model_dir)
        assert next(engine._base.parameters()).dtype == torch.bfloat16
    finally:
        engine.close()
    engine = start_engine(cfg, str(tiny_model_dir), dtype="float32")   # overrides win
    try:
        assert engine.dtype == "float32" and next(engine._base.parameters()).dtype == torch.float32
    finally:
        engine.close()


def test_hf_engine_has_every_capability(engine):
    for capability in (RolloutEngine, UpdatesAdapterInPlace, PushesWeights, ReleasesMemory):
        assert isinstance(engine, capability), capability.__name__
    assert engine.max_lora_rank is None and engine.adapter_dtype is None   # any rank, adapters as sent
    assert engine.name == "hf" and engine.help


def test_hf_settings_and_needs():
    """engine.hf holds its device; any rank or target list is within PEFT's reach."""
    from lorabench.engines.base import EngineNeeds
    from lorabench.engines.hf import HFSettings
    assert HFEngine.Settings is HFSettings and Config().engine.hf == HFSettings()
    assert HFEngine.needs_problems(HFSettings(), EngineNeeds(lora_rank=512, target_modules=("q_proj",))) == []
    with pytest.raises(ConfigError, match="engine.hf.device='gpu0'"):
        Config.load(overrides=["engine.hf.device=gpu0"])


# --- base vs adapter --------------------------------------------------------------------------------
def test_no_adapter_serves_base(engine, base_model, sample_sequences):
    seqs, lens = sample_sequences
    assert engine.loaded_adapters() == []
    assert max_abs_diff(engine.score(seqs, lens, None), model_logprobs(base_model, seqs, lens)) < 1e-5


def test_base_request_stays_base_while_adapter_loaded(engine, adapter, base_model, sample_sequences):
    model, flat = adapter
    seqs, lens = sample_sequences
    engine.load_adapter_tensors("policy", flat)
    assert engine.loaded_adapters() == ["policy"]
    base = model_logprobs(base_model, seqs, lens)
    assert max_abs_diff(engine.score(seqs, lens, None), base) < 1e-5
    adapted = engine.score(seqs, lens, "policy")
    assert max_abs_diff(adapted, model_logprobs(model, seqs, lens)) < 1e-5
    assert max_abs_diff(adapted, base) > 1e-3          # naming the adapter changes the output
    # and base again after an adapted request (no adapter left active by accident)
    assert max_abs_diff(engine.score(seqs, lens, None), base) < 1e-5


def test_zero_adapter_equals_base(engine, make_peft_model, sample_sequences):
    engine.load_adapter_tensors("fresh", peft_adapter(make_peft_model(perturb=False)))
    seqs, lens = sample_sequences
    assert max_abs_diff(engine.score(seqs, lens, "fresh"), engine.score(seqs, lens, None)) < 1e-6


def test_load_twice_raises_already_loaded(engine, adapter):
    _, flat = adapter
    engine.load_adapter_tensors("policy", flat)
    with pytest.raises(AdapterAlreadyLoaded, match="policy"):
        engine.load_adapter_tensors("policy", flat)
    assert engine.loaded_adapters() == ["policy"]


def test_unload_unknown_raises_not_loaded(engine, adapter):
    with pytest.raises(AdapterNotLoaded, match="ghost"):
        engine.unload_adapter("ghost")
    _, flat = adapter
    engine.load_adapter_tensors("policy", flat)
    with pytest.raises(EngineError):
        engine.unload_adapter("ghost")
    assert engine.loaded_adapters() == ["policy"]


def test_requests_naming_unknown_adapter_raise(engine, adapter, prompts, sample_sequences):
    seqs, lens = sample_sequences
    with pytest.raises(AdapterNotLoaded):
        engine.generate(prompts[:1], Sampling(max_new_tokens=2, temperature=0.0), adapter="policy")
    _, flat = adapter
    engine.load_adapter_tensors("policy", flat)
    with pytest.raises(AdapterNotLoaded, match="other"):
        engine.generate(prompts[:1], Sampling(max_new_tokens=2, temperature=0.0), adapter="other")
    with pytest.raises(AdapterNotLoaded):
        engine.score(seqs, lens, "other")


def test_load_by_path_equals_load_by_tensors(engine, adapter, tmp_path, sample_sequences):
    _, flat = adapter
    path = flat.save_peft_dir(tmp_path / "policy")
    engine.load_adapter("by_path", path)
    engine.load_adapter_tensors("by_tensors", flat)
    seqs, lens = sample_sequences
    by_path, by_tensors = engine.score(seqs, lens, "by_path"), engine.score(seqs, lens, "by_tensors")
    assert all(torch.equal(a, b) for a, b in zip(by_path, by_tensors))


def test_unload_last_adapter_then_base_and_reload(engine, adapter, base_model, sample_sequences):
    model, flat = adapter
    seqs, lens = sample_sequences
    engine.load_adapter_tensors("policy", flat)
    engine.unload_adapter("policy")
    assert engine.loaded_adapters() == []
    assert max_abs_diff(engine.score(seqs, lens, None), model_logprobs(base_model, seqs, lens)) < 1e-5
    with pytest.raises(AdapterNotLoaded):
        engine.score(seqs, lens, "policy")
    # the refresh pattern: the same name can be loaded again, with the new weights
    engine.load_adapter_tensors("policy", flat)
    assert max_abs_diff(engine.score(seqs, lens, "policy"), model_logprobs(model, seqs, lens)) < 1e-5


def test_two_adapters_are_independent(engine, make_peft_model, base_model, sample_sequences):
    seqs, lens = sample_sequences
    m1, m2 = make_peft_model(seed=1), make_peft_model(seed=2)
    want1, want2 = model_logprobs(m1, seqs, lens), model_logprobs(m2, seqs, lens)
    engine.load_adapter_tensors("one", peft_adapter(m1, version=1))
    engine.load_adapter_tensors("two", peft_adapter(m2, version=2))
    assert engine.loaded_adapters() == ["one", "two"]
    assert (engine.served_version("one"), engine.served_version("two")) == (1, 2)
    assert max_abs_diff(want1, want2) > 1e-3
    # interleaved requests: each gets its own adapter
    for _ in range(2):
        assert max_abs_diff(engine.score(seqs, lens, "one"), want1) < 1e-5
        assert max_abs_diff(engine.score(seqs, lens, "two"), want2) < 1e-5
    engine.unload_adapter("one")
    assert max_abs_diff(engine.score(seqs, lens, "two"), want2) < 1e-5
    assert max_abs_diff(engine.score(seqs, lens, None), model_logprobs(base_model, seqs, lens)) < 1e-5
    assert engine.served_version("one") is None and engine.served_version("two") == 2


@pytest.mark.parametrize("names", [("a", "lo"), ("x", "a")])
def test_names_inside_peft_prefix_load_right_and_quietly(engine, make_peft_model, sample_sequences, names):
    """A policy named 'a' is a PEFT adapter named 'a', inside PEFT's 'lora_' prefix: PEFT warns that its
    weights may load wrongly. Loaded first (get_peft_model) or beside another (add_adapter), each serves its
    own weights, and the warning is not shown (quiet_peft says why it does not apply)."""
    seqs, lens = sample_sequences
    models = [make_peft_model(seed=seed) for seed in (1, 2)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for version, (name, model) in enumerate(zip(names, models), 1):
            engine.load_adapter_tensors(name, peft_adapter(model, version=version))
    assert not [w for w in seen if "prefix" in str(w.message)]
    for name, model in zip(names, models):
        assert max_abs_diff(engine.score(seqs, lens, name), model_logprobs(model, seqs, lens)) < 1e-5


def test_unloading_the_active_adapter_is_quiet_and_keeps_the_other(engine, make_peft_model, sample_sequences):
    """Unloading the adapter the last request used: no PEFT warning (it reached notebook 03's output
    as a red box) and the other adapter still serves its own weights."""
    import warnings
    seqs, lens = sample_sequences
    m1, m2 = make_peft_model(seed=1), make_peft_model(seed=2)
    engine.load_adapter_tensors("one", peft_adapter(m1))
    engine.load_adapter_tensors("two", peft_adapter(m2))
    engine.score(seqs, lens, "two")                            # "two" is PEFT's active adapter now
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.unload_adapter("two")
    assert max_abs_diff(engine.score(seqs, lens, "one"), model_logprobs(m1, seqs, lens)) < 1e-5


def test_invalid_adapter_refused_before_install(engine, adapter, sample_sequences):
    _, flat = adapter
    bad = FlatAdapter(flat.buffer.clone(), flat.layout, flat.config, 1)
    next(v for k, v in sorted(bad.tensors.items()) if "lora_B" in k)[0, 0] = float("nan")
    with pytest.raises(AdapterError, match="NaN"):
        engine.load_adapter_tensors("policy", bad)
    assert engine.loaded_adapters() == [] and engine.served_version("policy") is None
    seqs, lens = sample_sequences
    assert all(torch.isfinite(t).all() for t in engine.score(seqs, lens, None))


def test_adapter_for_another_model_refused(engine, tiny_model_dir):
    """Tensors whose shapes do not fit the engine's base model are refused, naming the module."""
    from lorabench.adapters import PEFT_PREFIX
    module = "model.layers.0.self_attn.q_proj"
    wrong = FlatAdapter.from_tensors({f"{PEFT_PREFIX}{module}.lora_A.weight": torch.zeros(2, 7),
                                      f"{PEFT_PREFIX}{module}.lora_B.weight": torch.zeros(256, 2)},
                                     {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    with pytest.raises(AdapterError, match="another model") as info:
        engine.load_adapter_tensors("policy", wrong)
    assert module in str(info.value) and engine.loaded_adapters() == []


# --- versions -----------------------------------------------------------------------------------------
def test_served_version_follows_loads(engine, adapter, tmp_path):
    _, flat = adapter
    assert engine.served_version(None) == 0                     # the base weights as loaded
    assert engine.served_version("policy") is None              # nothing loaded under that name
    engine.load_adapter_tensors("policy", FlatAdapter(flat.buffer, flat.layout, flat.config, 5))
    assert engine.served_version("policy") == 5 and engine.served_version(None) == 0
    engine.unload_adapter("policy")
    assert engine.served_version("policy") is None
    engine.load_adapter("policy", flat.save_peft_dir(tmp_path / "a"), version=11)
    assert engine.served_version("policy") == 11
    engine.unload_adapter("policy")
    engine.load_adapter("policy", tmp_path / "a")               # a dir without a version: 0
    assert engine.served_version("policy") == 0


def test_served_version_follows_in_place_updates(engine, make_peft_model, sample_sequences):
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    engine.load_adapter_tensors("policy", peft_adapter(model, version=1))
    perturb_lora_B(model, seed=7)
    new = peft_adapter(model, version=2)
    assert engine.update_adapter_in_place("policy", new) == {}   # hf reports no timings of its own
    assert engine.served_version("policy") == 2
    assert max_abs_diff(engine.score(seqs, lens, "policy"), model_logprobs(model, seqs, lens)) < 1e-5


def test_refused_in_place_update_moves_neither_weights_nor_version(engine, make_peft_model, sample_sequences):
    """An in-place update keeps the engine's scaling: a changed config, a partial adapter or an unknown
    name is refused before anything is written, and the version stays where it was."""
    model = make_peft_model(seed=0)
    seqs, lens = sample_sequences
    engine.load_adapter_tensors("policy", peft_adapter(model, version=1))
    serving = engine.score(seqs, lens, "policy")
    perturb_lora_B(model, seed=4)
    new = peft_adapter(model, version=2)
    doubled_alpha = FlatAdapter(new.buffer, new.layout, {**new.config, "lora_alpha": 2 * new.config["lora_alpha"]}, 2)
    with pytest.raises(EngineError, match="lora_alpha"):
        engine.update_adapter_in_place("policy", doubled_alpha)
    partial = dict(new.tensors)
    partial.pop(next(iter(partial)))
    with pytest.raises(EngineError, match="whole adapter"):
        engine.update_adapter_in_place("policy", FlatAdapter.from_tensors(partial, new.config, 2))
    # same count, one tensor misshapen: checked before the first copy, so nothing is half-written
    shapes = {k: v for k, v in new.tensors.items()}
    last = sorted(shapes)[-1]
    shapes[last] = torch.zeros(shapes[last].shape[0], shapes[last].shape[1] + 1)
    with pytest.raises(EngineError, match="shape"):
        engine.update_adapter_in_place("policy", FlatAdapter.from_tensors(shapes, new.config, 2))
    assert engine.served_version("policy") == 1
    assert all(torch.equal(a, b) for a, b in zip(serving, engine.score(seqs, lens, "policy")))
    with pytest.raises(AdapterNotLoaded):
        engine.update_adapter_in_place("other", new)
    assert engine.served_version("other") is None


@pytest.mark.parametrize("name", ["policy", "model", "layers", "q_proj", "0"])
def test_in_place_update_under_any_adapter_name(engine, make_peft_model, sample_sequences, name):
    """engine.adapter_name is the user's choice; a name that is also a part of module paths
    ('model.layers.0...') must still find the adapter's own parameters."""
    model = make_peft_model(seed=0, target_modules=["q_proj", "v_proj"])
    seqs, lens = sample_sequences
    engine.load_adapter_tensors(name, peft_adapter(model, version=1))
    perturb_lora_B(model, seed=9)
    engine.update_adapter_in_place(name, peft_adapter(model, version=2))
    assert engine.served_version(name) == 2
    assert max_abs_diff(engine.score(seqs, lens, name), model_logprobs(model, seqs, lens)) < 1e-5


def test_update_weights_version(engine, base_model):
    name = "model.layers.1.self_attn.q_proj.weight"
    new = dict(base_model.named_parameters())[name].detach() * 1.5
    engine.update_weights([(name, new)], flush_cache=False)     # a bucket that is not the last: no version
    assert engine.served_version(None) == 0
    engine.update_weights([(name, new)], version=3)
    assert engine.served_version(None) == 3
    with pytest.raises(EngineError, match="no parameter"):
        engine.update_weights([("nonsense", new)], version=4)
    assert engine.served_version(None) == 3                     # a refused push does not move it


# --- generation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_adapter", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_generate_logprobs_equal_score(engine, adapter, prompts, use_adapter, temperature):
    _, flat = adapter
    name = None
    if use_adapter:
        engine.load_adapter_tensors("policy", flat)
        name = "policy"
    outs = engine.generate(prompts, Sampling(max_new_tokens=6, temperature=temperature, seed=5), adapter=name)
    assert len(outs) == len(prompts)
    for prompt, out in zip(prompts, outs):
        assert out.prompt_ids == prompt
        assert len(out.token_ids) == len(out.logprobs) and 1 <= len(out.token_ids) <= 6
        assert out.finish_reason in ("stop", "length")
        assert out.finish_reason == "length" or out.token_ids[-1] in engine.eos_ids
        assert all(lp <= 0 for lp in out.logprobs)
    scored = engine.score([o.prompt_ids + o.token_ids for o in outs], [len(o.prompt_ids) for o in outs],
                          name, temperature=temperature or 1.0)
    assert max_abs_diff(scored, [torch.tensor(o.logprobs) for o in outs]) < 1e-4


def test_generate_adapter_differs_from_base(engine, adapter, prompts):
    _, flat = adapter
    engine.load_adapter_tensors("policy", flat)
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=3)
    with_adapter = engine.generate(prompts, sampling, adapter="policy")
    base = engine.generate(prompts, sampling, adapter=None)
    lp_a = [lp for o in with_adapter for lp in o.logprobs]
    lp_b = [lp for o in base for lp in o.logprobs]
    assert [o.token_ids for o in with_adapter] != [o.token_ids for o in base] or lp_a != lp_b


def test_generate_in_chunks_equals_one_batch(tiny_model_dir, prompts):
    """GENERATE_BATCH splits large requests; the split does not change greedy output."""
    small = HFEngine(str(tiny_model_dir), device="cpu")
    small.GENERATE_BATCH = 1   # one sequence per generate call
    big = HFEngine(str(tiny_model_dir), device="cpu")
    try:
        greedy = Sampling(max_new_tokens=5, temperature=0.0)
        assert ([o.token_ids for o in small.generate(prompts, greedy, None)]
                == [o.token_ids for o in big.generate(prompts, greedy, None)])
    finally:
        small.close()
        big.close()


def test_stop_token_ends_completion(engine, prompts):
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=21)
    full = engine.generate(prompts, sampling, adapter=None)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in full)
    tokens = full[0].token_ids
    cut = next((i for i in range(1, 6) if tokens[i] not in tokens[:i]), None)
    assert cut is not None, tokens
    engine.eos_ids = {tokens[cut]}      # treat that token as the stop token (a real generate call)
    stopped = engine.generate(prompts, sampling, adapter=None)
    assert stopped[0].token_ids == tokens[:cut + 1]
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].logprobs == pytest.approx(full[0].logprobs[:cut + 1], abs=1e-5)
    for o, f in zip(stopped[1:], full[1:]):  # the rest of the batch is unaffected unless it stops too
        n = len(o.token_ids)
        assert o.token_ids == f.token_ids[:n]
        assert o.finish_reason == ("stop" if tokens[cut] in o.token_ids else "length")
        assert o.finish_reason == "stop" or n == 6


def test_greedy_is_deterministic(engine, prompts):
    greedy = Sampling(max_new_tokens=6, temperature=0.0)
    a, b = engine.generate(prompts, greedy, None), engine.generate(prompts, greedy, None)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    # greedy tokens are the argmax of the engine's own scores
    for o in a:
        seq = o.prompt_ids + o.token_ids
        logits_lp = engine.score([seq], [len(o.prompt_ids)], None)[0]
        assert torch.allclose(logits_lp, torch.tensor(o.logprobs), atol=1e-4)
    # batching does not change greedy output
    single = [engine.generate([p], greedy, None)[0].token_ids for p in prompts]
    assert single == [o.token_ids for o in a]


def test_seeded_sampling_reproducible(engine, prompts):
    def sample(seed):
        return [o.token_ids for o in engine.generate(prompts, Sampling(8, 1.0, 1.0, seed=seed), None)]
    state = torch.get_rng_state()
    first = sample(11)
    assert torch.equal(torch.get_rng_state(), state)  # a seeded call leaves the global RNG alone
    assert sample(11) == first
    assert sample(12) != first


def test_sampling_covers_full_distribution(engine, prompts):
    """top_p=1 means the whole vocabulary: no hidden top-k (transformers' default is 50)."""
    outs = engine.generate([prompts[0]] * 256, Sampling(1, temperature=1.0, top_p=1.0, seed=0), None)
    distinct = {o.token_ids[0] for o in outs}
    assert len(distinct) > 60, len(distinct)  # top-k 50 would cap it at 50


# --- base weights and memory ------------------------------------------------------------------------
def test_update_weights(engine, base_model, adapter, sample_sequences):
    _, flat = adapter
    seqs, lens = sample_sequences
    engine.load_adapter_tensors("policy", flat)
    name = "model.layers.1.self_attn.q_proj.weight"     # an adapted layer: PEFT wraps it in base_layer
    new = dict(base_model.named_parameters())[name].detach() * 1.5
    engine.update_weights([(name, new), ("model.norm.weight", torch.full((256,), 0.5))])
    reference = load_model(str(engine.model_path))
    reference.load_state_dict({name: new, "model.norm.weight": torch.full((256,), 0.5)}, strict=False)
    assert max_abs_diff(engine.score(seqs, lens, None), model_logprobs(reference, seqs, lens)) < 1e-5
    assert max_abs_diff(engine.score(seqs, lens, None), model_logprobs(base_model, seqs, lens)) > 1e-3


def test_update_weights_rejects_unknown_and_misshapen(engine, sample_sequences):
    seqs, lens = sample_sequences
    before = engine.score(seqs, lens, None)
    for bad in ["model.layers.0.self_attn.q_proj.base_layer.weight", "base_model.model.model.norm.weight",
                "model.layers.0.self_attn.q_proj.lora_A.weight", "nonsense"]:
        with pytest.raises(EngineError, match="no parameter"):
            engine.update_weights([(bad, torch.zeros(1))])
    with pytest.raises(EngineError, match="shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    # a good entry next to a bad one is not written either: every entry is checked first
    with pytest.raises(EngineError, match="shape"):
        engine.update_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(512, 256)),
                               ("model.norm.weight", torch.zeros(3))])
    assert all(torch.equal(a, b) for a, b in zip(before, engine.score(seqs, lens, None)))


def test_release_resume_symmetric(engine, sample_sequences):
    seqs, lens = sample_sequences
    with pytest.raises(TypeError):          # tags are required, as SGLang's engine requires them
        engine.release_memory()
    with pytest.raises(EngineError, match="without release"):
        engine.resume_memory()
    engine.release_memory(["kv_cache"])
    with pytest.raises(EngineError, match="twice"):
        engine.release_memory(["kv_cache"])
    engine.resume_memory()
    with pytest.raises(EngineError):
        engine.resume_memory()
    engine.release_memory(["kv_cache", "weights"])
    engine.resume_memory()
    assert engine.score(seqs, lens, None)[0].numel() == len(seqs[0]) - lens[0]
