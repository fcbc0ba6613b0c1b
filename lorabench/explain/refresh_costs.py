"""Notebook 02: what a refresh does to the engine's memory (the same storage or a new one) and what its
timings say, each order stated only where the repeats' spreads do not overlap."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..adapters import PEFT_PREFIX
from ..viz import call_ms, end_to_end_ms, median_ms, ms_text, part_ms, push_cost_fit, quartiles


def engine_lora_weight(engine, adapter: str, module: str, half: str = "lora_B") -> torch.Tensor:
    """The hf engine's own tensor (PEFT's parameter, not a copy) for `half` of `module` in `adapter`."""
    peft_model = getattr(engine, "_peft", None) if getattr(engine, "name", "") == "hf" else None
    if peft_model is None or adapter not in engine.loaded_adapters():
        raise ValueError(f"engine_lora_weight reads an hf engine holding adapter {adapter!r}; got "
                         f"{getattr(engine, 'name', type(engine).__name__)} with {engine.loaded_adapters()}")
    return getattr(peft_model.base_model.model.get_submodule(module), half)[adapter].weight


@torch.no_grad()
def storage_across_refresh(engine, peft_model, mode: str, module: str = "model.layers.0.self_attn.q_proj",
                           adapter_name: str = "storage", seed: int = 0) -> dict:
    """Refresh into the hf `engine` by `mode`, change the weights as an optimizer step does, refresh again: where
    the engine's lora_B of `module` lives before and after (the handle kept holds the old memory), what each holds."""
    from ..refresh_bench import scratch_refresher
    with scratch_refresher(engine, peft_model, mode, 64.0, adapter_name) as (layers, refresher):
        refresher.refresh(layers.snapshot(0))
        held = engine_lora_weight(engine, adapter_name, module)
        old = held.detach().clone()
        gen = torch.Generator(device=layers.buffer.device).manual_seed(seed)
        layers.buffer.add_(1e-3 * torch.randn(layers.buffer.shape, generator=gen, device=layers.buffer.device,
                                              dtype=layers.buffer.dtype))   # "an optimizer step"
        new = layers.snapshot(1)
        refresher.refresh(new)
        now = engine_lora_weight(engine, adapter_name, module)
        trainer = new.tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"].to(now.device, now.dtype)
        return {"mode": mode, "tensor": f"{module}.lora_B {tuple(now.shape)}",
                "storage before": held.untyped_storage().data_ptr(), "storage after": now.untyped_storage().data_ptr(),
                "data_ptr before": held.data_ptr(), "data_ptr after": now.data_ptr(),
                "values changed": not torch.equal(now, old), "engine = trainer": torch.equal(now, trainer),
                "old handle reads": "the new values" if torch.equal(held, now) else
                                    "the old values" if torch.equal(held, old) else "neither",
                "before": old.flatten()[:3].tolist(), "after": now.flatten()[:3].tolist()}


def storage_table(results: list[dict]):
    """storage_across_refresh results as a table (pointers in hex, the first values rounded)."""
    import pandas as pd
    rows = [{"mode": r["mode"], "engine tensor": r["tensor"], "storage before": hex(r["storage before"]),
             "storage after": hex(r["storage after"]), "same storage": r["storage before"] == r["storage after"],
             "first values before": ", ".join(f"{v:+.5f}" for v in r["before"]),
             "first values after": ", ".join(f"{v:+.5f}" for v in r["after"]),
             "engine = trainer's new values": r["engine = trainer"], "old handle reads": r["old handle reads"]}
            for r in results]
    return pd.DataFrame(rows).set_index("mode")


