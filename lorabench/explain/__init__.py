"""Teaching helpers for the notebooks, one module per subject; `from lorabench import explain` gives
every helper by name (explain.trainer_vs_engine, explain.rank_verdict, ...).

- lora: one LoRA layer's factors, base vs adapter-applied predictions, a refresh as a timeline;
- checks: the check behind each failure mode (trainer vs engine on the engine's own rollouts);
- step (notebook 01), refresh_costs (02), hotswap and staleness (03), ranks (04).

Every number comes from the real trainer model and the real engine; the plots take plain tensors or
rows, so they can be redrawn from saved runs; every sentence that states an order or a trend is
computed from the numbers it is about.
"""
from .checks import greedy_completions, rollout_sequences, self_check, trainer_vs_engine
from .hotswap import (
    RANK_TOL,
    WARM_START_LINE,
    cliff_sentence,
    delta_w_spectrum,
    last_mean,
    plot_delta_w,
    plot_singular_values,
    resolve_model_shown,
    train_shown,
    use_trained_run,
)
from .lora import (
    facts_frame,
    logprob_difference,
    lora_factors,
    lora_layer_facts,
    next_token_topk,
    plot_logprob_difference,
    plot_lora_factors,
    plot_refresh_timeline,
    plot_topk,
    restore_base_weights,
    token_labels,
    top_effects,
)
from .ranks import prediction_sentence, rank_verdict, update_sentence, update_table
from .refresh_costs import (
    buckets_markdown,
    cpu_gpu_markdown,
    cpu_gpu_table,
    engine_lora_weight,
    gpu_mode_rows,
    mode_groups,
    mode_prediction_note,
    modes_markdown,
    rank_markdown,
    storage_across_refresh,
    storage_markdown,
    storage_table,
    threads_markdown,
)
from .staleness import (
    ARM_COLORS,
    ARMS,
    HELDOUT_MEASURES,
    compare_sentence,
    compare_summary,
    group_loss_sentence,
    group_loss_table,
    group_table,
    harm_sentence,
    heldout_means,
    heldout_sentence,
    heldout_table,
    one_group_loss,
    plot_refreshed_vs_stale,
    refresh_once,
    refreshed_vs_stale,
)
from .step import (
    FOLD,
    advantage_note,
    broken_summary,
    clip_note,
    completion_end,
    direction,
    equal_reward_groups,
    fit_table,
    fold_direction,
    gradient_norm,
    group_rewards_note,
    group_view,
    half_means,
    kl_penalty_note,
    learned_summary,
    prediction_note,
    reward_exercise_note,
    share_se,
    stated_directions,
    tensor_shapes,
)

__all__ = [
    "ARMS", "ARM_COLORS", "FOLD", "HELDOUT_MEASURES", "RANK_TOL", "WARM_START_LINE", "advantage_note",
    "broken_summary", "buckets_markdown", "cliff_sentence", "clip_note", "compare_sentence", "compare_summary",
    "completion_end", "cpu_gpu_markdown", "cpu_gpu_table", "delta_w_spectrum", "direction", "engine_lora_weight",
    "equal_reward_groups", "facts_frame", "fit_table", "fold_direction", "gpu_mode_rows", "gradient_norm",
    "greedy_completions", "group_loss_sentence", "group_loss_table", "group_rewards_note", "group_table",
    "group_view", "half_means", "harm_sentence", "heldout_means", "heldout_sentence", "heldout_table",
    "kl_penalty_note", "last_mean", "learned_summary", "logprob_difference", "lora_factors", "lora_layer_facts",
    "mode_groups", "mode_prediction_note", "modes_markdown", "next_token_topk", "one_group_loss", "plot_delta_w",
    "plot_logprob_difference", "plot_lora_factors", "plot_refresh_timeline", "plot_refreshed_vs_stale",
    "plot_singular_values", "plot_topk", "prediction_note", "prediction_sentence", "rank_markdown", "rank_verdict",
    "refresh_once", "refreshed_vs_stale", "resolve_model_shown", "restore_base_weights", "reward_exercise_note",
    "rollout_sequences", "self_check", "share_se", "stated_directions", "storage_across_refresh",
    "storage_markdown", "storage_table", "tensor_shapes", "threads_markdown", "token_labels", "top_effects",
    "train_shown", "trainer_vs_engine", "update_sentence", "update_table", "use_trained_run"
]
