"""grpo.compile: the compiled head passes and decoder layers compute what the eager ones do. On the
CPU, in float32, one GRPO update of a compiled policy gives the eager policy's loss, log-probs and
LoRA gradients up to float32 rounding (inductor fuses and reorders sums). Its speed is the GPU's
question (benchmarks/train_gpu.py), not a test's."""
import shutil

import pytest
import torch
from conftest import perturb_lora_B
from synthetic import random_tokens_like_rollouts  # benchmarks/

from lorabench.policy import Policy
from lorabench.rollout import RolloutBatch
from lorabench.session.config import Config, ConfigError

# torch.compile on the CPU generates C++ and needs a compiler
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="torch.compile on the CPU needs a C++ compiler (g++ or c++); none on PATH")


def batch_of(prompts: list[int], completions: list[int], rewards: list[float], g: torch.Generator) -> RolloutBatch:
    """Random sequences of these prompt and completion lengths, right-padded, advantages centred."""
    ids, attn, cmask = random_tokens_like_rollouts(prompts, completions, (10, 400), g)
    r = torch.tensor(rewards)
    return RolloutBatch(ids, attn, cmask, torch.zeros(cmask.shape), r, r - r.mean())


def synthetic_batch(n: int = 6, seed: int = 0) -> RolloutBatch:
    """[n, L] right-padded sequences of varied length with completion masks and advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(6, 10, (n,), generator=g)
    completions = torch.randint(4, 12, (n,), generator=g)
    return batch_of(prompts.tolist(), completions.tolist(), [1.0, 0.0, 1.0, 0.0, 0.0, 1.0][:n], g)


def trained(model_dir, compile_mode: str, device: str = "cpu", *overrides: str) -> tuple[dict, list[torch.Tensor]]:
    cfg = Config.load(overrides=["lora.r=4", "lora.alpha=8", "grpo.micro_batch_tokens=48",
                                 f"grpo.compile={compile_mode}", *overrides])
    torch.manual_seed(0)
    policy = Policy(str(model_dir), cfg.lora, cfg.grpo, "float32", device)
    perturb_lora_B(policy.model, seed=3)                   # non-zero B: A gets gradients too
    stats = policy.train(synthetic_batch())
    return stats, [p.grad.clone().cpu() for p in policy.params]


@pytest.mark.parametrize("mode, graphs", [("head", 2), ("all", 3)])
def test_compiled_update_equals_eager(tiny_model_dir, mode, graphs):
    from torch._dynamo.utils import counters
    eager_stats, eager_grads = trained(tiny_model_dir, "off")
    torch._dynamo.reset()           # count this mode's graphs, not reuse of an earlier test's
    counters.clear()
    compiled_stats, compiled_grads = trained(tiny_model_dir, mode)
    # it did compile, each piece one whole graph: the head's two passes (and the decoder layer,
    # its checkpoint inside)
    assert counters["stats"]["unique_graphs"] >= graphs and not counters["graph_break"], dict(counters)
    assert_same_update((eager_stats, eager_grads), (compiled_stats, compiled_grads), rel=1e-5, abs_stats=1e-7)


def assert_same_update(eager, compiled, rel: float, abs_stats: float) -> None:
    """Two `trained` results agree: every LoRA gradient to `rel` in norm, loss, grad norm, tokens."""
    (eager_stats, eager_grads), (compiled_stats, compiled_grads) = eager, compiled
    assert len(eager_grads) == len(compiled_grads) > 0
    for e, c in zip(eager_grads, compiled_grads):
        assert e.norm() > 0
        assert ((c - e).norm() / e.norm()).item() < rel
    for key in ("loss", "grad_norm", "tokens"):
        assert compiled_stats[key] == pytest.approx(eager_stats[key], rel=rel, abs=abs_stats), key


def test_a_micro_batch_without_padding_reuses_the_compiled_layers(tiny_model_dir):
    """transformers drops a 2-D mask that pads nothing, and a layer compiled for a mask would compile
    again (~30 s on the H200); the policy hands compiled layers the full mask always."""
    from torch._dynamo.utils import counters

    def batch(prompts, completions):
        return batch_of(prompts, completions, [1.0, 0.0, 0.0], torch.Generator().manual_seed(0))

    torch._dynamo.reset()           # graphs of earlier tests must not stand in for this one's
    cfg = Config.load(overrides=["lora.r=4", "lora.alpha=8", "grpo.micro_batch_tokens=80", "grpo.compile=all"])
    policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cpu")
    policy.train(batch([6, 7, 8], [8, 9, 10]))           # one micro-batch of 3, padded
    counters.clear()
    policy.train(batch([7, 7, 7], [9, 9, 9]))           # one micro-batch of 3, no padding (16)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters)
    assert policy.version == 2


def test_compiled_layers_get_widths_in_multiples_of_8(tiny_model_dir, monkeypatch):
    """On the H200 a compiled layer compiled again mid-run (15 s) when a micro-batch's width turned
    from a multiple of 8 to not (an alignment guard of inductor's, not seen on the CPU):
    under compile=all every micro-batch reaches the layers padded to a multiple of 8 (masked columns;
    that they change nothing: test_grpo's micro-batch test, and compiled = eager above)."""
    import lorabench.policy as policy_module
    widths = []

    def recording(real):
        def forward(model, input_ids, *args, **kwargs):
            widths.append(input_ids.shape[1])
            return real(model, input_ids, *args, **kwargs)
        return forward

    for name in ("token_logprobs", "token_logprobs_and_entropy"):   # the training forward is the second
        monkeypatch.setattr(policy_module, name, recording(getattr(policy_module, name)))
    cfg = Config.load(overrides=["lora.r=4", "lora.alpha=8", "grpo.micro_batch_tokens=64", "grpo.compile=all"])
    policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cpu")
    g = torch.Generator().manual_seed(1)
    policy.train(batch_of([5, 9, 6, 7], [8, 8, 4, 11], [1.0, 0.0, 0.0, 1.0], g))   # 13..18 tokens
    assert len(widths) == 2 and all(w % 8 == 0 for w in widths), widths


def test_compile_without_decoder_layers_is_refused():
    """A model whose decoder keeps no `layers` list: a clear error naming the model and the fix."""
    from lorabench.policy import _compile_decoder_layers

    class NoLayers(torch.nn.Module):          # what PEFT and transformers expose, and nothing more
        def get_base_model(self):
            return self

        def get_decoder(self):
            return torch.nn.Linear(2, 2)

    with pytest.raises(ConfigError,
                       match=r"grpo.compile=all: the model models/odd \(Linear\) .* grpo.compile=head or off"):
        _compile_decoder_layers(NoLayers(), "models/odd", checkpointing=True)


def test_compiling_ahead_changes_nothing_and_leaves_the_update_nothing_to_compile(tiny_model_dir):
    """Policy.compile_now (run while the engine starts) trains a dummy batch and puts everything back: the
    policy's weights, optimizer, version and the RNG are as before, the first real update compiles no graph,
    and it equals the update of a policy that compiled in it."""
    from torch._dynamo.utils import counters
    cfg = Config.load(overrides=["lora.r=4", "lora.alpha=8", "grpo.micro_batch_tokens=96", "grpo.compile=all"])

    def new_policy() -> Policy:
        torch.manual_seed(0)
        policy = Policy(str(tiny_model_dir), cfg.lora, cfg.grpo, "float32", "cpu")
        perturb_lora_B(policy.model, seed=3)
        return policy

    torch._dynamo.reset()
    ahead = new_policy()
    weights, rng = [p.detach().clone() for p in ahead.params], torch.get_rng_state()
    ahead.compile_now()
    assert counters["stats"]["unique_graphs"] >= 3, dict(counters)   # it compiled: two head passes, the layer
    assert torch.equal(torch.get_rng_state(), rng) and ahead.version == 0 and not ahead.optimizer.state
    assert all(torch.equal(w, p) for w, p in zip(weights, ahead.params))
    counters.clear()
    ahead_stats = ahead.train(synthetic_batch())
    assert counters["stats"]["unique_graphs"] == 0, dict(counters)
    torch._dynamo.reset()
    plain = new_policy()
    plain_stats = plain.train(synthetic_batch())
    for key in ("loss", "grad_norm", "tokens"):
        assert ahead_stats[key] == pytest.approx(plain_stats[key], rel=1e-6, abs=1e-8), key
    for a, p in zip(ahead.params, plain.params):
        assert torch.allclose(a, p, rtol=1e-6, atol=1e-8)


def test_a_group_compiles_while_its_engine_starts_and_its_first_step_compiles_nothing(tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """Through GroupSession.open (what `lorabench run` does): the log says so, step 1 of five policies on one
    shared model compiles no graph, and no layer falls back to eager: on the H200 (torch 2.11) a group of four
    after a single run in the same process hit dynamo's limit of 8 graphs of the layer and trained one policy
    eagerly; with fail_on_recompile_limit_hit a hit fails here."""
    import json

    from torch._dynamo.utils import counters

    from lorabench.session import GroupSession
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    entries = [{"name": f"p{i}", "grpo": {"lr": 1e-4 * (i + 1)}} for i in range(5)]
    cfg = Config.load(None, [f"policies={json.dumps(entries)}", f"model.name_or_path={tiny_model_dir}",
                             f"run.out_dir={tmp_path}", "run.name=g", f"refresh.file.tmp_dir={tmp_path}",
                             "grpo.compile=all", "grpo.prompts_per_step=2", "grpo.group_size=2",
                             "grpo.max_new_tokens=4", "data.eval_size=2", "run.threads=1"])
    torch._dynamo.reset()
    lines: list[str] = []
    group = GroupSession.open(cfg, log=lines.append, evaluate_first=False)
    try:
        assert any("compiling the training graphs while the engine starts" in line for line in lines), lines
        counters.clear()
        group.trainer.step()
        assert counters["stats"]["unique_graphs"] == 0, dict(counters)
    finally:
        group.close()