def storage_markdown(results: list[dict]) -> str:
    """What the table shows, from its own values."""
    lines = []
    for r in results:
        same = r["storage before"] == r["storage after"]
        lines.append(f"- `{r['mode']}`: the engine's tensor is {'the same' if same else 'a new'} storage after the "
                     f"refresh ({'pointer unchanged' if same else 'pointer changed'}), its values "
                     f"{'changed' if r['values changed'] else 'did not change'}, it "
                     f"{'equals' if r['engine = trainer'] else 'does not equal'} the trainer's new weights, and the "
                     f"handle taken before the refresh reads {r['old handle reads']}.")
    return "\n".join(lines)


def _code(modes, sep: str = ", ") -> str:
    """Mode names as Markdown code, joined by `sep`."""
    return sep.join(f"`{m}`" for m in modes)


def _overlap(a: list[float], b: list[float]) -> bool:
    """Whether the middle halves (interquartile ranges) of two samples overlap."""
    qa, qb = quartiles(a), quartiles(b)
    return qa[0] <= qb[2] and qb[0] <= qa[2]


def mode_groups(rows) -> list[list[str]]:
    """Modes by median end to end, fastest first, grouped where a middle half overlaps the previous mode's."""
    groups: list[list[dict]] = []
    for row in sorted(rows, key=median_ms):
        if groups and _overlap(end_to_end_ms(groups[-1][-1]), end_to_end_ms(row)):
            groups[-1].append(row)
        else:
            groups.append([row])
    return [[r["mode"] for r in g] for g in groups]


def modes_markdown(rows, bandwidth_gbps: float) -> str:
    """Section 1's reading: the medians' order (as the spread allows), largest parts, distance to floor."""
    from ..refresh_bench import floor_seconds
    by_mode = {r["mode"]: r for r in rows}
    groups = mode_groups(rows)
    order = " < ".join(" ≈ ".join(f"`{m}` {ms_text(median_ms(by_mode[m]))} ms" for m in g) for g in groups)
    tied = [g for g in groups if len(g) > 1]
    spread = ("; ≈ joins modes whose middle halves overlap: their order is within the spread and can swap "
              "between runs" if tied else "; every mode's middle half is clear of the next one's")
    largest = ", ".join(f"`{r['mode']}` {max(r['parts'], key=r['parts'].get)} "
                        f"({100 * max(r['parts'].values()) / r['total_s']:.0f}% of its call)" for r in rows)
    ratios = {r["mode"]: r["total_s"] / floor_seconds(r["bytes"], bandwidth_gbps) for r in rows}
    near, far = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    return (f"- Fastest to slowest by median end to end: {order}{spread}.\n"
            f"- The largest part of each median call: {largest}.\n"
            f"- Each median call against its floor: from {ratios[near]:,.0f}× (`{near}`) to {ratios[far]:,.0f}× "
            f"(`{far}`).")


def buckets_markdown(rows) -> str:
    """Section 3's reading: push counts, the push part's trend and fitted line, and the rest of the call."""
    rows = sorted(rows, key=lambda r: r["buckets"])
    pushes = [part_ms(r, "push") for r in rows]
    medians = [quartiles(p)[1] for p in pushes]
    counts = ", ".join(f"{r['buckets']} ({r['bucket_mb']:g} MB)" for r in rows)
    falls = [(a, b, pa, pb) for a, b, pa, pb, ma, mb in zip(rows, rows[1:], pushes, pushes[1:], medians, medians[1:])
             if mb < ma]
    if not falls:
        trend = "From the fewest pushes to the most, the median push part grows at every step."
    else:
        steps = ", ".join(f"{a['buckets']} -> {b['buckets']} pushes{' (within the spread)' if _overlap(pa, pb) else ''}"
                          for a, b, pa, pb in falls)
        trend = f"The median push part does not grow at every step toward more pushes: it falls from {steps}."
    fixed, per_push = push_cost_fit(rows)
    worst = max(abs(m - (fixed + per_push * r["buckets"])) for r, m in zip(rows, medians))
    rest = [quartiles([c - p for c, p in zip(call_ms(r), part)])[1] for r, part in zip(rows, pushes)]
    return (f"- Pushes (bucket size): {counts}; {rows[0]['bytes'] / 2**20:.3g} MB of weights at every size.\n"
            f"- {trend}\n"
            f"- A straight line through the medians: {ms_text(fixed)} ms {'+' if per_push >= 0 else '−'} "
            f"{abs(per_push):.2g} ms per push; the medians sit within {ms_text(worst, 2)} ms of it.\n"
            f"- The rest of the call (snapshot and merge), which the bucket size does not change: a median of "
            f"{ms_text(min(rest))} to {ms_text(max(rest))} ms across the bucket sizes.")


