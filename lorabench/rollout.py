"""Rollout: prompts -> the engine's completions (`sample`, or `rollout_request` + `rollouts_of` for
several callers' requests in one engine batch) -> rewards (`score`) -> one padded batch (`collate`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain

import torch

from .data import Problem, prompt_ids
from .engines.base import Completion, GenerateRequest, Sampling
from .loss import group_advantages, sent_ahead
from .metrics import reward_of


@dataclass
class Rollouts:
    """What the engine returned for one step's prompts, group by group."""
    problems: list[Problem]           # P prompts
    completions: list[Completion]     # P * G, the G samples of prompt p at [p*G, (p+1)*G)
    texts: list[str]                  # the completions decoded
    adapter: str | None               # the adapter the requests named (None: base weights)
    served_version: int | None        # the version the engine reported for that adapter

    @property
    def group_size(self) -> int:
        return len(self.completions) // len(self.problems)

    @property
    def answers(self) -> list[str]:   # ground truth per completion
        return [p.ground_truth for p in self.problems for _ in range(self.group_size)]

    @property
    def questions(self) -> list[str]:
        return [p.question for p in self.problems for _ in range(self.group_size)]


@dataclass
class RolloutBatch:
    """One step's rollouts as tensors, right-padded to L = longest prompt + completion."""
    input_ids: torch.Tensor        # [N, L] prompt + completion tokens, N = P * G
    attention_mask: torch.Tensor   # [N, L] 1 on real tokens
    completion_mask: torch.Tensor  # [N, L-1] 1 where token t+1 is a completion token (log-prob targets)
    engine_logprobs: torch.Tensor  # [N, L-1] the engine's log-prob of token t+1 (0 off the mask)
    rewards: torch.Tensor          # [N]
    advantages: torch.Tensor       # [N]

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        return self.attention_mask.sum(1).tolist()

    def to(self, device) -> RolloutBatch:
        """A copy on `device`; from the host to a GPU sent ahead (loss.sent_ahead): the host does not wait."""
        return RolloutBatch(**{f.name: sent_ahead(getattr(self, f.name), device) for f in fields(self)})

    def rows(self, index: list[int], width_multiple: int = 1) -> RolloutBatch:
        """Rows `index`, trimmed to their longest sequence rounded up to `width_multiple` (at most this width)."""
        idx = torch.tensor(index, device=self.input_ids.device)
        longest = int(self.attention_mask[idx].sum(1).max())
        width = min(round_up(longest, width_multiple), self.input_ids.shape[1])
        return RolloutBatch(self.input_ids[idx, :width], self.attention_mask[idx, :width],
                            self.completion_mask[idx, :width - 1], self.engine_logprobs[idx, :width - 1],
                            self.rewards[idx], self.advantages[idx])

    def padded_to_multiple(self, multiple: int) -> RolloutBatch:
        """Masked columns (token 0, never looked at) added on the right until L is a multiple of `multiple`."""
        extra = -self.input_ids.shape[1] % multiple
        if extra == 0:
            return self
        pad = [torch.nn.functional.pad(t, (0, extra)) for t in (self.input_ids, self.attention_mask,
                                                                self.completion_mask, self.engine_logprobs)]
        return RolloutBatch(*pad, self.rewards, self.advantages)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sample(engine, tokenizer, problems: list[Problem], group_size: int, sampling: Sampling,
           adapter: str | None, enable_thinking: bool = False) -> Rollouts:
    """G completions per problem from the engine, with the adapter named on every request."""
    request = rollout_request(tokenizer, problems, group_size, sampling, adapter, enable_thinking)
    return rollouts_of(engine, tokenizer, problems, request,
                       engine.generate(request.prompt_ids, sampling, adapter=adapter))


def rollout_request(tokenizer, problems: list[Problem], group_size: int, sampling: Sampling, adapter: str | None,
                    enable_thinking: bool = False) -> GenerateRequest:
    """The engine request for G completions per problem: each prompt G times, group by group."""
    prompts = [prompt_ids(tokenizer, p.messages, enable_thinking) for p in problems]
    return GenerateRequest([p for p in prompts for _ in range(group_size)], sampling, adapter)


def rollouts_of(engine, tokenizer, problems: list[Problem], request: GenerateRequest,
                completions: list[Completion], served: int | None = None) -> Rollouts:
    """What the engine returned for `request`, decoded, with the version that served it (`served`, read
    with the generate: engines.base.generate_served; else asked of the engine now)."""
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    version = served if served is not None else engine.served_version(request.adapter)
    return Rollouts(problems, completions, texts, request.adapter, version)


def score(rollouts: Rollouts, reward_fns: list[tuple[str, object, float]]) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed reward per completion [N] and each function's mean (`reward/<name>/mean`)."""
    total, means = torch.zeros(len(rollouts.texts)), {}
    for name, fn, weight in reward_fns:
        values = torch.tensor(fn(rollouts.questions, rollouts.texts, answers=rollouts.answers), dtype=torch.float32)
        total += weight * values
        means[reward_of(name)] = values.mean().item()
    return total, means


def collate(rollouts: Rollouts, rewards: torch.Tensor, pad_id: int) -> RolloutBatch:
    """Right-padded token tensors, completion mask and the engine's log-probs aligned with it."""
    completions = rollouts.completions
    if any(len(c.logprobs) != len(c.token_ids) for c in completions):   # else rows would shift into each other
        raise ValueError("a completion's log-probs do not match its tokens (one per token): the engine's reply is "
                         "malformed")
    prompt = torch.tensor([len(c.prompt_ids) for c in completions])                     # [N]
    new = torch.tensor([len(c.token_ids) for c in completions])                         # [N]
    lengths = prompt + new                                                              # [N]
    positions = torch.arange(int(lengths.max()))
    attn = (positions < lengths[:, None]).long()                                        # [N, L]
    ids = torch.full(attn.shape, pad_id, dtype=torch.long)
    # one tensor per batch, not per row: a mask fills row after row, in the order the lists are joined
    tokens = chain.from_iterable(part for c in completions for part in (c.prompt_ids, c.token_ids))
    ids[attn.bool()] = torch.tensor(list(tokens), dtype=torch.long)
    start = (prompt - 1)[:, None]   # log-prob row t predicts token t+1
    cmask = ((positions[:-1] >= start) & (positions[:-1] < start + new[:, None])).float()   # [N, L-1]
    elp = torch.zeros(cmask.shape)
    elp[cmask.bool()] = torch.tensor(list(chain.from_iterable(c.logprobs for c in completions)), dtype=torch.float32)
    return RolloutBatch(ids, attn, cmask, elp, rewards, group_advantages(rewards, rollouts.group_size))

