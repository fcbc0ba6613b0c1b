"""The lessons' claim/number pairings, read back from the text a notebook rendered (the browser's
inner text of its Markdown outputs: bold, code and subscripts are plain text there): each verdict
sentence must agree with the numbers it quotes. `problems(stem, text)` lists what does not (a
sentence missing is a problem too); the notebooks' own self-checks test the same claims in the kernel,
this tests what the learner reads.
"""
from __future__ import annotations

import math
import re

NUM = r"[+\-−]?\d[\d,]*(?:\.\d+)?(?:e[+\-]\d+)?"


def plain(markdown: str) -> str:
    """Markdown as a browser shows it: no ** / * / backticks, no HTML tags."""
    return re.sub(r"<[^>]+>", "", markdown.replace("**", "").replace("`", "")).replace("*", "")


def _f(text: str) -> float:
    return float(text.replace("−", "-").replace(",", ""))


def _sentence(text: str, start: str) -> str | None:
    """The paragraph of `text` that contains `start`, from it on (None if it is not there)."""
    at = text.find(start)
    if at < 0:
        return None
    end = text.find("\n", at)
    return text[at:] if end < 0 else text[at:end]


def _missing(name: str) -> list[str]:
    return [f"the sentence '{name}' was not rendered"]


def step_through(text: str) -> list[str]:
    out = []
    learned = _sentence(text, "What this run learned")
    if learned is None:
        out += _missing("What this run learned")
    else:
        for word, a, b in re.findall(rf"\b(rose|fell|held) \(({NUM}) → ({NUM})\)", learned):
            a, b = _f(a), _f(b)
            if (word == "rose" and not b > a) or (word == "fell" and not b < a):
                out.append(f"learned summary: '{word}' for {a} → {b}")
    reveal = _sentence(text, "The reveal.")
    note = _sentence(text, "The advantage column.")
    if reveal is None or note is None:
        out += _missing("The reveal. / The advantage column.")
    else:
        best = re.search(rf"has advantage ({NUM})", reveal)
        worked = [_f(a) for a in re.findall(rf"reward {NUM} → ({NUM})", note)]
        if not best or not worked or abs(_f(best.group(1)) - max(worked)) > 0.005:
            out.append(f"the reveal's advantage {best and best.group(1)} is not the note's largest {worked}")
    broken = _sentence(text, "What breaking it showed")
    if broken is None:
        out += _missing("What breaking it showed")
    else:
        m = re.search(rf"The mismatch (rose|fell|held)\b.*?from ({NUM}) nats at step 1 .*? to ({NUM}) at step", broken)
        if not m:
            out.append("the broken run's mismatch sentence has no numbers")
        else:
            word, first, last = m.group(1), _f(m.group(2)), _f(m.group(3))
            fold = last / max(first, 1e-12)
            expect = "rose" if fold > 10 else "fell" if fold < 0.1 else "held"
            # the printed numbers are rounded to 2 digits: only a fold clear of the 10x line is judged
            if word != expect and not 8 < max(fold, 1 / max(fold, 1e-12)) < 12.5:
                out.append(f"broken run: mismatch '{word}' for {first:g} → {last:g}")
    kl = _sentence(text, "KL penalty.")
    if kl is None:
        out += _missing("KL penalty.")
    else:
        m = re.search(rf"({NUM}) nats per token from the base.*?kl_beta=({NUM}).*?β × KL = ({NUM})", kl)
        if not m or not math.isclose(_f(m.group(1)) * _f(m.group(2)), _f(m.group(3)), rel_tol=0.06, abs_tol=1e-12):
            out.append(f"KL penalty: β × KL is not β times the KL it quotes ({m and m.groups()})")
    if "paid" not in (_sentence(text, "Your reward") or ""):
        out += _missing("Your reward ... paid")
    return out


