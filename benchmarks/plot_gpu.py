"""Figures from the committed GPU results (benchmarks/results/gpu/*.json), drawn here, on any machine:

    python benchmarks/plot_gpu.py        # writes benchmarks/results/gpu/*.png
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GPU = Path(__file__).resolve().parent / "results" / "gpu"
HOW = ["naive_tensor", "naive_file", "tensor", "file", "inplace"]


def refresh_figure(perf: dict) -> None:
    rows = {r["how"]: r for r in perf["refresh"]}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    hows = [h for h in HOW if h in rows]
    only = [rows[h]["refresh_only"]["p50_ms"] for h in hows]
    e2e = [rows[h]["end_to_end"]["p50_ms"] for h in hows]
    ax.bar(hows, only, color="tab:blue", label="refresh call(s)")
    ax.bar(hows, [b - a for a, b in zip(only, e2e)], bottom=only, color="tab:gray", label="first request after it")
    for i, h in enumerate(hows):
        ax.text(i, e2e[i] + 3, f"{e2e[i]:.0f}", ha="center", fontsize=8)
    ax.axhline(rows[hows[-1]]["request_steady_ms"], ls="--", color="k", lw=1, label="the same request, steady")
    ax.set(ylabel="ms, p50 of 20", title=f"Refresh end to end, Qwen3-0.6B shape, r=32 ({perf['adapter_mb_bf16']:.0f} MB bf16)")
    ax.legend(fontsize=8)
    ranks = sorted({r["rank"] for r in perf["ranks"]})
    for h in ("naive_tensor", "tensor", "file", "inplace"):
        ys = [next(r["end_to_end"]["p50_ms"] for r in perf["ranks"] if r["rank"] == k and r["how"] == h) for k in ranks]
        ax2.plot(ranks, ys, "o-", label=h)
    ax2.set(xscale="log", xticks=ranks, xticklabels=ranks, xlabel="LoRA rank", ylabel="ms end to end, p50",
            title="vs adapter rank (0.6B shape)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{perf['gpu']}, SGLang {perf['sglang']}, commit {perf['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(GPU / "refresh_end_to_end.png", dpi=110)
    plt.close(fig)


def merged_figure(perf: dict) -> None:
    rows = perf["merged"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["bucket_mb"] for r in rows], [r["p50_ms"] for r in rows], "o-", label="merged push, p50")
    floor = 1e3 * rows[0]["bytes"] / (perf["device_copy_gbps"] * 1e9)
    ax.axhline(floor, ls="--", color="k", lw=1, label=f"floor: {rows[0]['bytes'] / 2**30:.2f} GB at "
               f"{perf['device_copy_gbps']:.0f} GB/s")
    for r in rows:
        ax.annotate(str(r["buckets"]), (r["bucket_mb"], r["p50_ms"]), fontsize=7, xytext=(2, 4),
                    textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlabel="bucket size (MB); labels: pushes", ylabel="ms",
           title="Merged full-weight push, Qwen3-0.6B shape")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(GPU / "merged_push_buckets.png", dpi=110)
    plt.close(fig)


def soak_figure(soak: dict) -> None:
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for mode in ("file", "tensor", "inplace"):
        rows = [r for r in soak["rows"] if r["mode"] == mode]
        ax.plot([r["cycle"] for r in rows], [r["host_rss_mb"] for r in rows], label=mode)
        ax2.plot([r["cycle"] for r in rows], [r["gpu_used_mb"] for r in rows], label=mode)
    ax.set(xlabel="refresh cycle", ylabel="MB", title="host RSS (trainer + engine processes)")
    ax2.set(xlabel="refresh cycle", ylabel="MB", title="GPU memory in use (device-wide)")
    ax.legend(fontsize=8)
    fig.suptitle(f"SGLang soak: {soak['cycles_per_mode']} refresh + generate cycles per mode, tiny model, "
                 f"{soak['gpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(GPU / "soak_sglang.png", dpi=110)
    plt.close(fig)


def tp_and_floor_figure(tp: dict, floor: dict) -> None:
    """Left: refresh end to end at tp=1 vs tp=2 (call + first request). Right: where an in-place
    refresh's time goes, by engine setting (prefill CUDA graphs off / on)."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.38
    for k, (tp_size, color) in enumerate(((1, "tab:blue"), (2, "tab:orange"))):
        rows = {r["how"]: r for r in tp["tp"] if r.get("tp") == tp_size and "how" in r}
        hows = [h for h in HOW if h in rows]
        xs = [i + (k - 0.5) * width for i in range(len(hows))]
        only = [rows[h]["refresh_only"]["p50_ms"] for h in hows]
        e2e = [rows[h]["end_to_end"]["p50_ms"] for h in hows]
        ax.bar(xs, only, width, color=color, label=f"tp={tp_size}: refresh call(s)")
        ax.bar(xs, [b - a for a, b in zip(only, e2e)], width, bottom=only, color=color, alpha=0.35,
               label=f"tp={tp_size}: first request after it")
        for x, y in zip(xs, e2e):
            ax.text(x, y + 3, f"{y:.0f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(HOW)), HOW)
    ax.set(ylabel="ms, p50 of 20", title="Refresh end to end, 0.6B shape r=32: engine on 1 vs 2 GPUs")
    ax.legend(fontsize=7)
    labels, parts = [], {}
    for row in floor["floor"]:
        if "inplace" not in row:
            continue
        r = row["inplace"]
        labels.append(row["variant"].replace("lora_", "").replace("_", " "))
        loader = r["engine_loader_p50_ms"]
        steps = {"snapshot": r["parts_p50_ms"]["snapshot"], "stage (bf16)": r["parts_p50_ms"]["stage"],
                 **{f"loader: {k}": v for k, v in loader.items() if k != "total"},
                 "round trip + flush": r["parts_p50_ms"]["write"] - loader["total"],
                 "first request": r["end_to_end"]["p50_ms"] - r["refresh_only"]["p50_ms"]}
        for name, value in steps.items():
            parts.setdefault(name, []).append(value)
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        ax2.barh(labels, values, left=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.set(xlabel="ms, p50 of 20", title="One in-place refresh, end to end, by engine setting")
    ax2.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{tp['gpu']} (two-GPU machine for tp), SGLang {tp['sglang']}; tp commits "
                 f"{sorted({r['commit'] for r in tp['tp']})}, floor commit {floor['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(GPU / "refresh_tp_and_floor.png", dpi=110)
    plt.close(fig)


def main() -> None:
    perf = json.loads((GPU / "perf.json").read_text())
    refresh_figure(perf)
    merged_figure(perf)
    soak_figure(json.loads((GPU / "soak_sglang.json").read_text()))
    tp_and_floor_figure(json.loads((GPU / "perf_tp.json").read_text()), json.loads((GPU / "perf_floor.json").read_text()))
    print("wrote", sorted(p.name for p in GPU.glob("*.png")))


if __name__ == "__main__":
    main()
