"""Figures from the GPU benchmarks' JSON (refresh_gpu.py, step_gpu.py), one question each:

    python benchmarks/plot_gpu.py [benchmarks/results/gpu]

refresh_floor.png  which refresh is fastest end to end, at tp=1 and tp=2 (the call and the first
                   request after it, stacked on a linear axis; p95 as a whisker)
step_parts.png     where a GRPO step's time goes at each rollout size, next to SGLang's own decode
                   of the same batch and the physical estimates
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"call": "#4c72b0", "first": "#dd8452", "rollout": "#55a868", "train": "#c44e52", "other": "#8172b2"}


def refresh_figure(results: Path) -> Path | None:
    paths = {tp: results / f"refresh_tp{tp}.json" for tp in (1, 2)}
    runs = [(f"tp={tp}", json.loads(p.read_text())) for tp, p in paths.items() if p.is_file()]
    if not runs:
        return None
    modes = [r["mode"] for r in runs[0][1]["settings"]["prefill_graphs_on"]["rows"]]
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.55 * len(modes) * len(runs)), dpi=110)
    labels, y = [], 0.0
    for mode in modes:
        for label, data in runs:
            row = next((r for r in data["settings"]["prefill_graphs_on"]["rows"] if r["mode"] == mode), None)
            if row is None:
                continue
            call, e2e = row["call_ms"]["p50"], row["end_to_end_ms"]["p50"]
            ax.barh(y, call, color=COLORS["call"], label="refresh call" if y == 0 else None)
            ax.barh(y, e2e - call, left=call, color=COLORS["first"], label="first request after it" if y == 0 else None)
            ax.errorbar(row["end_to_end_ms"]["p95"], y, xerr=[[row["end_to_end_ms"]["p95"] - e2e], [0]], fmt="none",
                        ecolor="#333333", capsize=3)
            ax.text(row["end_to_end_ms"]["p95"] + 3, y, f"{e2e:.1f} ms (call {call:.1f})", va="center", fontsize=9)
            labels.append((y, f"{mode}, {label}"))
            y += 1
        y += 0.5
    ax.set_yticks([p for p, _ in labels], [t for _, t in labels], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("ms, p50 of 20 refreshes (whisker: p95)", fontsize=10)
    meta = runs[0][1]
    ax.set_title(f"Adapter refresh end to end, {meta['setting']['model']}, {meta['setting']['lora']}\n"
                 f"{meta['gpu']}, sglang {meta['sglang']}, SGLang's default CUDA graphs", fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=9, frameon=False)
    ax.set_xlim(0, 1.25 * max(r["end_to_end_ms"]["p95"] for _, d in runs
                                for r in d["settings"]["prefill_graphs_on"]["rows"]))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = results / "refresh_floor.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def step_figure(results: Path) -> Path | None:
    path = results / "step.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    sizes = data["sizes"]
    fig, ax = plt.subplots(figsize=(11, 4.2), dpi=110)
    x = range(len(sizes))
    for i, s in enumerate(sizes):
        parts = s["parts_s_p50"]
        rollout, train = parts["rollout"], parts["train"]
        other = sum(v for k, v in parts.items() if k not in ("rollout", "train", "step"))
        ax.bar(i - 0.2, rollout, 0.38, color=COLORS["rollout"], label="rollout (with the adapter)" if i == 0 else None)
        ax.bar(i - 0.2, train, 0.38, bottom=rollout, color=COLORS["train"], label="train" if i == 0 else None)
        ax.bar(i - 0.2, other, 0.38, bottom=rollout + train, color=COLORS["other"],
               label="reward, refresh, probe, logs" if i == 0 else None)
        ax.text(i - 0.2, rollout + train + other + 0.2, f"wall {s['step_wall_s_p50']:.1f} s", ha="center", fontsize=9)
        base = s["sglang_base_decode"]["seconds"]
        est = s["estimate"]
        ax.bar(i + 0.2, base, 0.38, color="#bbbbbb", label="SGLang's own base decode, same batch" if i == 0 else None)
        ax.plot([i + 0.01, i + 0.39], [est["decode_s_at_hbm_peak"]] * 2, color="k", lw=1.5,
                label="decode at HBM peak (estimate)" if i == 0 else None)
        ax.plot([i - 0.39, i - 0.01], [rollout + est["train_s_at_bf16_peak"]] * 2, color="k", ls="--", lw=1.2,
                label="rollout + train at bf16 peak (estimate)" if i == 0 else None)
    ax.set_xticks(list(x), [s["size"] for s in sizes], fontsize=9)
    ax.set_xlabel("rollout size: prompts x samples x new tokens (left bar: the step; right: SGLang alone)",
                  fontsize=10)
    ax.set_ylabel("seconds (each part: p50 of steps 2-4)", fontsize=10)
    setting = data["setting"].replace(", inplace", ",\ninplace")
    ax.set_title(f"A GRPO step by rollout size ({data['gpu']}, sglang {data['sglang']})\n{setting}", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = results / "step_parts.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "gpu")
    for out in (refresh_figure(results), step_figure(results)):
        if out:
            print(out)


if __name__ == "__main__":
    main()
