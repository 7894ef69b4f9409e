"""The ablation sections: Table 4 (every variant at one size, seeds), the tuned-learning-rate
rerun of it, and the block size sweep (Fig. 6)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from .. import ablation as abl
from ..significance import compare, pooled_seed_sd, seeds_needed, seeds_needed_paired
from .. import noise
from .. import figures
from ..paper import Paper
from .section import Claim, Section, _f, _img, _md, _verdict, _write


def _seeds(runs):
    return runs["seed"] if "seed" in runs else None


def ablation_section(runs: pd.DataFrame, paper: Paper, out: Path, note: str = "",
                     n_boot: int = 1000, seed: int = 0, adaptive: dict | None = None) -> Section:
    title = "Ablation (paper Table 4)"
    if runs.empty:
        return Section(title, "No finished ablation runs: this section is empty.\n",
                       [Claim("Full and Block AttnRes beat the baseline", "no runs", "not tested")])
    res = abl.ablation_table(runs, paper.table4_loss(), n_boot=n_boot, seed=seed)
    files = abl.write_tables(res, out / "tables")
    t = res.table.set_index("variant")
    text = (note + "\n\n" if note else "") + abl.to_markdown(abl.formatted(res.table)) + "\n"
    text += ("Loss: final validation loss, mean ± 95% t-interval over seeds; Δ: difference to our "
             "baseline, the mean of same-seed differences ± its 95% paired t interval where seeds "
             "pair the runs (design: paired, with the number of shared seeds; runs of one "
             "`train.seed` share data order and initial weights, so pairing removes the noise they "
             "share), else Welch's; Δ Welch: the unpaired interval over all runs, beside it. "
             "'vs baseline' is *better*/*worse* when the primary interval excludes 0.\n\n")
    claims = []
    for v, name in (("full", "Full AttnRes"), ("block", "Block AttnRes")):
        if v in t.index and "baseline" in t.index:
            d, h = t.loc[v, "delta"], t.loc[v, "delta_ci"]
            pd_ = t.loc[v, "paper_delta"]
            paper_note = f" (paper Δ {pd_:+.3f})" if np.isfinite(pd_) else ""
            claims.append(Claim(f"{name} beats the baseline{paper_note}",
                                f"Δ = {_f(d)} ± {_f(h)} ({_design(t.loc[v])}; Welch "
                                f"{_f(t.loc[v, 'welch_delta'])} ± {_f(t.loc[v, 'welch_ci'])})",
                                _verdict(d - h, d + h), t.loc[v, "p"]))
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
    if np.isfinite(res.tau):
        r = res.resolution
        v = ("agrees" if res.tau > 0 and res.p_value < 0.05 else
             "does not agree" if res.tau < 0 and res.p_value < 0.05 else "inconclusive")
        claims.append(Claim("Ranking of the variants matches the paper's",
                            f"Kendall τ = {res.tau:.3f}, p = {res.p_value:.3g} over {res.n_common}"
                            + ("" if r is None or not np.isfinite(r.power) else
                               f"; power to resolve the paper's order {r.power:.0%}"),
                            v, res.p_value))
        text += (f"Rank agreement with the paper over the {res.n_common} variants both have: "
                 f"Kendall τ = {res.tau:.3f} (p = {res.p_value:.3g}). "
                 + (abl.resolution_text(r) if r is not None else "") + "\n\n")
    better = [v for v in t.index if t.loc[v, "verdict"] == "better"]
    worse = [v for v in t.index if t.loc[v, "verdict"] == "worse"]
    ties = [v for v in t.index if t.loc[v, "verdict"] == "tie"]
    text += (f"Better than our baseline at 95%: {', '.join(better) or 'none'}. "
             f"Worse: {', '.join(worse) or 'none'}. Within noise: {', '.join(ties) or 'none'}. ")
    tested = t.dropna(subset=["p"])
    if len(tested) > 1:
        held = [v for v in tested.index if tested.loc[v, "p_holm"] < 0.05]
        lowest = tested.sort_values("p").head(3)
        text += (f"Each of these is one of {len(tested)} comparisons at 5%; with Holm's correction "
                 f"for all of them (family-wise 5%) {len(held)} remain ({', '.join(held) or 'none'}); "
                 "lowest p-values (primary test, Holm-adjusted): "
                 + ", ".join(f"{v} {r.p:.3g} → {r.p_holm:.3g}" for v, r in lowest.iterrows()) + ". ")
    p_better = [v for v in t.index if t.loc[v, "paper_delta"] < 0]
    if len(p_better):
        agree = [v for v in p_better if v in better]
        text += (f"The paper has {len(p_better)} of these variants below its baseline; our runs "
                 f"confirm {len(agree)} of them ({', '.join(agree) or 'none'}).\n")
    text += "\n" + _adaptive_text(adaptive) + _what_it_would_take(runs, t)
    return Section(title, text, claims, files)


def _adaptive_text(adaptive: dict | None) -> str:
    """The stopping rule of `python -m analysis.adaptive` and its intervals, where the seeds of
    these runs were chosen by it (adaptive.json beside the snapshot)."""
    if not adaptive:
        return ""
    rows = [{"comparison": f"{c['a']} − {c['b']}", "seeds": c["n"], "Δ": _f(c["diff"]),
             "half-width": _f(c["half"]), "verdict": c["verdict"]} for c in adaptive["comparisons"]]
    return ("**Seeds chosen adaptively.** " + adaptive["rule"] + " The intervals at the look where "
            "each comparison stopped (the table above gives fixed-n 95% intervals over all seeds "
            "run, which the stopping rule makes slightly optimistic for these comparisons):\n\n"
            + abl.to_markdown(pd.DataFrame(rows)) + "\n")


def _design(row) -> str:
    return f"paired over {int(row['pairs'])} seeds" if row["design"] == "paired" else "Welch"


def _what_it_would_take(runs: pd.DataFrame, t: pd.DataFrame) -> str:
    """Seeds the paper's effect sizes would need at our noise level, paired and unpaired: the
    plain answer to "would more runs of this size settle it?". The effect is the paper's Δ, a
    number fixed before our runs; the Δ we observed is never the target (that power only
    restates its own p-value)."""
    sigma, dof = pooled_seed_sd(runs)
    if not np.isfinite(sigma) or "baseline" not in t.index:
        return ""
    nt = noise.noise_table(runs, variants=[v for v in t.index if v != "baseline"])
    sd_diff = nt.set_index("variant")["sd_diff"]
    lines = [f"**What it would take to tell.** Seed-to-seed noise at this scale: σ = {sigma:.4f} "
             f"(pooled over variants, {dof} degrees of freedom). Seeds per variant a two-sided "
             "5%-level t test against the baseline needs for 80% power to detect the paper's Δ: "
             "unpaired (two-sample t, as many seeds for the baseline, pooled σ) and paired "
             "(one-sample t over same-seed differences, with the σ of this variant's differences "
             "to the baseline), from the noncentral t distribution:\n"]
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
                 f"{', '.join(untuned)}.\n\n")
    if pool.empty:
        return Section(title, text + "No variant was trained at two learning rates or more.\n\n",
                       [Claim(f"{name} beats the baseline, each at its tuned learning rate",
                              "no grid", "not tested") for name in claim_names.values()])
    paper_loss = paper.table4_loss()
    rows = []
    for v in abl._order(set(pool["variant"])):
        # a grid point is the mean over the grid's seeds: the best point is not the luckiest seed
        g = pool[pool["variant"] == v].groupby("lr")["final_val_loss"].agg(["mean", "size"]).reset_index()
        best = g.loc[g["mean"].idxmin()]
        rows.append({"variant": v, "lrs": " ".join(f"{x:g}" for x in g["lr"]), "best_lr": best["lr"],
                     "at_edge": best["lr"] in (g["lr"].min(), g["lr"].max()), "seeds": int(best["size"]),
                     "loss": best["mean"], "paper_loss": paper_loss.get(v, np.nan)})
    table = pd.DataFrame(rows)
    sigma, dof = pooled_seed_sd(ablation)
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
    claims = []
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
    return Section(title, text, claims, files)




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
    claims = []
    attn = runs[runs["variant"].isin(["block", "full"])].assign(S=abl.block_size_of)
    attn = attn.dropna(subset=["S"])
    own = attn[~attn["run_id"].isin(shared)] if "run_id" in attn else attn
    if len(own) < len(attn):
        text += (f"{len(attn) - len(own)} of these runs repeat the ablation's own runs (same "
                 "recipe, variant, settings and seed): they are tested there, so the trend test "
                 f"below uses the {len(own)} runs of this sweep alone.\n\n")
    if own["S"].nunique() >= 3:
        res = stats.kendalltau(own["S"], own["final_val_loss"])
        v = ("agrees" if res.statistic > 0 and res.pvalue < 0.05 else "does not agree"
             if res.statistic < 0 and res.pvalue < 0.05 else "inconclusive")
        claims.append(Claim("Loss grows with block size S (S ≤ 8 near Full, larger S toward the "
                            "baseline)", f"Kendall τ(S, loss) = {res.statistic:.3f}, "
                            f"p = {res.pvalue:.3g} over {len(own)} runs", v, float(res.pvalue)))
        text += (f"Across runs, Kendall τ between S and loss is {res.statistic:.3f} "
                 f"(p = {res.pvalue:.3g})")
        f6 = paper.fig6.dropna(subset=["S"]).sort_values("S") if paper.fig6 is not None else None
        if f6 is not None and len(f6) >= 2:
            lo, hi = f6.iloc[0], f6.iloc[-1]
            text += (f"; the paper's curve rises from {lo['loss']:.3f} (S={lo['S']:g}) to "
                     f"{hi['loss']:.3f} (S={hi['S']:g})")
        text += ".\n\n"
    base = runs[runs["variant"] == "baseline"]
    if len(base):
        below = []
        for S, g in attn.groupby("S"):
            c = compare(g["final_val_loss"], base["final_val_loss"], _seeds(g), _seeds(base))
            below.append((S, _verdict(c.lo, c.hi)))
        n_ok = sum(v == "agrees" for _, v in below)
        n_bad = sum(v == "does not agree" for _, v in below)
        verdict = "agrees" if n_ok == len(below) else "does not agree" if n_bad else "inconclusive"
        claims.append(Claim("Every block size beats the baseline", f"{n_ok} of {len(below)} "
                            "block sizes below the baseline at 95% (paired over seeds where they "
                            "pair)", verdict))
    return Section(title, text, claims, files)
