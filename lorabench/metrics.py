"""A step's metrics: one metrics.jsonl row per GRPO step, slash-namespaced (`area/what`). Every name is
written here once; the trainer fills a row with `step_row`, and every reader imports the names it reads.
"""
from __future__ import annotations

from .rewards import gsm8k_reward, has_strict_format

REWARD, REWARD_STD, STRICT_FORMAT = "reward/mean", "reward/std", "reward/strict_format"  # weighted sum; '#### N'
CORRECT, FORMAT = "reward/correct/mean", "reward/format/mean"          # the built-in reward functions' means
ADVANTAGE_ABS, ACTIVE_GROUPS = "advantage/abs_mean", "advantage/active_groups"   # groups whose rewards differ
LOSS, CLIP_FRACTION, KL, ENTROPY = "loss/policy", "loss/clip_fraction", "kl/mean", "entropy/mean"
GRAD_NORM, TOKENS = "grad_norm", "train/tokens"
MEAN_LENGTH, STOP_FRACTION = "completions/mean_length", "completions/stop_fraction"
LAST_NUMBER_RIGHT = "completions/last_number_right"                     # the flexible reward, any format
MISMATCH, MISMATCH_P99, MISMATCH_MAX = "mismatch/mean", "mismatch/p99", "mismatch/max"   # |trainer - engine|
VERSION, SERVED_VERSION, DELTA_NORM = "adapter/version", "adapter/served_version", "adapter/delta_norm"
LAG, IS_WEIGHT, IS_TRUNCATED = "adapter/lag", "train/is_weight_mean", "train/is_truncated_fraction"  # stale
REFRESH_MODE, REFRESH_BYTES, REFRESH_S = "refresh/mode", "refresh/bytes", "refresh/total_s"
PROBE_GAP = "probe/adapter_gap"                                         # |adapter - base| on the fixed probe
STEP_S, COMMIT_WAIT_S = "time/step_s", "time/commit_wait_s"
SUMMARY_KEYS = (REWARD, REFRESH_S, MISMATCH_MAX)                         # what a run's summary reads of every row
# evals.jsonl, one row per evaluation (GRPOTrainer.evaluate): the share of held-out answers each measure takes
HELD_STRICT, HELD_FLEXIBLE, HELD_FORMAT = "strict", "flexible", "format"   # gsm8k_reward's modes; '#### N' ending
HELD_GREEDY, HELD_COUNT = "greedy", "n"                                     # greedy decoding or not; answers scored


def reward_of(name: str) -> str:
    """The mean of reward function `name` over the step's completions."""
    return f"reward/{name}/mean"


def refresh_part(part: str) -> str:
    """Seconds of one part of the step's refresh (refresh.RefreshRecord.parts)."""
    return f"refresh/{part}_s"


def refresh_parts(rows: list[dict]) -> set[str]:
    """The parts of the refresh that `rows` time (refresh_part's names)."""
    return {k[len("refresh/"):-2] for r in rows for k in r if k.startswith("refresh/") and k.endswith("_s")
            and k != REFRESH_S}


def time_of(part: str) -> str:
    """Seconds of one part of the step (its clock: rollout, reward, train, refresh, probe, log, ...)."""
    return f"time/{part}_s"


def memory_of(part: str) -> str:
    """This process's peak GPU memory during one part of the step, GB."""
    return f"memory/{part}_peak_gb"


def step_row(step: int, rollouts, batch, stats: dict, reward_means: dict, refresh, delta_norm: float) -> dict:
    """One metrics.jsonl row, less the probe (the step adds it) and the times (added when it is committed)."""
    completions, texts = rollouts.completions, rollouts.texts
    groups = batch.rewards.view(-1, rollouts.group_size)
    row = {
        "step": step, REWARD: batch.rewards.mean().item(), REWARD_STD: batch.rewards.std().item(), **reward_means,
        STRICT_FORMAT: sum(map(has_strict_format, texts)) / len(texts),
        ADVANTAGE_ABS: batch.advantages.abs().mean().item(), ACTIVE_GROUPS: (groups.std(1) > 0).float().mean().item(),
        LOSS: stats["loss"], CLIP_FRACTION: stats["clip_fraction"],
        KL: stats.get("kl_to_base"), ENTROPY: stats.get("entropy"), GRAD_NORM: stats["grad_norm"],
        TOKENS: stats["tokens"], MEAN_LENGTH: sum(len(c.token_ids) for c in completions) / len(completions),
        STOP_FRACTION: sum(c.finish_reason == "stop" for c in completions) / len(completions),
        LAST_NUMBER_RIGHT: sum(gsm8k_reward(t, a, "flexible") for t, a in zip(texts, rollouts.answers)) / len(texts),
        **{f"mismatch/{k}": stats[f"mismatch_{k}"] for k in ("mean", "p99", "max", "active_mean")},
        VERSION: refresh.version, SERVED_VERSION: rollouts.served_version, DELTA_NORM: delta_norm,
        REFRESH_MODE: refresh.mode, REFRESH_BYTES: refresh.nbytes, REFRESH_S: refresh.total_s,
        **{refresh_part(k): v for k, v in refresh.parts.items()},
    }
    if "is_weight_mean" in stats:   # grpo.max_staleness: how far the sampling adapter lagged; the loss's weights
        row.update({LAG: step - 1 - rollouts.served_version, IS_WEIGHT: stats["is_weight_mean"],
                    IS_TRUNCATED: stats["is_truncated_fraction"]})
    return row
