"""The multi-hop probe section: the paper's multi-step reasoning claim, in miniature."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .. import ablation as abl
from ..significance import compare, t_interval
from .. import figures
from .section import Claim, Section, _f, _img, _verdict, _write


def _hops(runs: pd.DataFrame) -> list[tuple[int, str]]:
    cols = [c for c in runs.columns if c.startswith("probe_acc_hop_")]
    return sorted((int(c.rsplit("_", 1)[1]), c) for c in cols if runs[c].notna().any())


CHANCE = 0.1  # the answer is one of ten digits; runs that log probe/copy_hop_k set a higher bar


def _level(runs: pd.DataFrame, k: int) -> float:
    """The accuracy to beat at k hops: that of answering with a random digit of the prompt
    (probe_copy_hop_k, logged by the runs), else one of ten digits for runs that predate it."""
    col = f"probe_copy_hop_{k}"
    return float(runs[col].mean()) if col in runs and runs[col].notna().any() else CHANCE


# Held-out prompts per hop count of a run: data.val_examples over the hop counts, 800 / 4 on the
# default probe; a snapshot column probe_examples_per_hop overrides it.
EXAMPLES_PER_HOP = 200


def wilson(acc, n_per_run: int, level: float = 0.95) -> tuple[float, float, float]:
    """(pooled accuracy, Wilson interval low, high) over runs' accuracies on n_per_run prompts
    each: the correct answers summed into one binomial count (statsmodels). It measures how well
    the prompts pin the accuracy down, not the seed-to-seed spread (the t interval beside it)."""
    from statsmodels.stats.proportion import proportion_confint

    a = np.asarray(acc, float)
    a = a[np.isfinite(a)]
    if not len(a):
        return np.nan, np.nan, np.nan
    if ((a < 0) | (a > 1)).any():  # not an accuracy: no binomial count behind it
        return float(a.mean()), np.nan, np.nan
    count, nobs = int(round(float((a * n_per_run).sum()))), n_per_run * len(a)
    lo, hi = proportion_confint(count, nobs, alpha=1 - level, method="wilson")
    return count / nobs, float(lo), float(hi)


def multihop_section(runs: pd.DataFrame, out: Path) -> Section:
    """Accuracy per hop count on the synthetic multi-hop probe (sweep `multihop`): the paper's
    downstream claim that AttnRes helps multi-step reasoning most, in miniature. Per run the
    summary is the mean accuracy over hop counts and the accuracy at the deepest hop; variants are
    compared with the baseline over seeds, paired where seeds pair the runs (Welch otherwise);
    per hop, Wilson intervals of the accuracy pooled over runs."""
    title = "Multi-hop probe (the paper's multi-step reasoning claim)"
    hops = _hops(runs) if len(runs) else []
    if not hops:
        return Section(title, "No multi-hop probe runs (sweep `multihop`, data=multihop) among "
                       "these runs.\n\n", [Claim("AttnRes helps multi-step reasoning most",
                                                 "no runs", "not tested")])
    cols = [c for _, c in hops]
    runs = runs.assign(probe_mean=runs[cols].mean(axis=1), probe_deepest=runs[cols[-1]])
    per_hop = (int(runs["probe_examples_per_hop"].dropna().iloc[0])
               if "probe_examples_per_hop" in runs and runs["probe_examples_per_hop"].notna().any()
               else EXAMPLES_PER_HOP)
    rows = []
    for v in abl._order(set(runs["variant"])):
        g = runs[runs["variant"] == v]
        row = {"variant": v, "runs": len(g)}
        for k, c in hops:
            m, h, _ = t_interval(g[c])
            row[f"hop {k}"], row[f"hop {k} ±"] = m, h
        row["mean"], row["mean ±"], _ = t_interval(g["probe_mean"])
        for k, c in hops:
            _, row[f"hop {k} wilson_lo"], row[f"hop {k} wilson_hi"] = wilson(g[c], per_hop)
        rows.append(row)
    table = pd.DataFrame(rows)
    files = _write(table, out, "multihop_probe")
    files += figures.multihop(table, [k for k, _ in hops], out / "figures")
    shown = table[["variant", "runs"]].copy()
    for k, _ in hops:
        shown[f"hop {k}"] = [f"{_f(m, 3)} ± {_f(h, 3)}" for m, h in
                             zip(table[f"hop {k}"], table[f"hop {k} ±"])]
    shown["mean"] = [f"{_f(m, 3)} ± {_f(h, 3)}" for m, h in zip(table["mean"], table["mean ±"])]
    text = abl.to_markdown(shown)
    wil = table[["variant"]].copy()
    for k, _ in hops:
        wil[f"hop {k}"] = [f"[{_f(lo, 3)}, {_f(hi, 3)}]" for lo, hi in
                           zip(table[f"hop {k} wilson_lo"], table[f"hop {k} wilson_hi"])]
    text += ("\nPer hop, pooled over each variant's runs (" f"{per_hop} held-out prompts per hop "
             "count and run), 95% Wilson intervals of the accuracy:\n\n" + abl.to_markdown(wil))
    t1 = table.set_index("variant")
    k1 = hops[0][0]
    levels = {k: _level(runs, k) for k, _ in hops}
    copied = any(levels[k] != CHANCE for k in levels)
    if "baseline" in t1.index:
        text += "\n"
        above = []
        for k, _ in hops:  # pooled over the baseline's runs, against that hop count's chance
            lo, hi = t1.loc["baseline", f"hop {k} wilson_lo"], t1.loc["baseline", f"hop {k} wilson_hi"]
            if lo > levels[k]:
                above.append(k)
            text += (f"The baseline at {k} hop{'s' if k > 1 else ''}: Wilson interval "
                     f"[{_f(lo, 3)}, {_f(hi, 3)}], {'' if lo > levels[k] else 'not '}above chance "
                     f"({levels[k]:.3f}).\n")
        text += (f"The baseline learned the probe at {', '.join(map(str, above))} "
                 f"hop{'s' if above != [1] else ''}.\n" if above else "")
    text += ("\nAccuracy: exact greedy answer on held-out chains, mean ± 95% t-interval over seeds, "
             f"{len(hops)} hop counts. Chance per hop: "
             + (", ".join(f"{k}: {v:.3f}" for k, v in levels.items())
                + " — the accuracy of answering with a random digit of the prompt, which follows no "
                  "chain (probe/copy_hop_k, from the held-out prompts).\n\n" if copied else
                f"{CHANCE:g} (one of ten digits; these runs predate probe/copy_hop_k, and a model "
                "that copies any digit of the prompt, following no chain, scores above it).\n\n"))
    # A run learned the probe at k hops when its own Wilson interval there lies above k's chance.
    learned = {k: int(sum(wilson([a], per_hop)[1] > levels[k] for a in runs[c])) for k, c in hops}
    at_chance = learned[k1] == 0
    text += ("Runs above chance at each hop count (their own 95% Wilson interval above its chance): "
             + ", ".join(f"{k}: {n} of {runs[c].notna().sum()}" for (k, c), n in zip(hops, learned.values()))
             + ".\n\n")
    if at_chance:
        text += (f"**No run is above chance at {hops[0][0]} hop** (the best "
                 f"{hops[0][0]}-hop accuracy of any run is {runs[hops[0][1]].max():.3f}): at this "
                 "budget no model learned to follow a chain at all, so this section cannot speak "
                 "to the paper's claim either way. The probe needs longer training (more tokens, "
                 "or a larger model) until the 1-hop lookup is solved; only then do the deeper hop "
                 "counts separate the variants.\n\n")
    claims = []
    base = runs[runs["variant"] == "baseline"]
    for v in ("block", "full", "mhc"):
        g = runs[runs["variant"] == v]
        if base.empty or g.empty:
            continue
        deepest = hops[-1][0]
        for stat, what, untested, why in (
                ("probe_mean", "mean over hop counts", at_chance, "every run at chance, the probe was not learned"),
                ("probe_deepest", f"at {deepest} hops", learned[deepest] == 0, f"every run at chance at {deepest} hops")):
            c = compare(g[stat], base[stat], g["seed"] if "seed" in g else None,
                        base["seed"] if "seed" in base else None)
            d, h = c.diff, c.half
            # A hop count no model learned says nothing about depth: "not tested", not
            # "inconclusive" (which promises that more seeds could settle it).
            claims.append(Claim(f"{v} answers multi-hop chains better than the baseline ({what})",
                                f"Δ accuracy = {_f(d, 3)} ± {_f(h, 3)}" + (f"; {why}" if untested else ""),
                                "not tested" if untested
                                else _verdict(d - h, d + h, better_is_negative=False),
                                np.nan if untested else c.p))
    return Section(title, text + _img(files, out, "multi-hop probe"), claims, files)