def _rank_tiers(at: dict, modes: list[str], ranks: list[int]) -> list[list[str]]:
    """The modes in tiers, fastest first, cut where at every rank every middle half before is below all after."""
    q = {key: quartiles(end_to_end_ms(row)) for key, row in at.items()}
    order = sorted(modes, key=lambda m: q[(m, ranks[0])][1])
    cuts = [s for s in range(1, len(order))
            if all(max(q[(m, k)][2] for m in order[:s]) < min(q[(m, k)][0] for m in order[s:]) for k in ranks)]
    bounds = [0, *cuts, len(order)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


def rank_markdown(rows) -> str:
    """Section 4's reading: bytes and medians from the smallest rank to the largest, and any order that holds."""
    ranks = sorted({r["rank"] for r in rows})
    low, high = ranks[0], ranks[-1]
    at = {(r["mode"], r["rank"]): r for r in rows}
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    size = {k: at[("tensor", k)]["bytes"] / 2**20 for k in (low, high)} if ("tensor", low) in at else None

    def change(m):
        within = _overlap(end_to_end_ms(at[(m, low)]), end_to_end_ms(at[(m, high)]))
        return f"`{m}` ×{median_ms(at[(m, high)]) / median_ms(at[(m, low)]):.2f}{' (within the spread)' * within}"
    tiers = _rank_tiers(at, modes, ranks)
    if len(tiers) > 1:
        order = (f"- At every rank: {' < '.join(_code(t) for t in tiers)} (each group's "
                 f"middle halves below the next group's at every rank; within a group the order can change)")
    else:
        fastest = {k: min((at[(m, k)] for m in modes), key=median_ms)["mode"] for k in ranks}
        order = ("- No mode's middle half is clear of another's at every rank; the fastest median at each: "
                 + ", ".join(f"r={k}: `{m}`" for k, m in fastest.items()))
    adapter = (f"the adapter grows ×{size[high] / size[low]:.0f} ({size[low]:.2g} MB -> {size[high]:.2g} MB)"
               if size else f"the adapter grows ×{high / low:.0f}")
    return (f"- From r={low} to r={high} {adapter}; each mode's median end to end changes by: "
            f"{', '.join(change(m) for m in modes)}.\n{order}.")


def threads_markdown(rows, cpus: int, load_average: float, chosen: int | None = None, asked: bool = False) -> str:
    """Section 0's reading: per thread count its median, upper quartile and slowest; the count chosen."""
    def threads(n):
        return f"{n} thread{'s' if n > 1 else ''}"
    parts = []
    for r in rows:
        _, median, upper = quartiles(end_to_end_ms(r))
        parts.append(f"{threads(r['threads'])}: median {ms_text(median)} ms, upper quartile {ms_text(upper)} ms, "
                     f"slowest {ms_text(max(end_to_end_ms(r)))} ms")
    text = f"- {'; '.join(parts)} (load average {load_average:.2g} on {cpus} CPUs while measured)."
    if chosen is not None:
        why = ("as `THREADS` asks" if asked else
               "the fewest threads whose upper quartile is within 10% of the lowest")
        text += f"\n- Sections 2-4 time with {threads(chosen)}: {why}."
    return text


# notebook 02's sweep on SGLang as the repository records it (gpu_mode_rows labels it from its own fields)
GPU_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu" / "refresh_notebook02_sglang.json"


def gpu_mode_rows(path: Path = GPU_RESULTS) -> tuple[list[dict], str] | None:
    """The GPU recording's section-2 rows (64 MB buckets) and label; None without the file."""
    if not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text())
    rows = {}
    for r in data.get("rows", []):
        if r.get("bucket_mb") == 64:
            rows.setdefault(r["mode"], r)
    rank = next(iter(rows.values()))["rank"] if rows else "?"
    return list(rows.values()), f"{data.get('engine', 'GPU')}, r={rank}, {str(data.get('date', ''))[:10]}"


