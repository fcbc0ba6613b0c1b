"""The checks behind each failure mode: the engine's rollouts or greedy completions re-scored by the
trainer, trainer vs engine log-probs, and a lesson's self-check table.
"""
from __future__ import annotations

import torch

from ..data import prompt_ids
from ..loss import token_logprobs


def _greedy(trainer, problems, adapter: str | None) -> list:
    """The engine's greedy outputs for `problems`; `adapter`: 'serving' (the trainer's), a name or None."""
    name = trainer.refresher.serving_adapter if adapter == "serving" else adapter
    prompts = [prompt_ids(trainer.tokenizer, p.messages) for p in problems]
    return trainer.engine.generate(prompts, trainer.sampling(greedy=True), adapter=name)


def rollout_sequences(trainer, n_prompts: int = 2, adapter: str | None = "serving") -> tuple[list, list]:
    """Greedy engine completions of held-out prompts: (prompt + completion ids, prompt lengths)."""
    outs = _greedy(trainer, trainer.source.eval_set(n_prompts), adapter)
    return [o.prompt_ids + o.token_ids for o in outs], [len(o.prompt_ids) for o in outs]


def greedy_completions(trainer, problems, adapter: str | None = "serving") -> list[str]:
    """The engine's greedy completion of each problem as text."""
    outs = _greedy(trainer, problems, adapter)
    return trainer.tokenizer.batch_decode([o.token_ids for o in outs], skip_special_tokens=True)


@torch.no_grad()
def trainer_vs_engine(trainer, sequences: list[list[int]], prompt_lens: list[int], adapter: str | None) -> dict:
    """|trainer − engine log-prob| over the completion tokens (mean, p99, max): whether a request ran the
    trainer's current policy. Both score at temperature 1 (SGLang's prefill scores at 1 only)."""
    engine_lp = trainer.engine.score(sequences, prompt_lens, adapter)
    ids = [torch.tensor([seq], device=trainer.device) for seq in sequences]
    diffs = torch.cat([(token_logprobs(trainer.model, i, torch.ones_like(i), 1.0)[0, plen - 1:].cpu() - lp).abs()
                       for i, plen, lp in zip(ids, prompt_lens, engine_lp)])
    return {"mean": diffs.mean().item(), "p99": diffs.quantile(0.99).item(), "max": diffs.max().item()}


def self_check(checks: dict[str, bool]) -> None:
    """Print each check with ✓ or ✗; raise AssertionError naming the failed ones."""
    for name, ok in checks.items():
        print(f"{'✓' if ok else '✗'} {name}")
    if failed := [name for name, ok in checks.items() if not ok]:
        raise AssertionError(f"self-check failed: {failed}")
    print(f"self-check: all {len(checks)} checks passed")
