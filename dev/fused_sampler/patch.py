"""Put `gumbel.gumbel_sample` into SGLang 0.5.17's Sampler.forward for plain temperature sampling (no top-p,
top-k or min-p, no seed, no top or chosen-token log-probs, not deterministic or on-policy mode, no sampling
masks); every other batch goes to SGLang's own forward. `install()` runs once per process."""
from __future__ import annotations

import os
import sys

_CALLS = {"fused": 0, "sglang": 0}


def _covered(sampler, info, top_logprobs_nums, token_ids_logprobs, original_logprob: bool) -> bool:
    return (not info.is_all_greedy and not info.need_top_p_sampling and not info.need_top_k_sampling
            and not info.need_min_p_sampling and info.sampling_seed is None
            and sampler.rl_on_policy_target is None and not sampler.enable_deterministic
            and not sampler.use_ascend_backend and not any(info.return_sampling_masks or [])
            and not original_logprob and not any(n > 0 for n in top_logprobs_nums or [])
            and not any(ids is not None for ids in token_ids_logprobs or [])
            and _tp_size() == 1)   # each rank would draw its own noise; SGLang's ranks must agree on a token


def _tp_size() -> int:
    from sglang.srt.layers.sampler import get_tp_group
    return get_tp_group().world_size


def _first(kind: str) -> None:
    if _CALLS[kind] == 1:
        print(f"[fused_sampler] first batch sampled by {kind} in pid {os.getpid()}", file=sys.stderr, flush=True)


def install() -> None:
    from gumbel import fits, gumbel_sample
    from sglang.srt.layers import sampler as module
    from sglang.srt.layers.logprob_processor import LogprobResult

    if getattr(module.Sampler, "_lorabench_fused", False):
        return
    original = module.Sampler.forward

    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs,
                positions):
        if not (fits(logits_output.next_token_logits) and _covered(
                self, sampling_info, top_logprobs_nums, token_ids_logprobs, module.SGLANG_RETURN_ORIGINAL_LOGPROB)):
            _CALLS["sglang"] += 1
            _first("sglang")
            return original(self, logits_output, sampling_info, return_logprob, top_logprobs_nums,
                            token_ids_logprobs, positions)
        _CALLS["fused"] += 1
        _first("fused")
        logits = self._preprocess_logits(logits_output.next_token_logits, sampling_info)
        ids, logprobs = gumbel_sample(logits, sampling_info.temperatures)
        if return_logprob:
            LogprobResult(token_logprobs=logprobs).write_output_to(logits_output)
        self._sync_token_ids_across_tp(ids, sampling_info)
        return ids

    module.Sampler.forward = forward
    module.Sampler._lorabench_fused = True
    print(f"[fused_sampler] Sampler.forward replaced in pid {os.getpid()}", file=sys.stderr, flush=True)
