"""The multi-hop probe section: the paper's multi-step reasoning claim, in miniature."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .. import ablation as abl
from ..significance import MIN_OWN_PAIRS, compare, pooled_diff_sd, same_seed_diffs, t_interval
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
    compared with the baseline at the seed level (one accuracy per run; every run sees the same
    prompts, so prompts are not independent trials across runs), paired where seeds pair the
    runs. Per hop, Wilson intervals pooled over a variant's runs are conditional on those trained
    models: they carry the prompts' sampling error, not the seeds'."""
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
    table = _probe_table(runs, hops, per_hop)
    files = _write(table, out, "multihop_probe")
    files += figures.multihop(table, [k for k, _ in hops], out / "figures")
    levels = {k: _level(runs, k) for k, _ in hops}
    text = _shown(table, hops, per_hop) + _baseline_text(runs, table, hops, levels)
    text += _chance_text(levels, len(hops))
    # A run learned the probe at k hops when its own Wilson interval there lies above k's chance.
    learned = {k: int(sum(wilson([a], per_hop)[1] > levels[k] for a in runs[c])) for k, c in hops}
    at_chance = learned[hops[0][0]] == 0
    text += ("Runs above chance at each hop count (their own 95% Wilson interval above its chance, "
             "conditional on each trained model): "
             + ", ".join(f"{k}: {n} of {runs[c].notna().sum()}" for (k, c), n in zip(hops, learned.values()))
             + ".\n\n")
    if at_chance:
        text += (f"**No run is above chance at {hops[0][0]} hop** (the best "
                 f"{hops[0][0]}-hop accuracy of any run is {runs[hops[0][1]].max():.3f}): at this "
                 "budget no model learned to follow a chain at all, so this section cannot speak "
                 "to the paper's claim either way. The probe needs longer training (more tokens, "
                 "or a larger model) until the 1-hop lookup is solved; only then do the deeper hop "
                 "counts separate the variants.\n\n")
    claims, note = _probe_claims(runs, hops, learned, at_chance)
    return Section(title, text + note + _img(files, out, "multi-hop probe"), claims, files)


def _probe_table(runs, hops, per_hop) -> pd.DataFrame:
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
    return pd.DataFrame(rows)


def _shown(table, hops, per_hop) -> str:
    shown = table[["variant", "runs"]].copy()
    for k, _ in hops:
        shown[f"hop {k}"] = [f"{_f(m, 3)} ± {_f(h, 3)}" for m, h in
                             zip(table[f"hop {k}"], table[f"hop {k} ±"])]
    shown["mean"] = [f"{_f(m, 3)} ± {_f(h, 3)}" for m, h in zip(table["mean"], table["mean ±"])]
    wil = table[["variant"]].copy()
    for k, _ in hops:
        wil[f"hop {k}"] = [f"[{_f(lo, 3)}, {_f(hi, 3)}]" for lo, hi in
                           zip(table[f"hop {k} wilson_lo"], table[f"hop {k} wilson_hi"])]
    return (abl.to_markdown(shown) + "\nPer hop, pooled over each variant's runs (" f"{per_hop} "
            "held-out prompts per hop count and run), 95% Wilson intervals of the accuracy. They are "
            "conditional on these trained models: every run answers the same prompts, so the "
            "interval holds the prompts' sampling error only, not the spread between seeds (the t "
            "interval above, over seeds, is the one about the variant):\n\n" + abl.to_markdown(wil))


