"""Summaries over seeds: the ablation table (paper Table 4) and the block-size sweep (Fig. 6).

Δ vs our baseline and its tests come from :mod:`analysis.significance` (paired where seeds are
shared, Welch beside it, Holm over the family); rank agreement with the paper is Kendall's τ-b.
Tables follow the paper's Table 4 order, variants it lacks last; Markdown and LaTeX are written
here, without a template dependency, so the files are byte-stable.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

from . import markup
from .paper import KNOWN_VARIANTS
from .significance import (RankResolution, compare, holm, pooled_diff_sd, rank_resolution,
                           same_seed_diffs, steady, t_interval)


def _order(variants) -> list[str]:
    known = [v for v in KNOWN_VARIANTS if v in variants]
    return known + sorted(v for v in variants if v not in KNOWN_VARIANTS)


@dataclass
class AblationResult:
    table: pd.DataFrame
    tau: float
    p_value: float
    n_common: int
    resolution: RankResolution | None = None
    pooled_diff: tuple[float, int] = (np.nan, 0)  # σ of same-seed differences pooled over variants, dof
    diverging: pd.DataFrame | None = None  # runs set apart (significance.steady)


def pooled_differences(runs: pd.DataFrame, baseline: str = "baseline",
                       metric: str = "final_val_loss") -> tuple[float, int]:
    """σ of same-seed differences to the baseline pooled over every variant (each around its own
    mean), with its degrees of freedom, from the runs that did not diverge."""
    kept, _ = steady(runs, metric)
    base = kept[kept["variant"] == baseline]
    if base.empty or "seed" not in kept:
        return np.nan, 0
    return pooled_diff_sd([same_seed_diffs(g, base, metric)
                           for v, g in kept.groupby("variant") if v != baseline])


def _row(v, g, base, baseline, metric, pooled, flagged) -> dict:
    mean, half, n = t_interval(g[metric])
    row = {"variant": v, "n": n, "loss": mean, "loss_ci": half, "delta": np.nan,
           "delta_ci": np.nan, "design": "–", "pairs": 0, "sd_from": "–", "dof": 0, "p": np.nan,
           "welch_delta": np.nan, "welch_ci": np.nan, "welch_p": np.nan,
           "diverging": int(flagged.get(v, 0))}
    if v == baseline:
        row["delta"] = 0.0
    elif base is not None:
        paired = "seed" in g  # snapshots without seeds compare unpaired
        # A variant with diverging runs keeps its own scatter: the pooled σ would hide it.
        c = compare(g[metric], base[metric], g["seed"] if paired else None,
                    base["seed"] if paired else None, pooled=None if row["diverging"] else pooled)
        row.update(delta=c.diff, delta_ci=c.half, design=c.design,
                   pairs=c.n if c.design == "paired" else 0, sd_from=c.sd_from, dof=c.dof, p=c.p,
                   welch_delta=c.welch_diff, welch_ci=c.welch_half, welch_p=c.welch_p)
    d, h = row["delta"], row["delta_ci"]
    row["verdict"] = ("n/a" if v == baseline or not np.isfinite(h) else "better" if d + h < 0
                      else "worse" if d - h > 0 else "tie")
    return row


def ablation_table(runs: pd.DataFrame, paper_loss: dict[str, float] | None = None,
                   baseline: str = "baseline", metric: str = "final_val_loss",
                   n_boot: int = 1000, seed: int = 0) -> AblationResult:
    """Table 4 from finished runs: one row per variant.

    Columns: variant, n, loss, loss_ci (half-width), delta, delta_ci, design (``paired``: mean
    of same-seed differences over ``pairs`` seeds, t interval; ``welch``: no two seeds shared),
    sd_from (``own``: the pairs' own σ; ``pooled``: fewer than MIN_OWN_PAIRS pairs, so the σ of
    same-seed differences pooled over variants, with its ``dof``), p (the primary test's
    two-sided p-value), welch_delta, welch_ci, welch_p (Welch over all runs, beside it),
    diverging (runs set apart by significance.diverging; such a variant keeps its own σ and is
    left out of every pool), paper_loss, paper_delta, verdict (``better`` / ``worse`` / ``tie``
    by the primary interval, ``n/a`` without one) and p_holm (Holm over every variant compared
    with the baseline).
    """
    paper_loss = paper_loss or {}
    groups = {v: g for v, g in runs.groupby("variant")}
    base = groups.get(baseline)
    p_base = paper_loss.get(baseline)
    _, apart = steady(runs, metric)
    flagged = apart["variant"].value_counts().to_dict() if len(apart) else {}
    pooled = pooled_differences(runs, baseline, metric)
    rows = []
    for v in _order(groups):
        row = _row(v, groups[v], base, baseline, metric, pooled, flagged)
        pl = paper_loss.get(v, np.nan)
        row["paper_loss"] = pl
        row["paper_delta"] = pl - p_base if p_base is not None else np.nan
        rows.append(row)
    cols = ["variant", "n", "loss", "loss_ci", "delta", "delta_ci", "design", "pairs", "sd_from",
            "dof", "p", "welch_delta", "welch_ci", "welch_p", "diverging", "paper_loss",
            "paper_delta", "verdict"]
    table = pd.DataFrame(rows)[cols]
    table["p_holm"] = holm(table["p"])
    common = table.dropna(subset=["loss", "paper_loss"])
    resolution = None
    if len(common) >= 2:
        res = stats.kendalltau(common["loss"], common["paper_loss"])
        tau, p = float(res.statistic), float(res.pvalue)
        resolution = rank_resolution(runs, paper_loss, metric, n_boot=n_boot, seed=seed)
    else:
        tau, p = np.nan, np.nan
    return AblationResult(table=table, tau=tau, p_value=p, n_common=len(common),
                          resolution=resolution, pooled_diff=pooled, diverging=apart)


def block_size_of(runs: pd.DataFrame) -> pd.Series:
    """Block size S (sublayers per block) of each run: 2·layers / num_blocks when
    ``residual.num_blocks`` is set, else ``residual.block_size``; Full AttnRes is S = 1 (paper §3:
    S = 1 recovers Full). num_blocks first, as the model resolves them
    (attnres.residuals.resolve_block_size): block_size is logged for every run, at its default 4
    when the run set num_blocks instead."""
    S = runs["block_size"].astype(float)
    derived = 2 * runs["layers"] / runs["num_blocks"]
    S = derived.where(derived.notna(), S)
    return S.where(runs["variant"] != "full", 1.0)


def block_size_table(runs: pd.DataFrame, baseline: str = "baseline",
                     metric: str = "final_val_loss") -> pd.DataFrame:
    """Fig. 6 as a table: one row per block size S (Block and Full runs), plus the baseline."""
    rows = []
    attn = runs[runs["variant"].isin(["block", "full"])].assign(S=block_size_of)
    for S, g in attn.dropna(subset=["S"]).groupby("S"):
        mean, half, n = t_interval(g[metric])
        nb = g["num_blocks"].dropna()
        if not len(nb) and "layers" in g:  # N = L / S (L = 2·layers sublayers; last block may be short)
            nb = np.ceil(2 * g["layers"].astype(float) / S).dropna()
        rows.append({"label": f"{int(S)}", "S": float(S),
                     "N": float(nb.iloc[0]) if len(nb) else np.nan, "n": n, "loss": mean,
                     "loss_ci": half})
    base = runs[runs["variant"] == baseline]
    if len(base):
        mean, half, n = t_interval(base[metric])
        rows.append({"label": "baseline", "S": np.nan, "N": np.nan, "n": n, "loss": mean,
                     "loss_ci": half})
    return pd.DataFrame(rows, columns=["label", "S", "N", "n", "loss", "loss_ci"])


# --------------------------------------------------------------------------------------------
# Writers
# --------------------------------------------------------------------------------------------
def _fmt(x, digits=4, signed=False):
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "–"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """The ablation table as strings, as printed in Markdown and LaTeX."""
    out = pd.DataFrame({
        "Variant": table["variant"],
        "n": table["n"].astype(int).astype(str),
        "Val. loss (ours)": [f"{_fmt(m)} ± {_fmt(h)}" if np.isfinite(h) else _fmt(m)
                             for m, h in zip(table["loss"], table["loss_ci"])],
        "Δ (ours)": [f"{_fmt(d, signed=True)} ± {_fmt(h)}" if np.isfinite(h)
                     else _fmt(d, signed=True) for d, h in zip(table["delta"], table["delta_ci"])],
        "design": [(f"{d} ({k}" + (", pooled σ" if s == "pooled" else "")
                    + (", diverging" if x else "") + ")") if d == "paired" else d
                   for d, k, s, x in zip(table["design"], table["pairs"], table["sd_from"],
                                         table["diverging"])],
        "Δ Welch": [f"{_fmt(d, signed=True)} ± {_fmt(h)}" if np.isfinite(h) else "–"
                    for d, h in zip(table["welch_delta"], table["welch_ci"])],
        "Val. loss (paper)": [_fmt(x, 3) for x in table["paper_loss"]],
        "Δ (paper)": [_fmt(x, 3, signed=True) for x in table["paper_delta"]],
        "vs baseline": table["verdict"],
    })
    return out


def to_markdown(df: pd.DataFrame) -> str:
    cols = [markup.md_cell(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(markup.md_cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def to_latex(df: pd.DataFrame, caption: str = "", label: str = "") -> str:
    cols = list(df.columns)
    lines = [r"\begin{table}[t]", r"\centering", r"\begin{tabular}{l" + "r" * (len(cols) - 1) + "}",
             r"\toprule", " & ".join(markup.latex(c) for c in cols) + r" \\", r"\midrule"]
    for row in df.itertuples(index=False):
        lines.append(" & ".join(markup.latex(v) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    if caption:
        lines.append(r"\caption{" + markup.latex(caption) + "}")
    if label:
        lines.append(r"\label{" + label + "}")
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


def tau_reading(r: RankResolution) -> str:
    """What τ's interval says, in words derived from it: against the paper's order (interval
    below 0), with it (above 0), or neither; and whether the test could have found the paper's
    order had it been true (power ≥ 80%)."""
    if not np.isfinite(r.tau_lo):
        return "no interval"
    side = ("our ranking runs against the paper's" if r.tau_hi < 0 else
            "our ranking follows the paper's" if r.tau_lo > 0 else
            "the interval admits both directions, so τ says nothing for or against the paper's order")
    if not r.resolvable and (r.tau_hi < 0 or r.tau_lo > 0):
        side += (", though the test had too little power to have found the paper's order had it "
                 "been true")
    return side


def resolution_text(r: RankResolution) -> str:
    """Could these runs order the variants: τ's power and interval at the pooled seed σ, the F
    test."""
    if not np.isfinite(r.power):
        return "Whether the runs could resolve a ranking is untested (no pooled seed σ)."
    head = (f"Were our variants ordered and spaced exactly as the paper's (range "
            f"{r.reference_spread:.3f}), τ's test would find that order with probability "
            f"{r.power:.0%} at our noise (each variant's mean blurred by the pooled seed σ = "
            f"{r.sigma:.4f}, {r.dof} degrees of freedom, over √n; standard error {r.median_se:.4f}, "
            "median; simulated). 95% interval of τ, each mean redrawn with that standard error "
            f"(seed noise alone, these variants fixed): [{r.tau_lo:.2f}, {r.tau_hi:.2f}]: "
            f"{tau_reading(r)}; whether so few variants show any association at all is Kendall's "
            "test, its p above")
    f = (f". Our variants do differ among themselves (F = {r.f:.2f}, p = {r.f_p:.2g}, variant + "
         f"seed model; range of means {r.spread:.3f})" if np.isfinite(r.f_p) and r.f_p < 0.05 else
         f". Our variants are not told apart among themselves (F = {r.f:.2f}, p = {r.f_p:.2g}, "
         "variant + seed model)" if np.isfinite(r.f_p) else "")
    return head + f + "."


def write_tables(result: AblationResult, folder, stem: str = "table4_ablation") -> list:
    """CSV, Markdown and LaTeX versions of the ablation table."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.csv", folder / f"{stem}.md", folder / f"{stem}.tex"]
    result.table.to_csv(paths[0], index=False, float_format="%.6g")
    pretty = formatted(result.table)
    tau = (f"Kendall τ = {result.tau:.3f} (p = {result.p_value:.3g}, {result.n_common} variants)"
           if np.isfinite(result.tau) else "Kendall τ: fewer than 2 variants shared with the paper")
    if result.resolution is not None:
        tau += " " + resolution_text(result.resolution)
    paths[1].write_text(to_markdown(pretty) + "\n" + tau + "\n")
    paths[2].write_text(to_latex(pretty, caption="Ablation (ours vs paper Table 4), mean ± 95% "
                                 "t-interval over seeds; Δ paired over shared seeds. " + tau,
                                 label="tab:ablation"))
    return paths
