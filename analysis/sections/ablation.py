"""The ablation sections: Table 4 (every variant at one size, seeds), the tuned-learning-rate
rerun of it, and the block size sweep (Fig. 6)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .. import ablation as abl
from .. import markup
from ..significance import (DIVERGING_Z, MIN_OWN_PAIRS, compare, paired_power, pooled_diff_sd,
                            pooled_seed_sd, same_seed_diffs, seeds_needed, seeds_needed_paired,
                            steady)
from .. import noise
from .. import figures
from ..paper import Paper
from .section import Claim, Section, _f, _img, _md, _verdict, _write


def _seeds(runs):
    return runs["seed"] if "seed" in runs else None


def ablation_section(runs: pd.DataFrame, paper: Paper, out: Path, note: str = "",
                     n_boot: int = 1000, seed: int = 0, adaptive: dict | None = None,
                     pilot: frozenset = frozenset()) -> Section:
    """Table 4. ``pilot``: run ids of the pilot that sized the study's seed counts (their runs are
    in ``runs`` too); the estimate from the runs after it is given beside the pooled one."""
    title = "Ablation (paper Table 4)"
    if runs.empty:
        return Section(title, "No finished ablation runs: this section is empty.\n",
                       [Claim("Full and Block AttnRes beat the baseline", "no runs", "not tested")])
    res = abl.ablation_table(runs, paper.table4_loss(), n_boot=n_boot, seed=seed)
    files = abl.write_tables(res, out / "tables")
    t = res.table.set_index("variant")
    text = (note + "\n\n" if note else "") + abl.to_markdown(abl.formatted(res.table)) + "\n"
    text += _table_note(res)
    claims = _delta_claims(runs, t, paper)
    if np.isfinite(res.tau):
        claims.append(_tau_claim(res))
        text += (f"Rank agreement with the paper over the {res.n_common} variants both have: "
                 f"Kendall τ = {res.tau:.3f} (p = {res.p_value:.3g}). "
                 + (abl.resolution_text(res.resolution) if res.resolution is not None else "")
                 + "\n\n")
    text += _holm_text(t) + _pilot_text(runs, pilot)
    text += "\n" + _adaptive_text(adaptive) + _what_it_would_take(runs, t)
    return Section(title, text, claims, files)


def _table_note(res) -> str:
    sd, dof = res.pooled_diff
    text = ("Loss: final validation loss, mean ± 95% t-interval over seeds; Δ: difference to our "
            "baseline, the mean of same-seed differences ± its 95% paired t interval where seeds "
            "pair the runs (design: paired, with the number of shared seeds; runs of one "
            "`train.seed` share data order and initial weights, so pairing removes the noise they "
            "share), else Welch's; Δ Welch: the unpaired interval over all runs, beside it. "
            f"*pooled σ*: fewer than {MIN_OWN_PAIRS} pairs, too few for their own σ (two pairs give "
            "it one degree of freedom), so the interval and p use the σ of same-seed differences "
            f"pooled over variants, {_f(sd)} on {dof} degrees of freedom. "
            "'vs baseline' is *better*/*worse* when the primary interval excludes 0, each on its "
            "own at 5%.\n\n")
    apart = res.diverging
    if apart is not None and len(apart):
        counts = apart["variant"].value_counts().sort_index()
        names = ", ".join(f"{markup.md(v)} ({n})" for v, n in counts.items())
        text += (f"**Diverging runs, set apart**: {names}. Rule: a run whose final loss lies more "
                 f"than {DIVERGING_Z:g} robust standard deviations (1.4826·MAD of every run's "
                 "deviation from its variant's median) from its variant's median; with two runs "
                 "both deviate alike, so both are set apart. They stay in the table with their own "
                 "interval (*diverging*) and are left out of every pooled σ.\n\n")
    return text


def _delta_claims(runs, t, paper) -> list[Claim]:
    claims = []
    for v, name in (("full", "Full AttnRes"), ("block", "Block AttnRes")):
        if v in t.index and "baseline" in t.index:
            d, h = t.loc[v, "delta"], t.loc[v, "delta_ci"]
            pd_ = t.loc[v, "paper_delta"]
            paper_note = f" (paper Δ {pd_:+.3f})" if np.isfinite(pd_) else ""
            # Power for the paper's Δ (never ours): whether the paired test could have found it.
            g, base = runs[runs["variant"] == v], runs[runs["variant"] == "baseline"]
            diffs = same_seed_diffs(g, base) if "seed" in runs else pd.Series(dtype=float)
            power = paired_power(float(diffs.std(ddof=1)) if len(diffs) > 1 else np.nan,
                                 len(diffs), pd_)
            claims.append(Claim(f"{name} beats the baseline{paper_note}",
                                f"Δ = {_f(d)} ± {_f(h)} ({_design(t.loc[v])}; Welch "
                                f"{_f(t.loc[v, 'welch_delta'])} ± {_f(t.loc[v, 'welch_ci'])})"
                                + (f"; power for the paper's Δ {power:.0%}" if np.isfinite(power) else ""),
                                _verdict(d - h, d + h), t.loc[v, "p"], against_baseline=v))
    if {"full", "block"} <= set(t.index):
        fr, br = runs[runs["variant"] == "full"], runs[runs["variant"] == "block"]
        c = compare(fr["final_val_loss"], br["final_val_loss"], _seeds(fr), _seeds(br))
        pl = paper.table4_loss()
        quoted = (f" (paper {pl['full']:.3f} vs {pl['block']:.3f})"
                  if {"full", "block"} <= set(pl) else "")  # read from results/paper, not typed in
        design = f"paired over {c.n} seeds" if c.design == "paired" else "Welch"
        claims.append(Claim(f"Full AttnRes ≤ Block AttnRes{quoted}",
                            f"Full − Block = {_f(c.diff)} ± {_f(c.half)} ({design}; Welch "
                            f"{_f(c.welch_diff)} ± {_f(c.welch_half)})", _verdict(c.lo, c.hi), c.p))
    return claims


def _tau_claim(res) -> Claim:
    r = res.resolution
    v = ("agrees" if res.tau > 0 and res.p_value < 0.05 else
         "does not agree" if res.tau < 0 and res.p_value < 0.05 else "inconclusive")
    extra = ("" if r is None or not np.isfinite(r.power) else
             f"; interval [{r.tau_lo:.2f}, {r.tau_hi:.2f}] and power to find the paper's order "
             f"{r.power:.0%}, both at the pooled seed σ")
    return Claim("Ranking of the variants matches the paper's",
                 f"Kendall τ = {res.tau:.3f}, p = {res.p_value:.3g} over {res.n_common}" + extra,
                 v, res.p_value)


def _holm_text(t: pd.DataFrame) -> str:
    """Which variants are better or worse than the baseline, from the Holm-adjusted p over the
    family of comparisons with it (each test's own 5% level is beside it)."""
    tested = t.dropna(subset=["p"])
    held = tested[tested["p_holm"] < 0.05]
    better = [v for v in held.index if held.loc[v, "delta"] < 0]
    worse = [v for v in held.index if held.loc[v, "delta"] > 0]
    alone = [v for v in tested.index if tested.loc[v, "p"] < 0.05 and v not in held.index]
    text = (f"With Holm's correction over the {len(tested)} comparisons with the baseline "
            f"(family-wise 5%): better than our baseline: {_names(better)}; worse: "
            f"{_names(worse)}; the rest within noise"
            + (f" ({_names(alone)} below 5% on its own only)" if alone else "") + ". ")
    if len(tested):
        lowest = tested.sort_values("p").head(3)
        text += ("Lowest p-values (primary test → Holm-adjusted): "
                 + ", ".join(f"{markup.md(v)} {r.p:.3g} → {r.p_holm:.3g}"
                             for v, r in lowest.iterrows()) + ". ")
    p_better = [v for v in t.index if t.loc[v, "paper_delta"] < 0]
    if p_better:
        agree = [v for v in p_better if v in better]
        text += (f"The paper has {len(p_better)} of these variants below its baseline; after Holm "
                 f"our runs confirm {len(agree)} of them ({_names(agree)}).")
    return text + "\n"


def _pilot_text(runs: pd.DataFrame, pilot: frozenset) -> str:
    """The study's seed counts were sized from a pilot whose runs are also in the analysis: the
    estimate from the runs after the pilot alone, beside the pooled one."""
    if not pilot or "run_id" not in runs:
        return ""
    rows, base = [], runs[runs["variant"] == "baseline"]
    for v in ("block", "full"):
        g = runs[runs["variant"] == v]
        after = g[~g["run_id"].isin(pilot)]
        if g.empty or base.empty or len(after) == len(g):
            continue
        for label, a in (("all seeds", g), ("pilot only", g[g["run_id"].isin(pilot)]),
                         ("after the pilot", after)):
            c = compare(a["final_val_loss"], base["final_val_loss"], _seeds(a), _seeds(base))
            rows.append({"comparison": f"{v} − baseline", "runs": label, "pairs": c.n,
                         "Δ": _f(c.diff), "±": _f(c.half), "p": f"{c.p:.2g}"})
    if not rows:
        return ""
    return ("\n**Pilot, then sized.** The seed counts were chosen from the σ of a pilot's same-seed "
            "differences, and the pilot's runs are part of the estimate above. Sizing from the noise, "
            "not the effect, keeps a fixed-n interval near its nominal coverage but not exactly at "
            "it; the same comparisons from the pilot's seeds alone and from the seeds trained after "
            "it (an estimate the sizing could not have touched):\n\n"
            + abl.to_markdown(pd.DataFrame(rows)))


def _adaptive_text(adaptive: dict | None) -> str:
    """The stopping rule of `python -m analysis.adaptive` and its intervals, where the seeds of
    these runs were chosen by it (adaptive.json beside the snapshot)."""
    if not adaptive:
        return ""
    rows = [{"comparison": f"{c['a']} − {c['b']}", "seeds": c["n"], "Δ": _f(c["diff"]),
             "half-width": _f(c["half"]), "verdict": c["verdict"]} for c in adaptive["comparisons"]]
    return ("**Seeds chosen adaptively.** " + markup.md(adaptive["rule"]) + " The intervals at the look where "
            "each comparison stopped (the table above gives fixed-n 95% intervals over all seeds "
            "run, which the stopping rule makes slightly optimistic for these comparisons):\n\n"
            + abl.to_markdown(pd.DataFrame(rows)) + "\n")


def _names(variants) -> str:
    """Run-given names for Markdown prose, comma-separated."""
    return ", ".join(markup.md(v) for v in variants) or "none"


def _design(row) -> str:
    if row["design"] != "paired":
        return "Welch"
    pooled = f", pooled σ on {int(row['dof'])} df" if row["sd_from"] == "pooled" else ""
    return f"paired over {int(row['pairs'])} seeds{pooled}"


def _what_it_would_take(runs: pd.DataFrame, t: pd.DataFrame) -> str:
    """Seeds the paper's effect sizes would need at our noise level, paired and unpaired: the
    plain answer to "would more runs of this size settle it?". The effect is the paper's Δ, a
    number fixed before our runs; the Δ we observed is never the target (that power only
    restates its own p-value)."""
    kept, apart = steady(runs)
    sigma, dof = pooled_seed_sd(kept)
    others = [v for v in t.index if v != "baseline"]
    if not np.isfinite(sigma) or "baseline" not in t.index or not others:  # nothing to compare
        return ""
    nt = noise.noise_table(runs, variants=others)
    nt = nt.set_index("variant")
    # Fewer than MIN_OWN_PAIRS pairs: the pooled σ of same-seed differences, as in the table.
    pooled = abl.pooled_differences(runs)[0]
    own = (nt["pairs"] >= MIN_OWN_PAIRS) | t["diverging"].reindex(nt.index).fillna(0).gt(0)
    sd_diff = nt["sd_diff"].where(own, pooled)
    lines = [f"**What it would take to tell.** Seed-to-seed noise at this scale: σ = {sigma:.4f} "
             f"(pooled over variants, {dof} degrees of freedom, the {len(apart)} diverging runs "
             f"apart; with them {pooled_seed_sd(runs)[0]:.4f}). Seeds per variant a two-sided "
             "5%-level t test against the baseline needs for 80% power to detect the paper's Δ: "
             "unpaired (two-sample t, as many seeds for the baseline, pooled σ) and paired "
             "(one-sample t over same-seed differences, with the σ of this variant's differences "
             f"to the baseline; pooled over variants, {_f(pooled)}, below {MIN_OWN_PAIRS} pairs), from "
             "the noncentral t distribution:\n"]
    rows = []
    for v in t.index:
        if v == "baseline":
            continue
        paper_d = t.loc[v, "paper_delta"]
        rows.append({"variant": v, "Δ paper": _f(paper_d, 3),
                     "seeds unpaired": _f(seeds_needed(sigma, paper_d), 0),
                     "σ same-seed diff": _f(sd_diff.get(v, np.nan)),
                     "seeds paired": _f(seeds_needed_paired(sd_diff.get(v, np.nan), paper_d), 0)})
    lines.append(abl.to_markdown(pd.DataFrame(rows)))
    lines.append("\nThe paper's Δs were measured with millions of times our compute per run (its "
                 "436M-class models on billions of tokens), where seed noise is smaller and the gaps "
                 "may differ, so these counts are a yardstick for how fine a difference this setup "
                 "can resolve, not a prediction of what more seeds would show.\n")
    return "\n".join(lines)


def noise_section(runs: pd.DataFrame, out: Path, target: float = 0.03,
                  comparisons=("block", "full"), histories: pd.DataFrame | None = None) -> Section:
    """The noise study of the ablation's recipe: seed σ, same-seed-difference σ, their
    correlation, minimum detectable effects and seeds for a stated target Δ (analysis.noise)."""
    title = "Noise study (the ablation's recipe)"
    present = [v for v in comparisons if v in set(runs["variant"])] if len(runs) else []
    if not present or "baseline" not in set(runs["variant"]):
        return Section(title, "No baseline and compared variant among the ablation's runs.\n")
    table = noise.noise_table(runs, variants=present, target=target)
    files = noise.write(table, out / "tables") + noise.plot(table, out / "figures")
    text = abl.to_markdown(noise.shown(table))
    text += (f"\nσ variant / σ baseline: seed-to-seed standard deviation of each arm's final "
             "validation loss; σ same-seed diff: that of variant − baseline at the same seed; corr: "
             "correlation of the pairs (a paired design gains when it is high: σ_diff² = σ_a² + "
             "σ_b² − 2·corr·σ_a·σ_b). MDE: the smallest true Δ a two-sided 5%-level test detects "
             "with 80% power at n seeds (paired: one-sample t on n differences; unpaired: "
             "two-sample t with n per arm). Seeds for Δ: the smallest n reaching 80% power for the "
             f"stated target Δ = {target:g} nats (an input of the study, not an observed Δ). Each σ "
             "is itself estimated from few seeds, so these counts are as uncertain as σ is; "
             "`python -m analysis noise` recomputes them for any recipe.\n\n")
    text += _img(files, out, "noise study")
    est = noise.estimators(runs, histories, variants=present, target=target) if histories is not None else pd.DataFrame()
    if len(est):
        files += _write(est, out, "noise_estimators")
        text += ("**Which final loss to compare.** The same comparisons with each run's final loss "
                 "taken as the last evaluation or as the mean of its last evaluations (from the runs' "
                 "own `val/loss` histories): the estimator with the smaller σ same-seed diff needs "
                 "fewer seeds.\n\n" + _md(est) + "\n")
    return Section(title, text, [], files)


# --------------------------------------------------------------------------------------------
def tuned_lr_section(tuned: pd.DataFrame, ablation: pd.DataFrame, paper: Paper, out: Path,
                     note: str = "") -> Section:
    """Table 4 at each variant's own learning rate: every variant's best run over a learning-rate
    grid (sweep `tuned_lr`, plus the ablation's runs of the same seed and recipe at the shared
    rate). One run per grid point, so a difference to the baseline is judged against the
    ablation's pooled seed noise: Δ ± t·σ·√2 (two single runs). Only variants trained at two
    learning rates or more are tuned: one run at the shared rate beside a tuned baseline would
    credit the baseline with its search. The caller gives runs of one recipe (report.py)."""
    title = "Ablation at each variant's tuned learning rate"
    claim_names = {"full": "Full AttnRes", "block": "Block AttnRes"}
    if tuned.empty:
        return Section(title, "No learning-rate grid among these runs (sweep `tuned_lr`).\n\n",
                       [Claim("Block AttnRes beats the baseline at tuned learning rates", "no runs",
                              "not tested")])
    seeds = set(tuned["seed"].dropna())
    pool = pd.concat([tuned, ablation[ablation["seed"].isin(seeds)]], ignore_index=True)
    pool = pool.dropna(subset=["final_val_loss"])
    rates = pool.groupby("variant")["lr"].nunique()
    untuned = abl._order({v for v, n in rates.items() if n < 2})
    pool = pool[~pool["variant"].isin(untuned)]
    text = (note[0].upper() + note[1:] + ".\n\n") if note else ""
    if untuned:
        text += (f"Left out, trained at one learning rate only (no grid, so not tuned): "
                 f"{_names(untuned)}.\n\n")
    if pool.empty:
        return Section(title, text + "No variant was trained at two learning rates or more.\n\n",
                       [Claim(f"{name} beats the baseline, each at its tuned learning rate",
                              "no grid", "not tested") for name in claim_names.values()])
    table = _tuned_table(pool, paper.table4_loss())
    sigma, dof = pooled_seed_sd(steady(ablation)[0])
    n = int(table["seeds"].min())
    half = (stats.t.ppf(0.975, dof) * sigma * np.sqrt(2 / n)) if dof else np.nan
    base = table.set_index("variant")["loss"].get("baseline", np.nan)
    table["delta"] = table["loss"] - base
    table["verdict"] = [("n/a" if v == "baseline" or not np.isfinite(half * d) else "better" if d + half < 0
                         else "worse" if d - half > 0 else "tie")
                        for v, d in zip(table["variant"], table["delta"])]
    files = _write(table, out, "table4_tuned_lr")
    text += _md(table)
    noise = (f"±{_f(half)} (t·σ·√(2/{n}) with the ablation's pooled seed σ = {_f(sigma)})" if np.isfinite(half)
             else "nothing: no ablation runs of this recipe with two seeds of a variant give the seed noise")
    text += (f"\nEach point is the mean over seed{'s' if len(seeds) > 1 else ''} "
             f"{', '.join(f'{x:g}' for x in sorted(seeds))} of its (variant, learning rate); "
             "best_lr at_edge = the best point is at an end of the grid (the optimum may lie beyond "
             f"it). Δ to the tuned baseline is judged against {noise}: *better*/*worse* only beyond it. "
             "That threshold is approximate: each loss is the best of the grid's points, a minimum that "
             "seed noise pulls down by more for a variant whose points are closer together, and σ was "
             "measured at the ablation's learning rate only; seeds at each chosen rate would settle it.\n\n")
    tau_text, claims = _tuned_tau(table)
    text += tau_text
    claims += _tuned_claims(table, claim_names, half, sigma, dof, n)
    return Section(title, text, claims, files)


def _tuned_table(pool: pd.DataFrame, paper_loss: dict) -> pd.DataFrame:
    rows = []
    for v in abl._order(set(pool["variant"])):
        # a grid point is the mean over the grid's seeds: the best point is not the luckiest seed
        g = pool[pool["variant"] == v].groupby("lr")["final_val_loss"].agg(["mean", "size"]).reset_index()
        best = g.loc[g["mean"].idxmin()]
        rows.append({"variant": v, "lrs": " ".join(f"{x:g}" for x in g["lr"]), "best_lr": best["lr"],
                     "at_edge": best["lr"] in (g["lr"].min(), g["lr"].max()), "seeds": int(best["size"]),
                     "loss": best["mean"], "paper_loss": paper_loss.get(v, np.nan)})
    return pd.DataFrame(rows)


def _tuned_tau(table: pd.DataFrame) -> tuple[str, list[Claim]]:
    text, claims = "", []
    common = table.dropna(subset=["loss", "paper_loss"])
    if len(common) >= 2:
        res = stats.kendalltau(common["loss"], common["paper_loss"])
        tau, pv = float(res.statistic), float(res.pvalue)
        text += (f"Rank agreement with the paper at tuned learning rates over {len(common)} variants: "
                 f"Kendall τ = {tau:.3f} (p = {pv:.3g}).\n\n")
        claims.append(Claim("Ranking of the variants matches the paper's (tuned learning rates)",
                            f"Kendall τ = {tau:.3f}, p = {pv:.3g} over {len(common)}",
                            "agrees" if tau > 0 and pv < 0.05 else
                            "does not agree" if tau < 0 and pv < 0.05 else "inconclusive", pv))
    return text, claims


def _tuned_claims(table, claim_names, half, sigma, dof, n) -> list[Claim]:
    claims = []
    t = table.set_index("variant")
    for v, name in claim_names.items():
        claim = f"{name} beats the baseline, each at its tuned learning rate"
        missing = [u for u in ("baseline", v) if u not in t.index]
        if missing:
            claims.append(Claim(claim, f"no grid for {' and '.join(missing)}", "not tested"))
        elif not np.isfinite(half):
            claims.append(Claim(claim, f"Δ = {_f(t.loc[v, 'delta'])}, no seed noise", "not tested"))
        else:
            d = t.loc[v, "delta"]
            p = (float(2 * stats.t.sf(abs(d) / (sigma * np.sqrt(2 / n)), dof))
                 if sigma > 0 else np.nan)  # the test behind ±t·σ·√(2/n)
            claims.append(Claim(claim, f"Δ = {_f(d)} ± {_f(half)}", _verdict(d - half, d + half), p))
    return claims




def block_size_section(runs: pd.DataFrame, paper: Paper, out: Path,
                       shared: frozenset = frozenset()) -> Section:
    """``shared``: run ids that repeat a run of the ablation (same recipe, variant, settings and
    seed): they are drawn and tabled here but tested only there, so that no run enters the
    report's family of tests twice."""
    title = "Block size (paper Fig. 6)"
    table = abl.block_size_table(runs) if len(runs) else abl.block_size_table(
        pd.DataFrame(columns=["variant", "block_size", "layers", "num_blocks", "final_val_loss"]))
    files = figures.block_size(table, paper.fig6, out / "figures")
    if table.dropna(subset=["S"]).empty:
        return Section(title, "No block-size sweep among these runs (sweep `block_size`); the "
                       "figure shows the paper's curve only.\n\n" + _img(files, out, "Fig. 6"),
                       [Claim("Loss grows with block size S", "no runs", "not tested")], files)
    files += _write(table, out, "fig6_block_size")
    shown = pd.DataFrame({"S": table["label"], "N": table["N"].map(lambda x: _f(x, 0)),
                          "runs": table["n"], "loss": table["loss"].map(_f),
                          "95% CI ±": table["loss_ci"].map(_f)})
    text = abl.to_markdown(shown) + "\n" + _img(files, out, "Fig. 6")
    attn = runs[runs["variant"].isin(["block", "full"])].assign(S=abl.block_size_of)
    attn = attn.dropna(subset=["S"])
    own = attn[~attn["run_id"].isin(shared)] if "run_id" in attn else attn
    if len(own) < len(attn):
        text += (f"{len(attn) - len(own)} of these runs repeat the ablation's own runs (same "
                 "recipe, variant, settings and seed): they are tested there, so the trend test "
                 f"below uses the {len(own)} runs of this sweep alone.\n\n")
    trend_text, claims = _trend(own, paper)
    text += trend_text
    base = runs[runs["variant"] == "baseline"]
    if len(base):
        claims.append(_every_size_claim(attn[attn["S"] >= 2], base))
    return Section(title, text, claims, files)


TREND_CLAIM = "Loss grows with block size S (S ≤ 8 near Full, larger S toward the baseline)"


def _trend(own: pd.DataFrame, paper: Paper) -> tuple[str, list[Claim]]:
    """The trend over S ≥ 2 as the slope of loss on log2 S with a seed effect (runs of one seed
    share data order and initial weights: they pair), a t test on its residual degrees of
    freedom; S = 1, Full through the Block path, is reported apart, since one end point would
    otherwise carry the trend."""
    import statsmodels.formula.api as smf

    text = ""
    s1 = own[own["S"] == 1]
    trend = own[own["S"] >= 2].dropna(subset=["final_val_loss"])
    if len(s1) and len(trend):
        nxt = trend[trend["S"] == trend["S"].min()]
        pooled = pooled_diff_sd([same_seed_diffs(g, nxt) for _, g in trend.groupby("S")]
                                + [same_seed_diffs(s1, nxt)])
        c = compare(s1["final_val_loss"], nxt["final_val_loss"], _seeds(s1), _seeds(nxt),
                    pooled=pooled)
        text += (f"S = 1 (Full through the Block code path) is reported apart from the trend, and "
                 f"from the claim that every block size beats the baseline (Full is judged in the "
                 f"ablation): loss {_f(s1['final_val_loss'].mean())} over {len(s1)} runs; S = 1 − "
                 f"S = {nxt['S'].iloc[0]:g}: {_f(c.diff)} ± {_f(c.half)} (paired over {c.n} seeds, "
                 f"σ of same-seed differences to S = {nxt['S'].iloc[0]:g} pooled over block sizes, "
                 f"{c.dof} df).\n\n")
    seeds = trend["seed"].nunique() if "seed" in trend else 0
    formula = "final_val_loss ~ np.log2(S)" + (" + C(seed)" if seeds > 1 else "")
    if trend["S"].nunique() < 3 or len(trend) <= trend["S"].nunique():
        return text, [Claim(TREND_CLAIM, f"{trend['S'].nunique()} block sizes of 2 or more", "not tested")]
    fit = smf.ols(formula, data=trend.assign(seed=trend.get("seed", 0).astype(str))).fit()
    slope, p, dof = float(fit.params["np.log2(S)"]), float(fit.pvalues["np.log2(S)"]), int(fit.df_resid)
    lo, hi = (float(x) for x in fit.conf_int(0.05).loc["np.log2(S)"])
    ours = (f"slope {slope:+.4f} per doubling of S [{lo:+.4f}, {hi:+.4f}] over S ≥ 2 "
            f"({len(trend)} runs, seed effect, {dof} df)")
    text += (f"Trend over S ≥ 2: loss against log2 S with a seed effect (the runs of one seed pair), "
             f"{ours}, p = {p:.2g}")
    f6 = paper.fig6.dropna(subset=["S"]).sort_values("S") if paper.fig6 is not None else None
    if f6 is not None and len(f6) >= 2:
        a, b = f6.iloc[0], f6.iloc[-1]
        text += (f"; the paper's curve rises from {a['loss']:.3f} (S={a['S']:g}) to "
                 f"{b['loss']:.3f} (S={b['S']:g})")
    return text + ".\n\n", [Claim(TREND_CLAIM, ours, _verdict(lo, hi, better_is_negative=False), p)]


def _every_size_claim(attn: pd.DataFrame, base: pd.DataFrame) -> Claim:
    """Each block size against the baseline at the same seeds; below MIN_OWN_PAIRS pairs with
    the σ of same-seed differences pooled over the block sizes."""
    pooled = pooled_diff_sd([same_seed_diffs(g, base) for _, g in attn.groupby("S")])
    below = []
    for S, g in attn.groupby("S"):
        c = compare(g["final_val_loss"], base["final_val_loss"], _seeds(g), _seeds(base),
                    pooled=pooled)
        below.append(_verdict(c.lo, c.hi))
    n_ok = sum(v == "agrees" for v in below)
    n_bad = sum(v == "does not agree" for v in below)
    verdict = "agrees" if n_ok == len(below) else "does not agree" if n_bad else "inconclusive"
    return Claim("Every block size S ≥ 2 beats the baseline",
                 f"{n_ok} of {len(below)} block sizes below the baseline and {n_bad} above at 95% "
                 f"(paired over seeds, σ of same-seed differences pooled over block sizes, "
                 f"{pooled[1]} df)", verdict)