def refresh_methods(text: str) -> list[str]:
    out = []
    order = _sentence(text, "Fastest to slowest by median end to end:")
    reveal = _sentence(text, "The reveal.")
    side = _sentence(text, "Fastest to slowest here:") or _sentence(text, "Here and on the GPU")
    if order is None or reveal is None or side is None:
        return _missing("section 2's order, its reveal and section 5's comparison")
    timed = re.findall(rf"\b(file|tensor|inplace|merged) ({NUM}) ms", order.split(";")[0])
    ms = [_f(v) for _, v in timed]
    if len(timed) != 4 or ms != sorted(ms):
        out.append(f"section 2's order is not by its medians: {timed}")
    fastest = timed[0][0] if timed else None
    said = re.search(r"Fastest end to end on this machine: (\w+)", reveal)
    if not said or said.group(1) != fastest:
        out.append(f"the reveal names {said and said.group(1)}, the order {fastest}")
    here = re.search(r"(?:here|the same): (\w+)", side)
    if not here or here.group(1) != fastest:
        out.append(f"section 5 puts {here and here.group(1)} first here, section 2 {fastest}")
    return out


def how_hotswap_works(text: str) -> list[str]:
    out = []
    harm = _sentence(text, "Where the harm shows.")
    if harm is None:
        return _missing("Where the harm shows.")
    served = re.search(rf"({NUM}) refreshed against ({NUM}) stale", harm)
    if not served:
        out.append("the harm sentence quotes no served rewards")
    elif "it shows in the served reward" in harm.lower() and not _f(served.group(1)) > _f(served.group(2)):
        out.append(f"'shows in the served reward' with {served.groups()}")
    parts = re.findall(r"(\d+)% stale against (\d+)% refreshed \((lower|the same|higher)", harm)
    if len(parts) != 3:
        out.append(f"the harm sentence compares {len(parts)} held-out measures, not 3")
    for stale, fresh, word in parts:
        stale, fresh = int(stale), int(fresh)
        if (word == "lower" and not stale < fresh) or (word == "higher" and not stale > fresh):
            out.append(f"held-out: '{word}' for {stale}% stale against {fresh}% refreshed")
    if ("does not show" in harm) == any(w == "lower" for *_, w in parts):
        out.append("'does not show' on held-out while a stale share is lower (or the reverse)")
    return out


def which_rank(text: str) -> list[str]:
    out = []
    verdict = _sentence(text, "Held-out, greedy (")
    update = _sentence(text, "The update size per rank.")
    reveal = _sentence(text, "The reveal.")
    if verdict is None or update is None or reveal is None:
        return _missing("the rank verdict, the update size per rank and the reveal")
    shares = {n: (_f(b), _f(se)) for n, _, b, se in re.findall(rf"(r\d+) ({NUM}) → ({NUM}) \(± ({NUM})\)", verdict)}
    if not shares:
        return ["the rank verdict quotes no shares"]
    top = max(v[0] for v in shares.values())
    best = re.search(r"The best is (r\d+)", verdict)
    if best and shares[best.group(1)][0] != top:
        out.append(f"the verdict's best {best.group(1)} is not the highest share {shares}")
    behind = re.search(r"behind by more than that: ([r\d, ]+)\.", verdict)
    for name in (behind.group(1).split(", ") if behind else []):
        b, se = shares[name]
        b_best, se_best = shares[best.group(1)]
        if b_best - b <= 2 * (se ** 2 + se_best ** 2) ** 0.5 - 0.02:   # the shares are printed to 2 decimals
            out.append(f"{name} called behind at {b} against {b_best}")
    named = re.search(r"Best held-out: (r\d+)", reveal)
    if not named or shares[named.group(1)][0] != top:
        out.append(f"the reveal's best {named and named.group(1)} is not the highest share")
    norms = [(n, _f(v)) for n, v in re.findall(rf"(r\d+) ({NUM})", update.split(":")[0])]
    values = [v for _, v in sorted(norms, key=lambda p: int(p[0][1:]))]
    falling = all(a > b for a, b in zip(values, values[1:]))
    if ("falls as the rank grows" in update) != falling:
        out.append(f"the update sentence's trend does not follow ‖ΔW‖ {norms}")
    return out


CHECKS = {"01_step_through": step_through, "02_refresh_methods": refresh_methods,
          "03_how_hotswap_works": how_hotswap_works, "04_which_rank": which_rank}


def problems(stem: str, text: str) -> list[str]:
    return CHECKS[stem](text)