def cpu_gpu_table(rows, gpu: tuple[list[dict], str] | None):
    """Each mode's median end to end and place here, beside the GPU recording's."""
    import pandas as pd
    table = pd.DataFrame(index=pd.Index([r["mode"] for r in sorted(rows, key=median_ms)], name="mode"))
    for label, measured in [("here", rows)] + ([(gpu[1], gpu[0])] if gpu is not None else []):
        ordered = sorted(measured, key=median_ms)
        table[f"{label}: ms"] = pd.Series({r["mode"]: median_ms(r) for r in ordered})
        table[f"{label}: place"] = pd.Series({r["mode"]: place for place, r in enumerate(ordered, 1)})
    return table


def cpu_gpu_markdown(rows, gpu: tuple[list[dict], str] | None) -> str:
    """The two orders in words: the same, or which modes trade places."""
    here = [r["mode"] for r in sorted(rows, key=median_ms)]
    if gpu is None:
        return f"Fastest to slowest here: {_code(here)}; no GPU recording found to compare."
    there = [r["mode"] for r in sorted(gpu[0], key=median_ms)]
    if here == there:
        return f"Here and on the GPU ({gpu[1]}) the order is the same: {_code(here, ' < ')}."
    moved = [f"`{m}` {here.index(m) + 1} here, {there.index(m) + 1} there" for m in here
             if m in there and here.index(m) != there.index(m)]
    why = []
    if "merged" in here and "merged" in there and here.index("merged") < there.index("merged"):
        why.append("here the engine is in this process and a copy of the whole weights is a memory copy like "
                   "any other, so `merged` costs little more than moving the adapter")
    if there[0] == "inplace" and here[0] != "inplace":
        why.append("on the GPU every engine call is a request to SGLang's scheduler and a load or a push "
                   "costs far more than its bytes, so `inplace`, which only writes values into memory the "
                   "engine holds, is fastest")
    tied = [_code(g, " and ") for g in mode_groups(rows) if len(g) > 1]
    ties = (f" Within each other's spread here (their places can swap in the next run): {'; '.join(tied)}."
            if tied else "")
    return (f"Fastest to slowest here: {_code(here, ' < ')}; on the GPU ({gpu[1]}): {_code(there, ' < ')}. "
            f"Places that differ: {'; '.join(moved)}.{ties}"
            + (f" Why: {'; '.join(why)}." if why else ""))


def mode_prediction_note(predicted: str | None, rows) -> str:
    """The fastest mode measured (with those tied with it within the spread) against the learner's guess."""
    first = mode_groups(rows)[0]
    fastest = _code(first, " ≈ ")
    if predicted is None:
        return (f"**The reveal.** Fastest end to end on this machine: {fastest}. You wrote no prediction "
                f"(set `my_prediction` before section 2 and run it again).")
    order = [r["mode"] for r in sorted(rows, key=median_ms)]
    if predicted not in order:
        modes = _code(r["mode"] for r in rows)
        return f"**The reveal.** Fastest here: {fastest}; `{predicted}` is not a mode ({modes})."
    place = order.index(predicted) + 1
    return (f"**The reveal.** Fastest end to end on this machine: {fastest}. You predicted `{predicted}`: "
            + ("right." if predicted in first else
               f"it came {({1: '1st', 2: '2nd', 3: '3rd'}).get(place, f'{place}th')} of {len(rows)}."))