def _baseline_text(runs, table, hops, levels) -> str:
    """Whether the baseline answers above chance at each hop count: for its trained models
    (pooled Wilson, prompts only) and for the variant (t interval over seeds)."""
    t1 = table.set_index("variant")
    if "baseline" not in t1.index:
        return ""
    text, models, seeds = "\n", [], []
    for k, _ in hops:
        lo, hi = t1.loc["baseline", f"hop {k} wilson_lo"], t1.loc["baseline", f"hop {k} wilson_hi"]
        m, h = t1.loc["baseline", f"hop {k}"], t1.loc["baseline", f"hop {k} ±"]
        if lo > levels[k]:
            models.append(k)
        if np.isfinite(h) and m - h > levels[k]:
            seeds.append(k)
        text += (f"The baseline at {k} hop{'s' if k > 1 else ''} (chance {levels[k]:.3f}): its models "
                 f"[{_f(lo, 3)}, {_f(hi, 3)}] (Wilson, conditional on them); over seeds "
                 f"{_f(m, 3)} ± {_f(h, 3)}.\n")
    n = int((runs["variant"] == "baseline").sum())
    return text + (f"The baseline's {n} trained models answer above chance at "
                   f"{_hops_text(models)}; as a property of the baseline over seeds (t interval, "
                   f"{n - 1} df), above chance at {_hops_text(seeds)}.\n")


def _hops_text(ks) -> str:
    return (", ".join(map(str, ks)) + f" hop{'s' if ks != [1] else ''}") if ks else "no hop count"


def _chance_text(levels, n_hops) -> str:
    copied = any(levels[k] != CHANCE for k in levels)
    return ("\nAccuracy: exact greedy answer on held-out chains, mean ± 95% t-interval over seeds, "
            f"{n_hops} hop counts. Chance per hop: "
            + (", ".join(f"{k}: {v:.3f}" for k, v in levels.items())
               + " — the accuracy of answering with a random digit of the prompt, which follows no "
                 "chain (probe/copy_hop_k, from the held-out prompts).\n\n" if copied else
               f"{CHANCE:g} (one of ten digits; these runs predate probe/copy_hop_k, and a model "
               "that copies any digit of the prompt, following no chain, scores above it).\n\n"))


def _probe_claims(runs, hops, learned, at_chance) -> tuple[list[Claim], str]:
    """Each AttnRes variant against the baseline over seeds, paired; below MIN_OWN_PAIRS pairs
    with the σ of same-seed differences pooled over the variants compared."""
    claims, base, deepest = [], runs[runs["variant"] == "baseline"], hops[-1][0]
    compared = [v for v in ("block", "full", "mhc") if not runs[runs["variant"] == v].empty]
    if base.empty or "seed" not in runs:
        compared = []
    dofs = set()
    for stat, what, untested, why in (
            ("probe_mean", "mean over hop counts", at_chance, "every run at chance, the probe was not learned"),
            ("probe_deepest", f"at {deepest} hops", learned[deepest] == 0, f"every run at chance at {deepest} hops")):
        pooled = pooled_diff_sd([same_seed_diffs(runs[runs["variant"] == v], base, stat) for v in compared])
        for v in compared:
            g = runs[runs["variant"] == v]
            c = compare(g[stat], base[stat], g["seed"], base["seed"], pooled=pooled)
            dofs.add((c.sd_from, c.dof))
            # A hop count no model learned says nothing about depth: "not tested", not
            # "inconclusive" (which promises that more seeds could settle it).
            claims.append(Claim(f"{v} answers multi-hop chains better than the baseline ({what})",
                                f"Δ accuracy = {_f(c.diff, 3)} ± {_f(c.half, 3)}"
                                + (f" (pooled σ, {c.dof} df)" if c.sd_from == "pooled" else "")
                                + (f"; {why}" if untested else ""),
                                "not tested" if untested
                                else _verdict(c.lo, c.hi, better_is_negative=False),
                                np.nan if untested else c.p))
    pooled_used = any(s == "pooled" for s, _ in dofs)
    note = ((f"Variants against the baseline: same-seed differences of each run's accuracy (the seed, "
             f"not the prompt, is the unit); with fewer than {MIN_OWN_PAIRS} pairs the σ of those "
             "differences is pooled over the variants compared.\n\n") if pooled_used else "")
    return claims, note
