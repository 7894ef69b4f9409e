"""The noise study: how finely a recipe can tell a variant from the baseline, from its own runs.

Per variant: each arm's seed σ, the σ and correlation of same-seed differences, the minimum
detectable effect paired and unpaired, and the seeds a stated target Δ needs (never the observed
Δ, whose power would only restate its p-value).
``python -m analysis noise --snapshot results/runs.csv --sweep study_cpu --variant block``
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from .significance import by_seed, mde, seeds_for_half_width, seeds_needed, seeds_needed_paired

SEED_COUNTS = (2, 4, 8, 16)


def noise_table(runs: pd.DataFrame, baseline: str = "baseline", variants=None,
                metric: str = "final_val_loss", ns=SEED_COUNTS, target: float = 0.03,
                level: float = 0.95) -> pd.DataFrame:
    """One row per variant compared with ``baseline`` (all other variants when ``variants`` is
    None). Columns: variant, seeds (of the variant), pairs (seeds shared with the baseline),
    sd_variant, sd_baseline, sd_unpaired (their root mean square: the σ of a two-arm design),
    sd_diff (σ of same-seed differences), corr (of the pairs), then mde_paired_n<k> and
    mde_unpaired_n<k> for each k in ``ns``, seeds_paired / seeds_unpaired for 80% power at
    ``target``, and seeds_halfwidth: pairs whose paired interval is expected within ±``target``."""
    base = runs[runs["variant"] == baseline]
    b = by_seed(base[metric], base["seed"])
    names = variants if variants is not None else sorted(set(runs["variant"]) - {baseline})
    rows = []
    for v in names:
        g = runs[runs["variant"] == v]
        a = by_seed(g[metric], g["seed"])
        common = a.index.intersection(b.index)
        sa, sb = (float(a.std(ddof=1)) if len(a) > 1 else np.nan,
                  float(b.std(ddof=1)) if len(b) > 1 else np.nan)
        sd_un = float(np.sqrt((sa ** 2 + sb ** 2) / 2))
        diff = (a[common] - b[common])
        sd_d = float(diff.std(ddof=1)) if len(common) > 1 else np.nan
        corr = (float(np.corrcoef(a[common], b[common])[0, 1])
                if len(common) > 2 and a[common].std() > 0 and b[common].std() > 0 else np.nan)
        row = {"variant": v, "seeds": len(a), "pairs": len(common), "sd_variant": sa,
               "sd_baseline": sb, "sd_unpaired": sd_un, "sd_diff": sd_d, "corr": corr}
        for n in ns:
            row[f"mde_paired_n{n}"] = mde(sd_d, n, paired=True, level=level)
            row[f"mde_unpaired_n{n}"] = mde(sd_un, n, paired=False, level=level)
        row["target"] = target
        row["seeds_paired"] = seeds_needed_paired(sd_d, target, level)
        row["seeds_unpaired"] = seeds_needed(sd_un, target, level)
        row["seeds_halfwidth"] = seeds_for_half_width(sd_d, target, level)
        rows.append(row)
    return pd.DataFrame(rows)


ESTIMATOR_EVALS = (1, 3, 6)  # the last evaluation, and means over the last 3 and 6


def estimators(runs: pd.DataFrame, histories: pd.DataFrame, baseline: str = "baseline", variants=None,
               evals=ESTIMATOR_EVALS, target: float = 0.03, level: float = 0.95) -> pd.DataFrame:
    """Which final-loss estimator gives the tighter same-seed comparison: for k in ``evals``, the
    mean of each run's last k `val/loss` evaluations (k = 1: the last one) in place of its final
    loss, then :func:`noise_table`'s σ of same-seed differences and the seeds ``target`` needs.
    One row per (estimator, variant); empty without histories."""
    val = histories[histories["key"] == "val/loss"] if len(histories) else histories
    val = val[val["run_id"].isin(runs["run_id"])] if len(val) else val
    if val.empty:
        return pd.DataFrame()
    tail = val.sort_values("step").groupby("run_id")["value"]
    rows = []
    for k in evals:
        est = runs.assign(estimate=runs["run_id"].map(tail.apply(lambda v: v.iloc[-k:].mean())))
        t = noise_table(est, baseline, variants, "estimate", ns=(), target=target, level=level)
        t.insert(0, "estimator", "last evaluation" if k == 1 else f"mean of the last {k} evaluations")
        rows.append(t[["estimator", "variant", "pairs", "sd_diff", "corr", "seeds_paired", "seeds_halfwidth"]])
    return pd.concat(rows, ignore_index=True)


def plot(table: pd.DataFrame, folder, stem: str = "noise_study", ns_max: int = 32) -> list[Path]:
    """MDE against seeds, paired (solid) and unpaired (dashed), one colour per variant, with the
    target Δ as a horizontal line."""
    from . import figures

    fig, ax = figures.plt.subplots(figsize=(6, 4))
    ns = np.arange(2, ns_max + 1)
    for r in table.itertuples(index=False):
        c = figures.color(r.variant)
        if np.isfinite(r.sd_diff):
            ax.plot(ns, [mde(r.sd_diff, n, True) for n in ns], color=c, label=f"{r.variant} paired")
        if np.isfinite(r.sd_unpaired):
            ax.plot(ns, [mde(r.sd_unpaired, n, False) for n in ns], color=c, ls="--",
                    label=f"{r.variant} unpaired")
    if len(table):
        ax.axhline(float(table["target"].iloc[0]), color="k", lw=0.8, ls=":", label="target Δ")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("seeds per variant")
    ax.set_ylabel("minimum detectable Δ (nats; 5%, 80% power)")
    ax.legend(fontsize=7)
    return figures.save(fig, folder, stem)


def shown(table: pd.DataFrame) -> pd.DataFrame:
    """The table as printed: 4 decimals, seeds as whole numbers, '–' where undefined."""
    def f(x, d=4):
        return "–" if not np.isfinite(x) else f"{x:.{d}f}"

    out = pd.DataFrame({"variant": table["variant"], "seeds": table["seeds"],
                        "pairs": table["pairs"], "σ variant": table["sd_variant"].map(f),
                        "σ baseline": table["sd_baseline"].map(f),
                        "σ same-seed diff": table["sd_diff"].map(f),
                        "corr": table["corr"].map(lambda x: f(x, 2))})
    for c in table.columns:
        if c.startswith("mde_"):
            kind, n = c[4:].rsplit("_n", 1)
            out[f"MDE {kind} n={n}"] = table[c].map(f)
    tgt = table["target"].iloc[0] if len(table) else np.nan
    out[f"seeds for Δ={tgt:g} paired"] = table["seeds_paired"].map(lambda x: f(x, 0))
    out[f"seeds for Δ={tgt:g} unpaired"] = table["seeds_unpaired"].map(lambda x: f(x, 0))
    if "seeds_halfwidth" in table:
        out[f"seeds for ±{tgt:g} paired"] = table["seeds_halfwidth"].map(lambda x: f(x, 0))
    return out


def write(table: pd.DataFrame, folder, stem: str = "noise_study") -> list[Path]:
    from .ablation import to_markdown

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.csv", folder / f"{stem}.md"]
    table.to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(to_markdown(shown(table)))
    return paths
